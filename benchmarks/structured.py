"""Structured outputs' cost: a JSON extraction workload constrained by its schemas against the same records
unconstrained, conveyor and (where its venv exists) vLLM CPU with its own guided decoding, in one run.

    python benchmarks/structured.py                      # 256 records, 4 schemas, 2 rounds, bfloat16
    python benchmarks/structured.py --n 64 --reps 1 --dtype float32 --engines conveyor

Each record asks to extract fields from a short synthetic text (a person, a product, an event, a review;
one JSON schema each). Every engine runs the records twice, each time in a fresh process
(benchmarks/bench_worker.py): first with each record's schema enforced (greedy; the grammar, EOS or
max_tokens ends it), then free, each record generating exactly as many tokens as it did constrained (EOS
ignored): the same work, with and without the grammar. Reported: output tokens/s of each (tokens generated /
wall time), constrained / free,
the share of constrained outputs that parse and validate against their schema (`jsonschema`), and
conveyor's grammar cost measured inside its run: seconds filling and applying token masks per step and
per row, and compile time per distinct schema. Engines and variants alternate over --reps rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from throughput import chat_token_ids, cpu_count, run_one, vllm_command  # noqa: E402

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                                "city": {"type": "string", "maxLength": 30}},
               "required": ["name", "age", "city"], "additionalProperties": False},
    "product": {"type": "object", "properties": {"product": {"type": "string", "maxLength": 40},
                                                 "price": {"type": "number", "minimum": 0},
                                                 "currency": {"enum": ["USD", "EUR", "GBP"]}},
                "required": ["product", "price", "currency"], "additionalProperties": False},
    "event": {"type": "object", "properties": {"event": {"type": "string", "maxLength": 40},
                                               "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                               "place": {"type": "string", "maxLength": 30}},
              "required": ["event", "date", "place"], "additionalProperties": False},
    "review": {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                                "summary": {"type": "string", "maxLength": 60}},
               "required": ["sentiment", "stars", "summary"], "additionalProperties": False},
}
NAMES = ["Maria Lopez", "John Smith", "Aiko Tanaka", "Omar Haddad", "Lena Novak", "Carlos Silva"]
CITIES = ["Madrid", "Boston", "Osaka", "Cairo", "Prague", "Lisbon"]
PRODUCTS = ["wireless headphones", "a steel water bottle", "a desk lamp", "running shoes", "a coffee grinder"]
EVENTS = ["the jazz festival", "the science fair", "the marathon", "the book launch", "the harvest market"]


def make_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = list(SCHEMAS)[i % len(SCHEMAS)]
        if kind == "person":
            text = f"{rng.choice(NAMES)}, {rng.randint(18, 90)}, lives in {rng.choice(CITIES)} and works as a baker."
        elif kind == "product":
            text = (f"Our shop now sells {rng.choice(PRODUCTS)} for {rng.randint(5, 300)}.{rng.randint(0, 99):02d} "
                    f"{rng.choice(['dollars', 'euros', 'pounds'])}.")
        elif kind == "event":
            text = (f"Join us at {rng.choice(EVENTS)} on {rng.randint(2020, 2030)}-{rng.randint(1, 12):02d}-"
                    f"{rng.randint(1, 28):02d} in {rng.choice(CITIES)}.")
        else:
            text = rng.choice(["I loved it, best purchase this year.", "It broke after two days. Avoid.",
                               "It is fine, nothing special.", "Great value and fast delivery!"])
        fields = ", ".join(SCHEMAS[kind]["properties"])
        out.append({"id": f"s{i:04d}", "kind": kind,
                    "messages": [{"role": "user", "content": f"Extract {fields} as JSON from: {text}"}]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="conveyor,vllm")
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=cpu_count())
    p.add_argument("--timeout", type=int, default=7200)
    p.add_argument("--vllm-venv", type=Path, default=HERE / ".venv-vllm")
    p.add_argument("--vllm-eager", action="store_true")
    p.add_argument("--out", type=Path, default=HERE / "results" / "structured.json")
    args = p.parse_args()
    args.baseline_path = None

    import jsonschema
    from transformers import AutoTokenizer

    from conveyor.core.model_loader import ensure_embedded

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if "vllm" in engines and vllm_command(args.vllm_venv, Path("x")) is None:
        print(f"vllm: skipped, no venv at {args.vllm_venv} (run: bash benchmarks/setup_vllm.sh)", file=sys.stderr)
        engines.remove("vllm")
    folder = str(ensure_embedded("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    records = make_records(args.n, args.seed)
    requests = [{"id": r["id"], "prompt_token_ids": chat_token_ids(tokenizer, r["messages"]),
                 "max_tokens": args.max_tokens, "json_schema": json.dumps(SCHEMAS[r["kind"]])} for r in records]
    warmup = [{**r, "id": "warmup-" + r["id"], "max_tokens": 8} for r in requests[-4:]]
    common = {"model": folder, "dtype": args.dtype, "threads": args.threads, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "kv_gib": args.kv_gib, "static_batch": 16,
              "vllm_eager": args.vllm_eager, "return_texts": True}
    variants = ("constrained", "free")
    free_warmup = [{k: v for k, v in w.items() if k != "json_schema"} for w in warmup]
    runs = []
    with tempfile.TemporaryDirectory(prefix="conveyor-structured-") as tmp:
        for rep in range(args.reps):
            for engine in engines:
                produced: dict = {}
                for variant in variants:
                    if variant == "constrained":
                        reqs, spec_extra = requests, {"ignore_eos": False, "warmup": warmup}
                    else:  # the same records, each as many tokens as it generated under its grammar
                        if not produced:
                            continue
                        reqs = [{"id": r["id"], "prompt_token_ids": r["prompt_token_ids"],
                                 "max_tokens": max(1, produced.get(r["id"], 1))} for r in requests]
                        spec_extra = {"ignore_eos": True, "warmup": free_warmup}
                    spec = Path(tmp) / f"{engine}-{variant}.json"
                    spec.write_text(json.dumps({**common, **spec_extra, "requests": reqs}))
                    log = Path(tmp) / f"{engine}-{variant}-{rep}.log"
                    print(f"[rep {rep + 1}/{args.reps}] {engine} {variant} ...", file=sys.stderr, flush=True)
                    res = run_one(engine, spec, args, log)
                    if "error" in res:
                        print(f"  ERROR {res['error']}", file=sys.stderr)
                        for line in res.get("log_tail", []):
                            print(f"    {line}", file=sys.stderr)
                        continue
                    res.update(variant=variant, rep=rep, tok_s=res["output_tokens_produced"] / res["wall_s"])
                    texts = res["extra"].pop("texts", {})
                    if variant == "constrained":
                        produced = res["extra"].pop("produced", {})
                        res["valid"] = sum(_valid(texts.get(r["id"]), r["json_schema"], jsonschema) for r in reqs)
                    print(f"  {engine} {variant}: {res['output_tokens_produced']} tokens in {res['wall_s']:.2f}s = "
                          f"{res['tok_s']:.1f} tok/s" + (f", {res['valid']}/{len(reqs)} valid" if "valid" in res
                                                         else ""), file=sys.stderr, flush=True)
                    runs.append(res)
    summary = {}
    for engine in engines:
        med = {}
        for variant in variants:
            rates = [r["tok_s"] for r in runs if r["engine"] == engine and r["variant"] == variant]
            med[variant] = statistics.median(rates) if rates else None
        valid = [r["valid"] for r in runs if r["engine"] == engine and r["variant"] == "constrained"]
        masks = [r["extra"].get("grammar_masks") for r in runs if r["engine"] == engine and r["variant"] == "constrained"
                 and r["extra"].get("grammar_masks")]
        compile_s = [v for r in runs if r["engine"] == engine for v in r["extra"].get("grammar_compile_s", {}).values()]
        summary[engine] = {"constrained_tok_s": med["constrained"], "free_tok_s": med["free"],
                           "ratio": med["constrained"] / med["free"] if med["constrained"] and med["free"] else None,
                           "valid": valid, "records": len(requests),
                           "mask_ms_per_step": statistics.median(1e3 * m["seconds"] / m["steps"] for m in masks)
                           if masks else None,
                           "mask_us_per_row": statistics.median(1e6 * m["seconds"] / m["rows"] for m in masks)
                           if masks else None,
                           "compile_ms": [round(1e3 * s, 2) for s in compile_s]}
    print(f"\n{'engine':10} {'constrained tok/s':>18} {'free tok/s':>11} {'ratio':>7} {'valid':>12} "
          f"{'mask ms/step':>13} {'mask us/row':>12}")
    for engine, s in summary.items():
        fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
        print(f"{engine:10} {fmt(s['constrained_tok_s'], '18.1f')} {fmt(s['free_tok_s'], '11.1f')} "
              f"{fmt(s['ratio'], '7.2f')} {str(s['valid']):>12} {fmt(s['mask_ms_per_step'], '13.2f')} "
              f"{fmt(s['mask_us_per_row'], '12.1f')}")
        if s["compile_ms"]:
            print(f"  {engine} compile ms per distinct schema: {s['compile_ms']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                    "runs": runs}, indent=2))
    print(f"wrote {args.out}")


def _valid(text: str | None, schema: str, jsonschema) -> bool:
    try:
        jsonschema.validate(json.loads(text), json.loads(schema))
    except Exception:  # noqa: BLE001 - any failure to parse or validate
        return False
    return True


if __name__ == "__main__":
    main()
