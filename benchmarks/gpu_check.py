"""GPU check (run by benchmarks/gpu_check.sh): the cuda backend against transformers on one GPU. Needs no network
and no model download.

    python benchmarks/gpu_check.py                       # on a CUDA machine (about 5 minutes on an H200)
    python benchmarks/gpu_check.py --device cpu --tiny   # dry run of every code path on a CPU

Models: randomly initialised Llamas with SmolLM2's vocabulary (49152) saved once to temporary HF folders with a
tokenizer (conveyor's cached SmolLM2 tokenizer when it is cached, else a word-level one built offline): for the
checks, hidden 1024, 16 layers, 16 heads, 4 KV heads (0.28B, float32); for throughput, hidden 1280, 24 layers,
20 heads, 4 KV heads, intermediate 4480 (0.63B, bfloat16). --tiny: hidden 64, 2 layers, vocab 512 for both.
Random weights are enough: equivalence is a property of the engine. Prompts are random token ids.

1. Equivalence (float32, TF32 off): each prompt through `model.generate` alone (greedy, EOS ignored) vs
   conveyor's Engine on all prompts at once, with a roomy pool, a pool small enough to force preemption, and
   a token budget small enough to chunk every prompt. A mismatch reports the first differing position and the
   gap between the two candidates' logits there (a gap near 0 is a float near-tie, not an engine bug).
   Then each decoder family (tests/core/families.py: tiny random models with windows, softcaps, sinks, MoE, q/k
   norms, partial rotary), greedy float32 against transformers' full-recompute forward on a crowded pool.
2. Exactness (bfloat16, seeded sampling at temperature 0.8, top-p 0.95): each record alone, then all records
   batched, chunked at a 48-token budget and preempted; how many records' outputs differ from alone. The
   cuda backend does not promise batch invariance (cuBLAS), so this reports and does not fail. Then speculative
   decoding (float32, greedy, logit-biased outputs that repeat): records equal with and without it at 4 and 64
   rows, draft acceptance and speed (reported, not failed, for the same reason).
3. Throughput (bfloat16): benchmarks/bench_worker.py, one fresh process per engine (conveyor, transformers'
   static batches, transformers' continuous batching = `generate_batch`), --n requests with the benchmark
   workload's max_tokens; each engine's fraction of the GPU's roofline for the workload (steady decode at
   --max-num-seqs rows: weights + KV read at --bandwidth, or 2 x params FLOPs per token at --flops, whichever
   is slower), and conveyor's full-batch steps against their own weight-and-KV read time.
Exit status: 0 when every equivalence prompt matches (near-ties excepted, and reported) and every engine produced
exactly its tokens; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from workload import make_workload  # noqa: E402

RESULT_PREFIX = "BENCH_RESULT "
NEAR_TIE = 1e-3  # logit gap under which a greedy flip is a float effect, not a bug


def model_config(tiny: bool, size: str = "check"):
    from transformers import LlamaConfig

    common = dict(max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=2)
    if tiny:
        return LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=512, **{**common,
                                                                                 "max_position_embeddings": 2048})
    if size == "throughput":
        return LlamaConfig(hidden_size=1280, intermediate_size=4480, num_hidden_layers=24, num_attention_heads=20,
                           num_key_value_heads=4, head_dim=64, vocab_size=49152, **common)
    return LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=64, vocab_size=49152, **common)


def make_tokenizer(vocab_size: int):
    """conveyor's cached SmolLM2 tokenizer if its vocab matches, else a word-level tokenizer made offline."""
    try:
        from conveyor.core.model_source import embedded_model_dir, is_embedded_cached

        if is_embedded_cached("smollm2-135m-instruct"):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(embedded_model_dir("smollm2-135m-instruct")))
            if len(tok) <= vocab_size:
                return tok, "smollm2 (cached)"
    except Exception:
        pass
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="</s>")
    return tok, "word-level (built offline)"


