"""bfloat16 against float32 on this CPU, the data behind `--dtype auto`: do bf16's outputs hold up?

    python benchmarks/dtype_check.py                 # the 256-request workload + 60 factual questions
    python benchmarks/dtype_check.py --n 64 --out /tmp/dtype.json

Two measurements, both greedy, both through conveyor's engine in each dtype:

1. Agreement on the benchmark workload (throughput.py's 256 requests, each generating its max_tokens with
   EOS ignored, as the benchmark does): how many bf16 outputs equal float32's token for token, and where
   the first differing token falls (its index, and that index as a fraction of the output's length).
2. Quality on 60 short factual questions (benchmarks/data/factual_qa.jsonl, each with its accepted
   answers): how many each dtype answers right (an accepted answer appears in the reply, case-insensitive),
   and on how many the two agree.

Prints a summary and writes it as JSON (--out, default benchmarks/results/dtype-check.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from roofline import cpu_signature  # noqa: E402
from throughput import build_requests, chat_token_ids  # noqa: E402


def generate(engine, requests) -> dict[str, list[int]]:
    from conveyor.core import GenerationRequest

    return {o.req_id: o.output_token_ids for o in engine.generate(GenerationRequest(i, p, s) for i, p, s in requests)}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256, help="requests of the benchmark workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qa", type=Path, default=HERE / "data" / "factual_qa.jsonl")
    p.add_argument("--qa-tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=HERE / "results" / "dtype-check.json")
    args = p.parse_args()

    from conveyor.core import EngineConfig, SamplingParams
    from conveyor.core.engine import Engine
    from conveyor.core.model_loader import ensure_embedded

    folder = str(ensure_embedded("smollm2-135m-instruct"))
    questions = [json.loads(line) for line in args.qa.read_text(encoding="utf-8").splitlines() if line.strip()]
    outputs = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine.from_pretrained(folder, EngineConfig(dtype=dtype, device="cpu"))
        tok = engine.tokenizer
        work = build_requests(tok, args.n, args.seed, None)
        bench = [(r["id"], r["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                                                 ignore_eos=True)) for r in work]
        qa = [(q["id"], chat_token_ids(tok, q["messages"]), SamplingParams(temperature=0, max_tokens=args.qa_tokens))
              for q in questions]
        outputs[dtype] = {"bench": generate(engine, bench), "qa": generate(engine, qa)}
        print(f"{dtype}: done", file=sys.stderr, flush=True)

    f32, b16 = outputs["float32"], outputs["bfloat16"]
    firsts, fractions = [], []
    for rid, ref in f32["bench"].items():
        i = first_difference(ref, b16["bench"][rid])
        if i is not None:
            firsts.append(i)
            fractions.append(i / len(ref))
    equal = len(f32["bench"]) - len(firsts)

    def right(ids, q):
        text = tok.decode(ids, skip_special_tokens=True).lower()
        return any(a.lower() in text for a in q["answers"])

    rows = []
    for q in questions:
        a, b = f32["qa"][q["id"]], b16["qa"][q["id"]]
        rows.append({"id": q["id"], "question": q["messages"][-1]["content"], "float32_right": right(a, q),
                     "bfloat16_right": right(b, q), "same_tokens": a == b,
                     "float32": tok.decode(a, skip_special_tokens=True), "bfloat16": tok.decode(b, skip_special_tokens=True)})
    quartiles = statistics.quantiles(firsts, n=4) if len(firsts) >= 2 else firsts
    summary = {
        "machine": {"cpu": cpu_signature(), "python": platform.python_version()},
        "workload": {"requests": len(f32["bench"]), "output_tokens": sum(map(len, f32["bench"].values())),
                     "bf16_equal_to_float32": equal,
                     "first_difference_token": {"min": min(firsts, default=None), "quartiles": quartiles,
                                                "max": max(firsts, default=None)},
                     "first_difference_fraction_median": statistics.median(fractions) if fractions else None},
        "factual_qa": {"questions": len(rows), "float32_right": sum(r["float32_right"] for r in rows),
                       "bfloat16_right": sum(r["bfloat16_right"] for r in rows),
                       "both_right": sum(r["float32_right"] and r["bfloat16_right"] for r in rows),
                       "same_tokens": sum(r["same_tokens"] for r in rows), "rows": rows},
    }
    w, q = summary["workload"], summary["factual_qa"]
    print(f"workload: {w['bf16_equal_to_float32']} of {w['requests']} greedy bf16 outputs equal float32's token for "
          f"token; where they differ, the first differing token is at index {w['first_difference_token']['min']}"
          f"..{w['first_difference_token']['max']} (quartiles {w['first_difference_token']['quartiles']}), a median "
          f"{w['first_difference_fraction_median']} of the way through the output")
    print(f"factual questions: float32 {q['float32_right']} / {q['questions']} right, bfloat16 {q['bfloat16_right']}"
          f" / {q['questions']}, both {q['both_right']}; identical replies {q['same_tokens']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
