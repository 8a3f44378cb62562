"""Durable journal of committed result rows: what makes a run exactly-once and resumable.

Storage: one embedded SQLite database (`journal.sqlite` in the run directory) in WAL mode with
`synchronous=FULL`. A commit is one SQLite transaction, so a process killed mid-commit (kill -9,
the main case) leaves either all of the batch or none of it, and SQLite rolls a torn WAL tail back
on the next open; FULL fsyncs the WAL on every commit, so a commit that returned also survives a
power loss (NORMAL would survive kill -9 but may lose the last commits on power loss; commits come
once per checkpoint interval, so the extra fsync costs nothing that matters). The B-tree keeps
lookups O(log n) and memory flat at 10 million rows: no id or index set is ever held in Python
beyond the rows buffered since the last commit. Rows are written once; the one exception is a run over an input
that changed, which moves and drops rows in one transaction (`rewriting`, journal_rebase.py) before it adds any.
Imports neither torch nor `conveyor.core`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import sqlite3
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from conveyor.io.errors import JournalCorrupt
from conveyor.io.rows.rows import SAMPLES_KEY


@dataclasses.dataclass(frozen=True)
class PartEntry:
    """A part of a part-file output as the journal records it (io/rows/parts.py)."""

    first: int  # its records: [first, stop)
    stop: int
    name: str  # its file's name in the output folder
    state: str  # "writing": its file may or may not be there yet; "written": it is
    rows: int = 0  # the output rows in it
    digest: str = ""  # of the journal rows it was written from


_SCHEMA_VERSION = 4  # 2: rows.digest; 3: partials; 4: rows.origin and rows.place, the match index
_PAGE = 4096  # rows fetched per query when streaming

# What a rerun over a changed input reads of every row (journal_rebase.py), in index order, without the rows' JSON.
_MATCH_INDEX = "CREATE INDEX IF NOT EXISTS rows_match ON rows(idx, digest, id, status, origin, place)"

_SCHEMA = [
    # idx is the input position and the B-tree key; row is the output row dict as JSON; digest a hash
    # of the input record as read (NULL in rows an earlier release wrote for a fingerprinted file); origin, for an
    # error row, what made it ("input": the record; "duplicate": its id; "run": the run, such as a step failure);
    # place where the record was read ("line 12"). A run over an input that changed matches rows to records by
    # these (journal_rebase.py).
    "CREATE TABLE IF NOT EXISTS rows (idx INTEGER PRIMARY KEY, id TEXT NOT NULL, status TEXT NOT NULL,"
    " row TEXT NOT NULL, digest TEXT, origin TEXT, place TEXT)",
    # The first index of each id: a table rather than UNIQUE(rows.id), because the error row of a
    # duplicate carries the same id, and an id is claimed when its record is read, before its row
    # exists. Its primary key is the unique index that makes id look-ups O(log n).
    "CREATE TABLE IF NOT EXISTS ids (id TEXT PRIMARY KEY, idx INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    # A record still generating when the run committed: the tokens it had generated (and their logprobs, where
    # asked for), so a resumed run continues it instead of starting it over. Gone once its row is committed.
    "CREATE TABLE IF NOT EXISTS partials (idx INTEGER PRIMARY KEY, num_tokens INTEGER NOT NULL, state TEXT NOT NULL)",
    # Part-file output (io/rows/parts.py): each part's records [first, stop), its file's name, "writing" from just
    # before its file is written to once it is there, then "written" with the digest of the rows it holds.
    "CREATE TABLE IF NOT EXISTS parts (part INTEGER PRIMARY KEY, first INTEGER NOT NULL, stop INTEGER NOT NULL,"
    " name TEXT NOT NULL, state TEXT NOT NULL, rows INTEGER NOT NULL, digest TEXT NOT NULL)",
]

# SQLite primary result codes (sqlite3.h); the extended code's low byte is the primary one.
_SQLITE_IOERR, _SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_CANTOPEN, _SQLITE_NOTADB = 10, 11, 13, 14, 26
_SQLITE_READONLY = 8


class Journal:
    """Committed result rows keyed by input index, plus the first index claimed by each id.

    Invariants: a committed index is never written again; `contiguous_prefix` indices
    [0, prefix) are all committed; the counters in `meta` are updated in the same transaction as
    the rows they count. Rows and id claims are buffered in memory until `commit()`. Not
    thread-safe: callers serialize access (the connection may be used from any one thread).
    """

    def __init__(self, path: str | Path, *, read_only: bool = False, verify: bool = True):
        # verify=True runs PRAGMA quick_check, a full O(size) read; `conveyor status` passes False.
        self.path = Path(path)
        self._read_only = read_only
        # index -> (id, status, json, digest, origin, place)
        self._pending_rows: dict[int, tuple[str, str, str, str | None, str | None, str | None]] = {}
        self._pending_ids: dict[str, int] = {}  # id -> first index, not yet in `ids`
        self._pending_errors = 0
        self._pending_columns: set[str] = set()  # row keys first seen since the last commit
        self._pending_partials: dict[int, tuple[int, str]] = {}  # index -> (tokens, state JSON), for the next commit
        self._pending_samples = 0  # output rows of the pending rows (a record with n > 1 has n)
        with self._guard():
            self._conn = self._connect()
            try:
                if verify:
                    problems = [r[0] for r in self._conn.execute("PRAGMA quick_check(5)")]
                    if problems != ["ok"]:
                        raise JournalCorrupt(self.path, "; ".join(problems))
                self._load_counters()
            except BaseException:
                self._conn.close()
                raise

    def _load_counters(self) -> None:
        self._num_committed = self._meta_int("num_committed", "SELECT COUNT(*) FROM rows")
        self._num_errors = self._meta_int("num_errors", "SELECT COUNT(*) FROM rows WHERE status = 'error'")
        self._prefix = self._meta_int("contiguous_prefix", None)
        samples = self._meta("num_samples")  # (absent in a journal of an earlier release that had no record with n > 1)
        self._num_samples = int(samples) if samples is not None else self._num_committed
        last = self._meta("last_commit_time")
        self._last_commit_time = float(last) if last is not None else None
        self._columns: set[str] = set(json.loads(self._meta("columns") or "[]"))

    @contextlib.contextmanager
    def rewriting(self, write: bool = True) -> Iterator[sqlite3.Connection]:
        """One transaction over the committed rows for a caller that moves or drops them (journal_rebase.py): the
        connection, inside BEGIN IMMEDIATE, committed on return (with write=False: rolled back, a dry run that
        only counts); the counters are read again afterwards. The caller calls `recount` after changing rows.
        Nothing may be pending."""
        if self._pending_rows or self._pending_ids or self._pending_partials:
            raise RuntimeError("Journal.rewriting: rows are pending; commit() first")
        with self._guard():
            self._conn.execute("BEGIN IMMEDIATE" if write and not self._read_only else "BEGIN")
            try:
                yield self._conn
                self._conn.execute("COMMIT" if write and not self._read_only else "ROLLBACK")
            except BaseException:
                self._rollback()
                raise
            finally:
                self._load_counters()

    def forget_run_errors(self) -> int:
        """--retry-errors: delete the error rows the run itself made (origin "run": a step failure, a grammar over
        its budget, a fault), so their records are computed again; the rows of bad input stay. Returns how many."""
        with self.rewriting() as conn:
            found = conn.execute("DELETE FROM rows WHERE status = 'error' AND origin = 'run'").rowcount
            if found:
                recount(conn)
        return found

    def _connect(self) -> sqlite3.Connection:
        if self._read_only:
            uri = f"file:{self.path.resolve()}?mode=ro"
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
            try:
                conn.execute("SELECT COUNT(*) FROM meta").fetchone()  # fails early if not a journal
            except sqlite3.OperationalError as e:
                conn.close()
                if "no such table" in str(e):
                    raise JournalCorrupt(self.path, "it holds no journal: an empty or foreign file") from None
                raise
            return conn
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA:
                conn.execute(statement)
            version = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if version is None:
                conn.executemany(
                    "INSERT INTO meta(key, value) VALUES (?, ?)",
                    [("schema_version", str(_SCHEMA_VERSION)), ("num_committed", "0"),
                     ("num_errors", "0"), ("contiguous_prefix", "0")],
                )
            elif int(version[0]) in (1, 2, 3):  # an earlier release's journal: what it lacks is added (the
                have = {r[1] for r in conn.execute("PRAGMA table_info(rows)").fetchall()}  # partials table by
                for column in ("digest", "origin", "place"):  # _SCHEMA above; version 1 also lacked the digests)
                    if column not in have:
                        conn.execute(f"ALTER TABLE rows ADD COLUMN {column} TEXT")
                conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(_SCHEMA_VERSION),))
            elif int(version[0]) != _SCHEMA_VERSION:
                raise JournalCorrupt(self.path, f"unknown schema version {version[0]}")
            conn.execute(_MATCH_INDEX)
            conn.execute("COMMIT")
        except BaseException:
            conn.close()
            raise
        return conn

    def _meta(self, key: str) -> str | None:
        found = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return found[0] if found else None

    def _meta_int(self, key: str, fallback_sql: str | None) -> int:
        value = self._meta(key)
        if value is not None:
            return int(value)
        if fallback_sql is None:
            return 0
        return int(self._conn.execute(fallback_sql).fetchone()[0])

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """SQLite errors -> JournalCorrupt or OSError (disk full -> ENOSPC), naming the file."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            translated = _translate(exc, self.path)
            if translated is exc:
                raise
            raise translated from exc

    @property
    def pending(self) -> int:
        return len(self._pending_rows)

    def add(self, row: dict, digest: str | None = None, origin: str | None = None, place: str | None = None,
            claim_id: bool = True) -> None:
        """Buffer one finished row (at least "index", "id", "status"), with the digest of the input record it
        answers where there is one, what made it where it is an error row ("input", "duplicate" or "run") and
        where its record was read ("line 12"); durable after commit(). `claim_id`: the row's id is its record's own,
        claimed for its index (as `claim_id` does); False where the id is the record's index (it has none, or it
        could not be read), which no other record's id is checked against."""
        index, record_id, status = row["index"], row["id"], row["status"]
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"row index must be a non-negative int, got {index!r}")
        if not isinstance(record_id, str) or not isinstance(status, str):
            raise ValueError(f"row {index}: id and status must be strings")
        # Committed rows beyond the prefix are caught by the primary key at commit(): a look-up
        # here would cost a third of add()'s time.
        if index in self._pending_rows or index < self._prefix:
            raise ValueError(f"row {index} is already in the journal; a row is written once")
        self._pending_rows[index] = (record_id, status, json.dumps(row, ensure_ascii=False), digest, origin, place)
        if claim_id:
            self._pending_ids.setdefault(record_id, index)
        self._pending_errors += status == "error"
        samples = row.get(SAMPLES_KEY)
        self._pending_samples += 1 if samples is None else len(samples)
        for keys in [row.keys()] if samples is None else [row.keys(), *(s.keys() for s in samples)]:
            if not keys <= self._columns:
                self._pending_columns.update(keys - self._columns)

    def claim_id(self, record_id: str, index: int) -> bool:
        """Record `index` as the first occurrence of `record_id`, when the record is read.

        False when another index holds the id (the caller makes this record a duplicate-id error
        row). Idempotent for the same index, so after a kill the records re-read from the
        committed prefix claim their ids again. Claims are persisted by the next commit(), rows or
        not; a claim whose row was never committed is re-made by the same index on resume.
        """
        holder = self._id_holder(record_id)
        if holder is None:
            holder = self._pending_ids.setdefault(record_id, index)
        return holder == index

    def _id_holder(self, record_id: str) -> int | None:
        # The database wins over the pending dict: its claims are older. (Inline try: this runs
        # once per record, and a context manager would double its cost.)
        try:
            found = self._conn.execute("SELECT idx FROM ids WHERE id = ?", (record_id,)).fetchone()
        except sqlite3.DatabaseError as exc:
            translated = _translate(exc, self.path)
            if translated is exc:
                raise
            raise translated from exc
        return found[0] if found else None

    def set_partials(self, partials: dict[int, dict]) -> None:
        """Buffer the states of records still generating (index -> {"tokens": [...], "logprobs": [...] or None}),
        written by the next commit() with its rows; a record's partial goes when its row is committed."""
        self._pending_partials = {index: (_partial_tokens(state), json.dumps(state))
                                  for index, state in partials.items()}

    def partials(self) -> dict[int, dict]:
        """The committed partials (index -> state): what a resumed run continues. Bounded by what was in flight."""
        with self._guard():
            try:
                found = self._conn.execute("SELECT idx, state FROM partials").fetchall()
            except sqlite3.OperationalError as e:  # a journal of an earlier release, opened read-only
                if "no such table" in str(e):
                    return {}
                raise
        return {index: json.loads(state) for index, state in found}

    def partial_tokens(self) -> tuple[int, int]:
        """(records held as partials, the tokens they hold)."""
        with self._guard():
            try:
                count, tokens = self._conn.execute("SELECT COUNT(*), SUM(num_tokens) FROM partials").fetchone()
            except sqlite3.OperationalError as e:
                if "no such table" in str(e):
                    return 0, 0
                raise
        return count, tokens or 0

    def parts(self) -> dict[int, PartEntry]:
        """The parts of a part-file output the journal records (part number -> entry), none for a journal of an
        earlier release."""
        with self._guard():
            try:
                found = self._conn.execute("SELECT part, first, stop, name, state, rows, digest FROM parts").fetchall()
            except sqlite3.OperationalError as e:
                if "no such table" in str(e):
                    return {}
                raise
        return {row[0]: PartEntry(*row[1:]) for row in found}

    def record_part(self, part: int, entry: PartEntry) -> None:
        """Record `part` as `entry`, durable on return (its own transaction; buffered rows stay buffered)."""
        with self._guard():
            self._conn.execute("INSERT OR REPLACE INTO parts(part, first, stop, name, state, rows, digest) VALUES "
                               "(?, ?, ?, ?, ?, ?, ?)", (part, *dataclasses.astuple(entry)))

    def forget_parts(self, parts: Iterable[int]) -> None:
        """Record the `parts` as never written."""
        with self._guard():
            self._conn.executemany("DELETE FROM parts WHERE part = ?", ((p,) for p in parts))

    def meta_value(self, key: str) -> str | None:
        """A value kept under `key` (`set_meta_value`), or None."""
        with self._guard():
            return self._meta(key)

    def set_meta_value(self, key: str, value: str | None) -> None:
        """Set (None: remove) one of the journal's own values, committed at once."""
        with self._guard():
            if value is None:
                self._conn.execute("DELETE FROM meta WHERE key = ?", (key,))
            else:
                self._conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    def count_between(self, first: int, stop: int) -> int:
        """The committed rows of the records [first, stop)."""
        with self._guard():
            return self._conn.execute("SELECT COUNT(*) FROM rows WHERE idx >= ? AND idx < ?",
                                      (first, stop)).fetchone()[0]

    def row_texts_between(self, first: int, stop: int) -> Iterator[tuple[int, str]]:
        """(index, the row as stored) of the committed rows of the records [first, stop), in index order, page by
        page."""
        sql = "SELECT idx, row FROM rows WHERE idx >= ? ORDER BY idx LIMIT ?"
        for idx, text in self._paged(sql, first):
            if idx >= stop:
                return
            yield idx, text

    def commit(self) -> int:
        """Write all buffered rows, id claims and partials in one transaction (a row's partial deleted with it);
        durable on return. Returns the rows written."""
        if not self._pending_rows and not self._pending_ids and not self._pending_partials:
            return 0
        rows = self._pending_rows
        now = time.time()
        with self._guard():
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                self._conn.executemany(
                    "INSERT INTO ids(id, idx) VALUES (?, ?) ON CONFLICT(id) DO NOTHING",
                    self._pending_ids.items(),
                )
                self._conn.executemany(
                    "INSERT INTO rows(idx, id, status, row, digest, origin, place) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    ((i, *fields) for i, fields in rows.items()),
                )
                self._conn.executemany("INSERT OR REPLACE INTO partials(idx, num_tokens, state) VALUES (?, ?, ?)",
                                       ((i, n, state) for i, (n, state) in self._pending_partials.items()
                                        if i not in rows))
                self._conn.executemany("DELETE FROM partials WHERE idx = ?", ((i,) for i in rows))
                prefix = self._advance_prefix(rows)
                num_committed = self._num_committed + len(rows)
                num_errors = self._num_errors + self._pending_errors
                num_samples = self._num_samples + self._pending_samples
                self._conn.executemany(
                    "UPDATE meta SET value = ? WHERE key = ?",
                    [(str(num_committed), "num_committed"), (str(num_errors), "num_errors"),
                     (str(prefix), "contiguous_prefix")],
                )
                self._conn.execute(
                    "INSERT OR REPLACE INTO meta(key, value) VALUES ('last_commit_time', ?)",
                    (repr(now),),
                )
                self._conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('num_samples', ?)",
                                   (str(num_samples),))
                columns = self._columns | self._pending_columns
                if self._pending_columns:
                    self._conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('columns', ?)",
                                       (json.dumps(sorted(columns)),))
                self._conn.execute("COMMIT")
            except sqlite3.IntegrityError:
                self._rollback()
                again = [i for i in sorted(rows) if self._is_committed(i)]
                raise ValueError(
                    f"rows {again[:5]} are already in the journal; a row is written once"
                ) from None
            except BaseException:
                # SQLite may already have rolled back (disk full does); the buffers are kept so a
                # later commit() can retry once the cause is fixed.
                self._rollback()
                raise
        count = len(rows)
        self._num_committed, self._num_errors, self._prefix = num_committed, num_errors, prefix
        self._last_commit_time = now
        self._pending_rows, self._pending_ids, self._pending_errors = {}, {}, 0
        self._num_samples, self._pending_samples = num_samples, 0
        self._pending_partials = {}
        self._columns, self._pending_columns = columns, set()
        return count

    def _rollback(self) -> None:
        # Never let a failing ROLLBACK hide the error that caused it.
        if self._conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")

    def _advance_prefix(self, batch: dict[int, tuple]) -> int:
        """The new contiguous prefix, inside the commit transaction.

        Commits are mostly in order, so walk the batch in memory first, then probe the table
        for rows committed earlier out of order beyond it (usually one probe that finds a gap).
        """
        prefix = self._prefix
        if prefix not in batch:
            return prefix  # index `prefix` is still missing: nothing can advance
        while prefix in batch:
            prefix += 1
        cursor = self._conn.execute("SELECT idx FROM rows WHERE idx >= ? ORDER BY idx", (prefix,))
        for (idx,) in cursor:
            if idx != prefix:
                break
            prefix += 1
        cursor.close()
        return prefix

    def num_committed(self) -> int:
        return self._num_committed

    def columns(self) -> set[str]:
        """Every key some committed row holds (the optional output columns a run's file needs)."""
        return set(self._columns)

    def num_errors(self) -> int:
        return self._num_errors

    def num_samples(self) -> int:
        """The output rows the committed rows hold: one each, n for a record with n > 1."""
        return self._num_samples

    def contiguous_prefix(self) -> int:
        """The smallest n such that every index < n is committed."""
        return self._prefix

    def last_commit_time(self) -> float | None:
        """Unix time of the last commit, or None if nothing was ever committed."""
        return self._last_commit_time

    def _is_committed(self, index: int) -> bool:
        if index < self._prefix:
            return True
        with self._guard():
            found = self._conn.execute("SELECT 1 FROM rows WHERE idx = ?", (index,)).fetchone()
        return found is not None

    def committed_indices_from(self, start: int) -> Iterator[int]:
        """Committed indices >= start, ascending, streamed page by page."""
        sql = "SELECT idx FROM rows WHERE idx >= ? ORDER BY idx LIMIT ?"
        for (idx,) in self._paged(sql, start):
            yield idx

    def committed_digests_from(self, start: int) -> Iterator[tuple[int, str | None]]:
        """(index, input digest or None) of the committed rows >= start, ascending, page by page."""
        sql = "SELECT idx, digest FROM rows WHERE idx >= ? ORDER BY idx LIMIT ?"
        yield from self._paged(sql, start)

    def iter_rows(self) -> Iterator[dict]:
        """All committed rows, decoded, in index order, streamed page by page."""
        sql = "SELECT idx, row FROM rows WHERE idx >= ? ORDER BY idx LIMIT ?"
        for _, text in self._paged(sql, 0):
            yield json.loads(text)

    def iter_rows_expecting(self, indices: range) -> Iterator[dict]:
        """`iter_rows` below `indices.stop`, checked as it streams to hold exactly one row for each of `indices` and no
        other: a journal whose rows were changed outside conveyor (a row deleted, one added) is refused, never
        trusted by its counters. JournalCorrupt names the indices at fault."""
        expected = iter(indices)
        for row in self.iter_rows():
            if row["index"] >= indices.stop:  # (past --limit: rows of an earlier, longer run)
                break
            want, index = next(expected, None), row["index"]
            if want != index:
                missing = [] if want is None else list(itertools.takewhile(index.__gt__,
                                                                           itertools.chain([want], expected)))
                raise JournalCorrupt(self.path, _row_mismatch(missing, index, indices))
            yield row
        rest = list(itertools.islice(expected, 6))
        if rest:
            raise JournalCorrupt(self.path, _row_mismatch(rest, None, indices))

    def count_rows(self) -> int:
        """The rows the file holds, counted (the counters are the journal's own account of them)."""
        with self._guard():
            return self._conn.execute("SELECT COUNT(*) FROM rows").fetchone()[0]

    def _paged(self, sql: str, start: int) -> Iterator[tuple]:
        # Keyset pagination: each page is its own short read, so no read transaction stays open
        # across a consumer's commits (a long reader would stop WAL checkpoints).
        while True:
            with self._guard():
                page = self._conn.execute(sql, (start, _PAGE)).fetchall()
            yield from page
            if len(page) < _PAGE:
                return
            start = page[-1][0] + 1

    def close(self) -> None:
        """Close the database; rows still pending are discarded (commit() first)."""
        self._conn.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def recount(conn: sqlite3.Connection) -> None:
    """The counters in `meta` (rows, errors, output rows, the contiguous prefix, the columns) counted again from the
    rows, inside the caller's transaction, after rows were moved or dropped."""
    rows, errors = conn.execute("SELECT COUNT(*), COUNT(*) FILTER (WHERE status = 'error') FROM rows").fetchone()
    samples = conn.execute(f"SELECT SUM(COALESCE(json_array_length(row, '$.{SAMPLES_KEY}'), 1)) FROM rows"
                           ).fetchone()[0] or 0
    prefix = conn.execute("SELECT CASE WHEN EXISTS (SELECT 1 FROM rows WHERE idx = 0) THEN (SELECT MIN(idx) + 1 FROM"
                          " rows r WHERE NOT EXISTS (SELECT 1 FROM rows s WHERE s.idx = r.idx + 1)) ELSE 0 END"
                          ).fetchone()[0]
    columns = [key for (key,) in conn.execute(
        f"SELECT DISTINCT key FROM rows, json_each(rows.row) UNION SELECT DISTINCT sample.key FROM rows, "
        f"json_each(rows.row, '$.{SAMPLES_KEY}') AS samples, json_each(samples.value) AS sample").fetchall()]
    conn.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                     [("num_committed", str(rows)), ("num_errors", str(errors)), ("num_samples", str(samples)),
                      ("contiguous_prefix", str(prefix)), ("columns", json.dumps(sorted(columns)))])


