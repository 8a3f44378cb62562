"""A seeded, reproducible benchmark workload: N chat requests with varied prompt lengths and a
skewed max_tokens distribution (many short, few long, clipped to 8..256); every engine must
generate exactly max_tokens tokens per request (ignore EOS), greedily.

    python benchmarks/workload.py --n 256 --out workload.jsonl   # also usable as conveyor input
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which have had are not but "
    "be or an were their one all has been would there what so if about who more when will can into out no "
    "time people year way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education "
    "river mountain ocean forest energy climate market price science theory model data engine memory signal"
).split()

_TASKS = (
    "Summarise the following notes in two sentences:",
    "Explain the main idea of this passage to a ten-year-old:",
    "Write a short title for this text:",
    "List three questions a reader might ask about this:",
    "Rewrite this in plain English:",
    "What is the tone of the following text?",
    "Continue this story:",
    "Translate the key points into bullet points:",
)


@dataclass(frozen=True)
class WorkloadRequest:
    id: str
    messages: list[dict]
    max_tokens: int


def make_workload(n: int = 256, seed: int = 0, min_words: int = 3, max_words: int = 300,
                  min_tokens: int = 8, max_tokens: int = 256) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        # prompt length log-uniform: many short prompts, some long ones
        num_words = int(math.exp(rng.uniform(math.log(min_words), math.log(max_words))))
        text = " ".join(rng.choice(_WORDS) for _ in range(num_words))
        content = f"{rng.choice(_TASKS)} {text}" if num_words > 12 else text.capitalize() + "?"
        # output length: log-normal skew (median ~32), clipped to [min_tokens, max_tokens]
        mt = int(min(max_tokens, max(min_tokens, round(rng.lognormvariate(math.log(32), 0.9)))))
        out.append(WorkloadRequest(f"w{i:05d}", [{"role": "user", "content": content}], mt))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="workload.jsonl")
    a = p.parse_args()
    with open(a.out, "w", encoding="utf-8") as f:
        for r in make_workload(a.n, a.seed):
            f.write(json.dumps({"id": r.id, "messages": r.messages, "max_tokens": r.max_tokens,
                                "ignore_eos": True, "temperature": 0}) + "\n")
    print(f"wrote {a.n} requests to {a.out}")


if __name__ == "__main__":
    main()
