"""Shards: one dataset split over N independent runs (`--shard I/N`), and the merge of their rows into one
output in input order (`conveyor merge`, or the shard that finishes last).

Record r belongs to shard r mod N. Round robin rather than contiguous ranges: a shard can start on a stream
without a count of the input first, every shard gets the same mix of short and long records (inputs are often
sorted by source or length), so N shards finish together; each shard reads the whole input and skips the
records of others (reading is cheap beside generation).

Each shard is a run directory of its own, `<run dir>/shard-I-of-N/` (manifest, journal, lock: resumable alone),
and writes `shard.json` there once every record of its shard has a committed row: the number of input records it
saw, which every shard must agree on. `ShardSet.check` refuses a merge while a shard is missing, unfinished or
drifted (another input, model or generation settings than shard 0), naming it. Ids are checked per shard as the
shards run; an id repeated across shards is found at the merge (a table of the shards' claimed ids on disk, not
in memory), and every record after the first with it gets the duplicate-id error row a single run gives it.
Knows nothing of the engine; imports neither torch nor `conveyor.core`.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from conveyor.core import Task
from conveyor.io.counts import counted
from conveyor.io.errors import SpecError
from conveyor.io.rows.rows import SAMPLE_INDEX, SAMPLES_KEY, duplicate_id_row, vector_size, without_errors
from conveyor.io.run_report import Outcome
from conveyor.io.state.atomic import atomic_write_text, make_temp, remove_leftovers
from conveyor.io.state.journal import Journal, JournalCorrupt
from conveyor.io.state.run_dir import Manifest, RunDir, RunDirError

MARKER = "shard.json"
_MERGE_SCRATCH = "merge-ids.sqlite"  # the ids a merge compares across shards, in a file of its own
MAX_SHARDS = 100_000  # a split into more is a typo, and each shard is a folder: refused before any is made
SHARD_DIR = re.compile(r"shard-(\d+)-of-(\d+)")  # a shard's folder: shard-I-of-N


class ShardError(RunDirError):
    """A merge that cannot happen: a shard missing, unfinished or drifted (the message names it)."""


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        """"I/N" (0 <= I < N) -> Shard; SpecError naming --shard otherwise."""
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
        if m and int(m.group(2)) > MAX_SHARDS:
            raise SpecError(f"--shard: {text!r} splits the input into more than {MAX_SHARDS:,} shards; use fewer (a "
                            "shard per GPU or node is the usual split)")
        if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
            raise SpecError(f"--shard: {text!r} is not I/N with 0 <= I < N, e.g. --shard 0/4 (of 4 shards: 0/4, "
                             "1/4, 2/4, 3/4)")
        return cls(int(m.group(1)), int(m.group(2)))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def owns(self, record_index: int) -> bool:
        return record_index % self.count == self.index

    @property
    def dir_name(self) -> str:
        return f"shard-{self.index}-of-{self.count}"

    def num_records(self, input_records: int) -> int:
        """How many of `input_records` records are this shard's."""
        return len(range(self.index, input_records, self.count))


def shard_dir(run_dir: str | Path, shard: Shard) -> Path:
    return Path(run_dir) / shard.dir_name


def mark_done(run_dir: Path, shard: Shard, input_records: int, on_error: str) -> None:
    """Say in the shard's directory that every record of it has a committed row."""
    atomic_write_text(run_dir / MARKER, json.dumps({"shard": shard.index, "of": shard.count,
                                                    "input_records": input_records, "on_error": on_error}) + "\n")


def clear_done(run_dir: Path) -> None:
    (run_dir / MARKER).unlink(missing_ok=True)


@dataclass
class _Member:
    shard: Shard
    path: Path
    manifest: Manifest
    marker: dict


