"""A run's state directory (`<output>.conveyor/`): its manifest (manifest.py), lock, and drift check.

Holds `manifest.json`, `journal.sqlite` (see journal.py), `run.json` and `lock`. `open_journal` is the
one place that decides whether a run directory's state is adopted, started over or refused, and
`reset` the one place that deletes it: only the files a conveyor manifest there lists as its own.
Knows nothing of records, the engine or terminals; imports neither torch nor `conveyor.core`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from conveyor.io.counts import counted
from conveyor.io.errors import JournalCorrupt, RunDirError
from conveyor.io.state.atomic import atomic_write_text, fsync_dir
from conveyor.io.state.journal import Journal
from conveyor.io.state.manifest import JOURNAL_FILES, DriftError, Manifest, settings_key

SET_ASIDE = "set-aside"  # states --restart set aside, a folder each, named by their settings (`settings_key`)
_SET_ASIDE_KEPT = 3  # the newest kept
_LOCK_TRIES = 5  # a `conveyor status` probe holds a shared lock for microseconds; retry past it


class RunLocked(RunDirError):
    """Another live process holds the run directory's lock."""

    def __init__(self, path: Path, holder: dict):
        self.path, self.holder = path, holder
        who = f"process {holder['pid']}" if holder.get("pid") else "another process"
        if holder.get("hostname") and holder["hostname"] != socket.gethostname():
            who += f" on {holder['hostname']}"
        started = holder.get("started")
        when = f" (started {_format_time(started)})" if started else ""
        super().__init__(f"run directory {path} is in use by {who}{when}; wait for it or stop it")


