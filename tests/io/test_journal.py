"""Journal: commits, prefix, id claims, kill -9 mid-stream, disk full, corruption."""

from __future__ import annotations

import errno
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from conveyor.io.state import journal as journal_mod
from conveyor.io.state.journal import Journal, JournalCorrupt


def row(index: int, record_id: str | None = None, status: str = "ok", **extra) -> dict:
    return {"index": index, "id": record_id if record_id is not None else str(index),
            "status": status, "output": f"out-{index}", **extra}


def id_holder(path, record_id: str) -> int | None:
    """The index whose committed claim holds `record_id`, read from the file (None: no claim committed)."""
    conn = sqlite3.connect(path)
    try:
        found = conn.execute("SELECT idx FROM ids WHERE id = ?", (record_id,)).fetchone()
    finally:
        conn.close()
    return found[0] if found else None


def commit_rows(journal: Journal, indices, **kwargs) -> int:
    for i in indices:
        journal.add(row(i, **kwargs))
    return journal.commit()


@pytest.fixture
def path(tmp_path):
    return tmp_path / "journal.sqlite"


def test_commit_then_reopen_keeps_rows_counts_and_time(path):
    with Journal(path) as j:
        assert j.last_commit_time() is None
        j.add(row(0))
        j.add(row(1, status="error", error="bad"))
        assert j.pending == 2 and j.num_committed() == 0
        assert j.commit() == 2
        assert j.pending == 0 and j.commit() == 0
        committed_at = j.last_commit_time()
        assert committed_at is not None
    with Journal(path) as j:
        assert j.num_committed() == 2 and j.num_errors() == 1
        assert j.last_commit_time() == committed_at
        assert list(j.iter_rows()) == [row(0), row(1, status="error", error="bad")]


def test_uncommitted_rows_are_lost_on_close(path):
    with Journal(path) as j:
        commit_rows(j, [0])
        j.add(row(1))
    with Journal(path) as j:
        assert j.num_committed() == 1 and 1 not in [r["index"] for r in j.iter_rows()]


def test_a_row_is_written_once(path):
    with Journal(path) as j:
        commit_rows(j, [0, 5])
        j.add(row(1))
        with pytest.raises(ValueError, match="row 0"):
            j.add(row(0))
        with pytest.raises(ValueError, match="row 1"):
            j.add(row(1))
        with pytest.raises(ValueError):
            j.add(row(-1))
        assert j.commit() == 1
        j.add(row(5))  # committed out of order: caught by the primary key at commit
        with pytest.raises(ValueError, match=r"rows \[5\] are already in the journal"):
            j.commit()
        assert j.num_committed() == 3
    with Journal(path) as j:
        assert [r["index"] for r in j.iter_rows()] == [0, 1, 5]


def test_contiguous_prefix_with_out_of_order_commits(path, monkeypatch):
    monkeypatch.setattr(journal_mod, "_PAGE", 2)  # exercise paging of the streamed reads
    with Journal(path) as j:
        commit_rows(j, [4, 1, 0, 3])
        assert j.contiguous_prefix() == 2
        commit_rows(j, [5, 7])
        assert j.contiguous_prefix() == 2
        assert {2, 3} & set(j.committed_indices_from(0)) == {3}
        assert list(j.committed_indices_from(2)) == [3, 4, 5, 7]
        assert list(j.committed_indices_from(6)) == [7]
        commit_rows(j, [2])
        assert j.contiguous_prefix() == 6  # filled the gap and ran through 3, 4, 5
        assert [r["index"] for r in j.iter_rows()] == [0, 1, 2, 3, 4, 5, 7]
    with Journal(path) as j:
        assert j.contiguous_prefix() == 6 and j.num_committed() == 7


