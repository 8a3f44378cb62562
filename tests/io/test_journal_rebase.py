"""journal_rebase: which rows an input that changed keeps (moved to their records' new indices) and which it drops,
the counts it says, and the journal's counters and id claims after it. Pure Python over SQLite."""

from __future__ import annotations

import sqlite3

from conveyor.io.rows.rows import SAMPLES_KEY, WHERE_KEY
from conveyor.io.state.journal import Journal
from conveyor.io.state.journal_rebase import Entry, rebase


def _row(index, record_id, status="ok", samples=None, where=None):
    row = {"id": record_id, "index": index, "status": status, "output": f"out {record_id}"}
    if where is not None:
        row[WHERE_KEY] = where
    if samples:
        row[SAMPLES_KEY] = [{**row, "sample_index": k} for k in range(samples)]
    return row


def _journal(path, rows):
    """rows: (index, own id or None, digest, status, origin)"""
    journal = Journal(path)
    for index, own, digest, status, origin in rows:
        where = f"line {index + 1}"
        journal.add(_row(index, own or str(index), status, where=where if own else None), digest, origin, where)
    journal.commit()
    return journal


def _entries(items):
    """items: (own id or None, digest), in index order."""
    return [Entry(i, f"line {i + 1}", digest, lambda own=own: own) for i, (own, digest) in enumerate(items)]


def test_an_input_that_grew_keeps_every_row_and_counts_the_new_records(tmp_path):
    journal = _journal(tmp_path / "j.sqlite", [(i, None, f"d{i}", "ok", None) for i in range(4)])
    reuse = rebase(journal, _entries([(None, f"d{i}") for i in range(6)]))
    assert (reuse.reused, reuse.new, reuse.changed, reuse.removed) == (4, 2, 0, 0)
    assert journal.num_committed() == 4 and journal.contiguous_prefix() == 4
    assert [r["index"] for r in journal.iter_rows()] == [0, 1, 2, 3]


def test_records_with_ids_keep_their_rows_wherever_they_move_and_those_without_only_in_place(tmp_path):
    journal = _journal(tmp_path / "j.sqlite", [(0, "a", "da", "ok", None), (1, "b", "db", "ok", None),
                                               (2, None, "dx", "ok", None), (3, "c", "dc", "ok", None)])
    # "new" inserted first: a, b, c move on by one; the record without an id moves too, so it is computed again;
    # b was edited.
    now = _entries([("new", "dn"), ("a", "da"), ("b", "db2"), (None, "dx"), ("c", "dc")])
    reuse = rebase(journal, now)
    assert (reuse.reused, reuse.new, reuse.changed, reuse.removed, reuse.moved_without_id) == (2, 1, 2, 0, 1)
    rows = list(journal.iter_rows())
    assert [(r["index"], r["id"], r[WHERE_KEY]) for r in rows] == [(1, "a", "line 2"), (4, "c", "line 5")]
    assert journal.num_committed() == 2 and journal.contiguous_prefix() == 0
    assert journal.claim_id("a", 1) and not journal.claim_id("a", 7)  # its claim moved with it
    assert journal.claim_id("b", 2)  # the edited record claims its id again when it is read


