"""Something built once into a shared cache, safe against concurrent and killed builders: the C++
kernels' library (`backends/cpu/kernels.py`) and the embedded model's converted folder (`model_loader.py`).
The cache is `cache_dir()`: $CONVEYOR_CACHE_DIR, else the user's cache directory.

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

A cached result is used only when it, its folder and that folder's parent are owned by the current user
and writable by no one else (`untrusted`): a library planted in a shared cache would otherwise run as
whoever loads it. Otherwise it is built afresh into a private folder for this process, with one line
saying why. Folders are created 0700.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: builds are not serialized
    fcntl = None  # type: ignore[assignment]


def cache_dir() -> Path:
    env = os.environ.get("CONVEYOR_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("conveyor"))


def cached_build(folder: Path, name: str, build: Callable[[Path], Path], wait_s: float = 900.0) -> Path:
    """`folder/name`, built by `build(scratch_dir) -> path of the built file or folder` if absent."""
    folder = Path(folder)
    target = folder / name
    problem = untrusted(target) if target.exists() else None
    if problem is None and target.exists():
        return target
    if problem is not None:
        private = Path(tempfile.mkdtemp(prefix="conveyor-private-"))
        sys.stderr.write(f"conveyor: not using {target}: {problem}; building a private copy in {private} instead\n")
        return _build(private / folder.name, name, build, wait_s)
    return _build(folder, name, build, wait_s)


def _build(folder: Path, name: str, build: Callable[[Path], Path], wait_s: float) -> Path:
    target = folder / name
    _private_dirs(folder.parent)
    with exclusive_lock(folder.parent / f"{folder.name}.lock", wait_s,
                        waiting=f"conveyor: waiting for another process to finish building {target}\n"):
        if target.exists() and untrusted(target) is None:  # built by the process we waited for
            return target
        for leftover in folder.parent.glob(f".{folder.name}.build-*"):  # of builders that died
            shutil.rmtree(leftover, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.build-"))
        try:
            built = Path(build(scratch))
            folder.mkdir(mode=0o700, exist_ok=True)
            os.replace(built, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def untrusted(target: Path) -> str | None:
    """Why `target` (a file, or a folder and the files directly in it) must not be loaded, or None.

    Each of them must be owned by this user and writable by no one else. Its folder and that folder's
    parent must be owned by this user too; where they are but others may write them (a umask of 002),
    their group and other write bits are cleared first: others could only have renamed or deleted entries
    there, and any file they put in would not be this user's, which the check of the files catches."""
    if not hasattr(os, "getuid"):  # pragma: no cover - not POSIX
        return None
    uid = os.getuid()
    folders = [target.parent.parent, target.parent]
    files = [target, *(sorted(target.iterdir()) if target.is_dir() and not target.is_symlink() else [])]
    for path in folders + files:
        try:
            st = path.lstat() if path in files or path == target.parent else path.stat()
        except OSError as e:
            return f"{path} cannot be inspected ({e.strerror or e})"
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a symbolic link"
        if st.st_uid != uid:
            return f"{path} belongs to another user (uid {st.st_uid})"
        loose = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if loose and path in folders:
            try:
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~loose)
            except OSError as e:
                return f"{path} is writable by other users and cannot be changed ({e.strerror or e})"
        elif loose:
            return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _private_dirs(path: Path) -> None:
    """mkdir -p with each folder it creates 0700."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        folder.mkdir(mode=0o700, exist_ok=True)


@contextlib.contextmanager
def exclusive_lock(path: Path, wait_s: float, waiting: str = "") -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if absent, never deleted); the kernel releases it
    if this process dies. Writes `waiting` to stderr once if another process holds it, and raises
    TimeoutError after `wait_s` seconds of waiting."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
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