def build_model_folder(folder: Path, tiny: bool, size: str = "check", dtype: str = "float32",
                       device: str = "cpu") -> tuple[dict, str]:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = model_config(tiny, size)
    torch.manual_seed(0)
    with torch.device(device):  # initialising 0.6B weights on the GPU takes seconds, on the CPU a minute
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.save_pretrained(folder)
    tok, kind = make_tokenizer(cfg.vocab_size)
    tok.save_pretrained(folder)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    return {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "intermediate": cfg.intermediate_size,
            "vocab": cfg.vocab_size, "params": n_params, "params_m": round(n_params / 1e6, 1)}, kind


def random_prompts(n: int, vocab: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        out.append([rng.randrange(3, vocab) for _ in range(length)])
    return out


def equivalence(folder: Path, device: str, num_prompts: int, max_tokens: int, tiny: bool, backend: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor.core.config import EngineConfig
    from conveyor.core.engine import Engine
    from conveyor.core.outputs import GenerationRequest
    from conveyor.core.sampling_params import SamplingParams

    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(num_prompts, vocab, seed=1, lo=4, hi=60 if tiny else 300)
    prompts[0] = prompts[0][:1]  # a one-token prompt
    if len(prompts) > 2:
        prompts[2] = prompts[1][:]  # a duplicate: shares every block with prompt 1 (prefix cache)

    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    refs = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.inference_mode():
            out = ref_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_tokens, min_new_tokens=max_tokens)
        refs.append(out[0, len(p):].tolist())

    def logit_gap(prompt, prefix, a, b) -> float:
        ids = torch.tensor([prompt + prefix], device=device)
        with torch.inference_mode():
            logits = ref_model(input_ids=ids).logits[0, -1].float()
        return abs(float(logits[a] - logits[b]))

    tokenizer = AutoTokenizer.from_pretrained(folder)
    block_size = 16
    longest = max(len(p) for p in prompts) + max_tokens
    # name -> (KV blocks, token budget): roomy; a pool that holds one request at a time (preemption); a
    # budget that chunks every prompt longer than 32 tokens
    runs = {"roomy": (None, 256), "preempting": (max(2, math.ceil(longest / block_size) + 1), 256),
            "chunked": (None, 32)}
    report = {"prompts": len(prompts), "max_tokens": max_tokens, "runs": {}}
    ok = True
    for name, (blocks, budget) in runs.items():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        cfg = EngineConfig(dtype="float32", device=device, max_num_seqs=max(2, len(prompts)), block_size=block_size,
                           max_num_batched_tokens=budget, num_kv_blocks=blocks, kv_cache_memory="512MiB",
                           backend=backend)
        engine = Engine(model, tokenizer, cfg)
        reqs = [GenerationRequest(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
                for i, p in enumerate(prompts)]
        outs = {o.req_id: o.output_token_ids for o in engine.generate(reqs)}
        stats = engine.stats()
        rows = []
        for i, (p, ref) in enumerate(zip(prompts, refs)):
            got = outs.get(f"p{i}", [])
            if got == ref:
                rows.append({"prompt": i, "len": len(p), "match": True})
                continue
            pos = next((k for k, (x, y) in enumerate(zip(got, ref)) if x != y), min(len(got), len(ref)))
            gap = logit_gap(p, ref[:pos], got[pos], ref[pos]) if pos < min(len(got), len(ref)) else None
            near_tie = gap is not None and gap < NEAR_TIE
            ok &= near_tie
            rows.append({"prompt": i, "len": len(p), "match": False, "first_diff": pos, "got_len": len(got),
                         "logit_gap": gap, "near_tie": near_tie})
        report["backend"] = engine.backend.describe()
        report["runs"][name] = {"num_kv_blocks": engine.num_kv_blocks, "preemptions": stats.num_preemptions,
                                "prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 3), "rows": rows}
        del engine, model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if report["runs"]["preempting"]["preemptions"] == 0:
        report["note"] = "the small pool did not force a preemption"
    report["ok"] = ok
    return report


class CharTokenizer:
    """Stand-in tokenizer for the tiny models' random token ids: token i decodes to one character; no EOS."""

    eos_token_id = None

    def decode(self, ids, **kwargs):
        return "".join(chr(0x4E00 + int(i)) for i in ids)


def families(device: str, backend: str, names: list[str]) -> dict:
    """Greedy float32 on the backend vs transformers' full-recompute forward (eager attention), for tiny random
    models of each decoder family (tests/core/families.py: windows, softcaps, sinks, MoE, q/k norms, partial
    rotary), with a crowded pool (preemption), chunked prompts and a shared prefix."""
    import torch

    sys.path.insert(0, str(REPO / "tests" / "core"))
    from families import build, prompts

    from conveyor.core.config import EngineConfig
    from conveyor.core.engine import Engine
    from conveyor.core.outputs import GenerationRequest
    from conveyor.core.sampling_params import SamplingParams

    max_tokens = 12
    report = {"families": {}, "ok": True}
    for name in names:
        model = build(name).to(device)
        model.set_attn_implementation("eager")
        want = {}
        with torch.inference_mode():
            for k, p in prompts().items():
                ids = list(p)
                for _ in range(max_tokens):
                    ids.append(int(model(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
                want[k] = ids[len(p):]
        engine = Engine(build(name).to(device), CharTokenizer(),
                        EngineConfig(dtype="float32", device=device, backend=backend, num_kv_blocks=14,
                                     max_num_batched_tokens=32, max_num_seqs=8))
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = {o.req_id: o.output_token_ids for o in engine.generate(
            GenerationRequest(k, p, sampling) for k, p in prompts().items())}
        same = sum(outs[k] == want[k] for k in want)
        report["families"][name] = {"same": same, "prompts": len(want), "backend": engine.backend.describe(),
                                    "preemptions": engine.stats().num_preemptions}
        report["ok"] &= same == len(want)
        del engine, model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return report


def quantized(device: str, backend: str, formats: list[str]) -> dict:
    """Quantized checkpoints (tests/quant_checkpoints.py: compressed-tensors W8A8 / W4A16, GPTQ act-order, AWQ) of a
    tiny random Llama, loaded as `conveyor run` loads them (quantized linears kept on the device): greedy float32
    on the backend (its Triton kernels) against the format's torch forward (transformers' forward over QuantLinear)."""
    import torch

    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO / "tests" / "core"))
    from families import build, prompts
    from quant_checkpoints import write

    from conveyor.core.checkpoint_format import read_scheme
    from conveyor.core.config import EngineConfig
    from conveyor.core.engine import Engine
    from conveyor.core.model_loader import load_config
    from conveyor.core.outputs import GenerationRequest
    from conveyor.core.quant.load import load_quantized
    from conveyor.core.sampling_params import SamplingParams

    max_tokens = 12
    report = {"formats": {}, "ok": True}
    for fmt in formats:
        with tempfile.TemporaryDirectory(prefix=f"conveyor-{fmt}-") as tmp:
            folder = Path(tmp)
            write(build("llama"), folder, fmt)
            cfg = load_config(str(folder))
            dev = torch.device(device)
            model = load_quantized(folder, cfg, read_scheme(cfg), torch.float32, dev, fmt).to(dev)
            model.set_attn_implementation("eager")
            want = {}
            with torch.inference_mode():
                for k, p in prompts().items():
                    ids = list(p)
                    for _ in range(max_tokens):
                        ids.append(int(model(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
                    want[k] = ids[len(p):]
            model.set_attn_implementation("sdpa")
            engine = Engine(model, CharTokenizer(), EngineConfig(dtype="float32", device=device, backend=backend,
                                                                 num_kv_blocks=14, max_num_batched_tokens=32,
                                                                 max_num_seqs=8))
            sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            outs = {o.req_id: o.output_token_ids for o in engine.generate(
                GenerationRequest(k, p, sampling) for k, p in prompts().items())}
            same = sum(outs[k] == want[k] for k in want)
            report["formats"][fmt] = {"same": same, "prompts": len(want), "backend": engine.backend.describe()}
            report["ok"] &= same == len(want) or "w8a8" in fmt  # (W8A8 may part at a near-tie: reported)
            del engine, model
    return report


QUANT_FORMATS = ("ct-w8a8", "ct-w4a16", "gptq-4-asym-desc", "awq")


FAMILIES = ("llama", "qwen2-window", "qwen3", "qwen3-moe", "mistral-window", "mixtral", "gemma", "gemma2", "gemma3",
            "phi3-partial-window", "olmo2", "granite", "smollm3", "exaone4", "starcoder2", "gpt-neox", "gpt2",
            "gpt-oss")


def exactness(folder: Path, device: str, num_prompts: int, max_tokens: int, tiny: bool, backend: str) -> dict:
    """bf16, seeded sampling: each record alone vs batched, chunked and preempted (issue-style exactness)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor.core.config import EngineConfig
    from conveyor.core.engine import Engine
    from conveyor.core.outputs import GenerationRequest
    from conveyor.core.sampling_params import SamplingParams

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(num_prompts, vocab, seed=4, lo=4, hi=60 if tiny else 200)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    block_size = 16
    longest = max(len(p) for p in prompts) + max_tokens

    def sampling(i):
        return SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True)

    def run(indices, **kw):
        cfg = EngineConfig(dtype="bfloat16", device=device, block_size=block_size, backend=backend,
                           kv_cache_memory="1GiB", **{"max_num_seqs": 64, "max_num_batched_tokens": 2048, **kw})
        engine = Engine(model, tokenizer, cfg)
        outs = {o.req_id: o.output_token_ids for o in engine.generate(
            GenerationRequest(f"r{i}", prompts[i], sampling(i)) for i in indices)}
        return outs, engine.stats().num_preemptions

    alone = {}
    for i in range(len(prompts)):
        alone.update(run([i], max_num_seqs=1)[0])
    report = {"records": len(prompts), "max_tokens": max_tokens, "configs": {}}
    configs = {"batched": {}, "chunked-48": {"max_num_batched_tokens": 48},
               "preempted": {"num_kv_blocks": max(2, math.ceil(longest / block_size) + 2)}}
    for name, kw in configs.items():
        outs, preemptions = run(range(len(prompts)), **kw)
        differ = [i for i in range(len(prompts)) if outs[f"r{i}"] != alone[f"r{i}"]]
        report["configs"][name] = {"differ": len(differ), "preemptions": preemptions, "records": differ[:20]}
    return report


def speculation(folder: Path, device: str, num_prompts: int, max_tokens: int, backend: str,
                row_counts: tuple[int, ...]) -> dict:
    """float32, greedy, --speculative ngram against none at `row_counts` rows: the tokens (random weights copy nothing,
    so a logit bias narrows every output to a few tokens, which repeat and make drafts right), the acceptance and
    the time. Reported, not failed: the cuda backend's linears change with a step's row count, and draft rows
    change it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor.core.config import EngineConfig
    from conveyor.core.engine import Engine
    from conveyor.core.outputs import GenerationRequest
    from conveyor.core.sampling_params import SamplingParams

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(num_prompts, vocab, seed=5, lo=8, hi=120)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    bias = {vocab - 3: 30.0, vocab - 2: 30.0, vocab - 1: 29.0}
    report = {"records": len(prompts), "max_tokens": max_tokens, "rows": {}}
    for rows in row_counts:
        got = {}
        for spec in (None, "ngram"):
            engine = Engine(model, tokenizer, EngineConfig(dtype="float32", device=device, backend=backend,
                                                           kv_cache_memory="1GiB", max_num_seqs=rows,
                                                           speculative=spec))
            t0 = time.perf_counter()
            outs = {o.req_id: o.output_token_ids for o in engine.generate(
                GenerationRequest(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                             logit_bias=bias)) for i, p in enumerate(prompts))}
            stats = engine.stats()
            got[spec] = (outs, time.perf_counter() - t0, stats.num_draft_tokens, stats.num_accepted_draft_tokens)
        (off, off_s, _, _), (on, on_s, drafted, accepted) = got[None], got["ngram"]
        report["rows"][rows] = {"same_tokens": sum(on[k] == v for k, v in off.items()), "speedup": off_s / on_s,
                                "draft_tokens": drafted, "accepted": accepted}
    return report


def roofline(shape: dict, work: list[dict], batch: int, bandwidth: float, flops: float, dtype_bytes: int) -> dict:
    """The workload's ceiling on this GPU: steady decode at `batch` rows, each reading the weights once per step
    and its own KV, or doing 2 x params FLOPs per token, whichever takes longer; and the read time of one such
    step at the workload's mean context."""
    kv_per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * dtype_bytes
    weights = shape["params"] * dtype_bytes
    mean_ctx = sum(len(r["prompt_token_ids"]) + r["max_tokens"] / 2 for r in work) / len(work)
    read_s = (weights + batch * mean_ctx * kv_per_token) / bandwidth
    compute_s = 2 * shape["params"] * batch / flops
    step_s = max(read_s, compute_s)
    return {"batch": batch, "mean_context": round(mean_ctx, 1), "weights_bytes": weights,
            "kv_bytes_per_token": kv_per_token, "step_read_s": read_s, "step_compute_s": compute_s,
            "tok_s": batch / step_s, "bandwidth": bandwidth, "flops": flops}


def throughput(folder: Path, device: str, dtype: str, n: int, reps: int, engines: list[str], cap: int | None,
               args) -> list[dict]:
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    work = make_workload(n, 0)
    prompts = random_prompts(n, vocab, seed=2, lo=8, hi=64 if args.tiny else 512)
    reqs = [{"id": w.id, "prompt_token_ids": p, "max_tokens": min(w.max_tokens, cap) if cap else w.max_tokens}
            for w, p in zip(work, prompts)]
    warm = [{"id": f"warmup-{i}", "prompt_token_ids": p, "max_tokens": 8}
            for i, p in enumerate(random_prompts(4, vocab, seed=3, lo=8, hi=64))]
    spec = {"model": str(folder), "dtype": dtype, "device": device, "threads": args.threads,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_gib": args.kv_gib, "static_batch": 16, "requests": reqs, "warmup": warm, "backend": args.backend}
    spec_path = folder / f"spec-{dtype}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    results = []
    for rep in range(reps):
        for e in engines:
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, str(HERE / "bench_worker.py"), "--engine", e, "--spec",
                                   str(spec_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env, cwd=str(REPO), timeout=args.timeout)
            line = next((l for l in reversed(proc.stdout.splitlines()) if l.startswith(RESULT_PREFIX)), None)
            if line is None:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
                results.append({"engine": e, "rep": rep, "error": f"exit {proc.returncode}", "tail": tail})
                print(f"  {e}: ERROR exit {proc.returncode}\n    " + "\n    ".join(tail), flush=True)
                continue
            r = json.loads(line[len(RESULT_PREFIX):])
            r["rep"], r["process_s"] = rep, time.perf_counter() - t0
            results.append(r)
            print(f"  {e}: {r['output_tokens']} tok in {r['wall_s']:.2f}s = {r['tok_s']:.0f} tok/s"
                  f"{'' if r['count_ok'] else ' COUNT MISMATCH'}", flush=True)
    return results, reqs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model and workload (CPU dry run)")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--eq-tokens", type=int, default=48)
    p.add_argument("--n", type=int, default=None, help="throughput requests (default 256; --tiny: 4)")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--engines", default="conveyor,hf-static,hf-cb")
    p.add_argument("--max-tokens-cap", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-gib", type=float, default=8.0)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--timeout", type=int, default=600, help="seconds per engine process")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-exactness", action="store_true")
    p.add_argument("--skip-speculation", action="store_true")
    p.add_argument("--skip-families", action="store_true")
    p.add_argument("--skip-quantized", action="store_true")
    p.add_argument("--families", default=",".join(FAMILIES), help="the decoder families checked (tests/core/families.py)")
    p.add_argument("--exact-records", type=int, default=16)
    p.add_argument("--backend", default="auto", help="conveyor's backend (default: cuda on a GPU)")
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s (H200, measured copy)")
    p.add_argument("--flops", type=float, default=790e12, help="bf16 FLOP/s (H200, measured)")
    p.add_argument("--out", type=Path, default=None, help="JSON report (default: $OUT/gpu_check.json or none)")
    a = p.parse_args()
    if a.tiny:
        a.n = a.n or 4
        a.max_tokens_cap = a.max_tokens_cap or 8
        a.eq_tokens = min(a.eq_tokens, 16)
        a.kv_gib = min(a.kv_gib, 0.25)
        a.max_num_seqs = min(a.max_num_seqs, 64)
        a.max_num_batched_tokens = min(a.max_num_batched_tokens, 512)
        a.exact_records = min(a.exact_records, 6)
        if a.device == "cpu" and a.backend == "auto":  # the dry run takes the cuda backend's code in Triton's
            os.environ.setdefault("TRITON_INTERPRET", "1")  # interpreter
            a.backend = "cuda"
    a.n = a.n or 256

    import torch
    import transformers

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; use --device cpu --tiny for a dry run")
        sys.exit(2)
    dev_name = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    report = {"device": dev_name, "torch": torch.__version__, "transformers": transformers.__version__,
              "cuda": torch.version.cuda}
    print(f"== gpu_check on {dev_name} (torch {torch.__version__}, cuda {torch.version.cuda}, "
          f"transformers {transformers.__version__})", flush=True)
    ok = True
    with tempfile.TemporaryDirectory(prefix="conveyor-gpu-check-") as tmp:
        folder = Path(tmp) / "random-llama"
        shape, tok_kind = build_model_folder(folder, a.tiny)
        report["model"] = {**shape, "tokenizer": tok_kind}
        print(f"model (checks): random Llama {shape}, tokenizer {tok_kind}", flush=True)

        t0 = time.perf_counter()
        eq = equivalence(folder, a.device, a.prompts, a.eq_tokens, a.tiny, a.backend)
        report["equivalence"] = eq
        ok &= eq["ok"]
        print(f"backend: {eq.get('backend')}")
        for name, run in eq["runs"].items():
            matched = sum(r["match"] for r in run["rows"])
            print(f"equivalence float32 [{name}: {run['num_kv_blocks']} blocks, {run['preemptions']} preemptions, "
                  f"prefix hit {run['prefix_cache_hit_rate']}]: {matched}/{len(run['rows'])} prompts identical",
                  flush=True)
            for r in run["rows"]:
                if not r["match"]:
                    print(f"   prompt {r['prompt']} (len {r['len']}): first diff at token {r['first_diff']}, "
                          f"logit gap {r['logit_gap']}, {'near-tie' if r['near_tie'] else 'MISMATCH'}")
        if "note" in eq:
            print(f"   note: {eq['note']}")
        print(f"   ({time.perf_counter() - t0:.0f}s)", flush=True)

        if not a.skip_families:
            t0 = time.perf_counter()
            names = [n.strip() for n in a.families.split(",") if n.strip()]
            if a.tiny and a.device == "cpu":
                names = names[:4]  # the dry run: Triton's interpreter takes seconds a family
            fam = families(a.device, a.backend, names)
            report["families"] = fam
            ok &= fam["ok"]
            for name, r in fam["families"].items():
                print(f"family {name:20s} float32 greedy vs transformers: {r['same']}/{r['prompts']} identical "
                      f"({r['preemptions']} preemptions) [{r['backend']}]", flush=True)
            print(f"   ({time.perf_counter() - t0:.0f}s)", flush=True)

        if not a.skip_quantized:
            t0 = time.perf_counter()
            formats = list(QUANT_FORMATS[:1] + QUANT_FORMATS[2:3]) if a.tiny and a.device == "cpu" else QUANT_FORMATS
            qr = quantized(a.device, a.backend, formats)
            report["quantized"] = qr
            ok &= qr["ok"]
            for fmt, r in qr["formats"].items():
                print(f"quantized {fmt:18s} float32 greedy vs its torch forward: {r['same']}/{r['prompts']} identical "
                      f"[{r['backend']}]", flush=True)
            print(f"   ({time.perf_counter() - t0:.0f}s)", flush=True)

        if not a.skip_exactness:
            t0 = time.perf_counter()
            ex = exactness(folder, a.device, a.exact_records, a.eq_tokens, a.tiny, a.backend)
            report["exactness_bf16"] = ex
            for name, c in ex["configs"].items():
                print(f"exactness bfloat16 [{name}, {c['preemptions']} preemptions]: {ex['records'] - c['differ']}/"
                      f"{ex['records']} records equal to themselves alone", flush=True)
            print(f"   ({time.perf_counter() - t0:.0f}s)", flush=True)

        if not a.skip_speculation:
            t0 = time.perf_counter()
            sp = speculation(folder, a.device, 3 if a.tiny else a.exact_records * 4, 8 if a.tiny else a.eq_tokens * 2,
                             a.backend, (4,) if a.tiny else (4, 64))
            report["speculation_float32"] = sp
            for rows, r in sp["rows"].items():
                print(f"speculation float32 [{rows} rows]: {r['same_tokens']}/{sp['records']} records equal to no "
                      f"speculation, {r['accepted']}/{r['draft_tokens']} draft tokens accepted, "
                      f"{r['speedup']:.2f}x", flush=True)
            print(f"   ({time.perf_counter() - t0:.0f}s)", flush=True)

        if not a.skip_throughput:
            folder = Path(tmp) / "random-llama-throughput"
            t0 = time.perf_counter()
            shape, tok_kind = build_model_folder(folder, a.tiny, "throughput", a.dtype,
                                                 "cuda" if a.device.startswith("cuda") else "cpu")
            report["throughput_model"] = {**shape, "tokenizer": tok_kind}
            print(f"model (throughput): random Llama {shape} ({time.perf_counter() - t0:.0f}s)", flush=True)
            engines = [e.strip() for e in a.engines.split(",") if e.strip()]
            print(f"throughput {a.dtype}, {a.n} requests, reps {a.reps}:", flush=True)
            runs, reqs = throughput(folder, a.device, a.dtype, a.n, a.reps, engines, a.max_tokens_cap, a)
            report["throughput"] = runs
            good = [r for r in runs if "error" not in r]
            ok &= len(good) == len(runs) and all(r["count_ok"] for r in good)
            med = {}
            for e in engines:
                tps = sorted(r["tok_s"] for r in good if r["engine"] == e)
                if tps:
                    med[e] = tps[len(tps) // 2]
            roof = roofline(shape, reqs, a.max_num_seqs, a.bandwidth, a.flops, 2 if a.dtype == "bfloat16" else 4)
            report["roofline"] = roof
            base = med.get("conveyor")
            print(f"roofline ({a.bandwidth / 1e12:.1f} TB/s, {a.flops / 1e12:.0f} TFLOP/s; decode at {roof['batch']} "
                  f"rows, mean context {roof['mean_context']}): {roof['tok_s']:.0f} tok/s")
            print(f"{'engine':<10} {'tok/s':>10} {'conveyor/x':>11} {'of roofline':>12} {'GPU MiB':>9}")
            for e, v in med.items():
                gpu = max((r.get("gpu_peak_allocated_mib") or 0) for r in good if r["engine"] == e)
                print(f"{e:<10} {v:>10.0f} {(f'{base / v:.2f}x' if base else '-'):>11} "
                      f"{v / roof['tok_s']:>11.1%} {gpu:>9.0f}")
            report["throughput_median_tok_s"] = med
            if "hf-cb" in med and base:
                print(f"conveyor vs transformers generate_batch: {base / med['hf-cb']:.2f}x (target >= 5x)")
            full = [r.get("full_batch_steps") for r in good if r["engine"] == "conveyor"]
            full = [f for f in full if f and f.get("steps")]
            if full:
                f = full[0]
                per_step = f["seconds"] / f["steps"]
                ctx = f.get("decode_context") or 0
                read = (roof["weights_bytes"] + a.max_num_seqs * ctx * roof["kv_bytes_per_token"]) / a.bandwidth
                report["full_batch_step"] = {"seconds": per_step, "read_s": read, "ratio": per_step / read,
                                             "decode_context": ctx, "steps": f["steps"]}
                print(f"conveyor full-batch steps ({f['steps']} at {a.max_num_seqs} rows, mean context {ctx:.0f}): "
                      f"{per_step * 1e3:.2f} ms vs {read * 1e3:.2f} ms weight+KV read = {per_step / read:.2f}x "
                      "(target <= 2x)")
    report["ok"] = bool(ok)
    out = a.out or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else None)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(f"wrote {out}")
    print("RESULT:", "OK" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
