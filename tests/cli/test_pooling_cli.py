"""`conveyor run` over the pooling tasks, as a user runs them: embeddings to Parquet (fixed-size float32 vectors) and
JSONL, vLLM's own run-batch test lines (embeddings, score, rerank; the unknown model an error line) answered in its
output shape, error rows for bad records, options that do not apply refused, kill -9 and resume with the same
vectors bit for bit, shards merged, and the summary's records/s and tokens/s."""

from __future__ import annotations

import base64
import json
import struct

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from cli_helpers import Child, journal_state, read_rows, run_in_process, write_jsonl

from conveyor.core.backends.cpu.kernels import cpu_kernels

TEXTS = ["hello world", "what is the capital of france?", "the blender was loud, three stars", "a",
         "paris is the capital city of france", "good product", "bad app, it crashes on upload"]
DOCS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
QUERY = "What is the capital of France?"
F32 = ["--dtype", "float32"]


def _texts(tmp_path, n=7):
    return write_jsonl(tmp_path / "texts.jsonl", [{"id": f"t{i}", "prompt": TEXTS[i % len(TEXTS)], "topic": i % 3}
                                                  for i in range(n)])


def _lines(path, lines):
    return write_jsonl(path, [{"custom_id": f"request-{i + 1}", "method": "POST", **line} for i, line in
                              enumerate(lines)])


def test_embeddings_to_parquet_are_fixed_size_float32_vectors_in_input_order(pooling_models, tmp_path):
    out, summary = tmp_path / "e.parquet", tmp_path / "s.json"
    result = run_in_process("run", _texts(tmp_path), "-o", out, "--model", pooling_models("bert-mean"), *F32,
                            "--keep-fields", "topic", "--summary-json", summary)
    assert result.code == 0, result.err
    table = pq.read_table(out)
    assert str(table.schema.field("embedding").type) == "fixed_size_list<element: float>[64]"
    assert table.column_names == ["id", "index", "status", "embedding", "prompt_tokens", "error", "queue_s",
                                  "latency_s", "topic"]
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == [f"t{i}" for i in range(len(TEXTS))]
    assert all(abs(sum(v * v for v in r["embedding"]) - 1) < 1e-5 for r in rows)  # normalized
    said = json.loads(summary.read_text())
    assert said["task"] == "embed" and said["records_per_s"] > 0 and said["prompt_tokens_per_s"] > 0
    assert "records/s" in result.out and "tokens/s" in result.out and "embed" in result.out

    jsonl = tmp_path / "e.jsonl"  # the same vectors as JSON lists
    assert run_in_process("run", _texts(tmp_path), "-o", jsonl, "--model", pooling_models("bert-mean"), *F32).code == 0
    assert [r["embedding"] for r in read_rows(jsonl)] == [r["embedding"] for r in rows]

    parts = tmp_path / "parts"  # and in part files: the same columns in each (the task's optional ones too)
    assert run_in_process("run", _texts(tmp_path), "-o", f"{parts}/", "--rows-per-file", "3", "--model",
                          pooling_models("bert-mean"), *F32, "--keep-fields", "topic").code == 0
    assert sorted(p.name for p in parts.glob("part-*")) == [f"part-0000{k}.parquet" for k in range(3)]
    folder = ds.dataset(str(parts), format="parquet").to_table()
    assert str(folder.schema.field("embedding").type) == "fixed_size_list<element: float>[64]"
    same = ["id", "index", "status", "embedding", "prompt_tokens", "error", "topic"]  # (not the timings)
    assert folder.select(same).to_pylist() == table.select(same).to_pylist()


def test_bad_records_are_error_rows_and_truncation_applies(pooling_models, tmp_path):
    long = " ".join(["capital"] * 200)  # over the checkpoint's 128 tokens
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello"}, {"prompt": ""}, {"prompt": long},
                                                 {"text": "no prompt field"}, {"prompt": "x", "temperature": 0.5},
                                                 {"prompt": None}])
    out = tmp_path / "o.jsonl"
    result = run_in_process("run", source, "-o", out, "--model", pooling_models("bert-cls"), *F32)
    assert result.code == 3, result.err
    rows = read_rows(out)
    assert [r["status"] for r in rows] == ["ok", "error", "error", "error", "error", "error"]
    assert "empty" in rows[1]["error"] and "at most 128" in rows[2]["error"] and "truncate" in rows[2]["error"]
    assert "'prompt'" in rows[3]["error"] and "'temperature'" in rows[4]["error"]
    assert rows[5]["error"] == "line 6: field 'prompt' has no value; give the record a text or remove it"
    cut = run_in_process("run", source, "-o", tmp_path / "cut.jsonl", "--model", pooling_models("bert-cls"), *F32,
                         "--truncate-prompt-tokens", "auto")
    assert read_rows(tmp_path / "cut.jsonl")[2]["status"] == "ok", cut.err


