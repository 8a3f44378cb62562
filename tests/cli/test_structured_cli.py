"""Structured outputs and logprobs from the command line (a tiny random model: the grammar, not the model,
makes outputs parse): run-level --choice / --regex / --json-schema with --logprobs, per-record fields
(OpenAI's and vLLM's names), their output columns in Parquet and JSONL, and an OpenAI batch file round
trip read back by the openai client's own types."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from cli_helpers import read_rows, run_in_process, tiny_args, write_jsonl

FAST = ["--temperature", "0", "--quiet", "--max-tokens", "24"]
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99}},
          "required": ["label", "n"], "additionalProperties": False}


def _run(tiny_model, *args):
    return run_in_process("run", *args, *tiny_args(tiny_model), *FAST)


def test_choice_with_logprobs_gives_a_label_and_typed_logprob_columns(tiny_model, tmp_path):
    import pyarrow.parquet as pq

    source = write_jsonl(tmp_path / "tickets.jsonl", [{"id": f"t{i}", "prompt": f"ticket {i}"} for i in range(6)])
    out = tmp_path / "labels.parquet"
    result = _run(tiny_model, source, "-o", out, "--choice", "bug,feature,question", "--logprobs", "3")
    assert result.code == 0, result.err
    table = pq.read_table(out)
    assert str(table.schema.field("logprobs").type) == (
        "list<element: struct<token: string, id: int64, logprob: double, top: list<element: struct<token: string, "
        "id: int64, logprob: double>>>>")
    for row in table.to_pylist():
        assert row["output"] in ("bug", "feature", "question") and row["finish_reason"] == "stop"
        assert len(row["logprobs"]) == row["completion_tokens"]
        assert all(len(e["top"]) == 3 and e["logprob"] <= 0 for e in row["logprobs"])
    assert "prompt_logprobs" not in table.schema.names


def test_run_level_grammars_and_their_usage_errors(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"record {i}"} for i in range(4)])
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert _run(tiny_model, source, "-o", tmp_path / "j.jsonl", "--json-schema", schema, "--max-tokens", "40").code == 0
    for row in read_rows(tmp_path / "j.jsonl"):
        if row["error"] is None:  # a whole match, whether EOS followed it or max_tokens came right at its end
            jsonschema.validate(json.loads(row["output"]), SCHEMA)
        else:
            assert row["finish_reason"] == "length" and "ran out before the output completed" in row["error"]
    assert _run(tiny_model, source, "-o", tmp_path / "r.jsonl", "--regex", "[0-9]{2}-[a-c]").code == 0
    assert all(re.fullmatch("[0-9]{2}-[a-c]", r["output"]) for r in read_rows(tmp_path / "r.jsonl"))
    both = run_in_process("run", source, "-o", tmp_path / "x.jsonl", "--choice", "a,b", "--regex", "a")
    assert both.code == 2 and "--choice and --regex" in both.err
    missing = run_in_process("run", source, "-o", tmp_path / "x.jsonl", "--json-schema", tmp_path / "none.json")
    assert missing.code == 2 and "--json-schema" in missing.err
    twice = tmp_path / "twice.json"  # a key given twice: one of its values would be dropped without a word
    twice.write_text('{"type": "object", "properties": {"a": {"type": "string"}, "a": {"type": "integer"}}}')
    repeated = run_in_process("run", source, "-o", tmp_path / "x.jsonl", "--json-schema", twice)
    assert repeated.code == 2 and f"--json-schema {twice}: the file is not valid JSON (the key \"a\" appears twice" \
        in repeated.err, repeated.err


def test_per_record_fields_under_their_openai_and_vllm_names(tiny_model, tmp_path):
    records = [
        {"id": "schema", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
            "name": "t", "strict": True, "schema": SCHEMA}}, "max_tokens": 40},
        {"id": "object", "prompt": "x", "response_format": {"type": "json_object"}, "max_tokens": 40},
        {"id": "choice", "prompt": "x", "guided_choice": ["yes", "no"], "logprobs": True, "top_logprobs": 2},
        {"id": "regex", "prompt": "x", "guided_regex": "[a-z]{3}"},
        {"id": "guided-json", "prompt": "x", "guided_json": json.dumps(SCHEMA), "max_tokens": 40},
        {"id": "scored", "prompt": "the quick brown fox", "prompt_logprobs": 1, "max_tokens": 2},
        {"id": "penalties", "prompt": "x", "presence_penalty": 1.5, "frequency_penalty": 0.5,
         "repetition_penalty": 1.3, "logit_bias": {"2": -100}, "bad_words": ["the"]},
        {"id": "bad-schema", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
            "name": "t", "schema": {"type": "objekt"}}}},
        {"id": "bad-regex", "prompt": "x", "guided_regex": "a(b"},
        {"id": "two", "prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
        {"id": "unsupported", "prompt": "x", "guided_grammar": "root ::= 'a'"},
        {"id": "too-many", "prompt": "x", "logprobs": True, "top_logprobs": 50},
        {"id": "text", "prompt": "x", "response_format": {"type": "text"}, "max_tokens": 3},
    ]
    out = tmp_path / "o.jsonl"
    result = _run(tiny_model, write_jsonl(tmp_path / "in.jsonl", records), "-o", out, "--choice", "p,q")
    assert result.code == 3, result.err
    rows = {r["id"]: r for r in read_rows(out)}
    if rows["schema"]["error"] is None:
        jsonschema.validate(json.loads(rows["schema"]["output"]), SCHEMA)
    if rows["object"]["error"] is None:
        assert isinstance(json.loads(rows["object"]["output"]), dict)
    assert rows["choice"]["output"] in ("yes", "no") and len(rows["choice"]["logprobs"][0]["top"]) == 2
    assert re.fullmatch("[a-z]{3}", rows["regex"]["output"])
    scored = rows["scored"]
    assert scored["prompt_logprobs"][0]["logprob"] is None and len(scored["prompt_logprobs"]) == scored["prompt_tokens"]
    assert scored["prompt_logprob_sum"] == pytest.approx(sum(e["logprob"] for e in scored["prompt_logprobs"][1:]))
    assert "invalid JSON schema" in rows["bad-schema"]["error"] and "line 8" in rows["bad-schema"]["error"]
    assert "invalid regex" in rows["bad-regex"]["error"]
    assert "set only one of guided_regex, guided_choice" in rows["two"]["error"]
    assert "guided_grammar is not supported" in rows["unsupported"]["error"]
    assert "top_logprobs must be a number of alternatives from 0 to 20" in rows["too-many"]["error"]
    assert rows["text"]["output"] not in ("p", "q")  # a record's text format lifts the run's --choice
    assert rows["penalties"]["output"] in ("p", "q")  # the run's --choice applies where a record sets none
    assert "logprobs" in rows["regex"] and rows["regex"]["logprobs"] is None  # the column is the run's


def test_openai_batch_round_trip_with_response_format_and_logprobs(tiny_model, tmp_path):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    lines = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "logprobs": True,
            "top_logprobs": 2, "response_format": {"type": "json_schema", "json_schema": {
                "name": "s", "strict": True, "schema": SCHEMA}}}},
        {"custom_id": "c2", "method": "POST", "url": "/v1/completions", "body": {
            "model": "any", "prompt": "once", "max_tokens": 5, "logprobs": 2}},
        {"custom_id": "c3", "method": "POST", "url": "/v1/chat/completions", "body": {
            "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}},
    ]
    out = tmp_path / "out.jsonl"
    result = _run(tiny_model, write_jsonl(tmp_path / "batch.jsonl", lines), "-o", out, "--output-format", "openai-batch",
                  "--served-model-name", "any")
    assert result.code == 3, result.err
    got = [json.loads(line) for line in out.read_text().splitlines()]
    chat = ChatCompletion.model_validate(got[0]["response"]["body"])
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    if chat.choices[0].finish_reason == "stop":  # (a length stop may also be whole, but the batch line cannot say)
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    completion = Completion.model_validate(got[1]["response"]["body"])
    assert len(completion.choices[0].logprobs.tokens) == completion.usage.completion_tokens
    assert got[2]["response"] is None and "body.tools is not supported" in got[2]["error"]["message"]


def _cut_run(tmp_path, model_args, max_tokens: str, *extra):
    """A --json-schema run whose max_tokens cuts the outputs: (its rows, its summary JSON, the result)."""
    schema, summary = tmp_path / "schema.json", tmp_path / "summary.json"
    schema.write_text(json.dumps(SCHEMA))
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"Label record {i} as JSON."}
                                                 for i in range(5)] + [{"id": "plain", "prompt": "x", "max_tokens": 2,
                                                                        "response_format": {"type": "text"}}])
    result = run_in_process("run", source, "-o", tmp_path / "out.jsonl", *model_args, "--json-schema", schema,
                            "--max-tokens", max_tokens, "--temperature", "0", "--summary-json", summary, *extra)
    return read_rows(tmp_path / "out.jsonl"), json.loads(summary.read_text()), result


def _assert_cut_said(rows, summary, result, structured: int) -> None:
    cut = [r for r in rows if r["finish_reason"] == "length" and r["error"] is not None and r["id"] != "plain"]
    assert result.code == 0 and all(r["status"] == "ok" for r in rows), result.err  # (ok rows all the same)
    assert cut and (summary["structured_outputs"], summary["structured_outputs_cut"]) == (structured, len(cut))
    assert f"warning: {len(cut)} of {structured} structured-output rows were cut by max_tokens" in result.err
    assert "raise --max-tokens" in result.err
    assert summary["finish_reasons"]["length"] >= len(cut)


def test_structured_outputs_cut_by_max_tokens_are_counted_and_warned_of_even_when_quiet(tiny_model, tmp_path):
    # no object of the schema fits in 3 tokens: every structured row is cut (the text record has no grammar)
    rows, summary, result = _cut_run(tmp_path, tiny_args(tiny_model), "3", "--quiet")
    _assert_cut_said(rows, summary, result, structured=5)
    assert summary["structured_outputs_cut"] == 5 and result.out == ""


@pytest.mark.slow
def test_the_embedded_model_cut_by_a_tiny_max_tokens_is_warned_of(tmp_path):
    rows, summary, result = _cut_run(tmp_path, [], "4")
    _assert_cut_said(rows, summary, result, structured=5)
    assert "finish reasons" in result.out and "length" in result.out
