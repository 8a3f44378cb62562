"""Files that appear whole or not at all: a private temporary file beside the target, fsync, rename.

The temporary file is made by `tempfile.mkstemp` in the target's folder (`O_CREAT | O_EXCL`, and
`O_NOFOLLOW` where the platform has it, mode 0600): a name planted in a shared folder, a symlink
included, is never opened or followed. Pure Python.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Write `path` through a temporary file that is renamed onto it only if the body succeeds (text modes
    in UTF-8 with "\\n" line ends); on any error the temporary file is removed and the error propagates."""
    target = os.path.abspath(path)
    directory, name = os.path.split(target)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.tmp-")
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


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path, "w") as f:
        f.write(text)


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
