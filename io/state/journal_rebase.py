"""A run's journal carried over to an input that changed: the rows of records that are still there, unchanged, are
kept (moved to their records' new positions), every other row is dropped, and the run computes only what is left.

A row is reused only where it is exactly what a fresh run would write for the record now:
- a record with its own id (its id field, or custom_id) keeps its row wherever it moved, when its digest (of the
  record as read) is the one the row was computed from and it is the first record with that id; its seed follows
  its id, so only the row's index and place change. An error row moves only where the record stayed at its place
  (the message names it).
- a record without one keeps its row only at the same index: its seed (and its id) follow its index.
- the error row of a duplicate id is never reused (it depends on the records around it).
Everything else in a row (the settings, the model, the kernels) is the run's: a change there is drift, refused
before this runs (run_dir.py). The records are streamed into a temporary table and matched in SQL, so memory stays
bounded whatever the input's size. Pure Python over sqlite3.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import NamedTuple

from conveyor.io.rows.rows import SAMPLES_KEY, WHERE_KEY
from conveyor.io.state.journal import Journal, recount

__all__ = ["Entry", "Reuse", "rebase", "refresh_kept_fields"]

_CHUNK = 10_000  # entries inserted per executemany
_PAGE = 4096  # rows read or rewritten per query
_REUSED_ERRORS = ("input", "run")  # the origins of the error rows that are reused (a duplicate's is worked out again)


class Entry(NamedTuple):
    """One input record as the rebase needs it: its index, its place ("line 12"), its digest, and a call that reads
    its own id (None where it has none). The id is read only where the record's row is not the one at its index:
    a record whose digest is its row's is the record that row was computed from, id and all (for JSONL, the line
    is then never parsed)."""

    index: int
    place: str
    digest: str
    read_id: Callable[[], str | None]


@dataclass
class Reuse:
    """What a rebase found: rows `reused`; records `new` (no row was ever computed for them) and `changed` (one was,
    for an earlier version of the record, or for the record at another index where it has no id); old rows
    `removed` (their records are gone); `moved_without_id`: records without an id found at another index, computed
    again because their seed follows their index."""

    reused: int = 0
    new: int = 0
    changed: int = 0
    removed: int = 0
    moved_without_id: int = 0

    def describe(self) -> str:
        return f"reused {self.reused}, new {self.new}, changed {self.changed}, removed {self.removed}"

    def to_json(self) -> dict:
        return asdict(self)


def rebase(journal: Journal, entries: Iterable[Entry], write: bool = True) -> Reuse | None:
    """Match the journal's rows to `entries` (the input as it is now, in index order) and, with `write`, keep only
    the reused rows, at their records' new indices, in one transaction. None where a committed row has no digest (a
    journal an earlier release wrote): its rows cannot be matched, and nothing is changed."""
    with journal.rewriting(write) as conn:
        if conn.execute("SELECT 1 FROM main.rows WHERE digest IS NULL LIMIT 1").fetchone() is not None:
            return None
        try:
            in_place = _stream(conn, entries)
            in_place -= _demote_duplicates(conn)
            _match_moved(conn)
            reuse = _count(conn, in_place)
            if write:
                _apply(conn, journal.contiguous_prefix())
        finally:
            for table in ("reuse", "first_ids", "incoming", "loose"):
                conn.execute(f"DROP TABLE IF EXISTS temp.{table}")
    return reuse


def _stream(conn: sqlite3.Connection, entries: Iterable[Entry]) -> int:
    """The entries against the rows at their indices, both streamed in index order: a row that is its record's as
    it is stays where it is (the common case: nothing of it is written); the other entries go to temp.incoming and
    the other rows' indices to temp.loose, matched in SQL after. Returns the rows that stay."""
    conn.execute("CREATE TEMP TABLE incoming (idx INTEGER PRIMARY KEY, place TEXT, digest TEXT NOT NULL, own_id TEXT)")
    conn.execute("CREATE TEMP TABLE loose (idx INTEGER PRIMARY KEY, digest TEXT, id TEXT)")
    old = _old_rows(conn)
    current = next(old, None)
    in_place = 0
    incoming: list[tuple] = []
    loose: list[tuple] = []
    for entry in entries:
        while current is not None and current[0] < entry.index:
            loose.append((current[0], current[2], current[1]))
            current = next(old, None)
        index, place, digest, read_id = entry
        if current is not None and current[0] == index:
            # the row (idx, id, digest, status, origin, place) at the entry's index is its row as it is
            if current[2] == digest and current[5] == place and (current[3] == "ok" or current[4] in _REUSED_ERRORS):
                in_place += 1
                current = next(old, None)
                continue
            loose.append((current[0], current[2], current[1]))
            current = next(old, None)
        incoming.append((index, place, digest, read_id()))
        if len(incoming) >= _CHUNK or len(loose) >= _CHUNK:
            _flush(conn, incoming, loose)
    while current is not None:
        loose.append((current[0], current[2], current[1]))
        current = next(old, None)
    _flush(conn, incoming, loose)
    return in_place


