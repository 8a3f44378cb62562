"""stdin or a pipe copied to a file in the run directory before a run reads it, so that it has a fingerprint of
its content like any file: a rerun over an input that grew or changed reuses the rows of its unchanged records
(journal_rebase.py) instead of refusing it. Memory stays bounded (the copy streams); the disk holds one copy of
the input while the run goes."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

__all__ = ["spool"]


def spool(source: str, path: Path) -> str:
    """Copy `source` ("-" for stdin, else a pipe's path) to `path`; its fingerprint, as `fingerprint_input` gives a
    file's ("sha256:<hex>" of the bytes)."""
    digest = hashlib.sha256()
    stream = sys.stdin.buffer if source == "-" else open(source, "rb")
    try:
        with open(path, "wb") as out:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    finally:
        if source != "-":
            stream.close()
    digest.update(b"\0")
    return "sha256:" + digest.hexdigest()
