"""Part-file output (`-o folder/`, `--rows-per-file N`): the rows of every N consecutive records in a file of their
own, `part-00000.parquet`, `part-00001.parquet`, ..., in input order, each written as soon as all its records have
rows, so that the folder reads as one table (the rows so far) while the run goes on.

A part's life is in the journal (`Journal.parts`): recorded "writing" just before its file is written (a temporary
file renamed onto it, or one upload to a store), "written" once it is there, with the digest of the journal rows
it was written from. A process killed between the two finds the file there on resume and keeps it; one killed
before the rename writes it again (and the temporary file it left is removed); a part recorded written is never
written again. Only rows that changed under a written part (an input that changed, --retry-errors: `revalidate`)
remove its file at once, to be written again when its records all have rows. A shard writes the parts of its own
records (`part-00003-shard-1-of-4.parquet`: records 3N to 4N - 1 of shard 1), so shards never share a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from conveyor.io.counts import counted
from conveyor.io.errors import JournalCorrupt, RunDirError, SpecError
from conveyor.io.records.readers.record import open_binary
from conveyor.io.state.atomic import atomic_write_text, create_text, make_temp, remove_leftovers
from conveyor.io.state.journal import Journal, PartEntry
from conveyor.io.state.shards import Shard
from conveyor.io.storage import info, is_remote, join, list_names, put, remove

_PART_NAME = re.compile(r"^part-(\d{5,})(-shard-\d+-of-\d+)?\.(parquet|jsonl)$")
_LAYOUT_KEY = "parts_layout"  # the journal's record of the folder, part size and names its parts were written with
# The folder's owner: {"run_id", "run_dir"} of the run whose parts it holds (a leading "_": readers of a Parquet
# dataset skip it). Each Parquet part also carries the run's id in its footer, under RUN_ID_KEY.
MARKER = "_conveyor_run.json"
RUN_ID_KEY = "conveyor.run_id"
# Set in the journal before rows are changed under its parts (a rebase, --retry-errors) and cleared once they are
# checked (`revalidate`): a process killed between the two leaves it, and the next checks them.
STALE_KEY = "parts_stale"


@dataclass(frozen=True)
class PartOwner:
    """The run that writes a part folder: its id (io/state/run_id.py) and its (base) run directory, for messages."""

    run_id: str
    run_dir: str


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


def _some(names: list[str]) -> str:
    """The first few of `names`, for a message."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


