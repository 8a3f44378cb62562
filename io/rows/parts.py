"""Part-file output (`-o folder/`, `--rows-per-file N`): the rows of every N consecutive records in a file of their
own, `part-00000.parquet`, `part-00001.parquet`, ..., in input order, each written as soon as all its records have
rows, so that the folder reads as one table (the rows so far) while the run goes on.

A part's life is in the journal (`Journal.parts`): recorded "writing" just before its file is written (a temporary
file renamed onto it, or one upload to a store), "written" once it is there, with the digest of the journal rows
it was written from. A process killed between the two finds the file there on resume and keeps it; one killed
before the rename writes it again (and the temporary file it left is removed); a part recorded written is never
written again. Only rows that changed under a written part (an input that changed, --retry-errors: `revalidate`)
remove its file at once, to be written again when its records all have rows. A shard writes the parts of its own
records (`part-00003-shard-1-of-4.parquet`: shard 1's records among records 3N to 4N - 1), so shards never write
the same file and need no merge.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from conveyor.io.errors import JournalCorrupt, SpecError
from conveyor.io.records.readers.record import open_binary
from conveyor.io.state.atomic import remove_leftovers
from conveyor.io.state.journal import Journal, PartEntry
from conveyor.io.state.shards import Shard
from conveyor.io.storage import is_remote, join, list_names, remove

_PART_NAME = re.compile(r"^part-(\d{5,})(-shard-\d+-of-\d+)?\.(parquet|jsonl)$")
_LAYOUT_KEY = "parts_layout"  # the journal's record of the folder, part size and names its parts were written with


@dataclass(frozen=True)
class PartLayout:
    """Where the parts go and what each holds: `records` consecutive records a part (a shard's own among them)."""

    folder: str  # a local folder or a store's URL
    records: int
    extension: str  # "parquet" or "jsonl"
    shard: Shard | None = None

    def name(self, part: int) -> str:
        suffix = f"-shard-{self.shard.index}-of-{self.shard.count}" if self.shard is not None else ""
        return f"part-{part:05d}{suffix}.{self.extension}"

    def path_of(self, name: str) -> str:
        """The path (or URL) of the file `name` in the folder."""
        return join(self.folder, name) if is_remote(self.folder) else os.path.join(self.folder, name)

    def is_ours(self, name: str) -> bool:
        """Whether `name` is a part file this layout writes (its shard's, of its format)."""
        match = _PART_NAME.match(name)
        return match is not None and name == self.name(int(match.group(1)))

    def expected(self, first: int, stop: int) -> int:
        """How many of the records [first, stop) this run answers (a shard: its own)."""
        if self.shard is None:
            return max(0, stop - first)
        start = first + (self.shard.index - first) % self.shard.count
        return len(range(start, stop, self.shard.count))

    def key(self) -> str:
        return json.dumps({"folder": self.folder, "records": self.records, "name": self.name(0)})


def _parts(count: int, noun: str = "part") -> str:
    """"1 part", "3 parts"."""
    return f"{count} {noun}{'s' if count != 1 else ''}"


def _some(names: list[str]) -> str:
    """The first few of `names`, for a message."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


class PartWriter:
    """The parts of one run's journal. `write_rows(rows, path, first, stop)` writes the journal rows (decoded, input
    order) of the records [first, stop) to one part's file atomically and returns the output rows it wrote; `say`
    gets what the user should read."""

    def __init__(self, journal: Journal, layout: PartLayout,
                 write_rows: Callable[[Iterable[dict], str, int, int], int],
                 say: Callable[[str], None], limit: int | None = None) -> None:
        self.journal = journal
        self.layout = layout
        self.write_rows = write_rows
        self.say = say
        self.limit = limit  # --limit: no part reaches past it
        self.parts: dict[int, PartEntry] = journal.parts()
        self.next = 0  # the lowest part not known to be written with its whole range
        self._last_count: tuple[int, int, int] | None = None  # a shard's (part's first record, rows, rows committed)

    # -- when the run opens ----------------------------------------------------------------------------------

    def open(self, restart: bool, rows_changed: bool) -> None:
        """Check the folder against the journal: a part size that changed is refused; parts of another format or
        shard layout forgotten; a part killed while it was written kept where its file is there; recorded parts
        whose files are gone (another folder, removed by hand) written again; the folder's part files the journal
        does not record removed (`restart`: all of them), or refused where the run has no rows yet (another run's).
        `rows_changed`: rows changed under the journal (a changed input, --retry-errors): `revalidate`."""
        journal, layout = self.journal, self.layout
        stored = journal.meta_value(_LAYOUT_KEY)
        before = json.loads(stored) if stored is not None else None
        if before is not None and self.parts:
            if before["records"] != layout.records:
                raise SpecError(f"--rows-per-file {layout.records}: the {len(self.parts)} parts this run wrote so far "
                                f"hold {before['records']} records each; resume with --rows-per-file "
                                f"{before['records']}, or pass --restart to write every part again")
            if before["name"] != layout.name(0):
                self.say(f"the parts so far were written as {before['name']}, ...: every part is written again as "
                         f"{layout.name(0)}, ...")
                self._forget(list(self.parts), remove_files=False)
        journal.set_meta_value(_LAYOUT_KEY, layout.key())
        if not is_remote(layout.folder):
            left = sorted(set(remove_leftovers(layout.folder, layout.is_ours)))
            if left:
                self.say(f"removed the temporary files of {_parts(len(left))} "
                         f"({_some(left)}) that an interrupted write left in {layout.folder}/")
        on_disk = {name for name in self._names() if layout.is_ours(name)}
        if restart and on_disk:
            for name in sorted(on_disk):
                self._remove(name)
            self.say(f"--restart: removed the {_parts(len(on_disk), 'part file')} of the earlier run from "
                     f"{layout.folder}/")
            on_disk = set()
        if on_disk and not self.parts and not journal.num_committed():
            raise SpecError(f"-o {layout.folder}/: the folder holds part files this run did not write "
                            f"({_some(sorted(on_disk))}); remove them, choose another folder, or pass --restart to "
                            "replace them")
        gone = []
        for part, entry in sorted(self.parts.items()):
            if entry.state == "writing" and entry.name in on_disk:  # killed after its file appeared: kept
                self._record(part, entry.first, entry.stop, "written", entry.rows or self._count_rows(entry))
            elif entry.name not in on_disk:
                if entry.state == "written":
                    gone.append(entry.name)
                self._forget([part], remove_files=False)
        if gone:
            self.say(f"{_parts(len(gone))} written earlier {'is' if len(gone) == 1 else 'are'} not in "
                     f"{layout.folder}/ ({_some(gone)}): written again")
        stray = sorted(on_disk - {entry.name for entry in self.parts.values()})
        for name in stray:
            self._remove(name)
        if stray:
            self.say(f"removed {_parts(len(stray), 'part file')} from {layout.folder}/ that this run's journal "
                     f"does not record ({_some(stray)})")
        if rows_changed:
            self.revalidate()

    def revalidate(self) -> None:
        """Remove the parts whose rows in the journal are no longer the rows they were written from."""
        stale = [part for part, entry in sorted(self.parts.items())
                 if entry.state != "written" or self._digest(entry.first, entry.stop) != entry.digest]
        if stale:
            names = [self.parts[p].name for p in stale]
            self._forget(stale, remove_files=True)
            self.say(f"{_parts(len(stale))} held rows that changed ({_some(names)}): removed, and written again when "
                     "their records have rows")

    # -- while it runs, and at its end -----------------------------------------------------------------------

    def write_ready(self) -> None:
        """Write every whole part whose records all have rows (called after each commit)."""
        size = self.layout.records
        while True:
            part = self.next
            first, stop = part * size, (part + 1) * size
            if self.limit is not None and stop > self.limit:
                return
            if not self._written_as(part, first, stop):
                if not self._complete(first, stop):
                    return
                self._write(part, first, stop)
            self.next += 1

    def _complete(self, first: int, stop: int) -> bool:
        """Whether every record of [first, stop) this run answers has its row: the journal's contiguous prefix says
        so at no cost; a shard's records are counted, only once enough rows were committed since the last count."""
        journal = self.journal
        if self.layout.shard is None:
            return journal.contiguous_prefix() >= stop
        expected, committed = self.layout.expected(first, stop), journal.num_committed()
        last = self._last_count
        if last is not None and last[0] == first and committed - last[2] < expected - last[1]:
            return False
        found = journal.count_between(first, stop)
        self._last_count = (first, found, committed)
        return found == expected

    def finish(self, total: int) -> tuple[int, int]:
        """Write every part left, the last one holding the records up to `total` (the input's, after --limit), and
        remove any beyond it (an input that shrank); (the parts, the output rows they hold)."""
        size = self.layout.records
        count = max(1, -(-total // size))
        for part in range(self.next, count):
            first, stop = part * size, min((part + 1) * size, total)
            if not self._written_as(part, first, stop):
                found, expected = self.journal.count_between(first, stop), self.layout.expected(first, stop)
                if found != expected:
                    raise JournalCorrupt(self.journal.path, f"it holds {found} rows of records {first} to {stop - 1}, "
                                                            f"where {expected} were expected")
                self._write(part, first, stop)
        beyond = [part for part in self.parts if part >= count]
        if beyond:
            self._forget(beyond, remove_files=True)
        return count, sum(entry.rows for entry in self.parts.values())

    # -- one part ----------------------------------------------------------------------------------------------

    def _written_as(self, part: int, first: int, stop: int) -> bool:
        entry = self.parts.get(part)
        return entry is not None and entry.state == "written" and (entry.first, entry.stop) == (first, stop)

    def _write(self, part: int, first: int, stop: int) -> None:
        """Write one part's file from the journal's rows, recorded "writing" before and "written" after. A file the
        part had (written for fewer records: an input that grew) is removed first, so that a "writing" part whose
        file is there on resume is always the new one."""
        if part in self.parts:
            self._remove(self.parts[part].name)
        self._record(part, first, stop, "writing", 0)
        digest = hashlib.sha256()

        def rows() -> Iterator[dict]:
            for _, text in self.journal.row_texts_between(first, stop):
                digest.update(text.encode())
                yield json.loads(text)

        written = self.write_rows(rows(), self.layout.path_of(self.layout.name(part)), first, stop)
        self._record(part, first, stop, "written", written, digest.hexdigest())

    def _record(self, part: int, first: int, stop: int, state: str, rows: int, digest: str | None = None) -> None:
        entry = PartEntry(first, stop, self.layout.name(part), state, rows,
                          digest if digest is not None else self._digest(first, stop) if state == "written" else "")
        self.journal.record_part(part, entry)
        self.parts[part] = entry

    def _forget(self, parts: list[int], remove_files: bool) -> None:
        for part in parts:
            entry = self.parts.pop(part)
            if remove_files:
                self._remove(entry.name)
        self.journal.forget_parts(parts)
        self.next = min([self.next, *parts])

    def _digest(self, first: int, stop: int) -> str:
        digest = hashlib.sha256()
        for _, text in self.journal.row_texts_between(first, stop):
            digest.update(text.encode())
        return digest.hexdigest()

    def _count_rows(self, entry: PartEntry) -> int:
        """The output rows of a part whose file a killed process left (read from its file)."""
        with open_binary(self.layout.path_of(entry.name)) as f:
            if self.layout.extension == "parquet":
                import pyarrow.parquet as pq

                return pq.ParquetFile(f).metadata.num_rows
            return sum(1 for _ in f)

    # -- the folder ------------------------------------------------------------------------------------------

    def _names(self) -> list[str]:
        folder = self.layout.folder
        if is_remote(folder):
            return list_names(folder)
        try:
            return os.listdir(folder)
        except FileNotFoundError:
            return []

    def _remove(self, name: str) -> None:
        path = self.layout.path_of(name)
        if is_remote(path):
            remove(path)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
