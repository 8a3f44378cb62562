"""Kernel microbenchmark: each linear of the embedded model and its attention, on every route this CPU has, against
the multiply-add peak measured here and torch's matmul on the same shapes.

    python benchmarks/kernel_speed.py                                   # both dtypes, M = 1, 16, 64, 256, 2048
    python benchmarks/kernel_speed.py --dtypes bfloat16 --ms 1,64 --out benchmarks/results/kernels-epyc.json

Linears (SmolLM2-135M's shapes, read from the cached model's config.json): qkv (q, k, v as one matmul, as the
fused forward runs them), o, gate_up (one matmul), down, lm_head; x [M, K] @ W.T with W [N, K], per layer's weight
a fresh tensor (30 of each, as in the model, so weights stream from memory at small M, as they do in a step).
Routes: float32 -> `panel_gemm` (float FMAs over 32-column panels); bfloat16 -> `pair_gemm` (AVX512-BF16 pair
products), `amx_gemm` (AMX tiles) where the CPU has them, and `panel_gemm` on bf16 weights (widened to float,
the route of CPUs with neither); torch's `F.linear` in the same dtype beside each. Per (linear, M, route): the
best time of --repeats (each at least --min-time s), GFLOP/s (2 M N K / t), and its fraction of the peak:
`fma_peak_gflops`, independent 512-bit FMAs (float32 and the panel routes) or pair products (bf16's pairs and
tiles, and torch's bf16, which takes them too) on every thread; and of the shape's roofline: that peak, or the
bytes of W, x and y read or written at the read bandwidth measured here (a sum over 1 GiB), whichever is lower.

Attention: the paged kernel (`paged_attention`, the pool in the engine's layout for the dtype), --rows decode
rows (one query each) at contexts of --contexts keys, and one prefill chunk ending at each context (its last 512
rows, or all of them); GFLOP/s counted as 4 x heads x head_dim x keys per query row. A decode's KV bytes read per
second are also given against a STREAM-like copy (bytes read plus written) measured just before and just after it.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from roofline import time_best  # noqa: E402


def model_config() -> dict:
    from conveyor.core.model_loader import ensure_embedded

    return json.loads((Path(ensure_embedded("smollm2-135m-instruct")) / "config.json").read_text())


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, layers)."""
    h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or h // heads
    layers = cfg["num_hidden_layers"]
    return {"qkv": ((heads + 2 * kv) * d, h, layers), "o": (heads * d, h, layers), "gate_up": (2 * inter, h, layers),
            "down": (h, inter, layers), "lm_head": (cfg["vocab_size"], h, 1)}


def routes(torch, ops, dtype) -> dict:
    """route name -> (pack(W) -> packed, run(x, packed, N)); only those this CPU and build can run."""
    from conveyor.core.backends.cpu import linears

    out = {"torch": (lambda w: w, lambda x, w, n: torch.nn.functional.linear(x, w))}
    if ops is None:
        return out
    def kernel(gemm):
        return lambda x, w, n: gemm(x, w, n, None)

    if dtype == torch.float32:
        out["panels"] = (linears.pack_panels, kernel(ops.panel_gemm))
    else:
        if ops.pair_gemm_available():
            out["pairs"] = (linears.pack_pairs, kernel(ops.pair_gemm))
        if ops.amx_gemm_available():
            out["amx"] = (linears.pack_amx, kernel(ops.amx_gemm))
        out["panels (widened)"] = (linears.pack_panels, kernel(ops.panel_gemm))
    return out


def _cycling(run, x, packed: list, n: int):
    """A call of `run` on x and the next of `packed` (each layer's weight in turn, as a step reads them)."""
    state = {"i": 0}

    def call():
        run(x, packed[state["i"] % len(packed)], n)
        state["i"] += 1

    return call


