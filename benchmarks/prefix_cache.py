"""Prefix caching on a dataset whose records share a ~500-token instruction.

Runs the same workload with prefix caching on and off (each in its own process, alternating,
median of --reps) and prints prompt tokens actually computed, the reduction, and output tokens/s.

    python benchmarks/prefix_cache.py --n 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

_FACTS = [
    "Answers must be short and factual.", "Cite no sources.", "Use plain English.",
    "If a question is ambiguous, state the most common reading and answer it.",
    "Numbers are written as digits.", "Never invent names, dates or figures.",
    "Prefer the metric system and give imperial units in brackets only when asked.",
    "Do not repeat the question.", "Avoid lists unless the question asks for several items.",
    "When a question concerns safety, begin with the safest course of action.",
]


def shared_instruction(num_sentences: int = 60, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(f"Rule {i + 1}: {rng.choice(_FACTS)}" for i in range(num_sentences))


def make_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    topics = ["rivers", "volcanoes", "bread", "bridges", "owls", "tides", "copper", "tea", "glaciers", "comets"]
    instruction = shared_instruction()
    return [{"id": f"p{i}", "messages": [
        {"role": "system", "content": instruction},
        {"role": "user", "content": f"Question {i}: what is one surprising fact about {rng.choice(topics)}?"}],
        "max_tokens": 32} for i in range(n)]


def _child(args: argparse.Namespace) -> None:
    from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
    from conveyor.core.engine import Engine

    engine = Engine.from_pretrained("smollm2-135m-instruct", EngineConfig(
        dtype=args.dtype, device="cpu", max_num_seqs=args.max_num_seqs, enable_prefix_caching=args.caching == "on"))
    tok = engine.tokenizer
    requests = []
    for r in make_records(args.n):
        ids = tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        requests.append(GenerationRequest(r["id"], ids, SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                                                       ignore_eos=True)))
    start = time.perf_counter()
    tokens = sum(o.num_output_tokens for o in engine.generate(requests))
    wall = time.perf_counter() - start
    s = engine.stats()
    print(json.dumps({"caching": args.caching, "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                      "computed_prompt_tokens": s.num_computed_prompt_tokens,
                      "cached_prompt_tokens": s.num_cached_prompt_tokens, "output_tokens": tokens, "wall_s": wall,
                      "tok_s": tokens / wall}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--caching", choices=["on", "off"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.caching:
        return _child(args)
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.reps):
        for mode in ("on", "off"):
            cmd = [sys.executable, __file__, "--caching", mode, "--n", str(args.n), "--dtype", args.dtype,
                   "--max-num-seqs", str(args.max_num_seqs)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            runs[mode].append(json.loads(out))
    on, off = runs["on"][0], runs["off"][0]
    tps = {m: statistics.median(r["tok_s"] for r in rs) for m, rs in runs.items()}
    reduction = 1 - on["computed_prompt_tokens"] / off["computed_prompt_tokens"]
    print(f"prompt tokens: {off['prompt_tokens']}; computed with caching off: {off['computed_prompt_tokens']}, "
          f"on: {on['computed_prompt_tokens']} ({reduction:.1%} fewer)")
    print(f"output tokens/s (median of {args.reps}): off {tps['off']:.1f}, on {tps['on']:.1f} "
          f"({tps['on'] / tps['off']:.2f}x)")


if __name__ == "__main__":
    main()
