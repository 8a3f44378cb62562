"""Progress display: a Rich bar on a TTY, a plain log line every N seconds otherwise (cron, pipes).

Renders io's `RunProgress` (`Run.progress()`), read only when a line or frame is drawn; writes to stderr. The bar
counts records done of the total and its ETA is in records too (how it is estimated: `io/run_progress.py`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from conveyor.io.run_progress import RunProgress

ReadProgress = Callable[[], RunProgress]


def _fmt_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


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

    def update(self, read: ReadProgress, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every:
            return
        self.last = now
        p = read()
        total = p.total if p.total is not None else "?"
        self.stream.write(
            f"conveyor: {time.strftime('%H:%M:%S')} records {p.done}/{total} errors {p.errors} "
            f"| {p.tokens_per_s:.1f} tok/s | running {p.running} waiting {p.waiting} "
            f"| kv {p.kv_usage:.0%} | preemptions {p.preemptions} | eta {_fmt_eta(p.eta_s)}\n")
        self.stream.flush()


class RichProgress:
    """A live bar: records done / total, ETA (in records), output tokens/s, running/waiting, KV use, preemptions."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(  # (the ETA is io's, which also counts the records left before any has finished)
            TextColumn("[bold]conveyor"), BarColumn(), MofNCompleteColumn(), TextColumn("eta {task.fields[eta]}"),
            TextColumn("{task.fields[info]}"), console=Console(stderr=True), transient=False,
            refresh_per_second=4)
        self.task = None

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, read: ReadProgress, force: bool = False) -> None:
        p = read()
        info = (f"{p.tokens_per_s:.0f} tok/s | run {p.running} wait {p.waiting} | kv {p.kv_usage:.0%} "
                f"| preempt {p.preemptions} | err {p.errors}")
        eta = _fmt_eta(p.eta_s)
        if self.task is None:
            self.task = self.progress.add_task("run", total=p.total, info=info, eta=eta)
        self.progress.update(self.task, completed=p.done, total=p.total, info=info, eta=eta)


class NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, read: ReadProgress, force: bool = False) -> None:
        pass


def make_progress(quiet: bool, log_every: float):
    if quiet:
        return NoProgress()
    if sys.stderr.isatty():
        return RichProgress()
    return PlainProgress(log_every)
