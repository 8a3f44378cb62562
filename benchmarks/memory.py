"""Memory stays flat with input size: peak RSS of a resumed run over N_LARGE short records vs a whole
run over N_SMALL records (records stream: memory does not grow with the size of the input).

    python benchmarks/memory.py                       # 20k vs 200k records (several minutes)
    python benchmarks/memory.py --n-small 2000 --n-large 20000

Steps: build a tiny random Llama folder (with the embedded tokenizer), write two JSONL files of
short raw prompts, run `conveyor run --max-tokens 1 --quiet` on the small one, run it on the large
one and stop it with SIGTERM once half of its records are committed, then resume it to the end.
Each child's own peak RSS comes from os.wait4 (RUSAGE_CHILDREN would give the maximum over every
child so far). Passes (exit 0) when the resumed large run peaks within --tolerance (10%) of the
small run. Not a test: it takes minutes and measures the machine as much as the code.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONVEYOR = [sys.executable, "-m", "conveyor.cli"]
WORDS = ["red", "blue", "green", "river", "stone", "cloud", "tree", "light", "paper", "glass", "salt", "wind"]


def build_tiny_model(folder: Path) -> Path:
    """The same tiny model as tests/cli/conftest.py: 2 layers, hidden 64, SmolLM2's tokenizer."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from conveyor.core.model_loader import ensure_embedded

    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m-instruct"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_records(path: Path, n: int) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            words = " ".join(WORDS[(i * k + k) % len(WORDS)] for k in range(1, 5))
            f.write(json.dumps({"id": f"r{i}", "prompt": f"{words} {i}"}) + "\n")
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _committed(run_dir: Path) -> int:
    from conveyor.io.state.journal import Journal

    try:
        with Journal(run_dir / "journal.sqlite", read_only=True, verify=False) as journal:
            return journal.num_committed()
    except Exception:  # noqa: BLE001 - not created yet
        return 0


def run_measured(args: list[str], log: Path, stop_when=None) -> tuple[int, float, float]:
    """Run `conveyor ARGS`; SIGTERM it once `stop_when()` holds. -> (exit code, peak RSS MiB, seconds)."""
    start = time.monotonic()
    with open(log, "wb") as err:
        proc = subprocess.Popen([*CONVEYOR, *args], stdout=subprocess.DEVNULL, stderr=err, env=_env())
    status = usage = None
    while status is None:
        pid, raw_status, raw_usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            status, usage = raw_status, raw_usage
            break
        if stop_when is not None and stop_when():
            proc.send_signal(signal.SIGTERM)
            stop_when = None
        time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    return proc.returncode, usage.ru_maxrss / 1024, time.monotonic() - start  # ru_maxrss is KiB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-small", type=int, default=20_000)
    parser.add_argument("--n-large", type=int, default=200_000)
    parser.add_argument("--tolerance", type=float, default=0.10, help="allowed growth of the peak RSS")
    parser.add_argument("--work-dir", type=Path, help="keep files here (default: a temporary folder)")
    parser.add_argument("--output-format", default="parquet", choices=("parquet", "jsonl"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="conveyor-memory-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = build_tiny_model(work / "tiny-model")
        common = ["--model", str(model), "--max-tokens", "1", "--quiet", "--kv-cache-memory", "64MiB",
                  "--checkpoint-every", "1000"]
        ext = args.output_format

        small_in = write_records(work / "small.jsonl", args.n_small)
        small_out = work / f"small.{ext}"
        code, small_rss, small_s = run_measured(["run", str(small_in), "-o", str(small_out), *common],
                                                work / "small.log")
        print(f"small: {args.n_small} records, exit {code}, peak RSS {small_rss:.0f} MiB, {small_s:.0f} s")
        if code != 0:
            print((work / "small.log").read_text()[-2000:], file=sys.stderr)
            return 2

        large_in = write_records(work / "large.jsonl", args.n_large)
        large_out = work / f"large.{ext}"
        run_dir = work / f"large.{ext}.conveyor"
        half = args.n_large // 2
        large_args = ["run", str(large_in), "-o", str(large_out), *common]
        code, first_rss, first_s = run_measured(large_args, work / "large-1.log",
                                                stop_when=lambda: _committed(run_dir) >= half)
        done = _committed(run_dir)
        print(f"large, first part: exit {code} after {done}/{args.n_large} records, peak RSS {first_rss:.0f} MiB, "
              f"{first_s:.0f} s")
        if code != 75:
            print(f"expected exit 75 (stopped by SIGTERM); see {work / 'large-1.log'}", file=sys.stderr)
            return 2
        code, resumed_rss, resumed_s = run_measured(large_args, work / "large-2.log")
        print(f"large, resumed: exit {code}, peak RSS {resumed_rss:.0f} MiB, {resumed_s:.0f} s")
        if code != 0:
            print((work / "large-2.log").read_text()[-2000:], file=sys.stderr)
            return 2

        ratio = resumed_rss / small_rss
        ok = ratio <= 1 + args.tolerance
        print(f"peak RSS ratio resumed {args.n_large} / whole {args.n_small}: {ratio:.3f} "
              f"({'within' if ok else 'OVER'} {args.tolerance:.0%})")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