def bench_linears(torch, ops, dtype, ms: list[int], args, peak: dict) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, (n, k, layers) in linear_shapes(model_config()).items():
        copies = min(layers, args.copies)
        weights = [torch.randn(n, k, generator=gen).to(dtype) * 0.02 for _ in range(copies)]
        for route, (pack, run) in routes(torch, ops, dtype).items():
            packed = [pack(w) for w in weights]
            for m in ms:
                x = torch.randn(m, k, generator=gen).to(dtype)
                with torch.inference_mode():
                    t = time_best(_cycling(run, x, packed, n), args.min_time, args.repeats)
                gflops = 2 * m * n * k / t / 1e9
                # bf16 products (pairs, tiles; torch's oneDNN takes them too) against the bf16 peak, float FMAs
                # (the panels, widened or not) against the float one
                bf16_products = route in ("pairs", "amx") or (route == "torch" and dtype == torch.bfloat16)
                ref = peak["bf16"] if bf16_products and peak["bf16"] else peak["float32"]
                # the roofline at this shape: that peak, or the weights and activations read at the measured bandwidth
                moved = (n * k + m * k + m * n) * dtype.itemsize
                roof = min(ref, 2 * m * n * k * peak["read_gbs"] / moved)
                rows.append({"linear": name, "n": n, "k": k, "m": m, "route": route, "seconds": t, "gflops": gflops,
                             "of_peak": gflops / ref if ref else None, "of_roofline": gflops / roof})
                print(f"  {str(dtype)[6:]:8} {name:8} M={m:5} {route:17} {t * 1e3:9.3f} ms {gflops:8.1f} GFLOP/s "
                      f"{gflops / ref:6.1%} of peak {gflops / roof:6.1%} of roofline", flush=True)
    return rows


