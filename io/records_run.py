"""`run_records`: the one loop that takes records through a request builder and an engine into a sink.

    from conveyor.core import EngineConfig, SamplingParams
    from conveyor.core.engine import Engine
    from conveyor.io.journal import Journal
    from conveyor.io.readers import open_reader
    from conveyor.io.records_run import run_records
    from conveyor.io.request_builder import BuildOptions, RequestBuilder
    from conveyor.io.sink import JournalSink

    engine = Engine.from_pretrained("smollm2-135m-instruct", EngineConfig())
    builder = RequestBuilder(engine.tokenizer, BuildOptions(sampling=SamplingParams(max_tokens=64)))
    with Journal("rows.sqlite") as journal:
        sink = JournalSink(journal)
        run_records(open_reader("prompts.jsonl"), builder, engine, sink)  # "done": every row committed

`conveyor run` (with its signals and progress around it), each shard of `--shard` and each Ray worker call it;
`conveyor validate` calls it without an engine (every record is built and checked, none generated). Records are
pulled lazily: at most the engine's `max_waiting` requests wait in it (backpressure), so memory does not grow
with the input.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from conveyor.io.readers import RawRecord
from conveyor.io.sink import RecordSink


def run_records(records: Iterable[RawRecord], builder, engine, sink: RecordSink,
                should_stop: Callable[[], bool] = lambda: False, on_progress: Callable[[], None] | None = None,
                progress_every: float = 0.2) -> str:
    """Build every record (`builder`: a `request_builder.RequestBuilder`), run the requests through `engine` (a
    `core.engine.Engine`, or None: build only) and give each record's outcome to `sink`, once. Returns "done"
    when every record has gone to the sink, "stopped" when `should_stop()` said so first (the sink is closed
    either way: a JournalSink commits what finished). Exceptions propagate after the sink is closed."""
    records = iter(records)
    exhausted = False
    last_progress = time.monotonic()
    completed = False
    try:
        while True:
            if should_stop():
                return "stopped"
            while not exhausted and (engine is None or engine.num_waiting < engine.config.max_waiting):
                raw = next(records, None)
                if raw is None:
                    exhausted = True
                    break
                built = builder.build(raw)
                request = sink.admit(raw, built)
                if request is None or engine is None:  # a row already, or build only
                    continue
                try:
                    engine.add_request(request)
                except ValueError as e:  # a request the engine can never run: the error names it
                    sink.rejected(raw, built, str(e))
            if engine is not None and engine.has_unfinished():
                for out in engine.step():
                    sink.finished(out)
            elif exhausted:
                completed = True
                return "done"
            now = time.monotonic()
            sink.tick(now)
            if on_progress is not None and now - last_progress >= progress_every:
                on_progress()
                last_progress = now
    finally:
        sink.close(completed)