class PartWriter:
    """The parts of one run's journal. `write_rows(rows, path, first, stop)` writes the journal rows (decoded, input
    order) of the records [first, stop) to one part's file atomically and returns the output rows it wrote; `say`
    gets what the user should read."""

    def __init__(self, journal: Journal, layout: PartLayout, owner: PartOwner,
                 write_rows: Callable[[Iterable[dict], str, int, int], int],
                 say: Callable[[str], None], limit: int | None = None) -> None:
        self.journal = journal
        self.layout = layout
        self.owner = owner
        self.written_now: set[int] = set()  # the parts this process wrote
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
        claim = self._claim(restart)
        stored = journal.meta_value(_LAYOUT_KEY)
        before = json.loads(stored) if stored is not None else None
        if before is not None and self.parts:
            if before["records"] != layout.records:
                raise SpecError(f"--rows-per-file {layout.records}: the {counted(len(self.parts), 'part')} this "
                                f"run wrote so far hold {before['records']} records each; resume with --rows-per-file "
                                f"{before['records']}, or pass --restart to write every part again")
            if before["name"] != layout.name(0):
                self.say(f"the parts so far were written as {before['name']}, ...: every part is written again as "
                         f"{layout.name(0)}, ...")
                self._forget(list(self.parts), remove_files=False)
        journal.set_meta_value(_LAYOUT_KEY, layout.key())
        if not is_remote(layout.folder):
            left = sorted(set(remove_leftovers(layout.folder, layout.is_ours)))
            if left:
                self.say(f"removed the temporary files of {counted(len(left), 'part')} "
                         f"({_some(left)}) that an interrupted write left in {layout.folder}/")
        on_disk = {name for name in self._names() if layout.is_ours(name)}
        if restart and on_disk:
            for name in sorted(on_disk):
                self._remove(name)
            self.say(f"--restart: removed the {counted(len(on_disk), 'part file')} of the earlier run from "
                     f"{layout.folder}/")
            on_disk = set()
        if on_disk and not self.parts and not journal.num_committed() and claim is not None:  # (no marker of ours)
            raise SpecError(f"-o {layout.folder}/: the folder holds part files this run did not write "
                            f"({_some(sorted(on_disk))}); remove them, choose another folder, or pass --restart to "
                            "replace them")
        gone = []
        for part, entry in sorted(self.parts.items()):
            if entry.state == "writing" and entry.name in on_disk:  # killed after its file appeared: kept where its
                # rows are still the journal's (the digest recorded with "writing"), else written again
                if entry.digest and entry.digest == self._digest(entry.first, entry.stop):
                    self._record(part, entry.first, entry.stop, "written", entry.rows or self._count_rows(entry),
                                 entry.digest)
                else:
                    self._forget([part], remove_files=True)
                    on_disk.discard(entry.name)
            elif entry.name not in on_disk:
                if entry.state == "written":
                    gone.append(entry.name)
                self._forget([part], remove_files=False)
        if gone:
            self.say(f"{counted(len(gone), 'part')} written earlier {'is' if len(gone) == 1 else 'are'} not in "
                     f"{layout.folder}/ ({_some(gone)}): written again")
        stray = sorted(on_disk - {entry.name for entry in self.parts.values()})
        for name in stray:
            self._remove(name)
        if stray:
            self.say(f"removed {counted(len(stray), 'part file')} from {layout.folder}/ that this run's journal "
                     f"does not record ({_some(stray)})")
        if claim is not None:
            self._write_marker(replace=claim)
        if rows_changed or journal.meta_value(STALE_KEY) is not None:
            self.revalidate()
            journal.set_meta_value(STALE_KEY, None)

    def _claim(self, restart: bool) -> bool | None:
        """Whether the folder's MARKER is to be written (True: replacing another run's; None: it is this run's
        already), or SpecError where the folder is another run's: one whose run directory is still there is never
        replaced; one whose state is gone (this run directory made anew) only with --restart."""
        marker = self._marker()
        if marker is None:
            return False
        if marker.get("run_id") == self.owner.run_id:
            return None
        self._refuse(marker, restart)
        removed = sorted(name for name in self._names() if _PART_NAME.match(name))
        for name in removed:
            self._remove(name)
        self.say(f"--restart: removed the {counted(len(removed), 'part file')} of an earlier run whose state is "
                 f"gone from {self.layout.folder}/")
        return True

    def _refuse(self, marker: dict, restart: bool) -> None:
        """SpecError for a folder another run owns (`marker`: its MARKER), unless --restart may replace it."""
        other = str(marker.get("run_dir"))
        alive = other != self.owner.run_dir and (is_remote(other) or os.path.exists(other))
        if alive or not restart:
            folder = self.layout.folder
            raise SpecError(f"-o {folder}/: the folder holds the parts of another run (run directory {other}, as "
                            f"{self.layout.path_of(MARKER)} says); give this run a folder of its own" +
                            (f", or delete that run's files from {folder}/ if you no longer need them" if alive else
                             ", or pass --restart to replace them"))

    def _marker(self) -> dict | None:
        path = self.layout.path_of(MARKER)
        if is_remote(path) and info(path) is None:
            return None
        try:
            with open_binary(path) as f:
                marker = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            marker = None
        return marker if isinstance(marker, dict) else {"run_id": None, "run_dir": "unknown (an unreadable marker)"}

    def _write_marker(self, replace: bool) -> None:
        """This run's MARKER in the folder: made only where there is none (a local folder: atomically, so that of two
        runs that start together one owns it and the other is refused), or replacing another's."""
        text = json.dumps({"run_id": self.owner.run_id, "run_dir": self.owner.run_dir}) + "\n"
        path = self.layout.path_of(MARKER)
        if replace and not is_remote(path):
            atomic_write_text(path, text)
        elif is_remote(path):  # (a store has no atomic create: the parts' footers tell the runs apart)
            fd, temp = make_temp(tempfile.gettempdir(), MARKER)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                put(temp, path)
            finally:
                os.remove(temp)
        elif not create_text(path, text):  # another process took it first: this run's (a shard of it), or refused
            marker = self._marker() or {}
            if marker.get("run_id") != self.owner.run_id:
                self._refuse(marker, restart=False)

    def revalidate(self) -> None:
        """Remove the parts whose rows in the journal are no longer the rows they were written from."""
        stale = [part for part, entry in sorted(self.parts.items())
                 if entry.state != "written" or self._digest(entry.first, entry.stop) != entry.digest]
        if stale:
            names = [self.parts[p].name for p in stale]
            self._forget(stale, remove_files=True)
            self.say(f"{counted(len(stale), 'part')} held rows that changed ({_some(names)}): removed, and written "
                     "again when their records have rows")

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
        for part in range(count):
            first, stop = part * size, min((part + 1) * size, total)
            if self._written_as(part, first, stop):
                entry = self.parts[part]
                problem = self._problem(entry.name, entry.rows)
                if problem is None:
                    continue
                self.say(f"{entry.name} in {self.layout.folder}/ is not the part this run wrote ({problem}): written "
                         "again")
            found, expected = self.journal.count_between(first, stop), self.layout.expected(first, stop)
            if found != expected:
                raise JournalCorrupt(self.journal.path, f"it holds {counted(found, 'row')} of records {first} to "
                                                        f"{stop - 1}, where {expected} were expected")
            self._write(part, first, stop)
        beyond = [part for part in self.parts if part >= count]
        if beyond:
            self._forget(beyond, remove_files=True)
        return count, sum(entry.rows for entry in self.parts.values())

    def written_here(self) -> tuple[int, int]:
        """(the parts this process wrote that the folder holds now, their output rows)."""
        mine = [entry for part, entry in self.parts.items() if part in self.written_now and entry.state == "written"]
        return len(mine), sum(entry.rows for entry in mine)

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
        digest = self._digest(first, stop)  # (what its file will hold: nothing commits while it is written)
        self._record(part, first, stop, "writing", 0, digest)
        rows = (json.loads(text) for _, text in self.journal.row_texts_between(first, stop))
        name = self.layout.name(part)
        written = self.write_rows(rows, self.layout.path_of(name), first, stop)
        problem = self._problem(name, written)
        if problem is not None:  # (never recorded written: the next run writes it again)
            raise RunDirError(f"{self.layout.path_of(name)}: {problem}, right after this run wrote it: another process "
                              f"writes in {self.layout.folder}/; give each run a folder of its own")
        self._record(part, first, stop, "written", written, digest)
        self.written_now.add(part)

    def _record(self, part: int, first: int, stop: int, state: str, rows: int, digest: str | None = None) -> None:
        entry = PartEntry(first, stop, self.layout.name(part), state, rows,
                          digest if digest is not None else self._digest(first, stop))
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

    def _problem(self, name: str, rows: int) -> str | None:
        """Why the part file `name` is not the one this run wrote with `rows` output rows (not there, another run's
        by its footer, other rows); None where it is."""
        path = self.layout.path_of(name)
        try:
            if is_remote(path) and info(path) is None:
                return "it is not there"
            with open_binary(path) as f:
                if self.layout.extension == "parquet":
                    import pyarrow.parquet as pq

                    meta = pq.ParquetFile(f).metadata
                    found, owner = meta.num_rows, (meta.metadata or {}).get(RUN_ID_KEY.encode())
                    if owner is not None and owner.decode(errors="replace") != self.owner.run_id:
                        return "another run wrote it"
                else:
                    found = sum(1 for _ in f)
        except FileNotFoundError:
            return "it is not there"
        except (OSError, ValueError) as e:  # (pyarrow's ArrowInvalid is a ValueError)
            return f"it cannot be read ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        return None if found == rows else f"it holds {found:,} rows, where this run wrote {rows:,}"

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
