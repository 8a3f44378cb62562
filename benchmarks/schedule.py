"""Scheduling policies against fcfs, in one process, on two workloads.

    python benchmarks/schedule.py                                  # 256 requests + 8 groups x 8 shared-prefix
    python benchmarks/schedule.py --n 96 --max-tokens-cap 32 --out benchmarks/results/schedule-cpu.json

(a) The throughput workload (benchmarks/workload.py: N chat requests, log-uniform prompt lengths, skewed
max_tokens), greedy with EOS ignored; under `priority` each request gets a seeded priority 0-3 (the workload has
none), and the TTFT of priority 0 is reported apart. (b) A shared-prefix workload: --groups groups of
--per-group records, each group's records sharing a long system prompt (--prefix-words), interleaved in the input
(record i is in group i mod groups) so that fcfs mixes the groups, on a KV pool of --prefix-kv-tokens tokens, small
enough that the groups' prefixes do not all stay cached at once.

One model load; one Engine per (workload, policy), run through `Engine.stream` as a run does (its look-ahead
window: the default max(2 x max_num_seqs, 64) unless --lookahead). Per policy: makespan (the wall seconds of the
whole workload), TTFT p50/p99 as the rows give it (`ttft_s`: from the request's arrival in the engine, which the
look-ahead window moves) and from the workload's start, the prefix-cache hit rate, preemptions; and each as a
ratio against fcfs. Policies alternate in --reps rounds (fcfs, priority, sjf, lpm, fcfs, ...); the median is kept.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from prefix_cache import shared_instruction  # noqa: E402
from workload import make_workload  # noqa: E402

POLICIES = ("fcfs", "priority", "sjf", "lpm")
TOPICS = ["rivers", "volcanoes", "bread", "bridges", "owls", "tides", "copper", "tea", "glaciers", "comets"]


def _tokens(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def throughput_workload(tok, args) -> list[tuple[str, list[int], int, int]]:
    """(id, prompt ids, max_tokens, priority) of workload (a)."""
    rng = random.Random(1)
    out = []
    for r in make_workload(args.n, args.seed):
        mt = min(r.max_tokens, args.max_tokens_cap) if args.max_tokens_cap else r.max_tokens
        out.append((r.id, _tokens(tok, r.messages), mt, rng.randrange(4)))
    return out


def prefix_workload(tok, args) -> list[tuple[str, list[int], int, int]]:
    """(id, prompt ids, max_tokens, priority) of workload (b): groups interleaved."""
    rng = random.Random(2)
    instructions = [shared_instruction(args.prefix_words // 6, seed=g) for g in range(args.groups)]
    out = []
    for i in range(args.groups * args.per_group):
        g = i % args.groups
        messages = [{"role": "system", "content": f"Group {g}. {instructions[g]}"},
                    {"role": "user", "content": f"Question {i}: one surprising fact about {rng.choice(TOPICS)}?"}]
        out.append((f"g{g}-{i}", _tokens(tok, messages), args.prefix_max_tokens, rng.randrange(4)))
    return out


def run_once(model, tok, work, policy: str, args, kv_tokens: int | None, max_num_seqs: int) -> dict:
    from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
    from conveyor.core.engine import Engine

    config = EngineConfig(dtype=args.dtype, device="cpu", backend=args.backend, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, schedule=policy,
                          lookahead=args.lookahead if policy != "fcfs" else None,
                          **({"num_kv_blocks": kv_tokens // 16} if kv_tokens else {}))
    engine = Engine(model, tok, config)
    requests = [GenerationRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True),
                                  priority=prio if policy == "priority" else 0) for rid, ids, mt, prio in work]
    priorities = {rid: prio for rid, _, _, prio in work}
    start_wall, start = time.perf_counter(), time.monotonic()
    outs = [o for step in engine.stream(requests) for o in step]
    makespan = time.perf_counter() - start_wall
    assert len(outs) == len(work) and all(o.num_output_tokens == mt for o, (_, _, mt, _) in
                                          zip(sorted(outs, key=lambda o: o.req_id), sorted(work)))
    ttft = sorted(o.ttft_s for o in outs)
    from_start = sorted(o.first_token_time - start for o in outs)
    top = sorted(o.first_token_time - start for o in outs if priorities[o.req_id] == 0)
    stats = engine.stats()
    return {"makespan_s": makespan, "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "first_token_from_start_p50_s": _pct(from_start, 0.5),
            "first_token_from_start_p99_s": _pct(from_start, 0.99),
            "priority0_first_token_from_start_p50_s": _pct(top, 0.5) if top else None,
            "prefix_hit_rate": stats.prefix_cache_hit_rate, "preemptions": stats.num_preemptions,
            "output_tokens": sum(o.num_output_tokens for o in outs),
            "outputs": {o.req_id: o.output_token_ids for o in outs}}


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def bench(model, tok, name: str, work, args, kv_tokens, max_num_seqs) -> dict:
    runs: dict[str, list[dict]] = {p: [] for p in args.policies}
    for rep in range(args.reps):
        for policy in args.policies:
            r = run_once(model, tok, work, policy, args, kv_tokens, max_num_seqs)
            runs[policy].append(r)
            print(f"  {name} rep {rep} {policy}: makespan {r['makespan_s']:.1f} s, ttft p50 {r['ttft_p50_s']:.2f} s "
                  f"p99 {r['ttft_p99_s']:.2f} s, hit rate {r['prefix_hit_rate']:.3f}, preemptions "
                  f"{r['preemptions']}", flush=True)
    reference = runs["fcfs"][0]["outputs"] if "fcfs" in runs else None
    out = {}
    for policy, rs in runs.items():
        keys = [k for k in rs[0] if k != "outputs" and rs[0][k] is not None]
        med = {k: statistics.median(r[k] for r in rs) for k in keys}
        if reference is not None:
            med["same_tokens_as_fcfs"] = sum(rs[0]["outputs"][k] == v for k, v in reference.items())
        out[policy] = med
    base = out.get("fcfs")
    if base:
        for med in out.values():
            med["vs_fcfs"] = {k: (med[k] / base[k] if base[k] else None) for k in
                              ("makespan_s", "ttft_p50_s", "ttft_p99_s", "first_token_from_start_p50_s",
                               "first_token_from_start_p99_s", "prefix_hit_rate")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--n", type=int, default=256, help="workload (a): requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens-cap", type=int, default=None, help="workload (a): cap every max_tokens")
    p.add_argument("--groups", type=int, default=8, help="workload (b): groups sharing a prefix")
    p.add_argument("--per-group", type=int, default=8, help="workload (b): records per group")
    p.add_argument("--prefix-words", type=int, default=360, help="workload (b): words of each group's prefix")
    p.add_argument("--prefix-max-tokens", type=int, default=16, help="workload (b): max_tokens of each record")
    p.add_argument("--prefix-kv-tokens", type=int, default=4096, help="workload (b): KV pool, in tokens")
    p.add_argument("--prefix-max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--lookahead", type=int, default=None, help="the window the policies choose in (default: "
                                                                  "the engine's, max(2 x max_num_seqs, 64))")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--backend", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--skip", choices=("a", "b"), default=None, help="leave one workload out")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.policies = tuple(args.policies.split(","))

    import torch

    from conveyor.core.model_loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m-instruct", device="cpu", dtype=args.dtype)
    result = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "threads": torch.get_num_threads()}
    if args.skip != "a":
        work = throughput_workload(tok, args)
        result["settings"]["a_prompt_tokens"] = sum(len(w[1]) for w in work)
        result["settings"]["a_output_tokens"] = sum(w[2] for w in work)
        print(f"(a) {len(work)} requests", flush=True)
        result["a_throughput_workload"] = bench(model, tok, "a", work, args, None, args.max_num_seqs)
    if args.skip != "b":
        work = prefix_workload(tok, args)
        result["settings"]["b_prompt_tokens"] = sum(len(w[1]) for w in work)
        print(f"(b) {len(work)} requests, prompts {min(len(w[1]) for w in work)}-{max(len(w[1]) for w in work)} "
              "tokens", flush=True)
        result["b_shared_prefix"] = bench(model, tok, "b", work, args, args.prefix_kv_tokens,
                                          args.prefix_max_num_seqs)
    for name in ("a_throughput_workload", "b_shared_prefix"):
        if name not in result:
            continue
        print(f"\n{name}")
        print("| policy | makespan s | vs fcfs | TTFT p50 s | p99 s | p50 vs fcfs | p99 vs fcfs | hit rate | "
              "preemptions |")
        print("|---|---|---|---|---|---|---|---|---|")
        for policy, m in result[name].items():
            v = m.get("vs_fcfs", {})
            print(f"| {policy} | {m['makespan_s']:.1f} | {v.get('makespan_s') or 0:.2f}x | {m['ttft_p50_s']:.2f} | "
                  f"{m['ttft_p99_s']:.2f} | {v.get('ttft_p50_s') or 0:.2f}x | {v.get('ttft_p99_s') or 0:.2f}x | "
                  f"{m['prefix_hit_rate']:.3f} | {m['preemptions']:g} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
