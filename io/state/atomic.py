"""Files that appear whole or not at all: a private temporary file beside the target, fsync, rename.

The temporary file is made by `tempfile.mkstemp` in the target's folder (`O_CREAT | O_EXCL`, and
`O_NOFOLLOW` where the platform has it, mode 0600): a name planted in a shared folder, a symlink
included, is never opened or followed. Its name says which host and process made it
(`.answers.parquet.tmp-<host>-<pid>-<random>`), so that one a killed process left is told from one still
being written (`remove_leftovers`). Pure Python.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import socket
import tempfile
from typing import IO, Callable, Iterator

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]  # short: a temporary name stays short


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Write `path` through a temporary file that is renamed onto it only if the body succeeds (text modes
    in UTF-8 with "\\n" line ends); on any error the temporary file is removed and the error propagates."""
    target = os.path.abspath(path)
    directory, name = os.path.split(target)
    fd, tmp = make_temp(directory, name)
    text_args = {"encoding": "utf-8", "newline": "\n"} if "b" not in mode else {}
    try:
        f = os.fdopen(fd, mode, **text_args)
    except BaseException:
        os.close(fd)
        os.remove(tmp)
        raise
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.chmod(tmp, 0o666 & ~_umask())  # what a plain open() would have given the file
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            f.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def make_temp(directory: str | os.PathLike, name: str) -> tuple[int, str]:
    """A fresh private file in `directory` for writing `name` (an fd and its path), named for this host and
    process. A name too long to take the tags within 255 bytes is cut short in the temporary name (whose
    leftover is then not recognized: rare, and never mistaken for another's)."""
    tags = f".tmp-{_HOST}-{os.getpid()}-"
    room = 255 - 1 - len(tags.encode()) - 8  # the leading ".", the tags, mkstemp's 8 random characters
    short = name.encode()[:room].decode(errors="ignore")
    return tempfile.mkstemp(dir=directory, prefix=f".{short}{tags}")


def remove_leftovers(directory: str | os.PathLike, is_target: Callable[[str], bool]) -> list[str]:
    """Remove the temporary files in `directory` that a process killed mid-write left (kill -9, a crash) for the
    names `is_target` accepts: those made on this host by a process that is gone. A live process's (another
    run writing the same file, a shard merging) and another host's are left alone. The targets' names, sorted."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for entry in names:
        target, pid = _temp_of(entry)
        if target is None or not is_target(target) or _alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, entry))
            removed.append(target)
    return sorted(removed)


def _temp_of(entry: str) -> tuple[str | None, int]:
    """(the target, the writer's pid) of a temporary file this host made, else (None, 0)."""
    if not entry.startswith("."):
        return None, 0
    target, sep, rest = entry[1:].rpartition(f".tmp-{_HOST}-")
    pid = rest.split("-", 1)[0]
    if not sep or not target or not pid.isdigit():
        return None, 0
    return target, int(pid)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:  # a zombie (killed, not yet reaped by its parent) writes nothing more
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path, "w") as f:
        f.write(text)


def create_text(path: str | os.PathLike, text: str) -> bool:
    """Write `text` to `path` whole, only where nothing is there yet (a private temporary file, fsync, then a hard
    link: of two processes that try at once, one makes it); False where a file was there already."""
    directory, name = os.path.split(os.path.abspath(path))
    fd, temp = make_temp(directory, name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(temp, path)
        except FileExistsError:
            return False
    finally:
        os.remove(temp)
    fsync_dir(directory)
    return True


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename in `directory` durable; where a directory cannot be opened or synced, nothing to do."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on a directory
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