def _old_rows(conn: sqlite3.Connection) -> Iterator[tuple]:
    """(idx, id, digest, status, origin, place) of every row, in index order, page by page."""
    last = -1
    while True:
        page = conn.execute("SELECT idx, id, digest, status, origin, place FROM main.rows WHERE idx > ? ORDER BY idx"
                            " LIMIT ?", (last, _PAGE)).fetchall()
        yield from page
        if len(page) < _PAGE:
            return
        last = page[-1][0]


def _flush(conn: sqlite3.Connection, incoming: list[tuple], loose: list[tuple]) -> None:
    conn.executemany("INSERT INTO temp.incoming VALUES (?, ?, ?, ?)", incoming)
    conn.executemany("INSERT INTO temp.loose VALUES (?, ?, ?)", loose)
    incoming.clear()
    loose.clear()


def _demote_duplicates(conn: sqlite3.Connection) -> int:
    """A row kept in place whose id a record ahead of it (one left to match) now has first: its record is a
    duplicate now, to work out again. Returns how many."""
    found = conn.execute(
        "SELECT DISTINCT d.idx FROM temp.incoming j JOIN main.ids d ON d.id = j.own_id WHERE d.idx > j.idx"
        " AND NOT EXISTS (SELECT 1 FROM temp.loose l WHERE l.idx = d.idx)"
        " AND EXISTS (SELECT 1 FROM main.rows r WHERE r.idx = d.idx AND r.id = j.own_id)").fetchall()
    if found:
        conn.executemany("INSERT INTO temp.loose SELECT idx, digest, id FROM main.rows WHERE idx = ?", found)
        conn.executemany("INSERT INTO temp.incoming SELECT idx, place, digest, id FROM main.rows WHERE idx = ?", found)
    return len(found)


def _match_moved(conn: sqlite3.Connection) -> None:
    """temp.reuse: (new index, old index) of the rows that follow their records elsewhere (or to another place)."""
    conn.execute("CREATE INDEX temp.incoming_digest ON incoming(digest)")
    conn.execute("CREATE INDEX temp.loose_digest ON loose(digest)")
    conn.execute("CREATE TEMP TABLE first_ids (own_id TEXT PRIMARY KEY, idx INTEGER NOT NULL)")
    conn.execute("INSERT INTO temp.first_ids SELECT own_id, MIN(idx) FROM temp.incoming WHERE own_id IS NOT NULL"
                 " GROUP BY own_id")
    conn.execute("CREATE TEMP TABLE reuse (new_idx INTEGER PRIMARY KEY, old_idx INTEGER NOT NULL UNIQUE, place TEXT,"
                 " own_id TEXT)")
    # Records with an id: the row its id points to (ids holds each id's first index), wherever it is, unless a row
    # kept in place ahead of it has the id (then it is a duplicate).
    conn.execute(
        "INSERT INTO temp.reuse SELECT i.idx, r.idx, i.place, i.own_id FROM temp.first_ids f"
        " JOIN temp.incoming i ON i.idx = f.idx JOIN main.ids d ON d.id = f.own_id"
        " JOIN temp.loose l ON l.idx = d.idx JOIN main.rows r ON r.idx = d.idx"
        " WHERE r.digest = i.digest AND r.id = i.own_id AND (r.status = 'ok' OR (r.origin IN ('input', 'run')"
        " AND r.idx = i.idx AND r.place IS i.place))")
    # Records without one: the row at the same index (whose place changed: a blank line ahead of it).
    conn.execute(
        "INSERT OR IGNORE INTO temp.reuse SELECT i.idx, r.idx, i.place, NULL FROM temp.incoming i"
        " JOIN temp.loose l ON l.idx = i.idx JOIN main.rows r ON r.idx = i.idx WHERE i.own_id IS NULL"
        " AND r.digest = i.digest AND r.status = 'ok'")


