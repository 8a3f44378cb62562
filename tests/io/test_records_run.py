"""run_records on its own: every record reaches the sink exactly once (a row, a refusal or a completion), a stop
ends it between steps or between records, and the sink is closed either way; with a fake engine and builder."""

from __future__ import annotations

import pytest

from conveyor.core import GenerationRequest, RequestOutput, SamplingParams
from conveyor.io.records.readers import RawRecord
from conveyor.io.records.record_head import ErrorRow
from conveyor.io.records.request_builder import BuiltRequest
from conveyor.io.records_run import run_records
from conveyor.io.rows.sink import RecordSink


class FakeEngine:
    """Finishes each request `steps` steps after it was added; refuses prompts longer than 3 tokens (an error
    output, with the next step's, as the real engine's). Pulls its requests lazily like the real engine's `stream`,
    at most `max_waiting` at a time."""

    def __init__(self, steps: int = 2, max_waiting: int = 2) -> None:
        self.steps = steps
        self.max_waiting = max_waiting
        self.left: dict[str, int] = {}
        self.num_steps = 0

    def stream(self, requests):
        source = iter(requests)
        exhausted = False
        while True:
            done = []
            while not exhausted and len(self.left) + len(done) < self.max_waiting:
                request = next(source, None)
                if request is None:
                    exhausted = True
                    break
                if len(request.prompt_token_ids) > 3:
                    done.append(RequestOutput(request.req_id, [], "", "error", len(request.prompt_token_ids), 0, 0,
                                              0.0, 0.0, 0.0, 0.0, error=f"request {request.req_id!r} is too long"))
                else:
                    self.left[request.req_id] = self.steps
            if not self.left:
                if done:
                    yield done
                    continue
                return
            self.num_steps += 1
            for req_id in list(self.left):
                self.left[req_id] -= 1
                if self.left[req_id] == 0:
                    del self.left[req_id]
                    done.append(RequestOutput(req_id, [1], "x", "stop", 1, 0, 0, 0.0, 0.0, 0.0, 0.0))
            yield done


class Builder:
    """Records {"n": k} become prompts of k tokens; {"bad": ...} an error row."""

    def build(self, raw: RawRecord):
        if "bad" in raw.record:
            return ErrorRow(raw.index, str(raw.index), f"record {raw.index}: bad", {}, None)
        return BuiltRequest(raw.index, str(raw.index), "completion", [0] * raw.record["n"], SamplingParams(), {},
                            False)


class Sink(RecordSink):
    def __init__(self) -> None:
        self.outcomes: dict[int, str] = {}
        self.ticks = 0
        self.closed: bool | None = None

    def admit(self, raw, built):
        if isinstance(built, ErrorRow):
            self._once(built.index, "error")
            return None
        return GenerationRequest(str(built.index), built.prompt_token_ids, built.sampling)

    def finished(self, out):
        if out.error is not None:
            assert "too long" in out.error
            self._once(int(out.req_id), "rejected")
        else:
            self._once(int(out.req_id), "ok")

    def _once(self, index: int, outcome: str) -> None:
        assert index not in self.outcomes, f"record {index} reached the sink twice"
        self.outcomes[index] = outcome

    def tick(self, now):
        self.ticks += 1

    def close(self, completed):
        self.closed = completed


def records(specs):
    return [RawRecord(i, i + 1, spec, None) for i, spec in enumerate(specs)]


SPECS = [{"n": 2}, {"bad": 1}, {"n": 5}, {"n": 1}, {"n": 3}, {"bad": 2}, {"n": 2}]


def test_every_record_reaches_the_sink_once():
    sink = Sink()
    engine = FakeEngine()
    assert run_records(records(SPECS), Builder(), engine, sink) == "done"
    assert sink.outcomes == {0: "ok", 1: "error", 2: "rejected", 3: "ok", 4: "ok", 5: "error", 6: "ok"}
    assert sink.closed is True and sink.ticks == engine.num_steps > 0


def test_without_an_engine_records_are_built_and_none_generated():
    sink = Sink()
    assert run_records(records(SPECS), Builder(), None, sink) == "done"
    assert sink.outcomes == {1: "error", 5: "error"} and sink.closed is True


@pytest.mark.parametrize("after_calls", [0, 3, 6])
def test_a_stop_ends_the_loop_and_closes_the_sink_uncompleted(after_calls):
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) > after_calls

    sink = Sink()
    assert run_records(records(SPECS * 3), Builder(), FakeEngine(steps=3), sink, should_stop) == "stopped"
    assert sink.closed is False and len(sink.outcomes) < len(SPECS) * 3


def test_a_stop_is_seen_between_records_while_only_bad_ones_are_read():
    read = []

    def bad_records():
        for i in range(10_000):
            read.append(i)
            yield RawRecord(i, i + 1, {"bad": i}, None)

    sink = Sink()
    assert run_records(bad_records(), Builder(), FakeEngine(), sink, lambda: len(read) >= 5) == "stopped"
    assert len(read) == 5


def test_an_engine_error_propagates_after_the_sink_is_closed():
    class Broken(FakeEngine):
        def stream(self, requests):
            yield from super().stream(requests)
            raise RuntimeError("the device went away")

    sink = Sink()
    with pytest.raises(RuntimeError, match="went away"):
        run_records(records(SPECS), Builder(), Broken(), sink)
    assert sink.closed is False


def test_progress_is_reported_between_steps():
    seen = []
    run_records(records(SPECS), Builder(), FakeEngine(), Sink(), on_progress=lambda: seen.append(1),
                progress_every=0.0)
    assert seen
