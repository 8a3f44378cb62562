"""Progress display: a Rich bar on a TTY, a plain log line every N seconds otherwise (cron, pipes).

Reads the run's totals and its engine's stats only; writes to stderr. The ETA (`eta_seconds`) counts tokens, not
only finished records: it shows while the first records are still generating, and the first short ones to finish
do not make it drop to nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Any


def _fmt_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def eta_seconds(records_left: int | None, records_in_flight: int, records_finished: int, tokens_finished: int,
                tokens_generated: int, tokens_carried_over: int, elapsed: float, tokens_cap: float) -> float | None:
    """Seconds until every record has a row: the tokens still expected over this process's token rate so far (None:
    not known yet).

    `records_left`: records without a row (None: the input's size is unknown), `records_in_flight` of them
    generating now; `records_finished`, `tokens_finished`: the rows this process finished and their completion
    tokens; `tokens_generated`: the tokens it sampled in `elapsed` seconds (`tokens_carried_over`: those continued
    records held from an earlier process); `tokens_cap`: the most a record may generate (--max-tokens times --n).
    A record left is expected to generate the finished ones' mean, weighed against the cap by how many have
    finished of those started (the short ones finish first: their mean alone would promise too little), less
    the tokens the records generating now already have."""
    if records_left is None or elapsed <= 0:
        return None
    if records_left <= 0:
        return 0.0
    if tokens_generated <= 0 or (records_finished and not tokens_finished):  # no token rate (yet): by records
        return records_left * elapsed / records_finished if records_finished else None
    known = records_finished / max(records_finished + min(records_in_flight, records_left), 1)
    per_record = known * (tokens_finished / max(records_finished, 1)) + (1 - known) * tokens_cap
    in_flight = max(tokens_generated + tokens_carried_over - tokens_finished, 0)
    expected = max(records_left * per_record - in_flight, records_left)  # (a token each, at least)
    return expected * elapsed / tokens_generated


def _snapshot(run) -> dict[str, Any]:
    t = run.totals
    stats = run.engine.stats() if run.engine else None
    elapsed = time.monotonic() - t.first_admit if t.first_admit else 0.0
    generated = run.engine.num_generated_tokens if run.engine else 0
    rate = generated / elapsed if elapsed > 0 else 0.0
    n = run.spec.build.n
    in_flight = -(-(stats.num_running + stats.num_waiting) // n) if stats else 0  # (records: a request per sample)
    eta = eta_seconds(None if t.total is None else t.total - t.done, in_flight, t.done - t.resumed_from,
                      t.completion_tokens, generated, t.tokens_carried_over, elapsed, run.spec.sampling.max_tokens * n)
    return {
        "done": t.done, "total": t.total, "errors": t.errors, "tok_s": rate, "eta": eta,
        "running": stats.num_running if stats else 0, "waiting": stats.num_waiting if stats else 0,
        "kv": stats.kv_usage if stats else 0.0, "preemptions": stats.num_preemptions if stats else 0,
    }


class PlainProgress:
    """One line every `every` seconds: for logs, where a redrawn bar would be noise."""

    def __init__(self, every: float = 10.0, stream=None) -> None:
        self.every = every
        self.stream = stream or sys.stderr
        self.last = time.monotonic()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, run, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every:
            return
        self.last = now
        s = _snapshot(run)
        total = s["total"] if s["total"] is not None else "?"
        self.stream.write(
            f"conveyor: {time.strftime('%H:%M:%S')} records {s['done']}/{total} errors {s['errors']} "
            f"| {s['tok_s']:.1f} tok/s | running {s['running']} waiting {s['waiting']} "
            f"| kv {s['kv']:.0%} | preemptions {s['preemptions']} | eta {_fmt_eta(s['eta'])}\n")
        self.stream.flush()


class RichProgress:
    """A live bar: records done / total, ETA (by tokens), output tokens/s, running/waiting, KV use, preemptions."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(  # (the ETA is eta_seconds', by tokens: Rich's counts finished records only)
            TextColumn("[bold]conveyor"), BarColumn(), MofNCompleteColumn(), TextColumn("eta {task.fields[eta]}"),
            TextColumn("{task.fields[info]}"), console=Console(stderr=True), transient=False,
            refresh_per_second=4)
        self.task = None

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, run, force: bool = False) -> None:
        s = _snapshot(run)
        info = (f"{s['tok_s']:.0f} tok/s | run {s['running']} wait {s['waiting']} | kv {s['kv']:.0%} "
                f"| preempt {s['preemptions']} | err {s['errors']}")
        eta = _fmt_eta(s["eta"])
        if self.task is None:
            self.task = self.progress.add_task("run", total=s["total"], info=info, eta=eta)
        self.progress.update(self.task, completed=s["done"], total=s["total"], info=info, eta=eta)


class NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, run, force: bool = False) -> None:
        pass


def make_progress(quiet: bool, log_every: float):
    if quiet:
        return NoProgress()
    if sys.stderr.isatty():
        return RichProgress()
    return PlainProgress(log_every)