def test_options_that_change_nothing_for_the_task_are_refused(pooling_models, tmp_path, tiny_model):
    source = _texts(tmp_path)
    embed = run_in_process("run", source, "-o", tmp_path / "o.jsonl", "--model", pooling_models("bert-mean"),
                           "--temperature", "0.3")
    assert embed.code == 2 and "--temperature" in embed.err and "--task embed" in embed.err
    generate = run_in_process("run", source, "-o", tmp_path / "g.jsonl", "--model", tiny_model, "--dimensions", "8")
    assert generate.code == 2 and "--dimensions" in generate.err
    wide = run_in_process("run", source, "-o", tmp_path / "w.jsonl", "--model", pooling_models("bert-mean"),
                          "--dimensions", "100")
    assert wide.code == 2 and "--dimensions 100" in wide.err and "64" in wide.err
    classify = run_in_process("run", source, "-o", tmp_path / "c.jsonl", "--model", pooling_models("bert-mean"),
                              "--task", "classify")
    assert classify.code == 2 and "sequence-classification head" in classify.err


def _vllm_embedding_lines(name):
    lines = [{"url": "/v1/embeddings", "body": {"model": name, "input": text}}
             for text in ("You are a helpful assistant.", "You are an unhelpful assistant.", "Hello world!")]
    return lines + [{"url": "/v1/embeddings", "body": {"model": "NonExistModel", "input": "Hello world!"}}]


def _check_line(line, custom_id):
    assert set(line) == {"id", "custom_id", "response", "error"} and line["custom_id"] == custom_id
    return line["response"]["body"] if line["response"] is not None else None


def test_vllm_run_batch_embedding_lines_in_its_output_shape(pooling_models, tmp_path):
    model = pooling_models("bert-mean")
    source = _lines(tmp_path / "batch.jsonl", [*_vllm_embedding_lines(model.name),
                                               {"url": "/v1/embeddings", "body": {"input": ["a", "b"],
                                                                                  "encoding_format": "base64",
                                                                                  "dimensions": 8}}])
    out = tmp_path / "results.jsonl"
    result = run_in_process("run", source, "-o", out, "--model", model, *F32, "--output-format", "openai-batch")
    assert result.code == 3, result.err  # the unknown model's line is an error line
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 5
    for k in range(3):
        body = _check_line(lines[k], f"request-{k + 1}")
        assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
        assert len(body["data"][0]["embedding"]) == 64 and body["usage"]["prompt_tokens"] > 0
    assert lines[3]["response"] is None and "NonExistModel" in lines[3]["error"]["message"]
    two = _check_line(lines[4], "request-5")["data"]
    assert [d["index"] for d in two] == [0, 1]
    vector = struct.unpack("<8f", base64.b64decode(two[0]["embedding"]))
    assert abs(sum(v * v for v in vector) - 1) < 1e-5  # cut to 8, then normalized
    checked = run_in_process("validate", source, "--model", model)  # the same checks, no model run
    assert checked.code == 3 and "5 records, 4 ok, 1 error" in checked.out and "NonExistModel" in checked.out
    parquet = run_in_process("run", source, "-o", tmp_path / "r.parquet", "--model", model, *F32)
    rows = pq.read_table(tmp_path / "r.parquet").to_pylist()  # per-record dimensions: a list column, a row per input
    assert parquet.code == 3 and [r["input_index"] for r in rows] == [None, None, None, None, 0, 1]
    assert len(rows[0]["embedding"]) == 64 and len(rows[4]["embedding"]) == 8


def test_vllm_run_batch_score_and_rerank_lines_in_its_output_shape(pooling_models, tmp_path):
    model = pooling_models("cross-encoder")
    score = _lines(tmp_path / "score.jsonl", [
        {"url": "/score", "body": {"model": model.name, "queries": QUERY, "documents": DOCS}},
        {"url": "/v1/score", "body": {"model": model.name, "queries": QUERY, "documents": DOCS}},
        {"url": "/v1/score", "body": {"model": model.name, "text_1": QUERY, "text_2": DOCS[1]}}])
    rerank = _lines(tmp_path / "rerank.jsonl", [
        {"url": "/rerank", "body": {"model": model.name, "query": QUERY, "documents": DOCS}},
        {"url": "/v1/rerank", "body": {"model": model.name, "query": QUERY, "documents": DOCS, "top_n": 1}},
        {"url": "/v2/rerank", "body": {"model": model.name, "query": QUERY, "documents": DOCS}}])
    scores = []
    for source, name in ((score, "score"), (rerank, "rerank")):
        out = tmp_path / f"{name}.out.jsonl"
        result = run_in_process("run", source, "-o", out, "--model", model, *F32, "--output-format", "openai-batch")
        assert result.code == 0, result.err
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert all(line["error"] is None for line in lines)
        for k, line in enumerate(lines):
            body = _check_line(line, f"request-{k + 1}")
            if name == "score":
                assert [d["object"] for d in body["data"]] == ["score"] * (2 if k < 2 else 1)
                scores.append([d["score"] for d in body["data"]])
            else:
                results = body["results"]
                assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0  # (vLLM's RerankUsage)
                assert len(results) == (1 if k == 1 else 2) and {"index", "document", "relevance_score"} <= set(
                    results[0])
                ranked = sorted(scores[0], reverse=True)
                assert [r["relevance_score"] for r in results] == ranked[:len(results)]
                assert results[0]["document"]["text"] == DOCS[scores[0].index(ranked[0])]
    assert scores[0] == scores[1] and scores[2] == [scores[0][1]]  # the same pair: the same score, alone or not


