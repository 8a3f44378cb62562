"""JSON-array reader: one top-level array of objects, decoded element by element from a text stream.

Memory holds one element plus a read buffer, however long the file. A syntax error is fatal here
(InputError naming the line): after it, where the next element starts cannot be known.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from typing import Any, Iterator, TextIO

from conveyor.io.errors import InputError
from conveyor.io.readers.record import RawRecord, Reader, StrictDecoder, is_stream, to_record

CHUNK = 1 << 20
_WHITESPACE = " \t\r\n"


class JsonArrayReader(Reader):
    format = "json"

    def __init__(self, source: str) -> None:
        self.source = source
        self.is_stream = is_stream(source)
        if not self.is_stream:
            with self._open() as f:
                first = f.read(4096).lstrip(_WHITESPACE)
            if not first.startswith("["):
                found = f"it starts with {first[:1]!r}" if first else "the file is empty"
                raise InputError(source, None, f"expected a JSON array of objects, but {found}; "
                                               "for one object per line use a .jsonl name or --input-format jsonl")

    @contextlib.contextmanager
    def _open(self) -> Iterator[TextIO]:
        try:
            if self.source == "-":
                f = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8-sig", newline="")
            else:
                f = open(self.source, encoding="utf-8-sig", newline="")
        except OSError as e:
            raise InputError(self.source, None, f"cannot be read ({e.strerror or e}); check the path "
                                                "and its permissions") from e
        try:
            yield f
        except UnicodeDecodeError as e:
            raise InputError(self.source, None, f"not valid UTF-8 ({e.reason}); save the file as UTF-8") from e
        finally:
            if self.source == "-":
                f.detach()  # leave sys.stdin.buffer open
            else:
                f.close()

    def iter_from(self, start_index: int) -> Iterator[RawRecord]:
        with self._open() as f:
            parser = _ArrayParser(f, self.source)
            for index, (value, line, non_finite) in enumerate(parser.values()):
                if index < start_index:
                    continue
                where = f"record {index} (line {line})"
                if non_finite is not None:
                    yield RawRecord(index, None, None, f"{where}: non-finite number ({non_finite}); "
                                                       "use null or a finite number")
                else:
                    yield to_record(value, index, None, where)

    def count(self) -> int | None:
        """Decodes the whole array once (no cheaper way to find element boundaries)."""
        if self.is_stream:
            return None
        with self._open() as f:
            return sum(1 for _ in _ArrayParser(f, self.source).values())


class _ArrayParser:
    """Walks `[ value , value ... ]` over a growing text buffer.

    buf: [consumed ... pos) [pos ... len(buf)) ; consumed text is dropped on each refill.
    The line cursor (line_pos, line_no) only moves forward, so line numbers cost O(file) in all.
    """

    def __init__(self, f: TextIO, source: str) -> None:
        self.f = f
        self.source = source
        self.decoder = StrictDecoder()
        self.buf = ""
        self.pos = 0
        self.is_eof = False
        self.line_pos = 0
        self.line_no = 1

    def values(self) -> Iterator[tuple[Any, int, str | None]]:
        """(value, 1-based line where it starts, non-finite literal seen or None) per element."""
        if self._next_char() != "[":
            found = self._next_char()
            found = f"found {found!r}" if found else "the file is empty"
            self._fail(f"expected a JSON array of objects, but {found}; for one object per line "
                       "use a .jsonl name or --input-format jsonl")
        self.pos += 1
        if self._next_char() == "]":
            self.pos += 1
        else:
            while True:
                if not self._next_char():
                    self._fail("the array ends early (missing ']'); the file may be truncated")
                line = self._line_at(self.pos)
                value = self._decode_value()
                yield value, line, self.decoder.non_finite
                sep = self._next_char()
                if sep == "]":
                    self.pos += 1
                    break
                if sep != ",":
                    self._fail(f"expected ',' or ']' after an element, found {sep!r}" if sep else
                               "the array ends early (missing ']'); the file may be truncated")
                self.pos += 1
        if self._next_char():
            self._fail("extra data after the array's closing ']'; the file must hold one JSON array")

    def _decode_value(self) -> Any:
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                # The element may just be cut by the buffer's end: read more and try again.
                if not self.is_eof and (e.msg.startswith("Unterminated string") or e.pos >= len(self.buf) - 16):
                    self._refill()
                    continue
                self._fail(f"invalid JSON ({e.msg}); fix the element or convert the file to JSONL", e.pos)
            except RecursionError:
                self._fail("JSON nested too deeply; flatten the element")
            except ValueError as e:
                self._fail(f"invalid JSON ({e})")
            if end >= len(self.buf) and not self.is_eof:
                self._refill()  # a number at the buffer's end may continue in the next chunk
                continue
            self.pos = end
            return value

    def _next_char(self) -> str:
        """Skip whitespace; the next character, or '' at the end of the file."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WHITESPACE:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if self.is_eof:
                return ""
            self._refill()

    def _refill(self) -> None:
        self._line_at(self.pos)
        self.buf = self.buf[self.pos:]
        self.line_pos -= self.pos
        self.pos = 0
        data = self.f.read(max(CHUNK, len(self.buf)))  # doubling keeps a huge element linear
        if not data:
            self.is_eof = True
        self.buf += data

    def _line_at(self, pos: int) -> int:
        if pos > self.line_pos:
            self.line_no += self.buf.count("\n", self.line_pos, pos)
            self.line_pos = pos
        return self.line_no

    def _fail(self, message: str, pos: int | None = None) -> None:
        raise InputError(self.source, self._line_at(self.pos if pos is None else pos), message)

