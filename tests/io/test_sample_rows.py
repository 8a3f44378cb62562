"""n samples per record, without a model: seeds and requests (request_builder), the sink's grouping of a record's
samples into one journal row and its partials (exactly once across a stop), and the rows the writers make of it
(a row per sample with sample_index; openai-batch: one line, n choices)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conveyor.core import ConfigError, InFlight, ModelLimits, RequestOutput, SamplingParams
from conveyor.io.records.build_options import BuildOptions
from conveyor.io.records.readers import RawRecord
from conveyor.io.records.record_head import ErrorRow
from conveyor.io.records.request_builder import BuiltRequest, RequestBuilder
from conveyor.io.records.seeds import derive_seed, index_seed, sample_seed
from conveyor.io.rows.rows import SAMPLES_KEY, duplicate_id_row, without_errors
from conveyor.io.rows.sink import BadRecordStop, JournalSink
from conveyor.io.rows.writers import write_output
from conveyor.io.state.journal import Journal

DEFAULTS = SamplingParams(temperature=0.7, max_tokens=16)


def build(tokenizer, record, index=4, **options):
    builder = RequestBuilder(tokenizer, BuildOptions(**options), DEFAULTS, ModelLimits(8192, len(tokenizer)))
    return builder.build(RawRecord(index, index + 1, record, None))


# -- seeds and requests --------------------------------------------------------------------------------------------

def test_sample_seeds_derive_from_the_record_seed_and_the_sample():
    seeds = [sample_seed(123, k) for k in range(1, 50)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    assert seeds[0] == sample_seed(123, 1) and sample_seed(124, 1) != seeds[0]
    assert sample_seed(-5, 3) >= 0  # a record's own seed may be negative
    assert {derive_seed(123, "1"), index_seed(123, 1)}.isdisjoint(seeds)  # hashed apart from both


def test_sample_0_is_the_n_1_request_and_the_others_are_seeded_apart(tokenizer):
    one = build(tokenizer, {"id": "a", "prompt": "hello"})
    four = build(tokenizer, {"id": "a", "prompt": "hello", "n": 4})
    assert (one.n, four.n) == (1, 4)
    assert four.to_generation_request(0) == one.to_generation_request()
    requests = [four.to_generation_request(k) for k in range(4)]
    assert [r.req_id for r in requests] == ["4", "4/1", "4/2", "4/3"]
    assert [r.sampling.seed for r in requests] == [one.sampling.seed] + [sample_seed(one.sampling.seed, k)
                                                                          for k in (1, 2, 3)]
    assert all(r.prompt_token_ids == one.prompt_token_ids for r in requests)
    assert all(dataclasses.replace(r.sampling, seed=0) == dataclasses.replace(one.sampling, seed=0) for r in requests)


def test_the_runs_n_is_a_default_a_record_replaces(tokenizer):
    assert build(tokenizer, {"prompt": "x"}, n=3).n == 3
    assert build(tokenizer, {"prompt": "x", "n": 1}, n=3).n == 1
    assert build(tokenizer, {"prompt": "x", "n": 2.0}).n == 2  # a float column's whole number
    body = {"custom_id": "c", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "n": 5}}
    assert build(tokenizer, body, n=3).n == 5


@pytest.mark.parametrize("record, says", [
    ({"prompt": "x", "n": 0}, "line 5: n must be from 1 to 128"),
    ({"prompt": "x", "n": 500}, "line 5: n must be from 1 to 128 (completions per record), got 500"),
    ({"prompt": "x", "n": "two"}, "line 5: n must be an integer"),
    ({"prompt": "x", "n": True}, "line 5: n must be an integer"),
    ({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "n": -1}}, "line 5: body.n must be from 1"),
    ({"prompt": "x", "n": 3, "best_of": 4}, "best_of is not supported by conveyor except at its default (got 4"),
    ({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "n": 2, "best_of": 3}},
     "body.best_of is not supported by conveyor except at its default (got 3"),
])
def test_a_bad_n_or_best_of_is_an_error_row_naming_it(tokenizer, record, says):
    result = build(tokenizer, record)
    assert isinstance(result, ErrorRow) and says in result.error, result


def test_a_bad_run_n_names_the_option():
    for bad in (0, 129, True):
        with pytest.raises(ConfigError, match=r"^n must be an integer from 1 to 128") as e:
            BuildOptions(n=bad)
        assert e.value.named("--n").startswith("--n must be")


# -- the sink: one journal row per record, exactly once across stops ----------------------------------------------

def raw(index: int) -> RawRecord:
    return RawRecord(index, index + 1, {"id": f"r{index}"}, None)


def built(index: int, n: int, **sampling) -> BuiltRequest:
    return BuiltRequest(index, f"r{index}", "completion", [1, 2, 3], SamplingParams(seed=7, **sampling), {"k": index},
                        n=n)


def output(req_id: str, tokens=(5, 6), error: str | None = None) -> RequestOutput:
    return RequestOutput(req_id, list(tokens), f"text {req_id}", "error" if error else "stop", num_prompt_tokens=3,
                         num_cached_tokens=0, num_preemptions=0, arrival_time=1.0, first_scheduled_time=1.5,
                         first_token_time=2.0, finish_time=3.0, error=error)


@pytest.fixture
def journal(tmp_path):
    with Journal(tmp_path / "j.sqlite") as j:
        yield j


def test_a_records_samples_become_one_journal_row_once_all_finished(journal):
    sink = JournalSink(journal)
    requests = sink.admit(raw(0), built(0, 3))
    assert [r.req_id for r in requests] == ["0", "0/1", "0/2"]
    assert sink.admit(raw(1), built(1, 1)).req_id == "1"
    for req_id in ("0/2", "1", "0"):
        sink.finished(output(req_id))
    assert journal.pending == 1  # record 1's row; record 0 waits for its sample 1
    sink.finished(output("0/1"))
    sink.close(True)
    rows = list(journal.iter_rows())
    group = rows[0]
    assert (group["index"], group["status"]) == (0, "ok")
    assert [s["sample_index"] for s in group[SAMPLES_KEY]] == [0, 1, 2]
    assert [s["output"] for s in group[SAMPLES_KEY]] == ["text 0", "text 0/1", "text 0/2"]
    assert [s["seed"] for s in group[SAMPLES_KEY]] == [7, sample_seed(7, 1), sample_seed(7, 2)]
    assert "sample_index" not in rows[1]
    t = sink.totals
    assert (t.done, t.samples, t.ok, t.errors, t.completion_tokens) == (2, 4, 2, 0, 8)
    assert journal.num_samples() == 4 and "sample_index" in journal.columns()


def test_a_samples_error_is_that_samples_error_row(journal):
    sink = JournalSink(journal)
    sink.admit(raw(0), built(0, 2))
    sink.finished(output("0/1", error="its grammar failed"))
    sink.finished(output("0", (), error="too long for the KV cache"))
    sink.close(True)
    (group,) = journal.iter_rows()
    assert group["status"] == "error" and [s["status"] for s in group[SAMPLES_KEY]] == ["error", "error"]
    assert group[SAMPLES_KEY][1]["error"] == "line 1: its grammar failed"
    assert group[SAMPLES_KEY][1]["seed"] == sample_seed(7, 1)
    assert (sink.totals.errors, sink.totals.samples) == (1, 2)


def test_on_error_fail_stops_at_a_samples_error(journal):
    sink = JournalSink(journal, on_error="fail")
    sink.admit(raw(0), built(0, 2))
    with pytest.raises(BadRecordStop, match="its grammar failed"):
        sink.finished(output("0/1", error="its grammar failed"))


def test_a_stop_between_samples_keeps_the_finished_ones_and_the_tokens_of_the_others(tmp_path):
    generating = {"0/2": InFlight((9, 9, 9), None)}
    with Journal(tmp_path / "j.sqlite") as journal:
        sink = JournalSink(journal, engine_in_flight=lambda: generating)
        sink.admit(raw(0), built(0, 4))
        sink.finished(output("0"))
        sink.finished(output("0/3"))
        sink.close(False)
        assert journal.num_committed() == 0 and journal.partial_tokens() == (1, 3)
        partials = journal.partials()
    samples = partials[0]["samples"]
    assert sorted(samples) == ["0", "2", "3"] and samples["2"] == {"tokens": [9, 9, 9], "logprobs": None}
    with Journal(tmp_path / "j.sqlite") as journal:  # the next process
        sink = JournalSink(journal, engine_in_flight=dict, partials=partials)
        requests = sink.admit(raw(0), built(0, 4))
        assert [(r.req_id, r.output_token_ids) for r in requests] == [("0/1", ()), ("0/2", (9, 9, 9))]
        assert (sink.totals.continued, sink.totals.tokens_carried_over) == (1, 3)
        for r in requests:
            sink.finished(output(r.req_id))
        sink.close(True)
        (group,) = journal.iter_rows()
        assert journal.partial_tokens() == (0, 0)
    assert [s["output"] for s in group[SAMPLES_KEY]] == ["text 0", "text 0/1", "text 0/2", "text 0/3"]


def test_a_partial_that_does_not_fit_the_record_is_dropped(journal):
    foreign = {"samples": {"0": {"row": {"index": 9, "sample_index": 0, "status": "ok"}}, "1": {"tokens": "x"}}}
    sink = JournalSink(journal, partials={0: foreign})
    requests = sink.admit(raw(0), built(0, 2))
    assert [(r.req_id, r.output_token_ids) for r in requests] == [("0", ()), ("0/1", ())]


# -- rows and writers ------------------------------------------------------------------------------------------------

def _rows(journal_rows, tmp_path, fmt, **kw):
    path = tmp_path / ("out.parquet" if fmt == "parquet" else "out.jsonl")
    write_output(journal_rows, str(path), fmt, keep_fields=("k",), model_name="m", **kw)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        return table.schema, table.to_pylist()
    return None, [json.loads(line) for line in path.read_text().splitlines()]


def _journal_rows(tmp_path):
    with Journal(tmp_path / "j.sqlite") as journal:
        sink = JournalSink(journal)
        sink.admit(raw(0), built(0, 2))
        sink.admit(raw(1), built(1, 1))
        sink.admit(raw(2), built(2, 3))
        for req_id in ("2/2", "0/1", "1", "2", "0", "2/1"):
            sink.finished(output(req_id, error="bad grammar" if req_id == "2/1" else None))
        sink.close(True)
        return list(journal.iter_rows()), journal.columns()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_row_per_sample_in_index_and_sample_order(tmp_path, fmt):
    rows, columns = _journal_rows(tmp_path)
    schema, out = _rows(rows, tmp_path, fmt, optional=columns)
    assert [(r["index"], r["sample_index"], r["status"]) for r in out] == [
        (0, 0, "ok"), (0, 1, "ok"), (1, 0, "ok"), (2, 0, "ok"), (2, 1, "error"), (2, 2, "ok")]
    assert [r["k"] for r in out] == [0, 0, 1, 2, 2, 2]
    if schema is not None:
        import pyarrow as pa

        assert schema.field("sample_index").type == pa.int64()
    _, skipped = _rows([r for r in map(without_errors, rows) if r is not None], tmp_path, fmt, optional=columns)
    assert [(r["index"], r["sample_index"]) for r in skipped] == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 2)]


def test_the_sample_index_column_is_absent_without_samples(tmp_path):
    with Journal(tmp_path / "j.sqlite") as journal:
        sink = JournalSink(journal)
        sink.admit(raw(0), built(0, 1))
        sink.finished(output("0"))
        sink.close(True)
        rows, columns = list(journal.iter_rows()), journal.columns()
    _, out = _rows(rows, tmp_path, "jsonl", optional=columns)
    assert "sample_index" not in out[0]
    _, out = _rows(rows, tmp_path, "jsonl", optional=columns | {"sample_index"})  # --n > 1: always there
    assert out[0]["sample_index"] == 0


def test_openai_batch_puts_a_records_samples_in_one_lines_choices(tmp_path):
    rows, columns = _journal_rows(tmp_path)
    _, lines = _rows(rows[:2], tmp_path, "openai-batch", optional=columns)
    assert len(lines) == 2
    body = lines[0]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["object"] == "text_completion" and [c["text"] for c in body["choices"]] == ["text 0", "text 0/1"]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert [c["index"] for c in lines[1]["response"]["body"]["choices"]] == [0]
    _, lines = _rows(rows[2:], tmp_path, "openai-batch", optional=columns)
    assert lines[0]["response"] is None and lines[0]["error"]["message"] == "sample 1: line 3: bad grammar"


def test_a_duplicate_id_found_at_a_merge_is_one_error_row(tmp_path):
    rows, _ = _journal_rows(tmp_path)
    dup = duplicate_id_row(rows[0])
    assert SAMPLES_KEY not in dup and dup["status"] == "error" and "duplicate id 'r0'" in dup["error"]
