"""Progress display: a Rich bar on a TTY, a plain log line every N seconds otherwise (cron, pipes).

Reads the run's totals and its engine's stats only; writes to stderr.
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


def _snapshot(run) -> dict[str, Any]:
    t = run.totals
    stats = run.engine.stats() if run.engine else None
    elapsed = time.monotonic() - t.first_admit if t.first_admit else 0.0
    generated = run.engine.num_generated_tokens if run.engine else 0
    rate = generated / elapsed if elapsed > 0 else 0.0
    new_rows = t.done - t.resumed_from
    eta = None
    if t.total is not None and new_rows > 0 and elapsed > 0:
        eta = (t.total - t.done) * elapsed / new_rows
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
    """A live bar: records done / total, ETA, output tokens/s, running/waiting, KV use, preemptions."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]conveyor"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
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
        if self.task is None:
            self.task = self.progress.add_task("run", total=s["total"], info=info)
        self.progress.update(self.task, completed=s["done"], total=s["total"], info=info)


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
