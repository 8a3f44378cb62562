"""Something built once into a shared cache, safe against concurrent and killed builders: the C++
kernels' library (`cpu_kernels.py`) and the embedded model's converted folder (`model_loader.py`).

`cached_build(folder, name, build)` returns `folder/name` (a file or a folder), calling
`build(scratch)` first when it is not there yet. The build runs in a scratch directory beside
`folder` under an exclusive `flock` on `<folder>.lock`, and its result is moved into place with one
atomic rename, so:
- two processes starting at once build it once; the second waits, then uses the first's result;
- a builder killed mid-build (kill -9, a cron timeout, a second Ctrl-C) leaves no lock behind: the
  kernel drops a dead process's flock, and the next caller builds afresh, clearing the dead one's
  scratch directory. (torch's own `load()` guards its build directory with a lock *file*; one left
  by a killed process made every later load wait forever.)
- the result is either whole or absent: a reader never loads a half-written one.
A caller that waits longer than `wait_s` for another builder gets a TimeoutError instead of
hanging.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: builds are not serialized
    fcntl = None  # type: ignore[assignment]


def cached_build(folder: Path, name: str, build: Callable[[Path], Path], wait_s: float = 900.0) -> Path:
    """`folder/name`, built by `build(scratch_dir) -> path of the built file or folder` if absent."""
    folder = Path(folder)
    target = folder / name
    if target.exists():
        return target
    folder.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(folder.parent / f"{folder.name}.lock", wait_s,
                        waiting=f"conveyor: waiting for another process to finish building {target}\n"):
        if target.exists():  # built by the process we waited for
            return target
        for leftover in folder.parent.glob(f".{folder.name}.build-*"):  # of builders that died
            shutil.rmtree(leftover, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.build-"))
        try:
            built = Path(build(scratch))
            folder.mkdir(exist_ok=True)
            os.replace(built, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


@contextlib.contextmanager
def exclusive_lock(path: Path, wait_s: float, waiting: str = "") -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if absent, never deleted); the kernel releases it
    if this process dies. Writes `waiting` to stderr once if another process holds it, and raises
    TimeoutError after `wait_s` seconds of waiting."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{path} stayed locked by another process for {wait_s:.0f} s") from None
                if waiting and not told:
                    sys.stderr.write(waiting)
                    sys.stderr.flush()
                    told = True
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # releases the lock