def _partial_tokens(state: dict) -> int:
    """The tokens a partial holds: a record's, or the sum of its samples' (a record with n > 1)."""
    if "samples" in state:
        return sum(len(s.get("tokens", ())) for s in state["samples"].values())
    return len(state["tokens"])


def _row_mismatch(missing: list[int], extra: int | None, indices: range) -> str:
    """What `iter_rows_expecting` found: rows missing, or a row that should not be there."""
    of = f"records {indices.start} to {indices.stop - 1}" + (f" step {indices.step}" if indices.step != 1 else "")
    if missing:
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        return f"it holds no row for record {shown} of {of}: rows were removed outside conveyor"
    return f"it holds a row for record {extra}, which is not one of {of}: rows were added outside conveyor"


def _translate(exc: sqlite3.DatabaseError, path: Path) -> Exception:
    """Map an SQLite error to the exception the CLI reports; leaves unknown errors as they are."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    message = str(exc)
    if primary == _SQLITE_FULL or "database or disk is full" in message:
        return OSError(errno.ENOSPC, "no space left on device while writing the journal", str(path))
    if primary in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or "malformed" in message or (
        "not a database" in message
    ):
        return JournalCorrupt(path, message)
    if primary == _SQLITE_IOERR:
        return OSError(errno.EIO, f"I/O error on the journal ({message})", str(path))
    if primary == _SQLITE_CANTOPEN and not path.exists():
        return OSError(errno.ENOENT, "no such journal", str(path))
    if primary in (_SQLITE_CANTOPEN, _SQLITE_READONLY):
        return OSError(errno.EACCES, f"cannot open the journal ({message})", str(path))
    return exc