def test_task_auto_follows_the_batch_lines_url_and_the_checkpoint(pooling_models, tmp_path):
    texts = _texts(tmp_path)
    labels = run_in_process("run", texts, "-o", tmp_path / "l.jsonl", "--model", pooling_models("classifier"), *F32)
    assert labels.code == 0, labels.err
    rows = read_rows(tmp_path / "l.jsonl")
    assert all(r["label"] in ("bug", "feature", "question") and len(r["probs"]) == 3 for r in rows)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"text_1": QUERY, "text_2": DOCS}, {"text_1": "a", "text_2": "b"}])
    scored = run_in_process("run", pairs, "-o", tmp_path / "s.parquet", "--model", pooling_models("cross-encoder"),
                            "--task", "score", *F32)
    assert scored.code == 0, scored.err
    rows = pq.read_table(tmp_path / "s.parquet").to_pylist()
    assert [(r["index"], r["input_index"]) for r in rows] == [(0, 0), (0, 1), (1, None)]
    assert all(0 < r["score"] < 1 for r in rows)
    reward = run_in_process("run", texts, "-o", tmp_path / "r.jsonl", "--model", pooling_models("reward"),
                            "--task", "reward", *F32)
    assert reward.code == 0 and all(isinstance(r["reward"], float) for r in read_rows(tmp_path / "r.jsonl"))


@pytest.mark.skipif(cpu_kernels() is None, reason="the same vectors across a resume need the exact packed route")
def test_kill_9_and_resume_give_the_same_vectors_bit_for_bit(pooling_models, tmp_path):
    model = pooling_models("qwen3")
    source = _texts(tmp_path, 1500)
    options = ["--model", model, "--dtype", "float32", "--max-num-batched-tokens", "32", "--checkpoint-every", "20"]
    reference = run_in_process("run", source, "-o", tmp_path / "reference.parquet", *options, "-q")
    assert reference.code == 0, reference.err
    out, run_dir = tmp_path / "out.parquet", tmp_path / "out.parquet.conveyor"
    child = Child(["run", source, "-o", out, *options], tmp_path, "killed")
    child.wait_until(lambda: run_dir.exists() and (run_dir / "journal.sqlite").exists() and
                     journal_state(run_dir, strict=False)[0] >= 100, what="100 rows committed")
    killed = child.kill9()
    assert killed.code == -9 and not out.exists(), "the run ended before the kill"
    done = journal_state(run_dir)[0]
    resumed = run_in_process("run", source, "-o", out, *options, "--summary-json", tmp_path / "s.json")
    assert resumed.code == 0, resumed.err
    assert json.loads((tmp_path / "s.json").read_text())["resumed_from"] == done
    want = pq.read_table(tmp_path / "reference.parquet").to_pylist()
    got = pq.read_table(out).to_pylist()
    assert [(r["id"], r["embedding"]) for r in got] == [(r["id"], r["embedding"]) for r in want]


def test_shards_merge_to_the_rows_of_one_run(pooling_models, tmp_path):
    model = pooling_models("bert-mean")
    source = _texts(tmp_path, 20)
    single = run_in_process("run", source, "-o", tmp_path / "one.parquet", "--model", model, *F32)
    assert single.code == 0, single.err
    for i in range(2):
        shard = run_in_process("run", source, "-o", tmp_path / "sharded.parquet", "--model", model, *F32,
                               "--shard", f"{i}/2")
        assert shard.code == 0, shard.err
    want = pq.read_table(tmp_path / "one.parquet").to_pylist()
    got = pq.read_table(tmp_path / "sharded.parquet").to_pylist()
    assert [(r["id"], r["embedding"]) for r in got] == [(r["id"], r["embedding"]) for r in want]