class RunDir:
    """One run directory. The lock fd stays open for the life of the process (or until
    release_lock); the kernel drops the flock when the process dies, even by kill -9.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock_fd: int | None = None

    @staticmethod
    def default_for(output: str | Path) -> Path:
        """`<output>.conveyor`, next to the output file."""
        output = Path(output)
        return output.with_name(output.name + ".conveyor")

    @property
    def journal_path(self) -> Path:
        return self.path / "journal.sqlite"

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @property
    def lock_path(self) -> Path:
        return self.path / "lock"

    def acquire_lock(self) -> None:
        """Take the run directory's lock, or raise RunLocked naming the live holder.

        flock on an fd held open, not "does the lock file exist": a lock left by a dead process
        is free again, so it is taken over. The file is never deleted (deleting it would let two
        processes lock two different inodes). Children forked after this share the lock.
        """
        if self._lock_fd is not None:
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"cannot make the run directory {self.path} ({e.strerror or e}); choose an output in a "
                              "folder you can write to, or a --run-dir there") from None
        try:
            for attempt in range(_LOCK_TRIES):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if attempt == _LOCK_TRIES - 1:
                        raise RunLocked(self.path, _read_holder(fd)) from None
                    time.sleep(0.02)
            info = {"pid": os.getpid(), "started": time.time(), "hostname": socket.gethostname()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd

    def release_lock(self) -> None:
        if self._lock_fd is None:
            return
        fd, self._lock_fd = self._lock_fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # no stale pid left behind for `status` to show
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def lock_holder(self) -> dict | None:
        """{"pid", "started", "hostname"} of the live process holding the lock, else None."""
        if self._lock_fd is not None:
            return _read_holder(self._lock_fd)
        try:
            fd = os.open(self.lock_path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            try:
                # A shared probe: it fails only against an exclusive holder, and never blocks
                # another `status`.
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _read_holder(fd)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def load_manifest(self) -> Manifest | None:
        """The stored manifest, None if there is none; RunDirError naming the file if it cannot be read."""
        try:
            text = self.manifest_path.read_bytes().decode("utf-8")
            return Manifest.from_json(text)
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, OSError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RunDirError(
                f"the manifest {self.manifest_path} is unreadable ({detail}); "
                "run with --restart to discard the old state"
            ) from None

    def write_manifest(self, manifest: Manifest) -> None:
        """Write atomically: a private temporary file, fsync, rename, fsync of the directory."""
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.manifest_path, manifest.to_json() + "\n")

    def open_journal(self, manifest: Manifest, stored: Manifest | None = None,
                     carry_over: Callable[[Journal, DriftError], bool] | None = None) -> tuple[Journal, str | None]:
        """The journal of the run `manifest` describes, and a note for the user or None.

        - No manifest here: a new run (the manifest is written), unless a journal exists without one:
          its rows' settings cannot be checked, and it may not be conveyor's, so it is refused.
        - A manifest that matches: the run resumes.
        - One that differs, given `carry_over`: `carry_over(journal, drift)` carries the journal over where the
          difference allows it (an input that changed, an output-only setting: Run's), and the new manifest is
          written after it; where it returns False, refused as drift.
        - One that differs otherwise (the model, generation settings): refused as drift while the journal holds
          committed rows; with none (a run that failed before finishing a record), it starts over.
        """
        stored = stored if stored is not None else self.load_manifest()  # (`stored`: the caller read it already)
        if stored is None:
            if self.journal_path.exists():
                raise RunDirError(
                    f"run directory {self.path} has a journal ({self.journal_path}) but no manifest "
                    f"({self.manifest_path}), so its rows' input and settings cannot be checked; if it is a "
                    "conveyor journal you no longer need, delete it, or choose another --run-dir"
                )
            self.write_manifest(manifest)
            return Journal(self.journal_path), None
        try:
            self.check_drift(manifest, stored)
        except DriftError as drift:
            rows, errors = self._committed_counts()
            if rows and errors < rows:
                if carry_over is None:
                    raise
                return self._carried_over(manifest, drift, carry_over), None
            self.reset()
            self.write_manifest(manifest)
            held = f"every row {self.path} held was an error row ({rows:,})" if rows else \
                f"{self.path} held no finished rows"
            return Journal(self.journal_path), f"{held}, so the run starts over with the new settings ({drift.detail})"
        return Journal(self.journal_path), None

    def _carried_over(self, manifest: Manifest, drift: DriftError,
                      carry_over: Callable[[Journal, DriftError], bool]) -> Journal:
        """The journal carried over to what changed, the new manifest written after it (a crash between the two
        carries it over again, to the same rows); DriftError where it cannot be."""
        journal = Journal(self.journal_path)
        try:
            if not carry_over(journal, drift):
                raise drift
        except BaseException:
            journal.close()
            raise
        self.write_manifest(manifest)
        return journal

    def _committed_rows(self) -> int:
        return self._committed_counts()[0]

    def _committed_counts(self) -> tuple[int, int]:
        """(the journal's committed rows, its error rows among them)."""
        if not self.journal_path.exists():
            return 0, 0
        try:
            with Journal(self.journal_path, read_only=True, verify=False) as journal:
                return journal.num_committed(), journal.num_errors()
        except JournalCorrupt:
            return (0 if self.journal_path.stat().st_size == 0 else 1), 0  # an unreadable journal may hold rows

    def check_drift(self, new: Manifest, stored: Manifest | None = None) -> None:
        """Raise DriftError if the input, model or generation config differ from the stored run (`stored`, where
        the caller has read it). A differing tool_version, input path, output path or creation time is allowed.
        """
        old = stored if stored is not None else self.load_manifest()
        if old is not None:
            changed, message = new.changes_since(old)
            if changed:
                raise DriftError(self.path, changed, message)

    def reset(self, set_aside: bool = False, keep_key: str | None = None) -> tuple[int, Path | None]:
        """--restart: delete the run's state: the files its manifest lists as conveyor's, then the manifest.
        With `set_aside`, a state holding finished rows is moved to SET_ASIDE instead, under its settings, so that
        a later run with those settings takes its rows back (`take_back`), unless those settings' key is
        `keep_key` (the restarting run's own: a restart with unchanged settings computes every row again). A folder without a conveyor manifest
        has nothing of conveyor's to delete (a journal there without one is refused by open_journal, never
        deleted). The lock, if held, stays held. Returns (the finished rows the state held, the folder they were set
        aside in: None where they were deleted)."""
        if self._lock_fd is None:
            holder = self.lock_holder()
            if holder is not None:
                raise RunLocked(self.path, holder)
        manifest = self.load_manifest() if self.manifest_path.exists() else None
        if manifest is None:
            return 0, None
        rows, aside = self._committed_rows(), None
        if set_aside and settings_key(manifest) != keep_key and rows:
            aside = self._set_aside(manifest)
        for name in manifest.state_files:
            with contextlib.suppress(FileNotFoundError):
                (self.path / name).unlink()
        self.manifest_path.unlink(missing_ok=True)
        fsync_dir(self.path)
        return rows, aside

    def _set_aside(self, manifest: Manifest) -> Path:
        """The journal, run.json and manifest moved to SET_ASIDE/<the settings' key> (the manifest last: a folder
        without one is never taken back); the oldest beyond _SET_ASIDE_KEPT deleted."""
        folder = self.path / SET_ASIDE / settings_key(manifest)
        if folder.exists():
            shutil.rmtree(folder)  # an older state with the same settings: the newer one wins
        folder.mkdir(parents=True)
        for name in (*JOURNAL_FILES, "run.json", self.manifest_path.name):
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path / name, folder / name)
        fsync_dir(folder)
        fsync_dir(self.path)
        kept = sorted((p for p in (self.path / SET_ASIDE).iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
        for old in kept[:-_SET_ASIDE_KEPT]:
            shutil.rmtree(old, ignore_errors=True)
        return folder

    def take_back(self, manifest: Manifest) -> int:
        """Where a run with `manifest`'s model and settings was set aside by --restart and this folder holds no run,
        its state is moved back; the rows it holds (0: none taken back). The caller holds the lock."""
        folder = self.path / SET_ASIDE / settings_key(manifest)
        if not (folder / self.manifest_path.name).exists() or self.manifest_path.exists() or \
                self.journal_path.exists():
            return 0
        for name in (self.manifest_path.name, *JOURNAL_FILES, "run.json"):  # (the manifest first: see _set_aside)
            with contextlib.suppress(FileNotFoundError):
                os.replace(folder / name, self.path / name)
        fsync_dir(self.path)
        shutil.rmtree(folder, ignore_errors=True)
        return self._committed_rows()

    def restart(self, fresh: Manifest) -> str | None:
        """--restart: the earlier run's rows set aside (where they have other settings than `fresh`'s) or dropped;
        the note that says so (None: there were none)."""
        rows, aside = self.reset(set_aside=True, keep_key=settings_key(fresh))
        finished = counted(rows, "finished row", thousands=True)
        if rows and aside is not None:
            return (f"--restart: the {finished} of the earlier run (other settings) are set aside in {aside}; a later "
                    "run with its settings takes them back")
        if rows:
            return f"--restart: the {finished} of the earlier run are dropped; every record is computed again"
        return None

    def stored_manifest(self, fresh: Manifest) -> tuple[Manifest | None, str | None]:
        """The folder's manifest; where it has none, that of rows set aside with `fresh`'s settings, taken back, and
        the note that says so."""
        stored = self.load_manifest()
        if stored is not None:
            return stored, None
        taken = self.take_back(fresh)
        if not taken:
            return None, None
        return self.load_manifest(), (f"took back the {counted(taken, 'row', thousands=True)} of an earlier run with "
                                      "these settings, which --restart had set aside")

    def summary(self) -> dict:
        """For `conveyor status`: the manifest's fields, journal counts and the lock holder."""
        manifest = self.load_manifest() if self.path.exists() else None
        out: dict = {"run_dir": str(self.path), "has_manifest": manifest is not None}
        if manifest is not None:
            out.update(dataclasses.asdict(manifest))
        if self.journal_path.exists():
            try:
                # Read-only and unverified: safe beside a running writer; counting 10M rows takes about a second.
                with Journal(self.journal_path, read_only=True, verify=False) as journal:
                    out["num_committed"] = journal.count_rows()  # counted: its counter could be stale
                    if out["num_committed"] != journal.num_committed():
                        out["journal_error"] = (f"{self.journal_path} holds {counted(out['num_committed'], 'row', thousands=True)} but counts "
                                                f"{journal.num_committed()}: it was changed outside conveyor; run "
                                                "with --restart to start over")
                    out["num_errors"] = journal.num_errors()
                    out["num_samples"] = journal.num_samples()
                    out["num_partials"], out["partial_tokens"] = journal.partial_tokens()
                    out["contiguous_prefix"] = journal.contiguous_prefix()
                    out["last_commit_time"] = journal.last_commit_time()
                    layout = journal.meta_value("parts_layout")
                    if layout is not None:  # a part-file output: its folder, part size, and the parts written
                        out["parts"] = {**json.loads(layout), "written": sum(
                            entry.state == "written" for entry in journal.parts().values())}
            except (JournalCorrupt, OSError) as exc:
                out["journal_error"] = str(exc)
        out["lock_holder"] = self.lock_holder() if self.path.exists() else None
        return out


def _format_time(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix).isoformat(sep=" ", timespec="seconds")


def _read_holder(fd: int) -> dict:
    """The lock file's {"pid", "started", "hostname"}; pid None if it is empty or garbled."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict):
        data = {}
    return {key: data.get(key) for key in ("pid", "started", "hostname")}
