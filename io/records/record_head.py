"""A record's head, read the same way for every task before its request is built: where it is, its id, its kept
fields and digest (`RecordHead`), and the row of a record that cannot run (`ErrorRow`). `RecordBuilder` and
`BuiltRecord` are what `run_records` takes from any builder (`RequestBuilder`, `PoolingRequestBuilder`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from conveyor.core import SamplingParams
from conveyor.io.records.batch_lines import error_id
from conveyor.io.records.readers.record import RawRecord, describe, location
from conveyor.io.records.reject import Reject


def own_id(record: dict, id_field: str) -> str | None:
    """A record's own id (its `id_field`, else its `custom_id`), or None where it has none; Reject where the field
    is not a non-empty string or an integer."""
    name = id_field
    value = record.get(name)
    if value is None:
        value, name = record.get("custom_id"), "custom_id"
    if value is None:
        return None
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise Reject(f"field '{name}' must be a non-empty string or an integer, got {describe(value)}; "
                 "fix it or choose another field with --id-field")


@dataclass(frozen=True)
class ErrorRow:
    index: int
    id: str
    error: str  # starts with the location: "line 12: ..." or "record 12: ..." (0-based index)
    kept: dict
    seed: int | None  # the effective seed when it could be worked out
    prompt_tokens: int | None = None  # known when the error came after tokenizing
    digest: str | None = None  # the input record's digest, where the reader gave one
    prompt_tokens_truncated: int | None = None  # tokens cut from the prompt's start, where it was truncated
    id_given: bool = False  # False: `id` is the index (or a bad id as given); no other record's id is checked against it


def unreadable(raw: RawRecord, keep_fields: tuple[str, ...]) -> ErrorRow:
    """The error row of a record its reader could not read (its kept fields null)."""
    where = location(raw.index, raw.line)
    return ErrorRow(raw.index, str(raw.index), raw.error or f"{where}: the record could not be read",
                    dict.fromkeys(keep_fields), None, digest=raw.digest)


@dataclass
class RecordHead:
    """What every row of a readable record carries: its index and location, its kept fields and digest, and its id
    (the index until `take_id` has read the record's own: a record whose id is bad has the id its error row names)."""

    index: int
    where: str  # "line 12", "record 12": how messages name it
    kept: dict  # keep_fields -> the record's values (None where missing)
    digest: str | None
    id: str
    id_given: bool = False

    @classmethod
    def of(cls, raw: RawRecord, keep_fields: tuple[str, ...]) -> RecordHead:
        record = raw.record
        return cls(raw.index, location(raw.index, raw.line), {name: record.get(name) for name in keep_fields},
                   raw.digest, error_id(record, raw.index))

    def take_id(self, record: dict, id_field: str) -> str | None:
        """The record's own id read (Reject where it is bad), or None where it has none (its id is its index)."""
        given = own_id(record, id_field)
        self.id_given = given is not None
        self.id = given if self.id_given else str(self.index)
        return given

    def error(self, message: str, seed: int | None = None, prompt_tokens: int | None = None,
              truncated: int | None = None) -> ErrorRow:
        """The record's error row: `message` after its location."""
        return ErrorRow(self.index, self.id, f"{self.where}: {message}", self.kept, seed, prompt_tokens, self.digest,
                        truncated, self.id_given)


class BuiltRecord(Protocol):
    """A record built for its engine (`BuiltRequest`, `BuiltPooling`): the request or requests to run, and what
    its row needs besides the results."""

    index: int
    id: str
    n: int  # requests to run for it (samples)
    sampling: SamplingParams

    def to_generation_request(self, sample: int = 0) -> Any:
        """The engine request of sample `sample` (0 <= sample < n)."""
        ...

    def error_row(self, message: str, prompt_tokens: int | None = None) -> ErrorRow:
        """The error row of this record, which could not run or did not finish."""
        ...


class RecordBuilder(Protocol):
    """Turns a RawRecord into what its engine runs, or into the row of a record that cannot run (never raises for a
    bad record)."""

    def build(self, raw: RawRecord) -> BuiltRecord | ErrorRow: ...
