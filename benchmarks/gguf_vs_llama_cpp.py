"""conveyor against llama.cpp (llama-cpp-python) on one GGUF file, one sequence at a time, in one run.

    pip install --no-binary :all: llama-cpp-python      # built from its sdist for this CPU (minutes)
    python benchmarks/gguf_vs_llama_cpp.py --gguf FILE.gguf --n 16 --max-tokens 64
    python benchmarks/gguf_vs_llama_cpp.py --gguf FILE.gguf --requantize Q4_0    # a Q4_0 copy made by llama.cpp first

Both engines get the same prompts as token ids (the benchmark workload's chat requests through the file's chat
template), greedy, every request `--max-tokens` tokens (llama.cpp's `generate` does not stop at EOS; conveyor's
requests ignore it), on `--threads` threads. llama-cpp-python's high-level API decodes one sequence at a time,
so conveyor runs with one sequence at a time too (`max_num_seqs=1`), the same number of parallel sequences; its
batched figure (every request at once) is printed beside it. Engines alternate (A B A B), each in a fresh process;
the table gives median output tok/s and conveyor's ratio.
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


def prompt_ids(gguf: Path, n: int, seed: int) -> list[list[int]]:
    from transformers import AutoTokenizer
    from workload import make_workload

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out = []
    for r in make_workload(n, seed):
        ids = tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def run_conveyor(args, prompts: list[list[int]], parallel: int) -> float:
    import torch

    from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
    from conveyor.core.engine import Engine
    from conveyor.core.model_loader import load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.gguf, device="cpu", dtype=args.dtype)
    engine = Engine(model, tok, EngineConfig(device="cpu", dtype=args.dtype, max_num_seqs=parallel))
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    list(engine.generate([GenerationRequest("warm", prompts[0][:16], SamplingParams(temperature=0.0, max_tokens=4))]))
    start = time.perf_counter()
    outs = list(engine.generate(GenerationRequest(f"r{i}", p, sampling) for i, p in enumerate(prompts)))
    seconds = time.perf_counter() - start
    return sum(len(o.output_token_ids) for o in outs) / seconds


def run_llama_cpp(args, prompts: list[list[int]]) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=args.gguf, n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                verbose=False)
    for _ in zip(range(4), llm.generate(prompts[0][:16], top_k=1, temp=0.0)):
        pass
    tokens, start = 0, time.perf_counter()
    for p in prompts:
        llm.reset()
        for i, _ in enumerate(llm.generate(p, top_k=1, temp=0.0, reset=True)):
            tokens += 1
            if i + 1 == args.max_tokens:
                break
    return tokens / (time.perf_counter() - start)


def requantize(gguf: str, kind: str) -> str:
    import llama_cpp

    out = str(Path(gguf).with_suffix(f".{kind}.gguf"))
    if not Path(out).exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
        params.allow_requantize = True
        params.nthread = 2
        if llama_cpp.llama_model_quantize(gguf.encode(), out.encode(), params) != 0:
            raise SystemExit(f"llama.cpp could not quantize {gguf} to {kind}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--requantize", default=None, help="a llama.cpp type (Q4_0, Q8_0, ...) to convert the file to first")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.requantize and not args.worker:
        args.gguf = requantize(args.gguf, args.requantize)
    prompts = prompt_ids(Path(args.gguf), args.n, args.seed)
    if args.worker:
        rate = run_llama_cpp(args, prompts) if args.worker == "llama.cpp" else \
            run_conveyor(args, prompts, 1 if args.worker == "conveyor" else len(prompts))
        print(json.dumps({"engine": args.worker, "tok_s": rate}))
        return
    engines = ("conveyor", "llama.cpp", "conveyor-batched")
    results: dict[str, list[float]] = {e: [] for e in engines}
    for rep in range(args.reps):
        for e in engines:
            cmd = [sys.executable, __file__, "--worker", e, "--gguf", args.gguf, "--n", str(args.n), "--seed",
                   str(args.seed), "--max-tokens", str(args.max_tokens), "--threads", str(args.threads), "--dtype",
                   args.dtype]
            line = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            results[e].append(json.loads(line)["tok_s"])
            print(f"round {rep + 1} {e:17s} {results[e][-1]:8.1f} tok/s", flush=True)
    base = statistics.median(results["llama.cpp"])
    print(f"\n{Path(args.gguf).name}, {args.n} requests of {args.max_tokens} tokens, {args.threads} threads "
          f"(median of {args.reps})")
    for e, xs in results.items():
        print(f"{e:17s} {statistics.median(xs):8.1f} tok/s  {statistics.median(xs) / base:.2f}x llama.cpp")


if __name__ == "__main__":
    main()
