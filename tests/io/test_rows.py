"""The output row (io/rows/rows.py) on its own: the declared columns and their Arrow types, and the rows of a completion,
a bad record and a repeated id."""

from __future__ import annotations

import pyarrow as pa

from conveyor.core import RequestOutput, SamplingParams
from conveyor.core.schedule_types import TokenLogprobs
from conveyor.io.records.record_head import ErrorRow
from conveyor.io.records.request_builder import BuiltRequest
from conveyor.io.rows.rows import (
    KIND_KEY,
    OPTIONAL_COLUMNS,
    OUTPUT_COLUMNS,
    WHERE_KEY,
    base_schema,
    duplicate_id_row,
    error_row,
    ok_row,
    optional_schema,
)


def _built(**kw) -> BuiltRequest:
    base = dict(index=3, id="q3", kind="chat", prompt_token_ids=[10, 11, 12], sampling=SamplingParams(seed=9),
                kept={"topic": "x"})
    return BuiltRequest(**{**base, **kw})


def _output(**kw) -> RequestOutput:
    base = dict(req_id="3", output_token_ids=[7, 8], text="ok", finish_reason="length", num_prompt_tokens=3,
                num_cached_tokens=0, num_preemptions=0, arrival_time=0.0, first_scheduled_time=0.25,
                first_token_time=0.5, finish_time=1.0)
    return RequestOutput(**{**base, **kw})


def test_the_schema_declares_every_output_column_with_an_explicit_type():
    schema = base_schema()
    assert tuple(schema.names) == OUTPUT_COLUMNS
    assert not any(pa.types.is_null(t) for t in schema.types)
    assert schema.field("index").type == pa.int64() and schema.field("latency_s").type == pa.float64()
    assert optional_schema("prompt_logprob_sum") == pa.float64()
    entry = optional_schema("logprobs").value_type
    assert [f.name for f in entry] == ["token", "id", "logprob", "top"]


def test_an_ok_row_has_every_column_and_the_kept_fields():
    row = ok_row(_built(), _output(), where="line 4")
    assert set(OUTPUT_COLUMNS) <= row.keys()
    assert (row["id"], row["index"], row["status"], row["output"], row["finish_reason"]) == ("q3", 3, "ok", "ok",
                                                                                           "length")
    assert (row["prompt_tokens"], row["completion_tokens"], row["seed"], row["error"]) == (3, 2, 9, None)
    assert (row["queue_s"], row["ttft_s"], row["latency_s"]) == (0.25, 0.5, 1.0)
    assert row["topic"] == "x" and row[KIND_KEY] == "chat" and row[WHERE_KEY] == "line 4"
    assert not set(OPTIONAL_COLUMNS) & row.keys()


def test_logprobs_name_their_tokens_and_prompt_logprobs_sum():
    out = _output(logprobs=(TokenLogprobs(7, -0.5, ((7, -0.5), (9, -1.5))), TokenLogprobs(8, -0.25)),
                  prompt_logprobs=(None, TokenLogprobs(11, -2.0), TokenLogprobs(12, -1.0)))
    row = ok_row(_built(), out, token_text=lambda t: f"<{t}>")
    assert row["logprobs"][0] == {"token": "<7>", "id": 7, "logprob": -0.5,
                                  "top": [{"token": "<7>", "id": 7, "logprob": -0.5},
                                          {"token": "<9>", "id": 9, "logprob": -1.5}]}
    assert row["prompt_logprobs"][0] == {"token": "<10>", "id": 10, "logprob": None, "top": []}
    assert row["prompt_logprob_sum"] == -3.0


def test_an_error_row_says_why_and_holds_no_output():
    row = error_row(ErrorRow(5, "r5", "line 6: no prompt", {"topic": None}, seed=None, prompt_tokens=None))
    assert set(OUTPUT_COLUMNS) <= row.keys()
    assert (row["status"], row["output"], row["error"], row["completion_tokens"]) == ("error", None,
                                                                                     "line 6: no prompt", 0)
    assert row["topic"] is None


def test_a_repeated_id_found_at_a_merge_gets_a_single_runs_error_row():
    row = ok_row(_built(), _output(logprobs=(TokenLogprobs(7, -0.5), TokenLogprobs(8, -0.25))), where="line 4")
    dup = duplicate_id_row(row)
    assert dup["status"] == "error" and dup["output"] is None and dup["completion_tokens"] == 0
    assert dup["error"].startswith("line 4: duplicate id 'q3'")
    assert "logprobs" not in dup and WHERE_KEY not in dup and dup["topic"] == "x"