def _count(conn: sqlite3.Connection, in_place: int) -> Reuse:
    (old,) = conn.execute("SELECT value FROM main.meta WHERE key = 'num_committed'").fetchone()
    (incoming,) = conn.execute("SELECT COUNT(*) FROM temp.incoming").fetchone()
    (moved,) = conn.execute("SELECT COUNT(*) FROM temp.reuse").fetchone()
    left = "NOT EXISTS (SELECT 1 FROM temp.reuse u WHERE u.new_idx = i.idx)"  # record i is to compute
    gone = "NOT EXISTS (SELECT 1 FROM temp.reuse u WHERE u.old_idx = r.idx)"  # loose row r is not reused
    without_id = "r.id = CAST(r.idx AS TEXT)"  # loose row r answered a record without an id (its id is its index)
    elsewhere = (f"EXISTS (SELECT 1 FROM temp.loose r WHERE r.digest = i.digest AND {without_id} AND r.idx != i.idx"
                 f" AND {gone})")
    # Changed: a record to compute whose earlier version had a row: the row its id points to; without an id, the
    # row of the same record at another index (it moved), or the row at its index of a record that is gone.
    (changed_id,) = conn.execute(
        f"SELECT COUNT(*) FROM temp.incoming i JOIN main.ids d ON d.id = i.own_id WHERE {left}").fetchone()
    (moved_without_id,) = conn.execute(
        f"SELECT COUNT(*) FROM temp.incoming i WHERE i.own_id IS NULL AND {left} AND {elsewhere}").fetchone()
    (edited_in_place,) = conn.execute(
        f"SELECT COUNT(*) FROM temp.incoming i JOIN temp.loose r ON r.idx = i.idx WHERE i.own_id IS NULL AND {left}"
        f" AND NOT {elsewhere} AND {gone} AND {without_id} AND NOT EXISTS (SELECT 1 FROM temp.incoming j"
        " WHERE j.digest = r.digest)").fetchone()
    changed = changed_id + moved_without_id + edited_in_place
    reused = in_place + moved
    return Reuse(reused=reused, new=incoming - moved - changed, changed=changed,
                 removed=max(0, int(old) - reused - changed), moved_without_id=moved_without_id)


def _apply(conn: sqlite3.Connection, prefix: int) -> None:
    """Drop the loose rows not reused, move the reused ones to their new indices (their row's index and place
    rewritten), move their id claims with them (and drop the claims of rows never committed: their indices are
    the old input's, as are the partials'), recount."""
    dropped = conn.execute("DELETE FROM main.rows WHERE idx IN (SELECT idx FROM temp.loose) AND idx NOT IN"
                           " (SELECT old_idx FROM temp.reuse)").rowcount
    moved = 0
    last = -1
    while True:
        page = conn.execute(
            "SELECT u.old_idx, u.new_idx, u.place, r.row FROM temp.reuse u JOIN main.rows r ON r.idx = u.old_idx"
            " WHERE u.old_idx > ? ORDER BY u.old_idx LIMIT ?", (last, _PAGE)).fetchall()
        # (a moved row goes to -1 - its new index first: no two rows ever hold one index mid-way)
        conn.executemany("UPDATE main.rows SET idx = ?, row = ?, place = ? WHERE idx = ?",
                         [(-1 - new, _moved(text, new, place), place, old) for old, new, place, text in page])
        moved += len(page)
        if len(page) < _PAGE:
            break
        last = page[-1][0]
    if moved:
        conn.execute("UPDATE main.rows SET idx = -1 - idx WHERE idx < 0")
    conn.execute("DELETE FROM main.ids WHERE idx IN (SELECT idx FROM temp.loose) OR (idx >= ? AND NOT EXISTS"
                 " (SELECT 1 FROM main.rows r WHERE r.idx = ids.idx))", (prefix,))
    conn.execute("INSERT OR REPLACE INTO main.ids(id, idx) SELECT own_id, new_idx FROM temp.reuse"
                 " WHERE own_id IS NOT NULL")
    conn.execute("DELETE FROM main.partials")
    if dropped or moved:
        recount(conn)


def refresh_kept_fields(journal: Journal, kept: Iterable[tuple[int, dict]], old_names: tuple[str, ...]) -> None:
    """--keep-fields changed: every row's kept fields (`old_names`) replaced by its record's now (`kept`: (index,
    fields) in index order, as the input gives them), in its samples too; one transaction."""
    fields = iter(kept)
    with journal.rewriting() as conn:
        last = -1
        while True:
            page = conn.execute("SELECT idx, row FROM main.rows WHERE idx > ? ORDER BY idx LIMIT ?",
                                (last, _PAGE)).fetchall()
            updates = []
            for index, text in page:
                found = next(fields, None)
                while found is not None and found[0] < index:
                    found = next(fields, None)
                if found is None or found[0] != index:
                    raise ValueError(f"journal row {index} has no record in the input to read its kept fields from")
                row = json.loads(text)
                for part in [row, *row.get(SAMPLES_KEY, ())]:
                    for name in old_names:
                        part.pop(name, None)
                    part.update(found[1])
                updates.append((json.dumps(row, ensure_ascii=False), index))
            conn.executemany("UPDATE main.rows SET row = ? WHERE idx = ?", updates)
            if len(page) < _PAGE:
                break
            last = page[-1][0]
        recount(conn)


def _moved(text: str, index: int, place: str | None) -> str:
    """A row's JSON with its record's new index and place (in each of its samples too)."""
    row = json.loads(text)
    for part in [row, *row.get(SAMPLES_KEY, ())]:
        part["index"] = index
        if WHERE_KEY in part:
            part[WHERE_KEY] = place
    return json.dumps(row, ensure_ascii=False)
