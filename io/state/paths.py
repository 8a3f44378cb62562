"""Where a run writes, checked against what it reads: every path check of `conveyor run` goes through
`check_run_paths`. Files are compared as files (device and inode where they exist, the fully resolved
path where the output does not exist yet), never as strings: `./in.jsonl`, a symlink to it and a hard
link of it are all the input. Pure Python.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from conveyor.io.errors import InputError
from conveyor.io.state.atomic import make_temp


class PathClash(InputError):
    """The output or the run directory would write over the input, or cannot be written as asked."""


def check_run_paths(source: str, output: str, run_dir: str | os.PathLike, state_files: tuple[str, ...],
                    folder: bool = False) -> None:
    """Raise PathClash when the output or the run directory (or one of its `state_files`, or its manifest or
    lock) is the input, or when the output exists and is not a regular file (a folder, a device, a FIFO, a socket,
    a link into /dev or /proc: the final rename would replace it). The output's temporary file needs no
    check: it is a fresh name made with O_EXCL beside the output (`conveyor.io.state.atomic`). "-" is stdout.
    `folder`: -o is a folder of part files; a URL in a store is no local file, so nothing to compare."""
    if not folder:
        check_output_path(output)
    if "://" in output:
        output = "-"
    out = Path(output)
    inputs = _input_files(source)
    if not inputs:
        return
    run = Path(run_dir)
    written = [*([("-o", out)] if output != "-" else []), ("the run directory", run),
               *((f"the run directory's {name}", run / name) for name in (*state_files, "manifest.json", "lock"))]
    for what, path in written:
        for item in inputs:
            if _same(path, item):
                raise PathClash(output, None, f"{what} ({path}) is the input ({source}); writing it would destroy "
                                              "the input: choose another output or --run-dir")


def check_output_path(output: str) -> None:
    """PathClash where -o exists and is not a regular file ("-", stdout, is not a path)."""
    kind = None if output == "-" else _kind(Path(output))
    if kind == "folder":
        raise PathClash(output, None, "-o names an existing folder; name the output file (.parquet or .jsonl), or "
                                      f"end it with / to write part files into it (-o {output.rstrip('/')}/)")
    if kind is not None:
        raise PathClash(output, None, f"-o names {kind}, not a file: the output is written to a file by rename, "
                                      "which would replace it; name a file, or -o - for stdout")


def _kind(path: Path) -> str | None:
    """What an existing -o that is not a regular file is ("a folder", "a FIFO", ...), else None (a regular file, a
    link to one outside /dev and /proc, or nothing there yet)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a link to nothing" if os.path.islink(path) else None
    except OSError as e:
        return f"something that cannot be read ({e.strerror})"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISREG(mode):
        real = os.path.realpath(path)
        return f"a link to {real}" if real.startswith(("/dev/", "/proc/")) else None
    for test, what in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "something that is not a regular file"


def _input_files(source: str) -> list[os.stat_result | Path]:
    """What the input is, to compare against: stdin's file where it is a regular file, the file or folder
    named (a datasets folder also by each of its files), nothing for a hub name."""
    if source == "-":
        try:
            st = os.fstat(0)
        except OSError:
            return []
        return [st] if stat.S_ISREG(st.st_mode) else []
    path = Path(source)
    if not path.exists():
        return []
    if path.is_dir():
        return [path, *(p for p in path.rglob("*") if p.is_file())]
    return [path]


def _same(path: Path, other: os.stat_result | Path) -> bool:
    try:
        mine = path.stat()
    except OSError:  # not there yet: the same file only if it resolves to the input's path
        return isinstance(other, Path) and os.path.realpath(path) == os.path.realpath(other)
    theirs = other if isinstance(other, os.stat_result) else _stat(other)
    return theirs is not None and (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


def check_output_writable(output: str, folder: bool = False) -> None:
    """Make the folder a local -o goes in (or, `folder`, the folder of part files) and write a probe file there, so
    that an output that cannot be written is refused before any work rather than after all of it. PathClash naming
    -o and why where it cannot; stdout and a store's URL are not checked here."""
    if output == "-" or "://" in output:
        return
    directory = os.path.abspath(output) if folder else os.path.dirname(os.path.abspath(output))
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = make_temp(directory, os.path.basename(os.path.abspath(output)) if not folder else "probe")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise PathClash(output, None, f"cannot write in {directory} ({e.strerror or e}); choose a folder you can "
                                      "write to") from None