def bench_attention(torch, ops, dtype, args, peak: float) -> list[dict]:
    from conveyor.core.backends.cpu.backend import LAYOUTS, kv_layout

    cfg = model_config()
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    bs = 16
    layout = LAYOUTS[kv_layout(dtype, d, bs, heads // kv_heads)]
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        prefill = min(512, context)  # a prefill chunk: its rows see context - prefill + 1 ... context keys
        for label, num_rows, chunk in (("decode", args.rows, 1), ("prefill", prefill, prefill)):
            reqs = num_rows // chunk
            blocks_per = -(-context // bs)
            num_blocks = reqs * blocks_per
            kv_bytes = 2 * num_blocks * bs * kv_heads * d * torch.empty(0, dtype=dtype).element_size()
            # Decode reads its keys once: pools cycled through until they pass --kv-mib, so that each call reads
            # from memory, not from a cache a smaller pool would stay in between calls.
            copies = max(1, -(-args.kv_mib * 2**20 // kv_bytes)) if label == "decode" else 1
            pools = [(torch.randn(layout.key_shape(num_blocks, bs, kv_heads, d)).to(dtype),
                      torch.randn(layout.value_shape(num_blocks, bs, kv_heads, d)).to(dtype)) for _ in range(copies)]
            k_cache, v_cache = pools[0]
            tables = torch.arange(num_blocks).view(reqs, blocks_per)
            token_req = torch.arange(reqs).repeat_interleave(chunk)
            token_ctx = torch.arange(context - chunk + 1, context + 1).repeat(reqs)
            q = torch.randn(num_rows, heads, d).to(dtype)
            calls = [functools.partial(ops.paged_attention, q, k, v, tables, token_req, token_ctx, bs, d ** -0.5)
                     for k, v in pools]
            turn = itertools.count()

            def call(calls=calls, turn=turn):
                return calls[next(turn) % len(calls)]()

            # The copy measured just before and just after the decode: this shared machine's memory bandwidth
            # drifts (20-50 GB/s across a day), and a decode's fraction is only meaningful against its own minutes.
            copy_before = copy_bandwidth(torch, args) if label == "decode" else None
            with torch.inference_mode():
                t = time_best(call, args.min_time, args.repeats)
            copy_gbs = (copy_before + copy_bandwidth(torch, args)) / 2 if label == "decode" else None
            flops = 4 * heads * d * float(token_ctx.sum())
            kv_gbs = kv_bytes / t / 1e9  # each key read once
            row = {"kind": label, "context": context, "rows": num_rows, "layout": layout.name, "seconds": t,
                   "gflops": flops / t / 1e9, "of_peak": flops / t / 1e9 / peak}
            if label == "decode":
                row.update(kv_gbs=kv_gbs, copy_gbs=copy_gbs, of_copy_bandwidth=kv_gbs / copy_gbs)
            rows.append(row)
            print(f"  {str(dtype)[6:]:8} attention {label:7} {num_rows} rows at {context:5} keys ({layout.name}): "
                  f"{t * 1e3:8.3f} ms {flops / t / 1e9:7.1f} GFLOP/s {flops / t / 1e9 / peak:6.1%} of peak"
                  + (f", KV read {kv_gbs:5.1f} GB/s, {kv_gbs / copy_gbs:6.1%} of the copy's {copy_gbs:.1f}"
                     if label == "decode" else ""), flush=True)
    return rows


def copy_bandwidth(torch, args) -> float:
    """GB/s of a STREAM-like copy of 1 GiB into another (bytes read plus bytes written), the best of --repeats."""
    src, dst = torch.ones(1 << 28), torch.empty(1 << 28)
    with torch.inference_mode():
        t = time_best(lambda: dst.copy_(src), args.min_time, args.repeats)
    return 2 * src.numel() * 4 / t / 1e9


def read_bandwidth(torch, args) -> float:
    """GB/s reading 1 GiB (a sum over it: more than any cache), the best of --repeats."""
    data = torch.ones(1 << 28)
    with torch.inference_mode():
        t = time_best(data.sum, args.min_time, args.repeats)
    return data.numel() * 4 / t / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--ms", default="1,16,64,256,2048")
    p.add_argument("--copies", type=int, default=30, help="weights of a linear cycled through (the model's layers)")
    p.add_argument("--contexts", default="128,512,2048")
    p.add_argument("--rows", type=int, default=64, help="attention: decode rows")
    p.add_argument("--min-time", type=float, default=0.2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--attention-only", action="store_true", help="skip the linears")
    p.add_argument("--kv-mib", type=int, default=1024, help="decode attention: KV pools cycled through, at least "
                   "this many MiB (more than the caches)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import torch

    from conveyor.core.backends.cpu.kernels import cpu_identity, cpu_kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    ops = cpu_kernels()
    if ops is None:
        sys.exit("kernel_speed.py: conveyor's C++ kernels do not run here (no AVX-512 or AVX2 + FMA, or no compiler)")
    peak = {"float32": ops.fma_peak_gflops(1.0, False),
            "bf16": ops.fma_peak_gflops(1.0, True) if ops.peak_bf16_available() else None,
            "read_gbs": read_bandwidth(torch, args), "copy_gbs": copy_bandwidth(torch, args)}
    print(f"{cpu_identity()[0]}, {torch.get_num_threads()} threads: float FMA peak {peak['float32']:.0f} GFLOP/s"
          + (f", bf16 pair-product peak {peak['bf16']:.0f} GFLOP/s" if peak["bf16"] else "")
          + f", read bandwidth {peak['read_gbs']:.1f} GB/s, copy {peak['copy_gbs']:.1f} GB/s", flush=True)
    result = {"cpu": cpu_identity()[0], "threads": torch.get_num_threads(), "peak_gflops": peak,
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "linears": [], "attention": []}
    ms = [int(m) for m in args.ms.split(",")]
    t0 = time.perf_counter()
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        if not args.attention_only:
            result["linears"] += [{**r, "dtype": name} for r in bench_linears(torch, ops, dtype, ms, args, peak)]
        attn_peak = peak["bf16"] if dtype == torch.bfloat16 and peak["bf16"] else peak["float32"]
        result["attention"] += [{**r, "dtype": name} for r in bench_attention(torch, ops, dtype, args, attn_peak)]
    print(f"\n({time.perf_counter() - t0:.0f} s)\n| dtype | linear | M | " + " | ".join(
        sorted({r["route"] for r in result["linears"]})) + " |")
    by = {}
    for r in result["linears"]:
        by.setdefault((r["dtype"], r["linear"], r["m"]), {})[r["route"]] = r
    names = sorted({r["route"] for r in result["linears"]})
    print("|---|---|---|" + "---|" * len(names))
    for (dt, lin, m), cells in by.items():
        print(f"| {dt} | {lin} | {m} | " + " | ".join(
            f"{cells[n]['gflops']:.0f} ({cells[n]['of_peak']:.0%}; {cells[n]['of_roofline']:.0%})" if n in cells
            else "-" for n in names) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
