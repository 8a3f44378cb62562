"""An input that changed under a run directory, as the journal's rows are matched to it (io/state/journal_rebase.py):
its records as entries (index, place, digest, own id), streamed, for `Run.open`, which carries the journal over
(`Carry`), and for `conveyor status`, which counts what a rerun would compute without loading the model or changing
a row.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

from conveyor.io.counts import counted
from conveyor.io.errors import InputError
from conveyor.io.records.readers import DEFAULT_MAX_RECORD_BYTES, RawRecord, Reader, fingerprint, open_reader
from conveyor.io.records.readers.record import location
from conveyor.io.records.record_head import own_id
from conveyor.io.records.reject import Reject
from conveyor.io.rows.parts import STALE_KEY
from conveyor.io.rows.sink import RunTotals
from conveyor.io.run_spec import RunSpec
from conveyor.io.state.journal import Journal
from conveyor.io.state.journal_rebase import Entry, Reuse, rebase, refresh_kept_fields
from conveyor.io.state.manifest import DriftError, Manifest
from conveyor.io.state.run_dir import RunDir
from conveyor.io.state.shards import Shard

__all__ = ["Carry", "input_entries", "input_kept_fields", "pending_in_changed_input", "piped",
           "rows_of_other_records"]


def piped(input_fingerprint: str) -> bool:
    """Whether the input is stdin or a pipe (`fingerprint` names them so): read once, so copied before a run."""
    return input_fingerprint == "stdin" or input_fingerprint.startswith("stream:")


def _count(number: int, noun: str) -> str:
    """"1 row", "1,024 rows"."""
    return counted(number, noun, thousands=True)


def _without_keep_fields(manifest: Manifest) -> Manifest:
    """`manifest` without --keep-fields, an output-only setting (the rows keep the fields; a change reads them again)."""
    return dataclasses.replace(manifest, generation_config={k: v for k, v in manifest.generation_config.items()
                                                            if k != "keep_fields"})


class Carry:
    """A run's journal carried over to its input as it is now: the rows of the records still there, unchanged,
    reused (a row is reused only for its own record); the counts said (`say`) and kept for the summary (`totals`).
    `shard`: the records this run answers; `run_dir`: named by the errors."""

    def __init__(self, spec: RunSpec, shard: Shard | None, totals: RunTotals, run_dir: Path,
                 say: Callable[[str], None]) -> None:
        self.spec, self.shard, self.totals, self.run_dir, self.say = spec, shard, totals, run_dir, say

    def carry_over(self, journal: Journal, drift: DriftError, stored: Manifest, manifest: Manifest,
                   reader: Reader) -> bool:
        """The journal of a run whose input or output-only settings changed, carried over: rows of the records still
        there, unchanged, kept (`rebase`), and their kept fields read again where --keep-fields changed. False where
        something else changed (drift: the model, a setting that decides rows)."""
        old_keep = tuple(stored.generation_config.get("keep_fields", ()))
        if "model" in drift.changed or "generation_config" in _without_keep_fields(manifest).changes_since(
                _without_keep_fields(stored))[0]:
            return False
        keep = self.spec.build.keep_fields
        if "input" in drift.changed:
            if piped(stored.input_fingerprint) or piped(manifest.input_fingerprint):  # (read once: not matched)
                return False
            why = "the input changed since the last run" if drift.detail.startswith("the input file changed") \
                else drift.detail.split(";")[0]
            if not self.rebase(journal, reader, why):
                raise DriftError(self.run_dir, drift.changed, f"{drift.detail}, and its rows were written by an "
                                 "earlier release, which kept no digest of the records they answer, so none can be "
                                 "reused")
        if old_keep != keep:
            refresh_kept_fields(journal, input_kept_fields(reader, keep, shard=self.shard), old_keep)
            self.say(f"--keep-fields changed ({', '.join(old_keep) or 'none'} -> {', '.join(keep) or 'none'}): the "
                     "rows are kept, their kept fields read again from the input")
        return True

    def check_rows(self, journal: Journal, reader: Reader) -> None:
        """A resume over an input whose fingerprint did not change: its rows are still checked against the records
        read now (a file rewritten while a run read it and restored, a selection an earlier release did not record),
        and where some answer other records, the journal is carried over to the input as it is (`rebase`)."""
        other = rows_of_other_records(journal, reader, self.spec.input.limit)
        if not other:
            return
        why = (f"{_count(other, 'row')} of this run answer{'s' if other == 1 else ''} records that are not the ones "
               "read now at their place (the input was changed, or read another way, after they were computed), and "
               "a row is reused only for its own record")
        if not self.rebase(journal, reader, why):
            raise DriftError(self.run_dir, ("input",), f"{_count(other, 'row')} of this run answer records that "
                             "are not in the input as it is now, and its rows were written by an earlier release, "
                             "which kept no digest of the records they answer, so none can be reused")

    def rebase(self, journal: Journal, reader: Reader, why: str) -> bool:
        """The journal carried over to the input as it is now (the records this run answers: within --limit, this
        shard's); the counts said and kept for the summary. False where its rows cannot be matched."""
        spec = self.spec
        journal.set_meta_value(STALE_KEY, "1")  # (its parts are checked against the rows: a kill in between too)
        reuse = rebase(journal, input_entries(reader, spec.build.id_field, spec.input.limit, self.shard))
        if reuse is None:
            return False
        self.totals.reuse = reuse.to_json()
        self.say(f"{why}: {reuse.describe()}")
        if reuse.moved_without_id:
            one = reuse.moved_without_id == 1
            self.say(f"{_count(reuse.moved_without_id, 'record')} without an id {'is' if one else 'are'} at another "
                     "index than before (a record was inserted or removed ahead): a seed follows its record's index, "
                     f"so {'it is' if one else 'they are'} computed again; "
                     "give records an id (--id-field) to reuse their rows wherever they move")
        return True


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
