"""Each decoder family's fused forward against the Llama-shaped one, at SmolLM2-135M's sizes, in one run.

    python benchmarks/families.py --dtype bfloat16                   # every shape, 256 requests, 2 rounds
    python benchmarks/families.py --shapes llama,gemma3 --n 32 --reps 1 --max-tokens-cap 16   # smoke test

A model of each shape is built from its transformers config with SmolLM2-135M-Instruct's sizes (hidden 576, 30
layers, 9 query and 3 KV heads of 64, MLP 1536, vocabulary 49152, tied embeddings) and random weights (seeded),
with each family's own features on: Qwen3's q/k norms; Qwen3-MoE's experts (8 of 192 wide, 2 per token: the
dense shapes' MLP weights split into experts, so the same 135M parameters); Gemma's norms, GELU-tanh and embedding scale, Gemma 2's sandwich norms and
softcaps (attention 50, final 30) on alternate 4096-token windows, Gemma 3's q/k norms and five of six layers on a
512-token window; Phi-3's fused q/k/v and gate/up; OLMo-2's norms after the sublayers; Granite's multipliers;
Mistral's 512-token window on every layer. The workload is benchmarks/workload.py's (--n chat requests through
the SmolLM2 tokenizer's chat template, greedy, EOS ignored, so every shape generates the same tokens' worth).

Each (shape, round) runs in a fresh process, shapes alternating (A B C A B C ...); the table gives the median
output tok/s, its spread, and each shape's ratio to the Llama shape's median. The forward each took is printed
(`cpu (fused ... forward)`): a shape that fell back to its transformers forward would say so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SIZES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
             eos_token_id=2, pad_token_id=2)
SHAPES = ("llama", "qwen3", "qwen3-moe", "gemma", "gemma2", "gemma3", "phi3", "olmo2", "granite", "mistral-window")


def config_of(shape: str):
    import transformers as tf

    s = SIZES
    return {
        "llama": lambda: tf.LlamaConfig(**s),
        "qwen3": lambda: tf.Qwen3Config(**s, head_dim=64),
        "qwen3-moe": lambda: tf.Qwen3MoeConfig(**s, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=192),
        "gemma": lambda: tf.GemmaConfig(**s, head_dim=64),
        "gemma2": lambda: tf.Gemma2Config(**s, head_dim=64, query_pre_attn_scalar=64, sliding_window=4096),
        "gemma3": lambda: tf.Gemma3TextConfig(**s, head_dim=64, query_pre_attn_scalar=64, sliding_window=512),
        "phi3": lambda: tf.Phi3Config(**s),
        "olmo2": lambda: tf.Olmo2Config(**s),
        "granite": lambda: tf.GraniteConfig(**s, embedding_multiplier=12.0, residual_multiplier=0.22,
                                            attention_multiplier=0.015625, logits_scaling=2.25),
        "mistral-window": lambda: tf.MistralConfig(**s, sliding_window=512),
    }[shape]()


def worker(args) -> None:
    """One shape, one round: build, warm up, time the workload; one JSON line on stdout."""
    import torch
    import transformers as tf
    from workload import make_workload

    from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
    from conveyor.core.engine import Engine
    from conveyor.core.model_loader import ensure_embedded

    torch.set_num_threads(args.threads)
    tok = tf.AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m-instruct"))
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config_of(args.worker), dtype=getattr(torch, args.dtype)).eval()
    engine = Engine(model, tok, EngineConfig(device="cpu", dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                                             max_waiting=max(256, args.n)))

    def requests(items):
        out = []
        for r in items:
            ids = tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids if isinstance(ids, list) else ids["input_ids"])
            mt = min(r.max_tokens, args.max_tokens_cap) if args.max_tokens_cap else r.max_tokens
            out.append(GenerationRequest(r.id, ids, SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True)))
        return out

    list(engine.generate(requests(make_workload(8, seed=99))))
    work = requests(make_workload(args.n, args.seed))
    start = time.perf_counter()
    outs = list(engine.generate(work))
    seconds = time.perf_counter() - start
    tokens = sum(len(o.output_token_ids) for o in outs)
    assert tokens == sum(r.sampling.max_tokens for r in work)
    print(json.dumps({"shape": args.worker, "tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
                      "backend": engine.backend.describe(), "exact": engine.backend.exact,
                      "params": sum(p.numel() for p in model.parameters())}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--max-tokens-cap", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON of every run (default benchmarks/results/families-<dtype>.json)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    runs: dict[str, list[dict]] = {s: [] for s in shapes}
    passthrough = ["--dtype", args.dtype, "--n", str(args.n), "--seed", str(args.seed), "--max-num-seqs",
                   str(args.max_num_seqs), "--threads", str(args.threads)]
    if args.max_tokens_cap:
        passthrough += ["--max-tokens-cap", str(args.max_tokens_cap)]
    for rep in range(args.reps):
        for shape in shapes:
            done = subprocess.run([sys.executable, __file__, "--worker", shape, *passthrough], capture_output=True,
                                  text=True, check=False)
            if done.returncode != 0:
                sys.exit(f"{shape}: the worker failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[shape].append(result)
            print(f"round {rep + 1} {shape:15s} {result['tok_s']:7.1f} tok/s  {result['backend']}", flush=True)
    base = statistics.median(r["tok_s"] for r in runs[shapes[0]])
    print(f"\n{'shape':15s} {'tok/s':>8s} {'range':>15s} {'vs ' + shapes[0]:>10s}  params  forward")
    for shape in shapes:
        rates = [r["tok_s"] for r in runs[shape]]
        med = statistics.median(rates)
        print(f"{shape:15s} {med:8.1f} {min(rates):7.1f}-{max(rates):<7.1f} {med / base:9.2f}x  "
              f"{runs[shape][0]['params'] / 1e6:5.0f}M  {runs[shape][0]['backend']}")
    out = Path(args.out or HERE / "results" / f"families-{args.dtype}.json")
    out.write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
