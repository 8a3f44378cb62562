"""`run_records`: the one loop that takes records through a request builder and an engine into a sink.

    from conveyor.core import EngineConfig, SamplingParams, load_engine
    from conveyor.io.state.journal import Journal
    from conveyor.io.records.readers import open_reader
    from conveyor.io.records_run import run_records
    from conveyor.io.records.build_options import BuildOptions
    from conveyor.io.records.request_builder import RequestBuilder
    from conveyor.io.rows.sink import JournalSink

    engine = load_engine("smollm2-135m-instruct", EngineConfig())
    builder = RequestBuilder(engine.tokenizer, BuildOptions(), SamplingParams(max_tokens=64), engine.limits)
    with Journal("rows.sqlite") as journal:
        sink = JournalSink(journal)
        run_records(open_reader("prompts.jsonl"), builder, engine, sink)  # "done": every row committed

`Run` (io/run.py) calls it for `conveyor run`, each shard and each Ray worker; `conveyor validate` calls it without
an engine (every record is built and checked, none generated). The engine's own loop (`Engine.stream`) pulls the
requests lazily: at most the engine's `max_waiting` wait in it (backpressure), so memory does not grow with the
input.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from conveyor.core.engine_api import InferenceEngine
from conveyor.io.records.readers import RawRecord
from conveyor.io.records.record_head import RecordBuilder
from conveyor.io.rows.sink import RecordSink


def run_records(records: Iterable[RawRecord], builder: RecordBuilder, engine: InferenceEngine | None, sink: RecordSink,
                should_stop: Callable[[], bool] = lambda: False, on_progress: Callable[[], None] | None = None,
                progress_every: float = 0.2) -> str:
    """Build every record (`builder`: a `RequestBuilder` or `PoolingRequestBuilder`), run the requests through
    `engine` (the generation or pooling engine; None: build only) and give each record's outcome to `sink`, once.
    Returns "done" when every record has gone to the sink, "stopped" when `should_stop()` said so first (checked
    between steps, and between records while they are read); the sink is closed either way (a JournalSink commits
    what finished).
    Exceptions propagate after the sink is closed."""
    completed = False
    try:
        if should_stop():
            return "stopped"
        requests = _requests(records, builder, sink, should_stop)
        if engine is None:
            for _ in requests:
                pass
        else:
            last_progress = time.monotonic()
            for outputs in engine.stream(requests):
                for out in outputs:
                    sink.finished(out)
                now = time.monotonic()
                sink.tick(now)
                if on_progress is not None and now - last_progress >= progress_every:
                    on_progress()
                    last_progress = now
                if should_stop():
                    return "stopped"
        if should_stop():
            return "stopped"
        completed = True
        return "done"
    finally:
        sink.close(completed)


def _requests(records: Iterable[RawRecord], builder: RecordBuilder, sink: RecordSink,
              should_stop: Callable[[], bool]) -> Iterator:
    """Each record built and admitted by the sink: the requests to generate (a record that became a row here
    yields none, one with n > 1 one per sample). Ends early once `should_stop()` says so."""
    for raw in records:
        request = sink.admit(raw, builder.build(raw))
        if isinstance(request, list):
            yield from request
        elif request is not None:
            yield request
        if should_stop():
            return
