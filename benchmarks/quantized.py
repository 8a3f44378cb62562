"""conveyor's quantized routes against its own bf16 route, on a model body of a named size, in one run.

    python benchmarks/quantized.py --body llama-1b --n 32                      # the issue's 32-request workload
    python benchmarks/quantized.py --body smollm2-135m --n 32 --max-tokens-cap 32 --reps 1   # smoke test
    python benchmarks/quantized.py --models bf16=~/.cache/conveyor/models/smollm2-135m-instruct,q4_1=FILE.gguf

A Llama-shaped model of the body's sizes is built with random weights (seeded) and saved once as a bf16 folder and
as quantized folders written from each format's definition (tests/quant_checkpoints.py: compressed-tensors W8A8
int8 with per-token activations, W4A16 in groups of 32, GPTQ 4-bit). Each (variant, round) runs in a fresh process
through `load_model` (the path `conveyor run` takes), variants alternating (A B C A B C ...); the table gives the
median output tok/s and each variant's ratio to bf16's median. `--models NAME=PATH,...` times given models instead
(a GGUF file against its de-quantized folder, say; the one named bf16 is the baseline). vLLM is not installed here: its W8A8 row is
measured where benchmarks/setup_vllm.sh has made its venv (throughput.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

BODIES = {  # Llama-shaped sizes of common checkpoints (tied embeddings)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
}
VARIANTS = ("bf16", "ct-w8a8", "ct-w4a16", "gptq-4")


def build(body: str, folder: Path) -> None:
    """The body's bf16 folder and each quantized variant's, with the SmolLM2 tokenizer (ids above its vocabulary are
    never asked for)."""
    import torch
    import transformers as tf
    from quant_checkpoints import write

    from conveyor.core.model_loader import ensure_embedded

    tok = tf.AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m-instruct"))
    cfg = tf.LlamaConfig(**BODIES[body], max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    for variant in VARIANTS:
        out = folder / variant
        if variant == "bf16":
            model.to(torch.bfloat16).save_pretrained(out)
            model.float()
        else:
            write(model, out, variant)
        tok.save_pretrained(out)


def worker(args) -> None:
    """One variant, one round: load, warm up, time the workload; one JSON line on stdout."""
    import torch
    from workload import make_workload

    from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
    from conveyor.core.engine import Engine
    from conveyor.core.model_loader import load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.path, device="cpu", dtype="bfloat16")
    engine = Engine(model, tok, EngineConfig(device="cpu", dtype="bfloat16", max_num_seqs=args.max_num_seqs,
                                             max_waiting=max(256, args.n)))

    def requests(items):
        out = []
        for r in items:
            ids = tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids if isinstance(ids, list) else ids["input_ids"])
            mt = min(r.max_tokens, args.max_tokens_cap) if args.max_tokens_cap else r.max_tokens
            out.append(GenerationRequest(r.id, ids, SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True)))
        return out

    list(engine.generate(requests(make_workload(4, seed=99))))
    work = requests(make_workload(args.n, args.seed))
    start = time.perf_counter()
    outs = list(engine.generate(work))
    seconds = time.perf_counter() - start
    tokens = sum(len(o.output_token_ids) for o in outs)
    print(json.dumps({"variant": args.worker, "tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
                      "backend": engine.backend.describe(), "exact": engine.backend.exact}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--body", choices=sorted(BODIES), default="llama-1b")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--n", type=int, default=32, help="requests in the workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-tokens-cap", type=int, default=None)
    p.add_argument("--folder", default=None, help="where the folders are (built there once)")
    p.add_argument("--models", default=None, help="NAME=PATH,... to time instead of a built body (bf16= the baseline)")
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.models:
        paths = dict(item.split("=", 1) for item in args.models.split(","))
    else:
        folder = Path(args.folder or tempfile.mkdtemp(prefix=f"quantized-{args.body}-"))
        if not (folder / "bf16" / "config.json").exists():
            build(args.body, folder)
        paths = {v: str(folder / v) for v in args.variants.split(",")}
    variants = list(paths)
    results: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(args.reps):
        for v in variants:
            cmd = [sys.executable, __file__, "--worker", v, "--path", str(Path(paths[v]).expanduser()), "--n", str(args.n),
                   "--seed", str(args.seed), "--threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs)]
            if args.max_tokens_cap:
                cmd += ["--max-tokens-cap", str(args.max_tokens_cap)]
            line = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            r = json.loads(line)
            results[v].append(r["tok_s"])
            print(f"round {rep + 1} {v:10s} {r['tok_s']:8.1f} tok/s  {r['backend']}{'' if r['exact'] else ' (not exact)'}",
                  flush=True)
    base = statistics.median(results["bf16"]) if results.get("bf16") else None
    print(f"\n{args.models or args.body}, {args.n} requests, {args.threads} threads (median of {args.reps})")
    for v, xs in results.items():
        med = statistics.median(xs)
        print(f"{v:10s} {med:8.1f} tok/s" + (f"  {med / base:.2f}x bf16" if base else ""))


if __name__ == "__main__":
    main()