class ShardSet:
    """The shards of one run directory, checked together."""

    def __init__(self, run_dir: str | Path, count: int | None = None) -> None:
        self.path = Path(run_dir)
        found: dict[int, set[int]] = {}
        if self.path.is_dir():
            for child in self.path.iterdir():
                m = SHARD_DIR.fullmatch(child.name)
                if m and child.is_dir():
                    found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
        if count is None:
            if not found:
                raise ShardError(f"{self.path} holds no shards (folders shard-I-of-N, made by `conveyor run ... "
                                 "--shard I/N`); run the shards first, or give the --run-dir they used")
            if len(found) > 1:
                raise ShardError(f"{self.path} holds shards of more than one split ({', '.join(counted(n, 'shard') for n in sorted(found))}); "
                                 "remove the folders of the split you do not want")
            count = next(iter(found))
        if count > MAX_SHARDS:
            raise ShardError(f"{self.path} holds shards of a split into {count} (more than {MAX_SHARDS:,}); remove "
                             f"the folders shard-*-of-{count}")
        self.count = count
        self.shards = [Shard(i, count) for i in range(count)]

    def status(self) -> dict[str, str]:
        """Shard ("I/N") -> "done", "running or stopped" or "missing"."""
        out = {}
        for shard in self.shards:
            path = shard_dir(self.path, shard)
            out[str(shard)] = ("done" if (path / MARKER).exists() else
                               "running or stopped" if path.exists() else "missing")
        return out

    def check(self) -> list[_Member]:
        """Every shard present, finished and run with shard 0's input, model and settings; else ShardError naming
        the first shard that is not, and what to do."""
        members: list[_Member] = []
        for shard in self.shards:
            path = shard_dir(self.path, shard)
            run_dir = RunDir(path)
            manifest = run_dir.load_manifest() if path.exists() else None
            if manifest is None:
                raise ShardError(f"shard {shard} is missing ({path} holds no run): run `conveyor run ... --shard "
                                 f"{shard}` with the same input, output and options as the other shards")
            try:
                marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
            except FileNotFoundError:
                raise ShardError(f"shard {shard} has not finished ({path} has no {MARKER}): run its command "
                                 f"(`conveyor run ... --shard {shard}`) again to resume it") from None
            except (OSError, ValueError) as e:
                raise ShardError(f"shard {shard}: {path / MARKER} is unreadable ({e}); run the shard again") from None
            if not _is_marker(marker, shard):
                raise ShardError(f"shard {shard}: {path / MARKER} is not what conveyor writes there (the shard's "
                                 f"index, count and input records); delete it and run the shard again "
                                 f"(`conveyor run ... --shard {shard}`)")
            if members:
                changed, message = manifest.changes_since(members[0].manifest)
                if changed:
                    raise ShardError(f"shard {shard} ({path}) was run with other settings than shard "
                                     f"{members[0].shard}: {message.replace('since this run started', 'between them')}"
                                     f"; rerun it with the same input and options (--restart --shard {shard})")
                if marker.get("input_records") != members[0].marker.get("input_records"):
                    raise ShardError(f"shard {shard} saw {marker.get('input_records')} input records, shard "
                                     f"{members[0].shard} {members[0].marker.get('input_records')}: they did not read "
                                     "the same input; rerun the shards with the same input and --limit")
            members.append(_Member(shard, path, manifest, marker))
        total = members[0].marker["input_records"]
        for m in members:
            with Journal(m.path / "journal.sqlite", read_only=True, verify=False) as journal:
                have, want = journal.num_committed(), m.shard.num_records(total)
            if have != want:
                raise ShardError(f"shard {m.shard} holds {counted(have, 'row')} where its share of the {counted(total, 'input record')} "
                                 f"is {want}; run it again (`conveyor run ... --shard {m.shard}`)")
        return members

    def rows(self, members: list[_Member]) -> Iterator[dict]:
        """Every shard's rows in input order, ids repeated across shards made duplicate-id error rows."""
        firsts = self._repeated_ids(members)
        journals = [Journal(m.path / "journal.sqlite", read_only=True, verify=False) for m in members]
        total = members[0].marker["input_records"]
        try:
            streams = (_checked_rows(m, j, total) for m, j in zip(members, journals))
            for row in heapq.merge(*streams, key=lambda r: r["index"]):
                first = firsts.get(row["id"])
                if first is not None and first != row["index"] and (row["status"] == "ok" or SAMPLES_KEY in row):
                    row = duplicate_id_row(row)
                yield row
        finally:
            for j in journals:
                j.close()

    def columns(self, members: list[_Member]) -> set[str]:
        out: set[str] = set()
        for m in members:
            with Journal(m.path / "journal.sqlite", read_only=True, verify=False) as journal:
                out |= journal.columns()
        return out

    def _repeated_ids(self, members: list[_Member]) -> dict[str, int]:
        """id -> the first index holding it, for the ids more than one shard claimed (usually none)."""
        # A file of this merge's own: two shards finishing together may both merge (each output by atomic rename).
        # One a merge killed mid-way left (a dead process's, this host's) goes now.
        remove_leftovers(self.path, lambda target: target == _MERGE_SCRATCH)
        fd, name = make_temp(self.path, _MERGE_SCRATCH)
        os.close(fd)
        scratch = Path(name)
        db = sqlite3.connect(scratch)
        try:
            db.execute("CREATE TABLE ids (id TEXT NOT NULL, idx INTEGER NOT NULL)")
            for m in members:
                db.execute("ATTACH DATABASE ? AS shard", (str(m.path / "journal.sqlite"),))
                db.execute("INSERT INTO ids SELECT id, idx FROM shard.ids")
                db.commit()
                db.execute("DETACH DATABASE shard")
            db.execute("CREATE INDEX ids_by_id ON ids (id)")
            return {rid: first for rid, first in
                    db.execute("SELECT id, MIN(idx) FROM ids GROUP BY id HAVING COUNT(*) > 1")}
        except sqlite3.DatabaseError as e:
            raise JournalCorrupt(scratch, str(e)) from e
        finally:
            db.close()
            scratch.unlink(missing_ok=True)


