"""A fingerprint of an input, so a resumed run can tell that its input changed.

Files are hashed whole (content only, not mtime); a datasets folder by its metadata and file sizes. The run
directory keeps it in its manifest (io/state may import this module; io/records never imports io/state).
"""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path

from conveyor.io.errors import InputError
from conveyor.io.records.readers.hf_datasets import MARKER_FILES
from conveyor.io.storage import is_remote, remote_fingerprint


def fingerprint(source: str) -> str:
    """Hex digest for a local file or datasets folder; "remote:<etag>:<size>" for an object in a store (its
    ETag or version); "stdin" for "-"; "hub:<name>" for a hub dataset;
    "stream:<path>" for a pipe or device, which cannot be read twice."""
    if source == "-":
        return "stdin"
    if is_remote(source):
        return remote_fingerprint(source)
    path = Path(source)
    if not path.exists():
        return f"hub:{source}"
    if not path.is_dir() and not path.is_file():
        return f"stream:{source}"
    try:
        return _folder_digest(path) if path.is_dir() else fingerprint_input(path)
    except OSError as e:
        raise InputError(source, None, f"cannot be read ({e.strerror or e}); check its permissions") from e


def fingerprints_content(digest: str) -> bool:
    """Whether a fingerprint is a hash of the input's content (a file's "sha256:...", a datasets folder's bare
    hex, an object's ETag), so that an unchanged fingerprint means unchanged records; "stdin", "stream:..." and "hub:..." are not."""
    return digest.startswith(("sha256:", "remote:")) or (len(digest) == 64 and all(c in "0123456789abcdef" for c in digest))


def fingerprint_input(path: str | Path) -> str:
    """Return "sha256:<hex>" over a file's bytes, or a directory's relative names and file bytes.

    The full content is hashed (about 1 s per GB, read once at start): a copied or touched but identical
    file is no drift, and an edit anywhere, even one that keeps size and mtime, is (a sampled hash would
    miss an edit in the middle, and mtime changes when the same file is copied again).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, "no such input file or directory", str(path))
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if file is not path:
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")
    return "sha256:" + digest.hexdigest()


def _folder_digest(path: Path) -> str:
    """A datasets folder: its metadata files' contents plus every data file's name and size."""
    h = hashlib.sha256(b"datasets:")
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path).as_posix()
        if file.name in MARKER_FILES:
            h.update(f"{rel}:".encode() + file.read_bytes())
        elif file.suffix == ".arrow":
            h.update(f"{rel}:{file.stat().st_size};".encode())
    return h.hexdigest()