def test_duplicate_id_claims_survive_a_kill_and_resume(path):
    ids = ["a", "b", "a", "c", "b", "d"]

    def read(j: Journal, index: int) -> dict:
        if j.claim_id(ids[index], index):
            return row(index, ids[index])
        return row(index, ids[index], status="error", error="duplicate id")

    # First run: all six records read (claimed), only rows 2 and 0 finish before the kill.
    with Journal(path) as j:
        first = {i: read(j, i) for i in range(6)}
        j.add(first[2])
        j.add(first[0])
        j.commit()
    # Resume: re-read from the prefix, skipping what was committed out of order.
    with Journal(path) as j:
        assert j.contiguous_prefix() == 1
        assert list(j.committed_indices_from(1)) == [2]
        assert j.claim_id("a", 0) and not j.claim_id("a", 2)
        assert id_holder(path, "a") == 0
        for i in (1, 3, 4, 5):
            j.add(read(j, i))
        j.commit()
        statuses = [r["status"] for r in j.iter_rows()]
    assert statuses == [first[i]["status"] for i in range(6)]
    assert statuses == ["ok", "ok", "error", "ok", "error", "ok"]


_CHILD = textwrap.dedent("""
    import sys
    from conveyor.io.state.journal import Journal
    j = Journal(sys.argv[1])
    start = j.contiguous_prefix()
    while True:
        for k in reversed(range(start, start + 50)):  # out of order inside a commit
            j.claim_id(f"id{k}", k)
            j.add({"index": k, "id": f"id{k}", "status": "ok", "output": "y" * (1000 + k % 97)})
        j.commit()
        start += 50
        print(start, flush=True)
""")


def test_kill_9_mid_stream_leaves_a_gap_free_set_of_whole_rows(path):
    reported = 0
    for _ in range(3):  # kill, resume, kill, ...
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE)
        start = reported
        while reported < start + 150:
            line = child.stdout.readline()
            assert line, "the child died before committing"
            reported = int(line)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        with Journal(path) as j:  # runs quick_check
            n = j.num_committed()
            assert n >= reported and n % 50 == 0  # every reported commit, whole commits only
            assert j.contiguous_prefix() == n
            rows = list(j.iter_rows())
            assert [r["index"] for r in rows] == list(range(n))
            assert all(r["output"] == "y" * (1000 + r["index"] % 97) for r in rows)
            assert id_holder(path, f"id{n - 1}") == n - 1
        reported = n
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM rows").fetchone()[0] == reported


_CHILD_DIES_INSIDE_COMMIT = textwrap.dedent("""
    import os, signal, sys
    from conveyor.io.state.journal import Journal

    class DieOnThirdMetaUpdate:  # the rows of commit 3 are written, its transaction is open
        def __init__(self, conn):
            self.conn, self.updates = conn, 0
        def executemany(self, sql, *args):
            if sql.startswith("UPDATE meta"):
                self.updates += 1
                if self.updates == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
            return self.conn.executemany(sql, *args)
        def __getattr__(self, name):
            return getattr(self.conn, name)

    j = Journal(sys.argv[1])
    j._conn = DieOnThirdMetaUpdate(j._conn)
    for start in range(0, 500, 100):
        for k in range(start, start + 100):
            j.add({"index": k, "id": str(k), "status": "ok", "output": "v" * 3000})
        j.commit()
""")


def test_kill_9_inside_a_commit_rolls_that_commit_back(path):
    child = subprocess.run([sys.executable, "-c", _CHILD_DIES_INSIDE_COMMIT, str(path)])
    assert child.returncode == -signal.SIGKILL
    with Journal(path) as j:
        assert j.num_committed() == j.contiguous_prefix() == 200
        assert [r["index"] for r in j.iter_rows()] == list(range(200))
        assert id_holder(path, "250") is None


