"""Peak RSS of a run whose records each carry a distinct small JSON schema: compiled grammars are cached within
bounds, so the peak should stay flat from tens to thousands of distinct schemas.

    python benchmarks/grammar_memory.py                      # 10 and 1000 distinct schemas, SmolLM2, 8 tokens each
    python benchmarks/grammar_memory.py --counts 10,100,1000 --model PATH
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def schema(i: int) -> dict:
    """A small schema of its own: two properties whose names and bounds depend on i."""
    return {"type": "object", "properties": {f"name_{i}": {"type": "string", "maxLength": 8 + i % 7},
                                             f"count_{i}": {"type": "integer", "minimum": i % 5}},
            "required": [f"name_{i}", f"count_{i}"], "additionalProperties": False}


def measure(count: int, model: str, folder: Path) -> dict:
    source = folder / f"schemas-{count}.jsonl"
    with open(source, "w", encoding="utf-8") as f:
        for i in range(count):
            f.write(json.dumps({"id": f"s{i}", "prompt": f"Describe item {i} as JSON.", "guided_json": schema(i)})
                    + "\n")
    # Each measurement in a child of its own: ru_maxrss of the children is the peak of the one that ran.
    probe = ("import resource, subprocess, sys\n"
             "code = subprocess.call(sys.argv[1:])\n"
             "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    command = [sys.executable, "-m", "conveyor.cli", "run", str(source), "-o", str(folder / f"out-{count}.jsonl"),
               "--model", model, "--max-tokens", "8", "--quiet", "--restart"]
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, check=True)
    code, peak_kib = map(int, out.stdout.split()[-2:])  # (the run's summary table comes first)
    return {"schemas": count, "exit_code": code, "peak_rss_mib": round(peak_kib / 1024), "seconds":
            round(time.monotonic() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="10,1000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="conveyor-grammar-memory-") as tmp:
        results = [measure(int(n), args.model, Path(tmp)) for n in args.counts.split(",")]
    for r in results:
        print(f"{r['schemas']:>6} distinct schemas: peak RSS {r['peak_rss_mib']} MiB, {r['seconds']} s, "
              f"exit {r['exit_code']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
