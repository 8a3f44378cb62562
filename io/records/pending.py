"""The records of a run that still need a row: the input read from the first record without a committed row, those
with one skipped, a shard's others left out, stopped at --limit.

An input with a fingerprint of its content (a file) was checked whole when the run resumed (drift), so reading
starts at the journal's contiguous prefix. An input without one (stdin, a pipe, a hub dataset) is read from its
start, and every record the journal already answered must be the record it answered (by digest). Pure Python.
The journal and the shard are described by what this module asks of them (io/state's Journal and Shard are
such), so io/records does not import io/state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from conveyor.io.errors import InputError
from conveyor.io.records.readers import RawRecord, Reader


class Answers(Protocol):
    """The records a run has rows for, as its journal tells (io.state.journal.Journal)."""

    def contiguous_prefix(self) -> int: ...

    def committed_indices_from(self, start: int) -> Iterator[int]: ...

    def committed_digests_from(self, start: int) -> Iterator[tuple[int, str | None]]: ...


class Share(Protocol):
    """The records one process of a split run answers (io.state.shards.Shard)."""

    def owns(self, record_index: int) -> bool: ...


class PendingRecords:
    """Iterates the records still to answer; `input_records` counts the input records read so far (every
    shard's, after --limit), which a finished shard records."""

    def __init__(self, reader: Reader, journal: Answers, source: str, limit: int | None = None,
                 shard: Share | None = None, checked: bool = False) -> None:
        self.reader = reader
        self.checked = checked  # an input without a fingerprint of its content: records checked by digest
        self.journal = journal
        self.source = source  # the input's name, for errors
        self.limit = limit
        self.shard = shard
        self.input_records = 0

    def __iter__(self) -> Iterator[RawRecord]:
        for raw in self._checked() if self.checked else self._unanswered():
            self.input_records = raw.index + 1
            if self.shard is None or self.shard.owns(raw.index):
                yield raw

    def _within_limit(self, raw: RawRecord) -> bool:
        return self.limit is None or raw.index < self.limit

    def _unanswered(self) -> Iterator[RawRecord]:
        start = self.journal.contiguous_prefix()
        if self.limit is not None:  # (rows past a --limit lowered since they were computed stay out of this run)
            start = min(start, self.limit)
        self.input_records = start  # the records below the prefix all have rows
        committed = self.journal.committed_indices_from(start)
        next_committed = next(committed, None)
        for raw in self.reader.iter_from(start):
            if not self._within_limit(raw):
                return
            while next_committed is not None and next_committed < raw.index:
                next_committed = next(committed, None)
            if next_committed == raw.index:
                self.input_records = raw.index + 1
                continue
            yield raw

    def _checked(self) -> Iterator[RawRecord]:
        committed = self.journal.committed_digests_from(0)
        answered = next(committed, None)
        for raw in self.reader.iter_from(0):
            if not self._within_limit(raw):
                return
            while answered is not None and answered[0] < raw.index:
                answered = next(committed, None)
            if answered is not None and answered[0] == raw.index:
                if answered[1] is not None and answered[1] != raw.digest:
                    raise InputError(self.source, raw.line, f"record {raw.index} is not the record this run "
                                     "answered at that position (an input without a file to fingerprint is checked "
                                     "record by record when a run resumes); feed the same input, or run with "
                                     "--restart to start over")
                answered = next(committed, None)
                self.input_records = raw.index + 1
                continue
            yield raw
        if answered is not None:
            raise InputError(self.source, None, f"the input ended before record {answered[0]}, which this run "
                             "already answered: it is not the input the run started with; feed the same input, or "
                             "run with --restart to start over")


def noting_keep_fields(records: Iterable[RawRecord], wanted: tuple[str, ...], seen: set[str]) -> Iterator[RawRecord]:
    """`records`, noting in `seen` which of the --keep-fields `wanted` they have (one no record has is said in the
    summary)."""
    for raw in records:
        if raw.record is not None and len(seen) < len(wanted):
            seen.update(name for name in wanted if name in raw.record)
        yield raw
