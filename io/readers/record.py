"""RawRecord, the Reader base class, and the strict JSON decoding the text readers share.

Pure Python: no conveyor.core, no torch.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator

BOM = b"\xef\xbb\xbf"
FORMATS = ("jsonl", "json", "parquet", "csv", "datasets")


@dataclass(frozen=True, slots=True)
class RawRecord:
    """One input record as read, before validation. Exactly one of `record` and `error` is set."""

    index: int  # 0-based record position in the input; blank lines take no index
    line: int | None  # 1-based line in the file (JSONL, CSV); None for JSON arrays, Parquet, datasets
    record: dict | None  # the parsed object, or None when it could not be parsed
    error: str | None  # why it cannot be used, starting with its location ("line 7: ...")


class Reader:
    """Streams RawRecords from one input; iterating again reopens the source (stdin: once only)."""

    source: str
    format: str

    def __iter__(self) -> Iterator[RawRecord]:
        return self.iter_from(0)

    def iter_from(self, start_index: int) -> Iterator[RawRecord]:
        """Records with index >= start_index, skipping the earlier ones as cheaply as the format allows."""
        raise NotImplementedError

    def count(self) -> int | None:
        """The number of records, when it is cheap to know; None otherwise."""
        return None


def is_stream(source: str) -> bool:
    """stdin, a pipe or a device: it can be read once only, so nothing may peek at it or count it."""
    return source == "-" or not os.path.isfile(source)


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


def to_record(value: Any, index: int, line: int | None, where: str) -> RawRecord:
    if isinstance(value, dict):
        return RawRecord(index, line, value, None)
    return RawRecord(index, line, None, f"{where}: expected a JSON object, got {describe(value)}; "
                                       'write each record as {"prompt": ...} or {"messages": [...]}')


class StrictDecoder:
    """json decoding that notices NaN, Infinity and overflowing numbers (1e999) instead of accepting them.

    The json module cannot reject them mid-value without losing its place in the text, so the hooks
    only record what they saw; callers check `non_finite` after each value.
    """

    def __init__(self) -> None:
        self.non_finite: str | None = None
        self._decoder = json.JSONDecoder(parse_constant=self._constant, parse_float=self._float)

    def _constant(self, name: str) -> None:
        self.non_finite = self.non_finite or name
        return None

    def _float(self, text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            self.non_finite = self.non_finite or text
        return value

    def raw_decode(self, text: str, pos: int) -> tuple[Any, int]:
        self.non_finite = None
        return self._decoder.raw_decode(text, pos)

    def line_record(self, raw: bytes, index: int, line: int) -> RawRecord:
        """One JSONL line (BOM already removed) -> a record, or an error naming the line."""
        where = f"line {line}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return RawRecord(index, line, None, f"{where}: not valid UTF-8 ({e.reason} at byte {e.start + 1}); "
                                                "save the file as UTF-8")
        self.non_finite = None
        try:
            value = self._decoder.decode(text)
        except json.JSONDecodeError as e:
            return RawRecord(index, line, None, f"{where}: invalid JSON ({e.msg} at column {e.colno}); "
                                                "each line must hold one complete JSON object")
        except RecursionError:
            return RawRecord(index, line, None, f"{where}: JSON nested too deeply; flatten the record")
        except ValueError as e:  # e.g. an integer longer than Python's digit limit
            return RawRecord(index, line, None, f"{where}: invalid JSON ({e})")
        if self.non_finite is not None:
            return RawRecord(index, line, None, f"{where}: non-finite number ({self.non_finite}); "
                                                "use null or a finite number")
        return to_record(value, index, line, where)
