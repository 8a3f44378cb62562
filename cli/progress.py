"""Progress display: a Rich bar on a TTY, a plain log line every N seconds otherwise (cron, pipes).

Renders io's `RunProgress` (`Run.progress()`), read only when a line or frame is drawn; writes to stderr. The bar
counts records done of the total and its ETA is in records too (how it is estimated: `io/run_progress.py`). On a
narrow terminal the bar's line drops its least useful fields first (`fitted_line`): records done / total, the ETA
and the errors stay.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from conveyor.io.run_progress import RunProgress

ReadProgress = Callable[[], RunProgress]

_LABEL = "conveyor "
_BAR_WIDTHS = (10, 40)  # the bar is drawn only where it gets at least 10 columns, and takes at most 40


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
        engine = f"waiting {p.waiting}" if p.pooling else \
            f"running {p.running} waiting {p.waiting} | kv {p.kv_usage:.0%} | preemptions {p.preemptions}"
        self.stream.write(f"conveyor: {time.strftime('%H:%M:%S')} records {p.done}/{total} errors {p.errors} "
                          f"| {p.tokens_per_s:.1f} tok/s | {engine} | eta {_fmt_eta(p.eta_s)}\n")
        self.stream.flush()


def fitted_line(p: RunProgress, width: int):
    """The bar's line for `p` in at most `width` columns (a rich Text). Records done / total, the ETA and the errors
    always show; the other fields go where they do not fit, the least useful first (preemptions, KV use, the
    engine's queue, then the bar and the token rate), and the label last."""
    from rich.text import Text

    kept = [f"{p.done}/{p.total if p.total is not None else '?'} eta {_fmt_eta(p.eta_s)}", f"err {p.errors}"]
    extra = [f"{p.tokens_per_s:.0f} tok/s"] + ([f"wait {p.waiting}"] if p.pooling else [
        f"run {p.running} wait {p.waiting}", f"kv {p.kv_usage:.0%}", f"preempt {p.preemptions}"])
    least, most = _BAR_WIDTHS
    for count in range(len(extra), -1, -1):  # with the bar: as many fields as leave it room
        text = " | ".join(kept + extra[:count])
        room = width - len(_LABEL) - len(text) - 1
        if room >= least:
            bar = min(room, most)
            done = round(bar * min(p.done / p.total, 1.0)) if p.total else 0
            style = "bar.finished" if p.total and p.done >= p.total else "bar.complete"
            return Text.assemble((_LABEL, "bold"), ("━" * done, style), ("━" * (bar - done), "bar.back"), " " + text)
    for count in range(len(extra), -1, -1):  # without it
        text = " | ".join(kept + extra[:count])
        if len(_LABEL) + len(text) <= width:
            return Text.assemble((_LABEL, "bold"), text)
    line = Text(" | ".join(kept))
    line.truncate(width, overflow="ellipsis")
    return line


class _Line:
    """The live display's renderable: the latest progress, fitted to the width it is drawn at."""

    def __init__(self) -> None:
        self.progress: RunProgress | None = None

    def __rich_console__(self, console, options):
        if self.progress is not None:
            yield fitted_line(self.progress, options.max_width)


class RichProgress:
    """A live line: a bar, records done / total, ETA (in records), errors, output tokens/s, running/waiting, KV use,
    preemptions, as many as the terminal's width holds."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self.line = _Line()
        self.live = Live(self.line, console=Console(stderr=True), transient=False, refresh_per_second=4)

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def update(self, read: ReadProgress, force: bool = False) -> None:
        self.line.progress = read()
        if force:
            self.live.refresh()


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
