"""What finding the new records of a grown input costs, against reading the input (issue: incremental runs).

A JSONL file of N records (default 1,000,000) is answered in a journal (its rows written directly, with the digests
and places a run keeps, no model); then K records (default 1,000) are appended, and the script times, in one
process, alternated:
  read:   the file read once with digests (what any rerun costs before its first record is known: the floor),
  check:  every resume's check that the journal's rows answer the records read now (run_rebase.rows_of_other_records),
  rebase: a run's rebase of the journal onto it (input_entries + journal_rebase.rebase: read, match, write),
  pending: the records left to compute after it (PendingRecords, as the run then streams them).
It prints each in seconds and their ratios to `read`, and checks the counts (reused N, new K).

    python benchmarks/reuse_scan.py [--records 1000000] [--new 1000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from conveyor.io.records.pending import PendingRecords
from conveyor.io.records.readers import open_reader
from conveyor.io.records.readers.record import location
from conveyor.io.run_rebase import input_entries, rows_of_other_records
from conveyor.io.state.journal import Journal
from conveyor.io.state.journal_rebase import rebase


def _write(path: Path, start: int, stop: int, mode: str) -> None:
    with path.open(mode, encoding="utf-8") as f:
        for i in range(start, stop):
            f.write(json.dumps({"id": f"q{i}", "prompt": f"Question number {i}: what is {i} plus {i}?",
                                "topic": i % 17}) + "\n")


def _journal(path: Path, source: Path) -> None:
    reader = open_reader(str(source))
    reader.with_digests = True
    journal = Journal(path)
    for raw in reader.iter_from(0):
        where = location(raw.index, raw.line)
        journal.add({"id": raw.record["id"], "index": raw.index, "status": "ok", "output": "an answer of a few words",
                     "finish_reason": "stop", "__conveyor_where": where}, raw.digest, None, where)
        if journal.pending >= 50_000:
            journal.commit()
    journal.commit()
    journal.close()


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _one(source: Path, base: Path, path: Path, records: int, new: int) -> dict[str, float]:
    """One round: the read, the rebase (on a fresh copy of the journal), the pending records after it."""
    reader = open_reader(str(source))
    reader.with_digests = True
    read, count = _timed(lambda: sum(1 for _ in reader.iter_from(0)))
    assert count == records + new
    shutil.copy(base, path)
    with Journal(path, verify=False) as journal:
        checked, other = _timed(lambda: rows_of_other_records(journal, reader))
        assert other == 0, other
        matched, reuse = _timed(lambda: rebase(journal, input_entries(reader, "id")))
        assert (reuse.reused, reuse.new, reuse.changed, reuse.removed) == (records, new, 0, 0), reuse
        pending = PendingRecords(reader, journal, str(source))
        left_s, left = _timed(lambda: sum(1 for _ in pending))
        assert left == new
    return {"read": read, "check": checked, "rebase": matched, "pending": left_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--new", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reuse-scan-"))
    try:
        source, base = work / "in.jsonl", work / "base.sqlite"
        _write(source, 0, args.records, "w")
        built, _ = _timed(lambda: _journal(base, source))
        _write(source, args.records, args.records + args.new, "a")
        size = source.stat().st_size
        print(f"{args.records:,} records answered, {args.new:,} appended: {size / 1e6:.0f} MB of JSONL "
              f"(journal built in {built:.1f} s, {base.stat().st_size / 1e6:.0f} MB)")
        times: dict[str, list[float]] = {"read": [], "check": [], "rebase": [], "pending": []}
        for _ in range(args.repeat):
            for name, value in _one(source, base, work / "j.sqlite", args.records, args.new).items():
                times[name].append(value)
        best = {name: min(values) for name, values in times.items()}
        for name, value in best.items():
            print(f"{name:8s} {value:7.2f} s  ({value / best['read']:.2f}x the read)")
        total = best["rebase"] + best["pending"]
        print(f"finding the {args.new:,} new records (rebase + pending): {total:.2f} s, "
              f"{total / best['read']:.2f}x one read of the file")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