def test_the_rows_of_records_that_are_gone_are_dropped_and_the_counters_recounted(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    journal.add(_row(0, "a", samples=3, where="line 1"), "da", None, "line 1")
    journal.add(_row(1, "b", "error", where="line 2"), "db", "run", "line 2")
    journal.add(_row(2, "c", where="line 3"), "dc", None, "line 3")
    journal.commit()
    assert journal.num_samples() == 5 and journal.num_errors() == 1
    reuse = rebase(journal, _entries([("c", "dc"), ("a", "da")]))
    assert (reuse.reused, reuse.new, reuse.changed, reuse.removed) == (2, 0, 0, 1)
    assert (journal.num_committed(), journal.num_errors(), journal.num_samples(), journal.contiguous_prefix()) == \
        (2, 0, 4, 2)
    rows = list(journal.iter_rows())
    assert [r["id"] for r in rows] == ["c", "a"]
    assert [s["index"] for s in rows[1][SAMPLES_KEY]] == [1, 1, 1]  # a sample's index follows its record's
    with Journal(tmp_path / "j.sqlite", read_only=True) as again:  # the counters are durable
        assert (again.num_committed(), again.num_samples(), again.contiguous_prefix()) == (2, 4, 2)


def test_rows_added_after_a_recount_count_as_output_rows_also_once_the_journal_is_opened_again(tmp_path):
    journal = _journal(tmp_path / "j.sqlite", [(i, None, f"d{i}", "ok", None) for i in range(4)])
    rebase(journal, _entries([(None, f"d{i}") for i in range(3)] + [(None, "new")]))  # one cut: recounted
    assert (journal.num_committed(), journal.num_samples()) == (3, 3)
    journal.add(_row(3, "3"), "new")
    journal.commit()
    journal.close()
    with Journal(tmp_path / "j.sqlite", read_only=True) as again:
        assert (again.num_committed(), again.num_samples()) == (4, 4)


def test_error_rows_are_reused_only_in_place_and_never_a_duplicates(tmp_path):
    journal = _journal(tmp_path / "j.sqlite", [(0, None, "d0", "error", "input"), (1, "a", "da", "error", "input"),
                                               (2, "b", "db", "ok", None), (3, "b", "db2", "error", "duplicate"),
                                               (4, "z", "dz", "error", "run")])
    same = rebase(journal, _entries([(None, "d0"), ("a", "da"), ("b", "db"), ("b", "db2"), ("z", "dz")]),
                  write=False)
    assert (same.reused, same.new, same.changed) == (4, 0, 1)  # the duplicate's row depends on the others
    moved = rebase(journal, _entries([("x", "dx"), (None, "d0"), ("a", "da"), ("b", "db"), ("z", "dz")]))
    assert moved.reused == 2  # b, and z's error row where it stayed: an error row names its record's line
    assert [r["id"] for r in journal.iter_rows()] == ["b", "z"]


def test_a_dry_rebase_counts_and_changes_nothing_even_on_a_read_only_journal(tmp_path):
    path = tmp_path / "j.sqlite"
    _journal(path, [(i, None, f"d{i}", "ok", None) for i in range(3)]).close()
    with Journal(path, read_only=True, verify=False) as journal:
        reuse = rebase(journal, _entries([(None, "d0"), (None, "e1")]), write=False)
        assert (reuse.reused, reuse.new, reuse.changed, reuse.removed) == (1, 0, 1, 1)
    with Journal(path) as journal:
        assert journal.num_committed() == 3 and [r["index"] for r in journal.iter_rows()] == [0, 1, 2]


def test_rows_without_digests_are_not_matched_and_nothing_changes(tmp_path):
    path = tmp_path / "j.sqlite"
    journal = _journal(path, [(0, None, None, "ok", None), (1, None, "d1", "ok", None)])
    assert rebase(journal, _entries([(None, "d1")])) is None
    assert journal.num_committed() == 2


def test_forget_run_errors_drops_only_the_runs_own_error_rows(tmp_path):
    journal = _journal(tmp_path / "j.sqlite", [(0, None, "d0", "error", "input"), (1, None, "d1", "error", "run"),
                                               (2, None, "d2", "ok", None), (3, "a", "d3", "error", "duplicate")])
    assert journal.forget_run_errors() == 1
    assert [r["index"] for r in journal.iter_rows()] == [0, 2, 3]
    assert (journal.num_committed(), journal.num_errors(), journal.contiguous_prefix()) == (3, 2, 1)
    assert journal.forget_run_errors() == 0


def test_a_journal_of_schema_3_gains_the_origin_and_place_columns(tmp_path):
    path = tmp_path / "j.sqlite"
    _journal(path, [(0, None, "d0", "ok", None)]).close()
    conn = sqlite3.connect(path)
    conn.execute("DROP INDEX rows_match")
    conn.execute("ALTER TABLE rows DROP COLUMN origin")
    conn.execute("ALTER TABLE rows DROP COLUMN place")
    conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with Journal(path) as journal:
        assert journal.num_committed() == 1
        reuse = rebase(journal, _entries([(None, "d0"), (None, "d1")]))
        assert (reuse.reused, reuse.new) == (1, 1)
    conn = sqlite3.connect(path)
    assert {r[1] for r in conn.execute("PRAGMA table_info(rows)")} >= {"origin", "place", "digest"}
    conn.close()
