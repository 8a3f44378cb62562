"""Scale of a part-file run: N short records (default 1M, then 10M) through a tiny random Llama with --max-tokens 1
into part files, measuring what grows with the run: peak RSS (flat?), the journal's size, a checkpoint's commit
time at that size, `conveyor status`, a rerun of the finished run, and a resume with the last 1,000 records left.

    python benchmarks/scale_parts.py --records 1000000 10000000 --out benchmarks/results/scale-parts.json

Each size runs in its own folder under --work (default /tmp/conveyor-scale); the run itself is a child process under
/usr/bin/time (its peak RSS). The model is built once: 2 layers, hidden 64, the embedded SmolLM2 tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from memory import build_tiny_model  # (benchmarks/memory.py: the tests' tiny model)

CONVEYOR = [sys.executable, "-m", "conveyor.cli"]
PART = 100_000  # records a part


def records(path: Path, n: int) -> Path:
    if not path.exists():
        with open(path, "w") as f:
            for i in range(n):
                f.write(f'{{"id": "r{i}", "prompt": "Item {i}: yes or no?"}}\n')
    return path


def timed_run(args: list[str], log: Path) -> tuple[float, int, int]:
    """(wall s, peak RSS KiB, exit code) of `conveyor ARGS`."""
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.run(["/usr/bin/time", "-f", "maxrss_kib=%M", *CONVEYOR, *args], stdout=f,
                              stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    rss = next((int(line.split("=")[1]) for line in log.read_text().splitlines() if line.startswith("maxrss_kib=")), 0)
    return wall, rss, proc.returncode


def commit_time(journal_path: Path, batch: int = 256, rounds: int = 20) -> float:
    """Median seconds of one commit of `batch` rows into a copy of the journal at its size (rows past its end)."""
    import shutil
    import statistics

    from conveyor.io.state.journal import Journal

    copy = journal_path.with_name("commit-probe.sqlite")
    shutil.copy(journal_path, copy)
    times = []
    with Journal(copy, verify=False) as journal:
        start = journal.num_committed() + 10
        row = next(iter(journal.iter_rows()))
        for r in range(rounds):
            for i in range(batch):
                index = start + r * batch + i
                journal.add({**row, "index": index, "id": f"probe{index}"})
            t = time.perf_counter()
            journal.commit()
            times.append(time.perf_counter() - t)
    copy.unlink()
    for suffix in ("-wal", "-shm"):
        Path(str(copy) + suffix).unlink(missing_ok=True)
    return statistics.median(times)


def one_size(n: int, work: Path, model: Path) -> dict:
    folder = work / f"n{n}"
    folder.mkdir(parents=True, exist_ok=True)
    src = records(folder / "in.jsonl", n)
    out = folder / "parts"
    common = ["-o", f"{out}/", "--rows-per-file", str(PART), "--model", str(model), "--max-tokens", "1",
              "--temperature", "0", "--kv-cache-memory", "64MiB", "-q"]
    first, rss_first, code = timed_run(["run", str(src), *common, "--limit", str(n - 1000)], folder / "first.log")
    assert code == 0, (folder / "first.log").read_text()[-2000:]
    resume, rss, code = timed_run(["run", str(src), *common], folder / "resume.log")
    assert code == 0, (folder / "resume.log").read_text()[-2000:]
    rerun, _, code = timed_run(["run", str(src), *common], folder / "rerun.log")
    assert code == 0
    t = time.monotonic()
    status = subprocess.run([*CONVEYOR, "status", f"{out}/"], capture_output=True, text=True)
    status_s = time.monotonic() - t
    run_dir = folder / "parts.conveyor"
    journal = run_dir / "journal.sqlite"
    size = sum(p.stat().st_size for p in run_dir.iterdir() if p.name.startswith("journal.sqlite"))
    return {"records": n, "run_s": round(first, 1), "records_per_s": round((n - 1000) / first),
            "peak_rss_mib": round(max(rss_first, rss) / 1024, 1), "journal_mib": round(size / 2**20, 1),
            "commit_ms": round(commit_time(journal) * 1000, 2), "status_s": round(status_s, 2),
            "status_ok": status.returncode == 0, "resume_last_1000_s": round(resume, 1),
            "rerun_finished_s": round(rerun, 1), "parts": len(list(out.glob("part-*.parquet")))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--work", type=Path, default=Path("/tmp/conveyor-scale"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(args.work / "tiny-model")
    results = []
    for n in args.records:
        results.append(one_size(n, args.work, model))
        print(json.dumps(results[-1]), flush=True)
    if len(results) > 1:
        print(f"peak RSS {results[-1]['records']:,} vs {results[0]['records']:,} records: "
              f"{results[-1]['peak_rss_mib'] / results[0]['peak_rss_mib']:.3f}x")
    if args.out:
        args.out.write_text(json.dumps({"cpu": os.uname().machine, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
