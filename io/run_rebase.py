"""An input that changed under a run directory, as the journal's rows are matched to it (io/state/journal_rebase.py):
its records as entries (index, place, digest, own id), streamed, for `Run.open`, which carries the journal over,
and for `conveyor status`, which counts what a rerun would compute without loading the model or changing a row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

from conveyor.io.errors import InputError
from conveyor.io.records.readers import DEFAULT_MAX_RECORD_BYTES, RawRecord, Reader, fingerprint, open_reader
from conveyor.io.records.readers.record import location
from conveyor.io.records.record_head import own_id
from conveyor.io.records.reject import Reject
from conveyor.io.state.journal import Journal
from conveyor.io.state.journal_rebase import Entry, Reuse, rebase
from conveyor.io.state.run_dir import RunDir
from conveyor.io.state.shards import Shard

__all__ = ["input_entries", "input_kept_fields", "pending_in_changed_input", "rows_of_other_records"]


def input_entries(reader: Reader, id_field: str, limit: int | None = None,
                  shard: Shard | None = None) -> Iterator[Entry]:
    """The records a run answers (within --limit, this shard's) as journal_rebase's entries; `reader` gives digests."""
    for index, line, digest, record in reader.keyed_from(0):
        if limit is not None and index >= limit:
            return
        if shard is None or shard.owns(index):
            yield Entry(index, location(index, line), digest, functools.partial(_own_id, record, id_field))


def rows_of_other_records(journal: Journal, reader: Reader, limit: int | None = None) -> int:
    """How many of the journal's committed rows answer a record other than the one read now at their index: a stored
    digest that differs from the record's, or a row past the input's end (within --limit). A row without a digest (an
    earlier release's) cannot be told apart and is not counted. The input is read once, digests only (JSONL: no
    line is parsed)."""
    committed = journal.committed_digests_from(0)
    answered = next(committed, None)
    other = 0
    for index, _, digest, _ in reader.keyed_from(0):
        if answered is None or (limit is not None and index >= limit):
            return other
        while answered is not None and answered[0] < index:  # (not the case for a reader that yields every index)
            answered = next(committed, None)
        if answered is not None and answered[0] == index:
            other += answered[1] is not None and answered[1] != digest
            answered = next(committed, None)
    while answered is not None and (limit is None or answered[0] < limit):  # rows past the input's end
        other += 1
        answered = next(committed, None)
    return other


def input_kept_fields(reader: Reader, names: tuple[str, ...], limit: int | None = None,
                      shard: Shard | None = None) -> Iterator[tuple[int, dict]]:
    """(index, its record's --keep-fields as a row holds them) of the records a run answers."""
    for raw in reader.iter_from(0):
        if limit is not None and raw.index >= limit:
            return
        if shard is None or shard.owns(raw.index):
            record = raw.record or {}
            yield raw.index, {name: record.get(name) for name in names}


def _own_id(record: Callable[[], RawRecord], id_field: str) -> str | None:
    """A record's own id as the request builder reads it; None where it has none or a bad one (its row is an error
    row, matched by its index)."""
    raw = record()
    if raw.record is None:
        return None
    try:
        return own_id(raw.record, id_field)
    except Reject:
        return None


def pending_in_changed_input(folder: Path) -> tuple[Reuse | None, str | None]:
    """For `conveyor status`: where the input of the run in `folder` changed since its manifest was written, what a
    rerun would reuse and compute (a dry rebase: nothing is written); (None, None) where it did not change, or
    (None, why) where it cannot be told (the input is gone, unreadable, or without a fingerprint of its content)."""
    run_dir = RunDir(folder)
    manifest = run_dir.load_manifest()
    if manifest is None or not run_dir.journal_path.exists():
        return None, None
    path = manifest.input_path
    if path == "-" or not Path(path).exists():
        return None, None
    now = fingerprint(path)
    if now == manifest.input_fingerprint:
        return None, None
    config, selection = manifest.generation_config, manifest.input_selection or {}
    try:
        reader = open_reader(path, selection.get("format"), selection.get("split"),
                             config.get("max_record_bytes", DEFAULT_MAX_RECORD_BYTES))
        reader.with_digests = True
        with Journal(run_dir.journal_path, read_only=True, verify=False) as journal:
            reuse = rebase(journal, input_entries(reader, config.get("id_field", "id")), write=False)
    except (InputError, OSError) as e:
        return None, f"the input {path} changed since the run's last start, and cannot be read here ({e})"
    if reuse is None:
        return None, (f"the input {path} changed since the run started, and its rows were written by an earlier "
                      "release: a rerun refuses it (run with --restart)")
    return reuse, None
