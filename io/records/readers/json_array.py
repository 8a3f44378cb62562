"""JSON-array reader: one top-level array of objects, decoded element by element from a text stream.

Memory holds one element plus a read buffer, however long the file. Each element's extent is found
first by a scan that tracks strings and brackets (regex jumps between the characters that matter), so
an element that is not valid JSON, or is bigger than `max_record_bytes`, becomes an error row and the
next element is read as usual. Only an array that ends early, or text outside it, is fatal
(InputError naming the line).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from typing import Any, Iterator, TextIO

from conveyor.io.errors import InputError
from conveyor.io.records.readers.compression import READ_ERRORS, decompressing, sniff
from conveyor.io.records.readers.record import (
    DEFAULT_MAX_RECORD_BYTES,
    RawRecord,
    Reader,
    StrictDecoder,
    digest_of,
    is_stream,
    location,
    open_binary,
    oversized,
    to_record,
)

CHUNK = 1 << 20
_WHITESPACE = " \t\r\n"
_OUTSIDE = re.compile(r'[\[\]{}",]')  # what changes the scan's state outside a string
_INSIDE = re.compile(r'["\\]')  # ... and inside one


class JsonArrayReader(Reader):
    format = "json"

    def __init__(self, source: str, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        self.source = source
        self.is_stream = is_stream(source)
        self.max_record_bytes = max_record_bytes
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
                raw = open_binary(self.source)
                f = io.TextIOWrapper(decompressing(raw, sniff(raw)), encoding="utf-8-sig", newline="")
        except OSError as e:
            raise InputError(self.source, None, f"cannot be read ({e.strerror or e}); check the path "
                                                "and its permissions") from e
        try:
            yield f
        except UnicodeDecodeError as e:
            raise InputError(self.source, None, f"not valid UTF-8 ({e.reason}); save the file as UTF-8") from e
        except READ_ERRORS as e:
            raise InputError(self.source, None, f"could not read the file ({e}); check that it is complete and not "
                                                "corrupt") from e
        finally:
            if self.source == "-":
                f.detach()  # leave sys.stdin.buffer open
            else:
                f.close()

    def iter_from(self, start_index: int) -> Iterator[RawRecord]:
        with self._open() as f:
            parser = _ArrayParser(f, self.source, self.max_record_bytes)
            for index, element in enumerate(parser.values()):
                if index < start_index:
                    continue
                where = location(index, element_line=element.line)
                raw = element.text or element.problem or ""  # an oversized element keeps no text, only its size
                digest = digest_of(raw.encode("utf-8", "surrogatepass")) if self.with_digests else None
                if element.problem is not None:
                    yield RawRecord(index, None, None, f"{where}: {element.problem}", digest)
                else:
                    yield to_record(element.value, index, None, where, digest)

    def count(self) -> int | None:
        """Scans the whole array once (no cheaper way to find element boundaries)."""
        if self.is_stream:
            return None
        with self._open() as f:
            return sum(1 for _ in _ArrayParser(f, self.source, self.max_record_bytes, decode=False).values())


class _Element:
    """One array element: its value, or the problem that makes it an error row; its text (for digests)."""

    __slots__ = ("line", "value", "problem", "text")

    def __init__(self, line: int, value: Any = None, problem: str | None = None, text: str = "") -> None:
        self.line, self.value, self.problem, self.text = line, value, problem, text


class _ArrayParser:
    """Walks `[ value , value ... ]` over a growing text buffer.

    buf: [consumed ... pos) [pos ... len(buf)) ; consumed text is dropped on each refill.
    The line cursor (line_pos, line_no) only moves forward, so line numbers cost O(file) in all.
    """

    def __init__(self, f: TextIO, source: str, max_chars: int, decode: bool = True) -> None:
        self.f = f
        self.source = source
        self.max_chars = max_chars
        self.decode = decode
        self.decoder = StrictDecoder()
        self.buf = ""
        self.pos = 0
        self.is_eof = False
        self.line_pos = 0
        self.line_no = 1

    def values(self) -> Iterator[_Element]:
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
                nxt = self._next_char()
                if not nxt:
                    self._fail("the array ends early (missing ']'); the file may be truncated")
                if nxt in ",]":
                    self._fail(f"an element is missing before this {nxt!r} (a stray ','); remove it")
                yield self._element()
                sep = self._next_char()
                if sep == "]":
                    self.pos += 1
                    break
                self.pos += 1  # the ',' the scan stopped at
        if self._next_char():
            self._fail("extra data after the array's closing ']'; the file must hold one JSON array")

    def _element(self) -> _Element:
        line = self._line_at(self.pos)
        end, size = self._scan()
        if end is None:
            return _Element(line, problem=oversized("", size, self.max_chars)[2:].replace("bytes", "characters", 1))
        text = self.buf[self.pos:end]
        self.pos = end
        if not self.decode:
            return _Element(line, text=text)
        try:
            value, stop = self.decoder.raw_decode(text, 0)
        except json.JSONDecodeError as e:
            return _Element(line, problem=f"invalid JSON ({e.msg}); fix the element", text=text)
        except RecursionError:
            return _Element(line, problem="JSON nested too deeply; flatten the element", text=text)
        except ValueError as e:  # e.g. an integer longer than Python's digit limit
            return _Element(line, problem=f"invalid JSON ({e})", text=text)
        if text[stop:].strip(_WHITESPACE):
            return _Element(line, problem=f"invalid JSON (extra data after the value: {text[stop:].strip()[:20]!r})",
                            text=text)
        problem = self.decoder.problem()
        if problem is not None:
            return _Element(line, problem=problem, text=text)
        return _Element(line, value=value, text=text)

    def _scan(self) -> tuple[int | None, int]:
        """From self.pos, the element's first character: (index in buf of the ',' or ']' that ends it, its
        length), tracking strings and brackets. One longer than max_chars is read past without being kept:
        (None, its length), with self.pos at its end."""
        depth, in_string, i, skipped = 0, False, self.pos, 0
        while True:
            m = (_INSIDE if in_string else _OUTSIDE).search(self.buf, i)
            if m is None:  # need more text
                if self.is_eof:
                    self._fail("the array ends early (missing ']'); the file may be truncated")
                if skipped or len(self.buf) - self.pos > self.max_chars:  # too big: drop what was read
                    skipped += len(self.buf) - self.pos
                    self._line_at(len(self.buf))
                    self.pos = len(self.buf)
                offset = i - self.pos  # i may be one past the buffer (after a backslash at its end)
                self._refill()
                i = self.pos + offset
                continue
            j, c = m.start(), m.group()
            if in_string:
                if c == "\\":
                    i = j + 2
                    continue
                in_string, i = False, j + 1
                continue
            if c == '"':
                in_string, i = True, j + 1
            elif c in "[{":
                depth, i = depth + 1, j + 1
            elif depth == 0 and c in ",]":
                size = skipped + j - self.pos
                if skipped:
                    self._line_at(j)
                    self.pos = j
                    return None, size
                if size > self.max_chars:
                    self._line_at(j)
                    self.pos = j
                    return None, size
                return j, size
            elif c in "]}":
                depth, i = max(depth - 1, 0), j + 1
            else:  # a ',' inside a nested value
                i = j + 1

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
