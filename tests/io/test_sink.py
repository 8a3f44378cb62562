"""JournalSink on its own: the in-flight join, id claims, error rows, the commit policy, --on-error and the totals,
with built records and engine outputs made by hand (no model, no engine)."""

from __future__ import annotations

import pytest

from conveyor.core import RequestOutput, SamplingParams
from conveyor.io.records.readers import RawRecord
from conveyor.io.records.record_head import ErrorRow, unreadable
from conveyor.io.records.request_builder import BuiltRequest
from conveyor.io.rows.sink import BadRecordStop, CommitPolicy, JournalSink
from conveyor.io.state.journal import Journal


def raw(index: int) -> RawRecord:
    return RawRecord(index, index + 1, {"id": f"r{index}"}, None)


def built(index: int, record_id: str | None = None, id_given: bool = True) -> BuiltRequest:
    return BuiltRequest(index, record_id or f"r{index}", "completion", [1, 2, 3], SamplingParams(seed=7), {},
                        id_given)


def output(req_id: str, tokens=(5, 6), text: str = "hi") -> RequestOutput:
    return RequestOutput(req_id, list(tokens), text, "stop", num_prompt_tokens=3, num_cached_tokens=0,
                         num_preemptions=0, arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0,
                         finish_time=3.0)


@pytest.fixture
def journal(tmp_path):
    with Journal(tmp_path / "j.sqlite") as j:
        yield j


def test_a_record_goes_in_as_a_request_and_comes_out_as_its_row(journal):
    sink = JournalSink(journal)
    request = sink.admit(raw(4), built(4))
    assert request.req_id == "4" and request.prompt_token_ids == [1, 2, 3] and request.sampling.seed == 7
    assert sink.in_flight.keys() == {"4"}
    sink.finished(output("4"))
    assert not sink.in_flight
    sink.close(True)
    [row] = list(journal.iter_rows())
    assert (row["id"], row["index"], row["status"], row["output"], row["completion_tokens"], row["seed"]) == \
        ("r4", 4, "ok", "hi", 2, 7)
    assert (row["queue_s"], row["ttft_s"], row["latency_s"]) == (0.5, 1.0, 2.0)
    t = sink.totals
    assert (t.done, t.ok, t.errors, t.prompt_tokens, t.completion_tokens) == (1, 1, 0, 3, 2)


def test_a_bad_record_and_a_repeated_id_become_error_rows_without_a_request(journal):
    sink = JournalSink(journal)
    assert sink.admit(raw(0), built(0, "same")) is not None
    bad = ErrorRow(1, "r1", "line 2: no prompt", {}, None)
    assert sink.admit(raw(1), bad) is None
    assert sink.admit(raw(2), built(2, "same")) is None
    assert sink.admit(raw(3), built(3, "3", id_given=False)) is not None  # an index as id is never a duplicate
    sink.close(False)
    rows = {r["index"]: r for r in journal.iter_rows()}
    assert rows.keys() == {1, 2}
    assert rows[1]["error"] == "line 2: no prompt"
    assert rows[2]["status"] == "error" and rows[2]["error"].startswith("line 3: duplicate id 'same'")
    assert sink.totals.errors == 2 and sink.totals.ok == 0


def test_an_index_as_id_never_makes_a_later_record_with_that_id_a_duplicate(journal):
    """The row of an unreadable record (its id is its index: it has no other) and the row of a record without an
    id, committed before a record whose own id is that index is read: the later record runs, as it would have had
    it been read first."""
    sink = JournalSink(journal)
    unparsed = RawRecord(0, 1, None, "line 1: invalid JSON")
    assert sink.admit(unparsed, unreadable(unparsed, ())) is None
    assert sink.admit(raw(1), built(1, "1", id_given=False)) is not None
    sink.finished(output("1"))
    sink.commit()
    assert sink.admit(raw(2), built(2, "0")) is not None
    assert sink.admit(raw(3), built(3, "1")) is not None
    assert sink.admit(raw(4), built(4, "1")) is None  # (an id given twice is still a duplicate)
    sink.close(False)
    rows = {r["index"]: r for r in journal.iter_rows()}
    assert [rows[i]["status"] for i in (0, 1, 4)] == ["error", "ok", "error"]
    assert "duplicate id '1'" in rows[4]["error"] and "duplicate" not in rows[0]["error"]


def test_a_request_the_engine_refuses_is_an_error_row_naming_where_it_was_read(journal):
    sink = JournalSink(journal)
    sink.admit(raw(5), built(5))
    refused = RequestOutput("5", [], "", "error", num_prompt_tokens=3, num_cached_tokens=0, num_preemptions=0,
                            arrival_time=1.0, first_scheduled_time=1.0, first_token_time=1.0, finish_time=1.0,
                            error="request '5': prompt + max_tokens exceeds the model's context")
    sink.finished(refused)
    sink.close(False)
    [row] = list(journal.iter_rows())
    assert row["status"] == "error" and row["error"] == "line 6: request '5': prompt + max_tokens exceeds the " \
                                                        "model's context"
    assert not sink.in_flight


def test_commits_follow_the_policy_by_rows_and_by_time(journal):
    sink = JournalSink(journal, CommitPolicy(every_rows=2, every_seconds=100.0))
    start = sink._last_commit
    for i in range(3):
        sink.admit(raw(i), built(i))
        sink.finished(output(str(i)))
        sink.tick(start + 1)
    assert journal.num_committed() == 2 and journal.pending == 1  # two rows made a commit; the third waits
    sink.tick(start + 50)
    assert journal.num_committed() == 2
    sink.tick(start + 102)  # 100 s after the last commit
    assert journal.num_committed() == 3


def test_on_error_fail_commits_what_finished_and_stops(journal):
    sink = JournalSink(journal, on_error="fail")
    sink.admit(raw(0), built(0))
    sink.finished(output("0"))
    with pytest.raises(BadRecordStop, match="line 2: empty"):
        sink.admit(raw(1), ErrorRow(1, "r1", "line 2: empty", {}, None))
    assert journal.num_committed() == 1


def test_an_unknown_on_error_is_refused():
    with pytest.raises(ValueError, match="on_error must be one of record, skip, fail"):
        JournalSink(None, on_error="ignore")


def test_a_request_that_failed_while_it_ran_is_an_error_row_naming_what_failed(journal):
    sink = JournalSink(journal)
    sink.admit(raw(2), built(2))
    failed = RequestOutput("2", [], "", "error", num_prompt_tokens=3, num_cached_tokens=0, num_preemptions=0,
                           arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0, finish_time=3.0,
                           error="the request failed while it ran (MinTokens failed: IndexError: index 999999 is out "
                                 "of bounds); the other requests went on")
    sink.finished(failed)
    sink.close(True)
    [row] = list(journal.iter_rows())
    assert row["status"] == "error" and row["prompt_tokens"] == 3 and row["output"] is None
    assert row["error"].startswith("line 3: the request failed while it ran (MinTokens failed: IndexError")
    assert sink.totals.errors == 1 and not sink.in_flight
