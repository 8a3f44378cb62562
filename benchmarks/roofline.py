"""Roofline ceiling for SmolLM2-135M decode on this machine: measured matmul rate and memory bandwidth.

    python benchmarks/roofline.py                 # writes benchmarks/roofline.json (read by throughput.py)
    python benchmarks/roofline.py --batch 64 --quick --out /tmp/roofline.json

Measured, per dtype (float32, bfloat16), with --threads threads:

  matmul rate R(M)  GFLOP/s of one "model step" of M tokens: for every linear layer of the model, with the
                    model's own weight shapes (read from the cached folder's config.json: q/k/v, o, gate/up,
                    down per layer, q/k/v and gate/up each one concatenated matmul as engines run them, and
                    the LM head), x[M, in] @ W[out, in].T, timed together; R(M) = sum of
                    2*M*in*out over the shapes / best time of the set. Timed through every implementation
                    available here, and R(M) is the fastest: torch's `F.linear` (MKL / oneDNN), oneDNN with
                    the weights prepacked once (`mkldnn._reorder_linear_weight`), conveyor's panel kernel
                    (`panel_gemm`), in bf16 its pair kernel (`pair_gemm`, AVX512-BF16) and, on CPUs with AMX,
                    its tile kernel (`amx_gemm`). A ceiling must bound every engine, conveyor's kernels included: with
                    torch's rate alone, conveyor's float32 decode steps ran above the "ceiling". Measured
                    at M = --ms (default 1, 8, 16, 32, 64, 256, 2048; 2048 is a prompt step of the default
                    token budget) and at the decode batch B. The weights (~135M params: 540 MB in fp32) do not
                    fit in cache, so R(M) includes the cost of streaming them at small M.
  bandwidth BW      GB/s reading a large tensor (`t.sum()` over --bw-mib MiB, bytes read / best time), and the
                    copy rate (`dst.copy_(src)`, 2 bytes moved per byte copied) for reference. The ceiling uses
                    the read rate: decode streams the weights, it does not write them.

Ceiling at a decode batch of B tokens per step (B requests, one new token each):

    P         = number of weight parameters touched per token: sum over linear layers of in*out
                (30 layers x (q 576x576 + k 576x192 + v 576x192 + o 576x576 + gate/up/down 3 x 576x1536))
                + LM head 576x49152 (tied to the embedding). Norm weights and the embedding lookup are ignored.
    flops     = 2 * P * B                                 (one multiply-add per parameter per token)
    t_compute = flops / R(B)
    t_memory  = P * bytes_per_element(dtype) / BW         (every weight read once per step)
              + B * C * kv_bytes_per_token / BW           (KV read, only with --context C > 0; default 0)
    t_step    = max(t_compute, t_memory)
    ceiling   = B / t_step   output tokens/s

With --context C > 0, attention adds 4 * L * n_heads * head_dim * C flops per token to `flops` and the KV
term above to t_memory (kv_bytes_per_token = L * 2 * n_kv_heads * head_dim * bytes_per_element); the default
(C = 0) is the weights-only bound, an upper bound on any engine's decode throughput at batch B.

The workload's steady-state ceiling (`workload_ceiling`, used by throughput.py with the workload's own
numbers): B requests always decoding (the step above, with the workload's mean decode context C), and for
each output token the workload's prompt tokens per output token prefilled at R(prompt step). Time per output
token = t_step / B + (prompt / output tokens) * t_prompt_token; the ceiling is its inverse. A whole run also
has a ramp-down (its last requests decode in small, weight-read-bound batches) that the steady state has not.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what decides which matmul kernels run here


def cpu_signature() -> str:
    """Model name and the matmul-relevant instruction sets, e.g. "AMD EPYC (avx2 avx512f avx512_bf16)":
    two machines with the same signature run the same kernels; rates from another signature do not apply."""
    from conveyor.core.backends.cpu.kernels import cpu_identity

    model, flags = cpu_identity()
    return f"{model} ({' '.join(f for f in _ISA_FLAGS if f in flags) or 'flags unknown'})"


def model_shapes(cfg: dict) -> tuple[list[tuple[int, int]], int]:
    """[(in, out), ...] of every linear layer, and the layer count they repeat over (lm head separate)."""
    h = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    kvh = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or h // nh
    inter = cfg["intermediate_size"]
    per_layer = [(h, nh * hd), (h, kvh * hd), (h, kvh * hd), (nh * hd, h), (h, inter), (h, inter), (inter, h)]
    return per_layer, cfg["num_hidden_layers"]


def timed_shapes(cfg: dict) -> tuple[list[tuple[int, int]], int]:
    """model_shapes with q/k/v and gate/up each concatenated into one matmul, as engines run them (vLLM's
    QKVParallelLinear / MergedColumnParallelLinear, conveyor's fused forward): same FLOPs, fewer calls."""
    (q, k, v, o, gate, up, down), layers = model_shapes(cfg)
    return [(q[0], q[1] + k[1] + v[1]), o, (gate[0], gate[1] + up[1]), down], layers


def params_per_token(cfg: dict) -> int:
    per_layer, layers = model_shapes(cfg)
    return layers * sum(i * o for i, o in per_layer) + cfg["hidden_size"] * cfg["vocab_size"]


def time_best(fn, min_time: float, repeats: int) -> float:
    """Best over `repeats` of the mean time per call, each repeat running for at least min_time seconds."""
    fn()
    fn()
    best = float("inf")
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            el = time.perf_counter() - t0
            if el >= min_time:
                break
        best = min(best, el / n)
    return best


IMPLS = ("torch", "onednn", "panels", "pairs", "amx")


def _linear_impl(torch, impl: str, dtype, m: int):
    """(prepare(W) -> packed, run(x, packed)) for one matmul implementation, or None where it does not apply."""
    if impl == "torch":
        return (lambda w: w), torch.nn.functional.linear
    if impl == "onednn":  # oneDNN with the weight prepacked once (conveyor's bf16 route above a few rows)
        try:
            if not torch.backends.mkldnn.is_available():
                return None
            if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return None
            w = torch.randn(64, 64).to(dtype)
            torch.ops.mkldnn._linear_pointwise(torch.randn(2, 64).to(dtype),
                                               torch.ops.mkldnn._reorder_linear_weight(w, 64), None, "none", [], "")
        except (RuntimeError, AttributeError):
            return None
        return ((lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 64)),
                (lambda x, pw: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")))
    if impl in ("panels", "pairs", "amx"):  # conveyor's own kernels, where built (and the CPU has the instructions)
        try:
            from conveyor.core.backends.cpu import linears
            from conveyor.core.backends.cpu.kernels import cpu_kernels
        except ImportError:
            return None
        ops = cpu_kernels()
        if ops is None:
            return None
        if impl == "panels":  # float multiply-adds over weights in 32-column panels
            pack, gemm = linears.pack_panels, ops.panel_gemm
        elif impl == "pairs":  # bf16 pair products (AVX512-BF16)
            if dtype != torch.bfloat16 or not ops.pair_gemm_available():
                return None
            pack, gemm = linears.pack_pairs, ops.pair_gemm
        else:  # the tile kernel, bf16 only (weights in tile layout)
            if dtype != torch.bfloat16 or not ops.amx_gemm_available():
                return None
            pack, gemm = linears.pack_amx, ops.amx_gemm
        return (lambda w: (pack(w), w.shape[0])), (lambda x, pw: gemm(x, pw[0], pw[1], None))
    raise ValueError(impl)


def matmul_rate(torch, cfg: dict, dtype, m: int, min_time: float, repeats: int, impl: str = "torch") -> dict | None:
    """GFLOP/s of all the model's linear shapes at M tokens (one model step's matmuls, layers deduplicated:
    each distinct layer's weight is its own tensor, so per-layer weights are streamed as in the model),
    through one implementation (None where it does not apply)."""
    fns = _linear_impl(torch, impl, dtype, m)
    if fns is None:
        return None
    prepare, run = fns
    per_layer, layers = timed_shapes(cfg)
    shapes = [s for _ in range(layers) for s in per_layer] + [(cfg["hidden_size"], cfg["vocab_size"])]
    gen = torch.Generator().manual_seed(0)
    try:
        weights = [prepare(torch.randn(o, i, generator=gen, dtype=torch.float32).to(dtype) * 0.02) for i, o in shapes]
    except ValueError:  # a shape this implementation does not take (AMX: K not a multiple of 32)
        return None
    xs = {i: torch.randn(m, i, generator=gen, dtype=torch.float32).to(dtype) for i in {s[0] for s in shapes}}

    def step():
        for (i, _o), w in zip(shapes, weights):
            run(xs[i], w)

    with torch.inference_mode():
        t = time_best(step, min_time, repeats)
    flops = 2 * m * sum(i * o for i, o in shapes)
    return {"m": m, "seconds": t, "gflops": flops / t / 1e9, "impl": impl}


def best_matmul_rate(torch, cfg: dict, dtype, m: int, min_time: float, repeats: int) -> dict:
    """The fastest of IMPLS at M (the ceiling must bound every engine, conveyor's own kernels included)."""
    found = [r for impl in IMPLS if (r := matmul_rate(torch, cfg, dtype, m, min_time, repeats, impl)) is not None]
    best = dict(max(found, key=lambda r: r["gflops"]))
    best["by_impl"] = {r["impl"]: r["gflops"] for r in found}
    return best


def bandwidth(torch, mib: int, min_time: float, repeats: int) -> dict:
    n = mib * 1024 * 1024 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    with torch.inference_mode():
        t_read = time_best(lambda: src.sum(), min_time, repeats)
        t_copy = time_best(lambda: dst.copy_(src), min_time, repeats)
    return {"bytes": nbytes, "read_gbs": nbytes / t_read / 1e9, "copy_gbs": 2 * nbytes / t_copy / 1e9}


def ceiling(cfg: dict, dtype_name: str, rate_gflops: float, bw_gbs: float, batch: int, context: int) -> dict:
    elem = 4 if dtype_name == "float32" else 2
    p = params_per_token(cfg)
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // nh
    kvh = cfg.get("num_key_value_heads") or nh
    layers = cfg["num_hidden_layers"]
    flops = 2 * p * batch + 4 * layers * nh * hd * context * batch
    kv_bytes = batch * context * layers * 2 * kvh * hd * elem
    t_compute = flops / (rate_gflops * 1e9)
    t_memory = (p * elem + kv_bytes) / (bw_gbs * 1e9)
    t_step = max(t_compute, t_memory)
    return {"params_per_token": p, "flops_per_step": flops, "weight_bytes": p * elem, "kv_bytes_per_step": kv_bytes,
            "t_compute_s": t_compute, "t_memory_s": t_memory, "bound": "compute" if t_compute >= t_memory else "memory",
            "tok_s": batch / t_step}


def prefill_params_per_token(cfg: dict) -> int:
    """Weights a prompt token multiplies: the decoder layers (the LM head runs on sampled rows only)."""
    per_layer, layers = model_shapes(cfg)
    return layers * sum(i * o for i, o in per_layer)


def rate_at(rates: list[dict], m: int) -> dict:
    """The measured rate at the largest measured M <= m (or the smallest M measured)."""
    below = [r for r in rates if r["m"] <= m]
    return max(below, key=lambda r: r["m"]) if below else min(rates, key=lambda r: r["m"])


def workload_ceiling(cfg: dict, dtype_name: str, rates: list[dict], bw_gbs: float, batch: int, prefill_m: int,
                     prompt_per_output: float, decode_context: float, prompt_context: float) -> dict:
    """Output tokens/s ceiling of a workload's steady state: `batch` requests always decoding (each step's
    matmuls at R(batch), KV of `decode_context` tokens per request read once), and, for every output token,
    `prompt_per_output` prompt tokens prefilled in steps of `prefill_m` tokens at R(prefill_m) (attention
    over `prompt_context` keys on average). Time per output token = t_step(batch) / batch + prompt_per_output
    * t_prompt_token; the ceiling is its inverse. Ramp-up and ramp-down (a run's first prompt steps, and
    its last requests decoding in small batches) are not in it, so whole runs sit below it."""
    elem = 4 if dtype_name == "float32" else 2
    dec_rate = rate_at(rates, batch)
    dec = ceiling(cfg, dtype_name, dec_rate["gflops"], bw_gbs, batch, int(round(decode_context)))
    t_decode = max(dec["t_compute_s"], dec["t_memory_s"]) / batch
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // nh
    layers = cfg["num_hidden_layers"]
    pre_rate = rate_at(rates, prefill_m)
    pp = prefill_params_per_token(cfg)
    flops = 2 * pp + 4 * layers * nh * hd * prompt_context
    t_prompt = max(flops / (pre_rate["gflops"] * 1e9), pp * elem / prefill_m / (bw_gbs * 1e9))
    t_out = t_decode + prompt_per_output * t_prompt
    return {"tok_s": 1.0 / t_out, "batch": batch, "prefill_m": prefill_m, "decode_rate_m": dec_rate["m"],
            "decode_gflops": dec_rate["gflops"], "prefill_rate_m": pre_rate["m"], "prefill_gflops": pre_rate["gflops"],
            "decode_context": decode_context, "prompt_per_output": prompt_per_output, "prompt_context": prompt_context,
            "t_decode_per_token_s": t_decode, "t_prompt_per_token_s": t_prompt, "decode_bound": dec["bound"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="decode batch B (tokens per step)")
    p.add_argument("--context", type=int, default=0, help="mean context C per request for the KV term (0: off)")
    p.add_argument("--ms", default="1,8,16,32,64,256,2048",
                   help="token counts M at which to time the matmuls (2048: a prompt step)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--bw-mib", type=int, default=1024, help="tensor size for the bandwidth test")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds per timing repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smoke test: tiny timings, M=1 and B only, 64 MiB")
    p.add_argument("--model-dir", default=None, help="HF folder (default: conveyor's cached SmolLM2)")
    p.add_argument("--out", type=Path, default=HERE / "roofline.json")
    a = p.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    if a.model_dir:
        folder = Path(a.model_dir)
    else:
        from conveyor.core.model_loader import ensure_embedded

        folder = ensure_embedded("smollm2-135m-instruct")
    cfg = json.loads((Path(folder) / "config.json").read_text())
    ms = sorted({int(x) for x in a.ms.split(",") if x.strip()} | {a.batch})
    if a.quick:
        ms, a.min_time, a.repeats, a.bw_mib = sorted({1, a.batch}), 0.05, 1, 64

    bw = bandwidth(torch, a.bw_mib, a.min_time, a.repeats)
    print(f"bandwidth: read {bw['read_gbs']:.1f} GB/s, copy {bw['copy_gbs']:.1f} GB/s "
          f"({a.bw_mib} MiB, {a.threads} threads)")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    rates: dict[str, list[dict]] = {}
    ceilings: dict[str, dict] = {}
    for name in [d.strip() for d in a.dtypes.split(",") if d.strip()]:
        rates[name] = []
        for m in ms:
            r = best_matmul_rate(torch, cfg, dtypes[name], m, a.min_time, a.repeats)
            rates[name].append(r)
            others = ", ".join(f"{k} {v:.0f}" for k, v in r["by_impl"].items())
            print(f"matmul {name:<9} M={m:<4} {r['gflops']:8.1f} GFLOP/s  ({r['seconds'] * 1e3:.2f} ms per model step; "
                  f"{others})")
        at_b = next(r for r in rates[name] if r["m"] == a.batch)
        c = ceiling(cfg, name, at_b["gflops"], bw["read_gbs"], a.batch, a.context)
        c.update({"batch": a.batch, "context": a.context, "matmul_gflops": at_b["gflops"], "bandwidth_gbs": bw["read_gbs"]})
        ceilings[name] = c
        print(f"ceiling  {name:<9} B={a.batch}: {c['tok_s']:.0f} tok/s ({c['bound']}-bound; compute "
              f"{c['t_compute_s'] * 1e3:.2f} ms, memory {c['t_memory_s'] * 1e3:.2f} ms per step)")

    record = {
        "model": str(folder),
        "batch": a.batch,
        "context": a.context,
        "threads": a.threads,
        "machine": {"cpu": cpu_signature(), "torch": torch.__version__},
        "params_per_token": params_per_token(cfg),
        "bandwidth": bw,
        "matmul": rates,
        "ceilings": ceilings,
        "quick": a.quick,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
