"""`--executor ray` with 1 worker against N workers on this machine, one torch thread per worker, same records.

    python benchmarks/scale_out.py                  # 96 chat requests of the benchmark workload, 1 vs 2 workers
    python benchmarks/scale_out.py --workers 1,2,4 --n 256

For each worker count a local Ray instance with that many CPUs is started first (so each worker gets one CPU
and one torch thread; its start is not timed), then `conveyor run ... --executor ray --num-workers K` runs in
this process on a fresh run directory. Printed: the command's wall time (model loads, shard runs, merge), the
generation time (the slowest worker's first admission to last completion), output tokens/s over the wall
time, and each count's speed-up over 1 worker. The outputs of every count are checked equal row for row.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import make_workload  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=96)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens-cap", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    a = p.parse_args()
    import pyarrow.parquet as pq
    import ray

    from conveyor.cli.app import main as conveyor

    counts = [int(x) for x in a.workers.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="conveyor-scale-out-") as tmp:
        src = Path(tmp) / "in.jsonl"
        with open(src, "w", encoding="utf-8") as f:
            for w in make_workload(a.n, 0):
                f.write(json.dumps({"id": w.id, "messages": w.messages,
                                    "max_tokens": min(w.max_tokens, a.max_tokens_cap)}) + "\n")
        reference = None
        for k in counts:
            out = Path(tmp) / f"out-{k}.parquet"
            summary = Path(tmp) / f"summary-{k}.json"
            ray.init(num_cpus=k, include_dashboard=False, log_to_driver=False)
            t0 = time.perf_counter()
            try:
                conveyor(["run", str(src), "-o", str(out), "--model", a.model, "--dtype", a.dtype, "--temperature",
                          "0", "--ignore-eos", "--executor", "ray", "--num-workers", str(k), "--quiet",
                          "--summary-json", str(summary)])
            except SystemExit as e:
                if e.code not in (0, None):
                    raise RuntimeError(f"conveyor exited {e.code} with {k} workers") from None
            wall = time.perf_counter() - t0
            ray.shutdown()
            s = json.loads(summary.read_text())
            rows = pq.read_table(out, columns=["id", "output"]).to_pylist()
            if reference is None:
                reference = rows
            same = rows == reference
            results.append({"workers": k, "wall_s": wall, "generation_s": s["elapsed_s"], "load_s": s["load_s"],
                            "completion_tokens": s["completion_tokens"], "tok_s_wall": s["completion_tokens"] / wall,
                            "same_rows_as_1": same})
            print(f"{k} workers: wall {wall:.1f}s (load {s['load_s']:.1f}s, generation {s['elapsed_s']:.1f}s), "
                  f"{s['completion_tokens']} tokens, {s['completion_tokens'] / wall:.0f} tok/s over the wall, "
                  f"rows {'equal' if same else 'DIFFERENT'}", flush=True)
    base = results[0]
    for r in results[1:]:
        print(f"{r['workers']} workers vs {base['workers']}: {base['wall_s'] / r['wall_s']:.2f}x wall, "
              f"{base['generation_s'] / r['generation_s']:.2f}x generation")
    if a.out:
        a.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