def test_disk_full_surfaces_as_enospc_and_loses_nothing(path):
    j = Journal(path)
    commit_rows(j, range(10))
    # Cap the file at its current size: SQLite then fails exactly as on a full disk.
    pages = j._conn.execute("PRAGMA page_count").fetchone()[0]
    j._conn.execute(f"PRAGMA max_page_count = {pages}")
    for i in range(10, 60):
        j.add(row(i, output="z" * 4000))
    with pytest.raises(OSError) as info:
        j.commit()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert j.num_committed() == 10 and j.pending == 50
    j._conn.execute("PRAGMA max_page_count = 1073741823")  # space is back
    assert j.commit() == 50
    j.close()
    with Journal(path) as j:
        assert j.num_committed() == 60 and j.contiguous_prefix() == 60


class _FullAtCommit:
    """Wraps a connection; COMMIT fails the way a full disk makes it fail."""

    def __init__(self, conn):
        self._conn = conn

    def execute(self, sql, *args):
        if sql == "COMMIT":
            raise sqlite3.OperationalError("database or disk is full")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._conn, name)


def test_disk_full_at_commit_rolls_back_and_reopen_works(path):
    j = Journal(path)
    commit_rows(j, range(3))
    real = j._conn
    j._conn = _FullAtCommit(real)
    with pytest.raises(OSError) as info:
        commit_rows(j, range(3, 6))
    assert info.value.errno == errno.ENOSPC and str(path) in str(info.value)
    assert not real.in_transaction
    real.close()
    with Journal(path) as j:
        assert j.num_committed() == 3 and [r["index"] for r in j.iter_rows()] == [0, 1, 2]


def test_garbage_file_is_reported_corrupt(path):
    path.write_bytes(b"this is not an sqlite database at all" * 200)
    with pytest.raises(JournalCorrupt) as info:
        Journal(path)
    assert str(path) in str(info.value) and "--restart" in str(info.value)


def test_truncated_file_is_reported_corrupt(path):
    with Journal(path) as j:
        for i in range(300):
            j.add(row(i, output="w" * 2000))
        j.commit()
    assert not path.with_name(path.name + "-wal").exists()  # checkpointed on close
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(JournalCorrupt, match="--restart"):
        Journal(path)


def test_read_only_open_beside_a_writer(path):
    with Journal(path) as writer:
        commit_rows(writer, [0, 1], status="error")
        with Journal(path, read_only=True, verify=False) as reader:
            assert reader.num_committed() == 2 and reader.num_errors() == 2
            assert reader.contiguous_prefix() == 2


def test_partials_are_committed_with_rows_and_go_with_their_row(path):
    with Journal(path) as j:
        j.add(row(0))
        j.set_partials({1: {"tokens": [5, 6, 7], "logprobs": None}, 2: {"tokens": [9], "logprobs": [[9, -0.5, []]]}})
        j.commit()
        assert j.partials() == {1: {"tokens": [5, 6, 7], "logprobs": None},
                                2: {"tokens": [9], "logprobs": [[9, -0.5, []]]}}
        assert j.partial_tokens() == (2, 4)
        j.add(row(1))  # record 1 finished: its partial goes in the same transaction
        j.set_partials({2: {"tokens": [9, 10], "logprobs": [[9, -0.5, []], [10, -0.25, []]]}})
        j.commit()
    with Journal(path) as j:
        assert j.partials() == {2: {"tokens": [9, 10], "logprobs": [[9, -0.5, []], [10, -0.25, []]]}}
        assert j.num_committed() == 2


def test_a_journal_of_the_release_before_partials_resumes(path):
    with Journal(path) as j:
        commit_rows(j, [0, 1])
    conn = sqlite3.connect(path)  # what the earlier release left: schema version 2, no partials table
    conn.execute("DROP TABLE partials")
    conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with Journal(path, read_only=True, verify=False) as old:
        assert old.partials() == {} and old.partial_tokens() == (0, 0)  # `conveyor status` reads it as it is
    with Journal(path) as j:  # a run opens it: migrated
        assert j.num_committed() == 2 and j.partials() == {}
        j.set_partials({2: {"tokens": [1], "logprobs": None}})
        j.commit()
        assert j.partials() == {2: {"tokens": [1], "logprobs": None}}
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "4"
    conn.close()
