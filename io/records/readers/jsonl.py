"""JSONL reader (plain, compressed or stdin): streams lines in binary, so memory stays flat.

A bad line becomes a RawRecord with its error; only an unreadable file raises InputError.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import sys
from typing import BinaryIO, Callable, Iterator

from conveyor.io.errors import InputError
from conveyor.io.records.readers.compression import READ_ERRORS, decompressing, sniff
from conveyor.io.records.readers.record import (
    BOM,
    DEFAULT_MAX_RECORD_BYTES,
    RawRecord,
    Reader,
    StrictDecoder,
    digest_of,
    is_stream,
    location,
    open_binary,
    oversized,
)

CHUNK = 1 << 20  # count() reads this much at a time
_BUFFER = 1 << 16
# Whitespace-only lines (bytes.isspace's whitespace). The pattern starts with a literal newline, which
# lets re scan at memchr speed; a per-position ^ anchor was ten times slower.
_BLANK_AFTER_NEWLINE = re.compile(rb"\n(?=[ \t\r\x0b\x0c]*\n)")
_BLANK_FIRST_LINE = re.compile(rb"[ \t\r\x0b\x0c]*\n")


class JsonlReader(Reader):
    """One JSON object per line. Blank lines take no index; a UTF-8 BOM and CRLF endings are fine."""

    format = "jsonl"

    def __init__(self, source: str, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        self.source = source
        self.is_stream = is_stream(source)
        self.max_record_bytes = max_record_bytes

    @contextlib.contextmanager
    def _open(self) -> Iterator[BinaryIO]:
        if self.source == "-":
            yield sys.stdin.buffer  # not ours to close
            return
        try:
            raw = open_binary(self.source, _BUFFER)
        except OSError as e:
            raise InputError(self.source, None, f"cannot be read ({e.strerror or e}); check the path "
                                                "and its permissions") from e
        with raw, decompressing(raw, sniff(raw)) as f:
            yield f

    def iter_from(self, start_index: int) -> Iterator[RawRecord]:
        decoder = StrictDecoder()
        for index, line, raw, size, digest in self._lines_from(start_index):
            if raw is None:  # over the size limit: an error row, never parsed
                yield RawRecord(index, line, None, oversized(location(index, line), size, self.max_record_bytes), digest)
            else:
                yield decoder.line_record(raw, index, line, digest)

    def keyed_from(self, start_index: int) -> Iterator[tuple[int, int | None, str | None, Callable[[], RawRecord]]]:
        decoder = StrictDecoder()
        for index, line, raw, size, digest in self._lines_from(start_index):
            if raw is None:
                record = RawRecord(index, line, None, oversized(location(index, line), size, self.max_record_bytes),
                                   digest)
                yield index, line, digest, lambda record=record: record
            else:
                yield index, line, digest, functools.partial(decoder.line_record, raw, index, line, digest)

    def _lines_from(self, start_index: int) -> Iterator[tuple[int, int, bytes | None, int, str | None]]:
        """(index, line, the line's bytes or None where it is over the size limit, its size, its digest) of each
        record from start_index; earlier lines are only counted, never parsed."""
        index = 0
        line = 0
        with self._open() as f:
            try:
                for raw, size, big_digest in _lines(f, self.max_record_bytes):
                    line += 1
                    if raw is None:
                        if index >= start_index:
                            yield index, line, None, size, big_digest if self.with_digests else None
                        index += 1
                        continue
                    if line == 1 and raw.startswith(BOM):
                        raw = raw[len(BOM):]
                    if not raw or raw.isspace():
                        continue
                    if index >= start_index:
                        yield index, line, raw, size, digest_of(raw.rstrip(b"\r\n")) if self.with_digests else None
                    index += 1
            except READ_ERRORS as e:
                raise InputError(self.source, line + 1, f"could not read the file ({e}); "
                                                        "check that it is complete and not corrupt") from e

    def count(self) -> int | None:
        """Non-blank lines, counted over 1 MiB chunks without parsing (a compressed file: by decompressing)."""
        if self.is_stream:
            return None
        num_records = 0
        is_pending = False  # the line cut by the previous chunk's end has non-whitespace bytes
        with self._open() as f:
            try:
                chunk = f.read(len(BOM))
                if chunk == BOM:
                    chunk = f.read(CHUNK)
                while chunk:
                    num_records, is_pending = _count_chunk(chunk, num_records, is_pending)
                    chunk = f.read(CHUNK)
            except READ_ERRORS as e:
                raise InputError(self.source, None, f"could not read the file ({e}); "
                                                    "check that it is complete and not corrupt") from e
        return num_records + is_pending


def _lines(f: BinaryIO, limit: int) -> Iterator[tuple[bytes | None, int, str | None]]:
    """(line, its size in bytes, None) for each line of `f`; a line longer than `limit` is never held
    whole: (None, its size, the digest of its bytes), read past in chunks (b"" for one of whitespace only)."""
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw, len(raw), None
            continue
        size, h, blank = len(raw), hashlib.sha256(raw), raw.isspace()
        while not raw.endswith(b"\n"):
            raw = f.readline(CHUNK)
            if not raw:
                break
            size += len(raw)
            h.update(raw)
            blank = blank and raw.isspace()
        if blank:  # (whitespace only, however long: a blank line, which takes no index, as `count` has it)
            yield b"", size, None
            continue
        yield None, size, h.hexdigest()[:32]


def _count_chunk(chunk: bytes, num_records: int, is_pending: bool) -> tuple[int, bool]:
    """
    chunk:  ...end of a cut line\n  whole\n lines\n  start of a cut line...
            [0, first_nl)           [first_nl+1, last_nl+1)  [last_nl+1, len)
    """
    first_nl = chunk.find(b"\n")
    if first_nl < 0:
        return num_records, is_pending or not chunk.isspace()
    head = chunk[:first_nl]
    if is_pending or (head and not head.isspace()):
        num_records += 1
    last_nl = chunk.rfind(b"\n")
    body = chunk[first_nl + 1:last_nl + 1]
    num_records += body.count(b"\n") - _num_blank_lines(body)
    tail = chunk[last_nl + 1:]
    return num_records, bool(tail) and not tail.isspace()


def _num_blank_lines(body: bytes) -> int:
    """Whitespace-only lines in `body`, which starts at a line start and ends with a newline."""
    return len(_BLANK_AFTER_NEWLINE.findall(body)) + (_BLANK_FIRST_LINE.match(body) is not None)
