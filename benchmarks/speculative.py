"""Speculative decoding (--speculative ngram) against none, in one process, on two workloads and three batch sizes.

    python benchmarks/speculative.py                       # bf16, both workloads at --max-num-seqs 1, 4 and 64
    python benchmarks/speculative.py --rows 1,4 --skip mixed --k 2,4,6 --out benchmarks/results/spec-k.json

(grounded) The records of sample_data/extract.jsonl: 16 passages, each with 8 tasks that copy from it (repeat,
list its numbers or names, rewrite, extract as JSON, continue, quote), greedy, EOS kept, --grounded-max-tokens.
(mixed) The throughput workload (benchmarks/workload.py: log-uniform prompts of random words, skewed max_tokens),
greedy with EOS ignored.

One model load. Per (workload, rows): --reps rounds of off and each K in --k, alternated (off, K1, K2, ..., off,
...), each a fresh Engine through `Engine.stream`, as a run drives it (the speculator measures its cost curve when
the engine starts, outside the timed part). Reported: output tok/s (median over rounds), its ratio to off, the
draft acceptance rate, and how many requests' tokens equal off's (all must). At one and four rows, the first
--subset-1 / --subset-4 records of a workload keep the run short.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workload import make_workload  # noqa: E402

GROUNDED = HERE.parent / "sample_data" / "extract.jsonl"


def _tokens(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def grounded(tok, args) -> list[tuple[str, list[int], int, bool]]:
    """(id, prompt ids, max_tokens, ignore_eos) of the grounded workload."""
    records = [json.loads(line) for line in GROUNDED.read_text(encoding="utf-8").splitlines()]
    return [(r["id"], _tokens(tok, r["messages"]), args.grounded_max_tokens, False) for r in records]


def mixed(tok, args) -> list[tuple[str, list[int], int, bool]]:
    return [(r.id, _tokens(tok, r.messages), r.max_tokens, True) for r in make_workload(args.n, 0)]


def run_once(model, tok, work, rows: int, k: int | None, args) -> dict:
    from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
    from conveyor.core import engine as engine_module
    from conveyor.core.speculative import SpeculativeConfig

    if k is not None and (args.min_n or args.max_n):
        defaults = SpeculativeConfig(1)
        engine_module.SpeculativeConfig = functools.partial(
            SpeculativeConfig, min_n=args.min_n or defaults.min_n, max_n=args.max_n or defaults.max_n)
    config = EngineConfig(dtype=args.dtype, device="cpu", max_num_seqs=rows, speculative=None if k is None else "ngram",
                          num_speculative_tokens=k)
    engine = engine_module.Engine(model, tok, config)
    engine_module.SpeculativeConfig = SpeculativeConfig
    requests = [GenerationRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=ignore))
                for rid, ids, mt, ignore in work]
    start = time.perf_counter()
    outs = [o for step in engine.stream(requests) for o in step]
    seconds = time.perf_counter() - start
    stats = engine.stats()
    tokens = sum(o.num_output_tokens for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds, "steps": stats.num_forward_steps,
            "draft_tokens": stats.num_draft_tokens, "accepted": stats.num_accepted_draft_tokens,
            "outputs": {o.req_id: o.output_token_ids for o in outs}}


def bench(model, tok, name: str, work, rows: int, args) -> dict:
    variants = [None, *args.k]
    runs: dict[str, list[dict]] = {_label(k): [] for k in variants}
    for rep in range(args.reps):
        for k in variants:
            r = run_once(model, tok, work, rows, k, args)
            runs[_label(k)].append(r)
            rate = r["accepted"] / r["draft_tokens"] if r["draft_tokens"] else 0.0
            print(f"  {name} rows={rows} rep {rep} {_label(k)}: {r['tok_s']:.1f} tok/s, {r['steps']} steps, "
                  f"acceptance {rate:.2f} ({r['accepted']}/{r['draft_tokens']})", flush=True)
    reference = runs["off"][0]["outputs"]
    out = {}
    for label, rs in runs.items():
        med = {key: statistics.median(r[key] for r in rs) for key in ("tok_s", "seconds", "steps", "draft_tokens",
                                                                        "accepted")}
        med["tok_s_range"] = [min(r["tok_s"] for r in rs), max(r["tok_s"] for r in rs)]
        med["acceptance"] = med["accepted"] / med["draft_tokens"] if med["draft_tokens"] else 0.0
        med["same_tokens_as_off"] = min(sum(r["outputs"][i] == v for i, v in reference.items()) for r in rs)
        out[label] = med
    for med in out.values():
        med["vs_off"] = med["tok_s"] / out["off"]["tok_s"]
    out["requests"] = len(work)
    return out


def _label(k: int | None) -> str:
    return "off" if k is None else f"ngram k={k}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", default="1,4,64", help="--max-num-seqs values")
    p.add_argument("--k", default=None, help="draft tokens per step, comma-separated: each is a variant "
                   "(default: the engine's)")
    p.add_argument("--min-n", type=int, default=None, help="shortest match (default: the engine's)")
    p.add_argument("--max-n", type=int, default=None, help="longest match (default: the engine's)")
    p.add_argument("--n", type=int, default=256, help="mixed: requests")
    p.add_argument("--grounded-max-tokens", type=int, default=256)
    p.add_argument("--subset-1", type=int, default=24, help="records at one row")
    p.add_argument("--subset-4", type=int, default=64, help="records at four rows")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--skip", choices=("grounded", "mixed"), default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from conveyor.core import DEFAULT_SPECULATIVE_TOKENS

    args.k = [int(k) for k in (args.k or str(DEFAULT_SPECULATIVE_TOKENS)).split(",")]

    import torch

    from conveyor.core.model_loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m-instruct", device="cpu", dtype=args.dtype)
    result = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "threads": torch.get_num_threads()}
    for name, build in (("grounded", grounded), ("mixed", mixed)):
        if args.skip == name:
            continue
        work = build(tok, args)
        for rows in (int(r) for r in args.rows.split(",")):
            subset = {1: args.subset_1, 4: args.subset_4}.get(rows, len(work))
            print(f"({name}) {min(subset, len(work))} requests at {rows} rows", flush=True)
            result[f"{name}@{rows}"] = bench(model, tok, name, work[:subset], rows, args)
    print("\n| workload | rows | variant | tok/s | vs off | acceptance | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for key, res in result.items():
        if "@" not in key:
            continue
        name, rows = key.split("@")
        for label, m in res.items():
            if label == "requests":
                continue
            print(f"| {name} | {rows} | {label} | {m['tok_s']:.1f} | {m['vs_off']:.2f}x | {m['acceptance']:.2f} | "
                  f"{m['same_tokens_as_off']}/{res['requests']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
