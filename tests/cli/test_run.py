"""`conveyor run` and friends, end to end on a tiny random model (and a few runs of the real one).

Process-level behaviour (exit status, what a fresh interpreter prints on stderr, the no-TTY log)
runs `python -m conveyor.cli` in a child; everything else calls `main()` in this process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from cli_helpers import (
    DESIGN_COLUMNS,
    read_rows,
    run_child,
    run_in_process,
    stable,
    tiny_args,
    write_input,
    write_jsonl,
)

from conveyor.io.records.seeds import derive_seed

RECORDS = [
    {"id": "r-0", "prompt": "The sky is", "topic": "weather"},
    {"id": "r-1", "prompt": "Once upon a time", "topic": "story"},
    {"id": "r-2", "prompt": "Water boils at", "topic": "science"},
    {"id": "r-3", "prompt": "A good name for a cat is", "topic": "pets"},
]
FIXED = ["--max-tokens", "4", "--ignore-eos"]  # a random model almost never says EOS; make sure


def _run_tiny(tiny_model, input_path, output_path, *extra, stdin=None):
    return run_in_process("run", input_path, "-o", output_path, *tiny_args(tiny_model), *FIXED, *extra,
                          stdin=stdin)


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory):
    """RECORDS from a JSONL file: the rows every other input format must reproduce."""
    tmp = tmp_path_factory.mktemp("baseline")
    result = _run_tiny(tiny_model, write_jsonl(tmp / "in.jsonl", RECORDS), tmp / "out.jsonl", "-q")
    assert result.code == 0, result.err
    return read_rows(tmp / "out.jsonl")


def test_jsonl_rows_follow_the_input(baseline, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert [r["id"] for r in baseline] == [r["id"] for r in RECORDS]
    assert [r["index"] for r in baseline] == [0, 1, 2, 3]
    for row, record in zip(baseline, RECORDS):
        assert row["status"] == "ok" and row["error"] is None
        assert isinstance(row["output"], str) and row["output"]
        assert row["finish_reason"] == "length" and row["completion_tokens"] == 4
        assert row["prompt_tokens"] == len(tokenizer(record["prompt"])["input_ids"])
        assert row["seed"] == derive_seed(0, record["id"])
        assert all(row[k] is not None and row[k] >= 0 for k in ("queue_s", "ttft_s", "latency_s"))


@pytest.mark.parametrize("fmt", ["jsonl.gz", "json", "parquet", "csv", "datasets", "stdin"])
def test_every_input_format_gives_the_same_rows(fmt, baseline, tiny_model, tmp_path):
    if fmt == "stdin":
        data = "".join(json.dumps(r) + "\n" for r in RECORDS).encode()
        result = _run_tiny(tiny_model, "-", tmp_path / "out.jsonl", stdin=data)
    else:
        name = "in" if fmt == "datasets" else f"in.{fmt}"
        source = write_input(tmp_path / name, RECORDS, fmt)
        result = _run_tiny(tiny_model, source, tmp_path / "out.jsonl")
    assert result.code == 0, result.err
    assert stable(read_rows(tmp_path / "out.jsonl")) == stable(baseline)


def test_parquet_output_has_explicit_types_and_input_order(tiny_model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"id": f"p{i}", "prompt": f"number {i} is", "topic": f"t{i}", "score": i, "flag": i % 2 == 0,
                "note": None} for i in range(5)]
    records[2] = {"id": "p2", "prompt": "", "topic": "t2", "score": 2, "flag": True, "note": None}  # an error row
    result = _run_tiny(tiny_model, write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.parquet",
                       "--keep-fields", "topic,score,flag,note")
    assert result.code == 3, result.err
    table = pq.read_table(tmp_path / "out.parquet")
    expected = {"id": pa.string(), "index": pa.int64(), "status": pa.string(), "output": pa.string(),
                "finish_reason": pa.string(), "prompt_tokens": pa.int64(), "completion_tokens": pa.int64(),
                "error": pa.string(), "seed": pa.int64(), "queue_s": pa.float64(), "ttft_s": pa.float64(),
                "latency_s": pa.float64(), "topic": pa.string(), "score": pa.int64(), "flag": pa.bool_(),
                "note": pa.string()}
    assert {f.name: f.type for f in table.schema} == expected
    assert table.schema.names == list(expected)  # DESIGN's columns first, then the kept ones in order
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == [r["id"] for r in records]
    assert [r["index"] for r in rows] == list(range(5))
    assert [r["status"] for r in rows] == ["ok", "ok", "error", "ok", "ok"]
    assert rows[2]["output"] is None and "line 3" in rows[2]["error"]
    assert [(r["topic"], r["score"], r["flag"], r["note"]) for r in rows] == \
        [(r["topic"], r["score"], r["flag"], None) for r in records]


def test_jsonl_output_columns_and_keep_fields(tiny_model, tmp_path):
    records = [{"id": "k0", "prompt": "alpha", "topic": "x", "extra": 1}, {"id": "k1", "prompt": "beta", "topic": "y"}]
    result = _run_tiny(tiny_model, write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl",
                       "--keep-fields", "topic")
    assert result.code == 0, result.err
    rows = read_rows(tmp_path / "out.jsonl")
    assert [list(r) for r in rows] == [[*DESIGN_COLUMNS, "topic"]] * 2  # "extra" was not asked for
    assert [r["topic"] for r in rows] == ["x", "y"]


def test_keep_fields_that_clash_with_output_columns_are_refused(tiny_model, tmp_path):
    result = _run_tiny(tiny_model, write_jsonl(tmp_path / "in.jsonl", RECORDS), tmp_path / "out.jsonl",
                       "--keep-fields", "topic,status")
    assert result.code == 2
    assert "--keep-fields" in result.err and "status" in result.err
    assert not (tmp_path / "out.jsonl").exists()


def test_openai_batch_output(tiny_model, tmp_path):
    lines = [
        {"custom_id": "req-chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}},
        {"custom_id": "req-text", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": "The weather today", "max_tokens": 2}},
        {"custom_id": "req-bad", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}},
    ]
    result = _run_tiny(tiny_model, write_jsonl(tmp_path / "batch.jsonl", lines), tmp_path / "results.jsonl",
                       "--output-format", "openai-batch", "--served-model-name", "m")
    assert result.code == 3, result.err
    out = read_rows(tmp_path / "results.jsonl")
    assert [o["custom_id"] for o in out] == ["req-chat", "req-text", "req-bad"]
    chat, text, bad = out
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    body = chat["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(body["choices"][0]["message"]["content"], str)
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 3 and body["usage"]["prompt_tokens"] > 0
    assert text["response"]["body"]["object"] == "text_completion"
    assert isinstance(text["response"]["body"]["choices"][0]["text"], str)
    assert text["response"]["body"]["usage"]["completion_tokens"] == 2
    assert bad["response"] is None and "line 3" in bad["error"]["message"]


# -- bad input ------------------------------------------------------------------------------------

# (line content, expected id of the error row or None for "ok", words the error must contain)
BAD_LINES = [
    (b'{"id": "good-1", "prompt": "hello world"}', None, ()),
    (b'{"id": "bad-json", "prompt": "oops"', "1", ("invalid JSON",)),
    (b'[1, 2, 3]', "2", ("expected a JSON object", "a list")),
    (b'{"id": "no-prompt", "text": "x"}', "no-prompt", ("no prompt",)),
    (b'{"id": "empty", "prompt": "   "}', "empty", ("empty",)),
    (b'{"id": "wrong-type", "prompt": 42}', "wrong-type", ("prompt", "must be a string")),
    (b'{"id": "temp-neg", "prompt": "hi", "temperature": -1}', "temp-neg", ("temperature",)),
    (b'{"id": "temp-hot", "prompt": "hi", "temperature": "hot"}', "temp-hot", ("temperature", "number")),
    (b'{"id": "nan", "prompt": "hi", "temperature": NaN}', "8", ("non-finite", "NaN")),
    (b'{"id": "inf", "prompt": "hi", "top_p": 1e999}', "9", ("non-finite",)),
    (b'{"id": "bytes", "prompt": "caf\xe9 au lait"}', "10", ("UTF-8",)),
    (b'{"id": "deep", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "11", ("nested",)),
    (b'{"id": "good-1", "prompt": "the same id again"}', "good-1", ("duplicate id",)),
    (b'{"id": "long", "prompt": "' + b"hello " * 3000 + b'"}', "long", ("context",)),
    (b'{"id": "too-many", "prompt": "hi", "max_tokens": 5000}', "too-many", ("max_tokens", "context")),
    (b'{"id": "bad-role", "messages": [{"role": "wizard", "content": "hi"}]}', "bad-role", ("role",)),
    (b'{"id": "good-2", "messages": [{"role": "user", "content": "hi"}]}', None, ()),
]


@pytest.fixture(scope="module")
def bad_run(tiny_model, tmp_path_factory):
    """One child-process run over a file holding every kind of bad record between two good ones."""
    tmp = tmp_path_factory.mktemp("bad")
    source = tmp / "bad.jsonl"
    source.write_bytes(b"\n".join(line for line, _, _ in BAD_LINES) + b"\n")
    result = run_child("run", source, "-o", tmp / "out.jsonl", *tiny_args(tiny_model), "--max-tokens", "4")
    rows = read_rows(tmp / "out.jsonl") if (tmp / "out.jsonl").exists() else []
    return result, rows


def test_bad_input_finishes_with_exit_3_and_no_traceback(bad_run):
    result, rows = bad_run
    assert result.code == 3, result.err
    assert "Traceback" not in result.err and "Traceback" not in result.out
    assert len(rows) == len(BAD_LINES)
    assert [r["index"] for r in rows] == list(range(len(BAD_LINES)))


@pytest.mark.parametrize("line_no", range(1, len(BAD_LINES) + 1))
def test_each_bad_record_becomes_an_error_row_naming_its_line(bad_run, line_no):
    _, rows = bad_run
    _, expected_id, words = BAD_LINES[line_no - 1]
    row = rows[line_no - 1]
    if expected_id is None:
        assert row["status"] == "ok" and row["error"] is None and row["output"]
        return
    assert row["status"] == "error" and row["output"] is None
    assert row["id"] == expected_id
    assert row["error"].startswith(f"line {line_no}: "), row["error"]
    for word in words:
        assert word in row["error"], row["error"]


def test_duplicate_id_keeps_the_first_occurrence(bad_run):
    _, rows = bad_run
    first, later = [r for r in rows if r["id"] == "good-1"]
    assert first["index"] < later["index"]
    assert (first["status"], later["status"]) == ("ok", "error")


def test_bom_crlf_and_blank_lines_are_fine(tiny_model, tmp_path):
    text = "\ufeff" + '{"id": "a", "prompt": "one"}\r\n\r\n   \r\n{"id": "b", "prompt": "two"}\r\n\n' \
           '{"id": "c", "prompt": "three"}'  # no final newline either
    (tmp_path / "in.jsonl").write_bytes(text.encode())
    result = _run_tiny(tiny_model, tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    assert result.code == 0, result.err
    rows = read_rows(tmp_path / "out.jsonl")
    assert [(r["id"], r["index"], r["status"]) for r in rows] == [("a", 0, "ok"), ("b", 1, "ok"), ("c", 2, "ok")]


@pytest.mark.parametrize("args, named", [(["--temperature", "-1"], "--temperature"), (["--bogus"], "--bogus"),
                                         (["--max-tokens", "abc"], "--max-tokens"), ([], "nope.jsonl")],
                         ids=["temperature", "unknown-option", "not-an-int", "missing-input"])
def test_bad_options_are_one_line_usage_errors(args, named, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", RECORDS) if args else tmp_path / "nope.jsonl"
    result = run_child("run", source, "-o", tmp_path / "out.jsonl", *args, fresh=True)
    assert result.code == 2
    assert len(result.err_lines) == 1, result.err
    assert result.err.startswith("conveyor") and "Traceback" not in result.err
    assert named in result.err
    assert result.out == ""
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.jsonl.conveyor").exists()


def test_no_tty_progress_is_plain_log_lines_on_stderr(tiny_model, tmp_path):
    records = [{"id": f"n{i}", "prompt": f"line {i} of the log test"} for i in range(150)]
    config = tmp_path / "run.yaml"
    config.write_text("log_every: 0.1\nmax_num_seqs: 4\ntemperature: 0\n")
    result = run_child("run", write_jsonl(tmp_path / "in.jsonl", records), "-o", tmp_path / "out.jsonl",
                       "-c", config, *tiny_args(tiny_model), "--max-tokens", "8", "--ignore-eos")
    assert result.code == 0, result.err
    progress = re.findall(r"^conveyor: \d\d:\d\d:\d\d records (\d+)/150 errors 0 ", result.err, re.M)
    assert len(progress) >= 2, result.err
    assert progress[-1] == "150"
    assert [int(p) for p in progress] == sorted(int(p) for p in progress)
    assert "\x1b" not in result.err  # no terminal escapes without a TTY
    assert "records" not in result.out.replace("│ records", "")  # progress stays off stdout
    assert "conveyor run summary" in result.out
    assert len(read_rows(tmp_path / "out.jsonl")) == 150


def test_quiet_prints_no_progress_and_one_closing_line(tiny_model, tmp_path):
    result = _run_tiny(tiny_model, write_jsonl(tmp_path / "in.jsonl", RECORDS), tmp_path / "out.jsonl", "--quiet")
    assert result.code == 0, result.err
    assert result.err_lines == [f"conveyor: {len(RECORDS)}/{len(RECORDS)} records have a row (0 errors); wrote "
                                f"{tmp_path / 'out.jsonl'}"] and result.out == ""
    assert len(read_rows(tmp_path / "out.jsonl")) == len(RECORDS)


def test_config_file_values_apply_and_flags_override_them(tiny_model, tmp_path):
    config = tmp_path / "greedy.yaml"
    config.write_text("max-tokens: 3\nignore_eos: true\ntemperature: 0\nkeep_fields: [topic]\n")
    source = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    base = ("run", source, "-c", config, *tiny_args(tiny_model), "-q")
    from_file = run_in_process(*base, "-o", tmp_path / "a.jsonl", "--seed", "1")
    overridden = run_in_process(*base, "-o", tmp_path / "b.jsonl", "--seed", "2", "--max-tokens", "5")
    assert from_file.code == 0 and overridden.code == 0, from_file.err + overridden.err
    a, b = read_rows(tmp_path / "a.jsonl"), read_rows(tmp_path / "b.jsonl")
    assert [r["completion_tokens"] for r in a] == [3] * 4  # the file's max_tokens
    assert [r["completion_tokens"] for r in b] == [5] * 4  # the flag wins
    assert [r["topic"] for r in a] == [r["topic"] for r in RECORDS]
    # temperature 0 from the file: greedy, so another seed still gives the same first tokens
    for ra, rb in zip(a, b):
        assert ra["seed"] != rb["seed"]
        assert rb["output"].startswith(ra["output"]), (ra["output"], rb["output"])


def test_unknown_config_key_names_the_key_and_the_file(tiny_model, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("max_tokens: 3\nmax_tokenz: 4\n")
    result = run_in_process("run", write_jsonl(tmp_path / "in.jsonl", RECORDS), "-o", tmp_path / "out.jsonl",
                            "-c", config)
    assert result.code == 2
    assert len(result.err_lines) == 1
    assert "max_tokenz" in result.err and str(config) in result.err


def test_summary_json(tiny_model, tmp_path):
    records = RECORDS + [{"id": "bad", "prompt": ""}]
    result = _run_tiny(tiny_model, write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl",
                       "--summary-json", tmp_path / "summary.json", "-q")
    assert result.code == 3, result.err
    summary = json.loads((tmp_path / "summary.json").read_text())
    keys = {"records", "ok", "errors", "prompt_tokens", "completion_tokens", "load_s", "elapsed_s",
            "output_tokens_per_s", "preemptions", "prefix_cache_hit_rate"}
    assert keys <= set(summary)
    rows = read_rows(tmp_path / "out.jsonl")
    assert (summary["records"], summary["ok"], summary["errors"]) == (5, 4, 1)
    assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in rows) == 16
    assert summary["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows if r["status"] == "ok")
    assert summary["preemptions"] == 0 and 0.0 <= summary["prefix_cache_hit_rate"] <= 1.0
    assert summary["load_s"] > 0 and summary["elapsed_s"] > 0 and summary["output_tokens_per_s"] > 0


def test_validate_counts_records_and_sets_the_exit_code(tiny_model, tmp_path):
    good = run_in_process("validate", write_jsonl(tmp_path / "good.jsonl", RECORDS), "--model", tiny_model)
    assert good.code == 0, good.err
    assert "4 records, 4 ok, 0 errors" in good.out
    assert "model context 2048" in good.out
    bad = run_in_process("validate", write_jsonl(tmp_path / "bad.jsonl", RECORDS + [{"id": "x"}, {"prompt": 3}]),
                         "--model", tiny_model)
    assert bad.code == 3, bad.err
    assert "6 records, 4 ok, 2 errors" in bad.out
    assert "line 5: no prompt" in bad.out and "line 6:" in bad.out
    assert not list(tmp_path.glob("*.conveyor"))  # validate runs nothing and keeps no state


def test_validate_finds_repeated_ids_across_its_scratch_commits(tiny_model, tmp_path, monkeypatch):
    from conveyor.io.validation import ValidationSink

    monkeypatch.setattr(ValidationSink, "COMMIT_EVERY", 2)  # the ids of records 1..4 are on disk by record 5
    records = [{"id": f"r{i}", "prompt": "w1 " * (i + 1)} for i in range(6)] + [{"id": "r1", "prompt": "again"}]
    result = run_in_process("validate", write_jsonl(tmp_path / "ids.jsonl", records), "--model", tiny_model)
    assert result.code == 3 and "7 records, 6 ok, 1 error" in result.out, result.out
    assert "line 7: duplicate id 'r1'" in result.out
    assert "prompt tokens: min 3, median 9, p95 13, max 13, total 48" in result.out, result.out  # 2n + 1 tokens


def test_models_lists_the_embedded_model():
    result = run_in_process("models")
    assert result.code == 0
    assert re.search(r"^smollm2-135m-instruct\t(cached|not cached)", result.out, re.M)


def test_help_is_fast_and_shows_examples():
    top = run_child("--help", fresh=True)
    assert top.code == 0
    for command in ("run", "validate", "status", "models"):
        assert command in top.out
    run_help = run_child("run", "--help", fresh=True)
    assert run_help.code == 0
    assert "Examples" in run_help.out and "conveyor run prompts.jsonl -o answers.parquet" in run_help.out
    assert "--max-tokens" in run_help.out and "--max-runtime" in run_help.out
    assert "[default: 16]" in " ".join(run_help.out.split())  # not eaten as markup (--block-size's)
    probe = ("import sys\nfrom conveyor.cli.app import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print('LOADED', sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "LOADED []" in out


def test_limit_takes_the_first_records(tiny_model, tmp_path):
    result = _run_tiny(tiny_model, write_jsonl(tmp_path / "in.jsonl", RECORDS), tmp_path / "out.jsonl",
                       "--limit", "2")
    assert result.code == 0, result.err
    assert [r["id"] for r in read_rows(tmp_path / "out.jsonl")] == ["r-0", "r-1"]


ON_ERROR_RECORDS = [{"id": "g0", "prompt": "fine"}, {"id": "b0", "prompt": ""}, {"id": "g1", "prompt": "also fine"},
                    {"id": "b1", "messages": "not a list"}, {"id": "g2", "prompt": "last"}]


def test_on_error_skip_writes_no_error_rows(tiny_model, tmp_path):
    result = _run_tiny(tiny_model, write_jsonl(tmp_path / "in.jsonl", ON_ERROR_RECORDS), tmp_path / "out.jsonl",
                       "--on-error", "skip")
    assert result.code == 0, result.err
    rows = read_rows(tmp_path / "out.jsonl")
    assert [(r["id"], r["index"], r["status"]) for r in rows] == [("g0", 0, "ok"), ("g1", 2, "ok"), ("g2", 4, "ok")]


def test_on_error_fail_stops_at_the_first_bad_record(tiny_model, tmp_path):
    result = _run_tiny(tiny_model, write_jsonl(tmp_path / "in.jsonl", ON_ERROR_RECORDS), tmp_path / "out.jsonl",
                       "--on-error", "fail")
    assert result.code not in (0, 75)
    assert "line 2" in result.err and "Traceback" not in result.err
    assert not (tmp_path / "out.jsonl").exists()


def test_seeded_sampling_repeats_and_seeds_matter(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        result = _run_tiny(tiny_model, source, tmp_path / f"{name}.jsonl", "--seed", seed, "--temperature", "1.0",
                           "-q")
        assert result.code == 0, result.err
        runs[name] = read_rows(tmp_path / f"{name}.jsonl")
    assert stable(runs["a"]) == stable(runs["b"])
    assert [r["seed"] for r in runs["a"]] != [r["seed"] for r in runs["c"]]
    assert [r["output"] for r in runs["a"]] != [r["output"] for r in runs["c"]]


@pytest.mark.slow
def test_real_model_answers(tmp_path):
    """The embedded SmolLM2 model, greedy: the sample data runs, and France's capital is Paris."""
    import pathlib

    sample = pathlib.Path(__file__).resolve().parents[2] / "sample_data" / "chat.jsonl"
    result = run_in_process("run", sample, "-o", tmp_path / "sample.parquet", "--limit", "4", "--max-tokens", "12",
                            "--temperature", "0", "-q")
    assert result.code == 0, result.err
    rows = read_rows(tmp_path / "sample.parquet")
    assert len(rows) == 4 and all(r["status"] == "ok" and r["output"] for r in rows)
    assert all(1 <= r["completion_tokens"] <= 12 for r in rows)
    question = [{"id": "france", "messages": [{"role": "user", "content": "What is the capital of France?"}]}]
    result = run_in_process("run", write_jsonl(tmp_path / "fr.jsonl", question), "-o", tmp_path / "fr.jsonl.out",
                            "--output-format", "jsonl", "--max-tokens", "12", "--temperature", "0", "-q")
    assert result.code == 0, result.err
    (row,) = read_rows(tmp_path / "fr.jsonl.out")
    assert "Paris" in row["output"], row["output"]

