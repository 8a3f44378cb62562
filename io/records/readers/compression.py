"""Compressed text inputs (JSONL, JSON, CSV as .gz, .bz2, .xz or .zst): the compression is told by the file's first
bytes, which no UTF-8 text starts with, and the format by its name without the compression's suffix
(`data.csv.gz` is CSV). gzip, bz2 and xz are read with the standard library, zstd with pyarrow's codec.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
import zlib
from typing import IO

SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
# gzip (deflate), bz2 (a block or the end of an empty stream), xz, zstd frames.
_MAGIC = re.compile(rb"\x1f\x8b\x08|BZh[1-9](?:\x31\x41\x59\x26\x53\x59|\x17\x72\x45\x38\x50\x90)|\xfd7zXZ\x00|"
                    rb"\x28\xb5\x2f\xfd")
_KINDS = {b"\x1f": "gzip", b"B": "bz2", b"\xfd": "xz", b"\x28": "zstd"}
READ_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)  # a truncated or corrupt file (zstd's: OSError)


def without_suffix(name: str) -> str:
    """`name` without a compression suffix (`data.csv.gz` -> `data.csv`)."""
    lower = name.lower()
    for suffix in SUFFIXES:
        if lower.endswith(suffix):
            return name[:-len(suffix)]
    return name


def sniff(f: IO[bytes]) -> str | None:
    """The compression a buffered stream's first bytes say ("gzip", "bz2", "xz", "zstd"), None for plain bytes;
    read with peek, so nothing is consumed (a pipe included)."""
    head = f.peek(10)[:10]
    match = _MAGIC.match(head)
    return _KINDS[head[:1]] if match else None


def decompressing(raw: IO[bytes], kind: str | None) -> IO[bytes]:
    """`raw` read through its decompressor (closing it closes `raw`); `raw` itself where `kind` is None."""
    if kind is None:
        return raw
    if kind == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if kind == "bz2":
        return bz2.BZ2File(raw, mode="rb")
    if kind == "xz":
        return lzma.LZMAFile(raw, mode="rb")
    import pyarrow as pa

    return io.BufferedReader(_ArrowStream(pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd")))


class _ArrowStream(io.RawIOBase):
    """A pyarrow input stream as a raw stream that io.BufferedReader can buffer."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            data = self._stream.read(len(buffer))
        except Exception as e:  # noqa: BLE001 - pyarrow's errors (ArrowInvalid: a corrupt frame) as a read error
            raise OSError(f"zstd: {e}") from e
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._stream.close()
        super().close()