def _is_marker(marker: object, shard: Shard) -> bool:
    """Whether `marker` is the shard.json `mark_done` writes for `shard`."""
    return (isinstance(marker, dict) and marker.get("shard") == shard.index and marker.get("of") == shard.count
            and type(marker.get("input_records")) is int and marker["input_records"] >= 0)


def _checked_rows(member: _Member, journal: Journal, total: int) -> Iterator[dict]:
    """A shard's rows, checked as they stream to be exactly its share of the `total` input records."""
    shard = member.shard
    try:
        yield from journal.iter_rows_expecting(range(shard.index, total, shard.count))
    except JournalCorrupt as e:
        raise ShardError(f"shard {shard}: its journal {e.path} is not what the shard wrote ({e.detail}); rerun it "
                         f"with `conveyor run ... --restart --shard {shard}`") from None


@dataclass
class MergeResult:
    rows: int  # records written (a record with n > 1: its samples' rows)
    errors: int  # records with an error row (written, or left out under --on-error skip)
    shards: int
    skipped_errors: bool  # the shards ran with --on-error skip

    @property
    def outcome(self) -> Outcome:
        """OK, or SOME_ERRORS where the output holds error rows (exit code 3)."""
        return Outcome.of(self.errors, self.skipped_errors)


def merge(run_dir: str | Path, output: str, output_format: str | None = None, write: bool = True) -> MergeResult:
    """Write `output` from the finished shards under `run_dir`, in input order, as the shards' runs would have
    (their keep fields, model name, --on-error); ShardError while a shard is missing, unfinished or drifted. An
    output in a store is staged in `run_dir`. Without `write` (shards that wrote their own part files), the rows
    are checked and counted only."""
    from conveyor.io.rows.writers import write_output

    shards = ShardSet(run_dir)
    members = shards.check()
    first = members[0]
    skip = first.marker.get("on_error") == "skip"
    counts = {"rows": 0, "errors": 0}

    def rows() -> Iterator[dict]:
        for row in shards.rows(members):
            if row["status"] == "error":
                counts["errors"] += 1
                if skip:  # (a record with n > 1 keeps its ok samples' rows)
                    row = without_errors(row)
                    if row is not None:
                        yield row
                    continue
            counts["rows"] += 1
            yield row

    if not write:
        for _ in rows():
            pass
        return MergeResult(counts["rows"], counts["errors"], len(members), skip)
    config = first.manifest.generation_config
    fmt = output_format or first.manifest.output_format
    task = Task(config.get("task", Task.GENERATE))
    size = vector_size(shards.rows(members)) if task is Task.EMBED and fmt == "parquet" else None
    served = config.get("served_model_names") or [first.manifest.model]  # (the name result lines give, as a run's)
    write_output(rows(), output, fmt, tuple(config.get("keep_fields") or ()), model_name=served[0],
                 optional=shards.columns(members) | ({SAMPLE_INDEX} if "n" in config else set()), task=task,
                 vector_size=size, staging=str(run_dir))
    return MergeResult(counts["rows"], counts["errors"], len(members), skip)
