"""RawRecord, the Reader base class, a record's location as messages give it, and the strict JSON decoding the text
readers share.

Pure Python: no conveyor.core, no torch.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterator

from conveyor.io.storage import is_remote, open_read

BOM = b"\xef\xbb\xbf"
FORMATS = ("jsonl", "json", "parquet", "csv", "tsv", "datasets")
DEFAULT_MAX_RECORD_BYTES = 4 << 20  # a record bigger than this is an error row, never parsed
# A JSON \u escape of a UTF-16 surrogate: only where one appears can a decoded string hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(frozen=True, slots=True)
class RawRecord:
    """One input record as read, before validation. Exactly one of `record` and `error` is set."""

    index: int  # 0-based record position in the input; blank lines take no index
    line: int | None  # 1-based line in the file (JSONL, CSV); None for JSON arrays, Parquet, datasets
    record: dict | None  # the parsed object, or None when it could not be parsed
    error: str | None  # why it cannot be used, starting with its location ("line 7: ...")
    digest: str | None = None  # a hash of the record as read, where the reader was asked for them


class Reader:
    """Streams RawRecords from one input; iterating again reopens the source (stdin: once only).

    `max_record_bytes`: a record bigger than this becomes an error row before it is parsed.
    `with_digests`: give each record a `digest` of its raw form (for inputs that have no fingerprint,
    such as stdin, a resumed run compares its records one by one against the journal's)."""

    source: str
    format: str
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    with_digests: bool = False
    split: str | None = None  # the datasets split read (resolved: a DatasetDict's only split, a hub's default)

    @property
    def selection(self) -> dict[str, str]:
        """What, beside the source's bytes, decides the records read: the format they are parsed as and the split.
        The same bytes read another way are another input (a run's manifest records this with the fingerprint)."""
        return {"format": self.format, **({"split": self.split} if self.split is not None else {})}

    def __iter__(self) -> Iterator[RawRecord]:
        return self.iter_from(0)

    def iter_from(self, start_index: int) -> Iterator[RawRecord]:
        """Records with index >= start_index, skipping the earlier ones as cheaply as the format allows."""
        raise NotImplementedError

    def keyed_from(self, start_index: int) -> Iterator[tuple[int, int | None, str | None, Callable[[], RawRecord]]]:
        """(index, line, digest, the record) of the records from start_index, the record a call away: a reader that
        can digest a record without parsing it (JSONL) parses only the records whose call is made (a rerun over an
        input that changed needs little more than the digests of the records that did not)."""
        for raw in self.iter_from(start_index):
            yield raw.index, raw.line, raw.digest, _given(raw)

    def count(self) -> int | None:
        """The number of records, when it is cheap to know; None otherwise."""
        return None


def _given(raw: RawRecord) -> Callable[[], RawRecord]:
    return lambda: raw


def is_stream(source: str) -> bool:
    """stdin, a pipe or a device: it can be read once only, so nothing may peek at it or count it."""
    return source == "-" or (not is_remote(source) and not os.path.isfile(source))


def open_binary(source: str, buffering: int = -1) -> IO[bytes]:
    """A file or an object-storage URL (streamed in ranged reads), opened to read bytes (a buffered stream either
    way: `readline(limit)`, `peek`)."""
    if is_remote(source):
        return io.BufferedReader(open_read(source), buffer_size=buffering if buffering > 0 else io.DEFAULT_BUFFER_SIZE)
    return open(source, "rb", buffering=buffering)


def location(index: int, line: int | None = None, element_line: int | None = None) -> str:
    """Where a record is, as its error messages begin: "line 7" (a JSONL or CSV line, 1-based), "record 3 (line 12)"
    (a JSON array's element and the line it starts on), "record 3" (a 0-based index: Parquet, datasets)."""
    if line is not None:
        return f"line {line}"
    if element_line is not None:
        return f"record {index} (line {element_line})"
    return f"record {index}"


def describe(value: Any) -> str:
    """A JSON value's kind, for messages: 'a list', 'a string', 'null', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def first_line(e: BaseException) -> str:
    """An exception's first line, for one-line messages."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def to_record(value: Any, index: int, line: int | None, where: str, digest: str | None = None) -> RawRecord:
    if not isinstance(value, dict):
        return RawRecord(index, line, None, f"{where}: expected a JSON object, got {describe(value)}; "
                                            'write each record as {"prompt": ...} or {"messages": [...]}', digest)
    bad = lone_surrogate(value)
    if bad is not None:
        return RawRecord(index, line, None, f"{where}: {bad}", digest)
    return RawRecord(index, line, value, None, digest)


def table_row(reader: Reader, row: dict, index: int, line: int | None) -> RawRecord:
    """A row of a table-like input (Parquet, CSV, datasets): an error row when it is bigger than the reader's
    max_record_bytes (counting its strings' characters), with its digest where the reader wants them."""
    where = location(index, line)
    digest = None
    if reader.with_digests:
        digest = digest_of(json.dumps(row, sort_keys=True, default=_stable_text, ensure_ascii=False)
                           .encode("utf-8", "surrogatepass"))
    size = _size(row)
    if size > reader.max_record_bytes:
        return RawRecord(index, line, None, oversized(where, size, reader.max_record_bytes), digest)
    return RawRecord(index, line, row, None, digest)


def _stable_text(value: Any) -> str:
    """A value JSON has no form for, as a record's digest takes it: the same value gives the same text in every
    process. An object that holds its data as bytes (a decoded image, an array) by a hash of them (its `str` may
    name a memory address, or elide the middle of a long array); anything else (dates, decimals, bytes) by `str`."""
    tobytes = getattr(value, "tobytes", None)
    if callable(tobytes):
        shape = getattr(value, "mode", ""), getattr(value, "size", ""), getattr(value, "shape", "")
        return f"{type(value).__name__}{shape}:{hashlib.sha256(tobytes()).hexdigest()}"
    return str(value)


def _size(value: Any) -> int:
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, dict):
        return sum(_size(k) + _size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 8


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def oversized(where: str, size: int, limit: int) -> str:
    return (f"{where}: the record is {size:,} bytes, over the {limit:,} of --max-record-bytes; shorten it "
            "or raise --max-record-bytes")


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where `value` (a decoded JSON value) holds a string with a lone UTF-16 surrogate, which no text
    encoding can write: "field 'a.b[2]' holds ..." or None. JSON allows such escapes (\\ud800); they are
    not text, and would fail in the tokenizer, the seed or the journal."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            code = ord(value[e.start])
            where = f"field '{path}'" if path else "a field name"
            return (f"{where} holds a lone UTF-16 surrogate (\\u{code:04x} at character {e.start}), which is "
                    "not text; fix or remove it")
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                bad = lone_surrogate(key, "")
                if bad is not None:
                    return bad.replace("a field name", f"a field name in '{path or '(the record)'}'")
            bad = lone_surrogate(item, f"{path}.{key}" if path else str(key))
            if bad is not None:
                return bad
    elif isinstance(value, list):
        for i, item in enumerate(value):
            bad = lone_surrogate(item, f"{path}[{i}]")
            if bad is not None:
                return bad
    return None


def may_hold_surrogates(raw: bytes) -> bool:
    """Whether JSON text `raw` escapes a surrogate anywhere (decoded strings can hold lone ones only then)."""
    return _SURROGATE_ESCAPE.search(raw) is not None


def strict_loads(text: str) -> Any:
    """`json.loads`, but a NaN, an infinity or a key given twice in one object is a ValueError saying so."""
    decoder = StrictDecoder()
    value, end = decoder.raw_decode(text, len(text) - len(text.lstrip()))
    if text[end:].strip():
        raise ValueError(f"extra data after the value: {text[end:].strip()[:20]!r}")
    problem = decoder.problem()
    if problem is not None:
        raise ValueError(problem)
    return value


class StrictDecoder:
    """json decoding that notices NaN, Infinity and overflowing numbers (1e999), and a key given twice in one
    object (a reader keeps one of its values and drops the other without a word), instead of accepting them.

    The json module cannot reject them mid-value without losing its place in the text, so the hooks
    only record what they saw; callers check `problem()` after each value.
    """

    def __init__(self) -> None:
        self.non_finite: str | None = None
        self.repeated: str | None = None
        self._decoder = json.JSONDecoder(parse_constant=self._constant, parse_float=self._float,
                                         object_pairs_hook=self._object)

    def problem(self) -> str | None:
        """What the last value decoded holds that a record cannot (None: nothing)."""
        if self.non_finite is not None:
            return f"non-finite number ({self.non_finite}); use null or a finite number"
        if self.repeated is not None:
            return (f"the key {json.dumps(self.repeated, ensure_ascii=False)} appears twice in one object (a JSON "
                    "reader keeps one of its values and drops the other); keep one")
        return None

    def _object(self, pairs: list[tuple[str, Any]]) -> dict:
        value = dict(pairs)
        if len(value) != len(pairs) and self.repeated is None:
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    self.repeated = key
                    break
                seen.add(key)
        return value

    def _constant(self, name: str) -> None:
        self.non_finite = self.non_finite or name
        return None

    def _float(self, text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            self.non_finite = self.non_finite or text
        return value

    def raw_decode(self, text: str, pos: int) -> tuple[Any, int]:
        self.non_finite = self.repeated = None
        return self._decoder.raw_decode(text, pos)

    def line_record(self, raw: bytes, index: int, line: int, digest: str | None = None) -> RawRecord:
        """One JSONL line (BOM already removed) -> a record, or an error naming the line."""
        where = location(index, line)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return RawRecord(index, line, None, f"{where}: not valid UTF-8 ({e.reason} at byte {e.start + 1}); "
                                                "save the file as UTF-8", digest)
        self.non_finite = self.repeated = None
        try:
            value = self._decoder.decode(text)
        except json.JSONDecodeError as e:
            return RawRecord(index, line, None, f"{where}: invalid JSON ({e.msg} at column {e.colno}); "
                                                "each line must hold one complete JSON object", digest)
        except RecursionError:
            return RawRecord(index, line, None, f"{where}: JSON nested too deeply; flatten the record", digest)
        except ValueError as e:  # e.g. an integer longer than Python's digit limit
            return RawRecord(index, line, None, f"{where}: invalid JSON ({e})", digest)
        problem = self.problem()
        if problem is not None:
            return RawRecord(index, line, None, f"{where}: {problem}", digest)
        if isinstance(value, dict) and not may_hold_surrogates(raw):
            return RawRecord(index, line, value, None, digest)  # the common case: nothing to walk
        return to_record(value, index, line, where, digest)
