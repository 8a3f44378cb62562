"""Stopping early on purpose: SIGTERM, SIGINT and --max-runtime set a flag the run loop checks.

The first SIGINT or SIGTERM asks for a clean stop (stop admitting, commit, exit 75); a second
SIGINT exits at once with 130 (the journal's last commit stands; SQLite keeps it consistent).
"""

from __future__ import annotations

import os
import signal
import sys
import time


class StopController:
    def __init__(self, max_runtime: float | None = None) -> None:
        self.deadline = time.monotonic() + max_runtime if max_runtime else None
        self.reason: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if self._previous:  # already installed: keep the handlers that were there before us
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (tests); the deadline still works
                pass

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.reason is not None and signum == signal.SIGINT:
            sys.stderr.write("conveyor: second interrupt, stopping now; the last checkpoint stands\n")
            sys.stderr.flush()
            os._exit(130)
        name = signal.Signals(signum).name
        self.reason = name
        sys.stderr.write(f"conveyor: {name} received, stopping after this step and checkpointing "
                         "(press Ctrl-C again to stop at once)\n")
        sys.stderr.flush()

    def should_stop(self) -> bool:
        if self.reason is None and self.deadline is not None and time.monotonic() >= self.deadline:
            self.reason = "max-runtime"
        return self.reason is not None
