"""Stopping early on purpose: SIGTERM, SIGHUP, SIGINT, --max-runtime (and, in a Ray worker, the driver's stop
file) set a flag the run loop checks.

The first SIGINT, SIGTERM or SIGHUP (a cron wrapper or ssh session losing its terminal) asks for a clean
stop: stop admitting, commit, exit 75. A second SIGINT exits at once with 130 (the journal's last commit
stands; SQLite keeps it consistent), even while the main thread is inside a long C call such as
tokenizing a huge record: Python runs signal handlers only between bytecodes of the main thread, so the
signals also reach a watchdog thread through `signal.set_wakeup_fd`, written by the C-level handler the
moment a signal arrives. From the process's first instant (`entry.py`, before the libraries import), a stop
signal is held instead of ending the process, and the run's controller acts on it once installed: a cron job's
`kill` during start-up also exits 75. A command that never installs one gets the signal back as it ends; one that
came after the run's controller was uninstalled (the run had ended) leaves the run's exit code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)
_held: list[int] = []  # stop signals that arrived while no StopController was installed
_controlled = False  # a StopController was installed in this process: the command's work had one


def hold_early_signals() -> None:
    """Hold the stop signals (the process's entry, before anything else): see the module's docstring."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _hold)


def _hold(signum, frame) -> None:
    if signum == signal.SIGINT and signum in _held:  # a second Ctrl-C: at once, as once running
        os._exit(130)
    _held.append(signum)


def release_held_signals() -> None:
    """At the process's end: a stop signal that no StopController took ends the process as it would have, unless
    one was installed: then the signal came once its work had ended (a run complete, its rows written, its summary
    said), and the process ends with that work's exit code."""
    if _controlled:
        _held.clear()
        # Ignored from here to the process's end: the interpreter's finalization puts a Python handler back to the
        # default action, and a signal in that window would end a finished run with -15 instead of its exit code.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        return
    for sig in dict.fromkeys(_held):
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)


class StopController:
    def __init__(self, max_runtime: float | None = None) -> None:
        self.max_runtime = max_runtime
        self.deadline = time.monotonic() + max_runtime if max_runtime else None
        self.reason: str | None = None
        self._previous: dict[int, object] = {}
        self._previous_wakeup: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._interrupts = 0
        self._lock = threading.Lock()
        self._stop_file: tuple[str, str] | None = None  # (path, reason): stop once it exists
        self._next_look = 0.0

    def start_clock(self) -> None:
        """Count --max-runtime from now (the run's own start, after the process's libraries are loaded)."""
        self.deadline = time.monotonic() + self.max_runtime if self.max_runtime else None

    def install(self) -> None:
        if self._previous:  # already installed: keep the handlers that were there before us
            return
        try:
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread (tests); the deadline still works
            self._previous.clear()
            return
        global _controlled
        _controlled = True
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="conveyor-signals", daemon=True).start()
        for sig in _held:  # (arrived while the process started)
            self._stop(sig)
        _held.clear()

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup if self._previous_wakeup is not None else -1)
            for fd in reversed(self._pipe):  # the write end first: the watchdog's read then ends
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._pipe = None

    def _watch(self, read_fd: int) -> None:
        """The watchdog: each byte is a signal number, written the moment the signal arrived."""
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in STOP_SIGNALS:
                    self._stop(signum)

    def _handle(self, signum, frame) -> None:
        """The Python-level handler: the watchdog has already acted on the signal; nothing left to do but
        keep SIGINT from raising KeyboardInterrupt and SIGTERM / SIGHUP from ending the process."""
        if self._pipe is None:  # no watchdog (not installed from the main thread)
            self._stop(signum)

    def _stop(self, signum: int) -> None:
        with self._lock:
            if signum == signal.SIGINT:
                self._interrupts += 1
                if self._interrupts > 1:
                    sys.stderr.write("conveyor: second interrupt, stopping now; the last checkpoint stands\n")
                    sys.stderr.flush()
                    os._exit(130)
            if self.reason is not None:
                return
            name = signal.Signals(signum).name
            self.reason = name
        sys.stderr.write(f"conveyor: {name} received, stopping after this step and checkpointing "
                         "(press Ctrl-C again to stop at once)\n")
        sys.stderr.flush()

    def stop_when_exists(self, path: str, reason: str) -> None:
        """Also stop once `path` exists (looked for at most every 0.1 s): how a Ray driver that got a signal
        stops its workers, which run in other processes, maybe on other nodes."""
        self._stop_file = (path, reason)

    def should_stop(self) -> bool:
        if self.reason is None and self.deadline is not None and time.monotonic() >= self.deadline:
            self.reason = "max-runtime"
        if self.reason is None and self._stop_file is not None and time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + 0.1
            if os.path.exists(self._stop_file[0]):
                self.reason = self._stop_file[1]
        return self.reason is not None
