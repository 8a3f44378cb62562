"""(torch) A quantized linear's tensors, as its format stores them, read into a `QuantWeight` (or, for FP8 weights,
the de-quantized float32 weight): compressed-tensors (`pack-quantized`, `int-quantized`, `float-quantized`), GPTQ
(`gptq`, `gptq_v2`) and AWQ GEMM packing, each from the format's definition:

- compressed-tensors: `weight_packed` int32 [N, ceil(K / (32 / b))], value j of a word at bits [b j, b j + b), stored
  as q + 2^(b-1); `weight_zero_point` packed the same way along N where the weights are asymmetric; `weight_scale`
  [N, groups] ([N, 1] per channel, one value per tensor); `weight_g_idx` the group of each k (act-order);
  w = (q - zero) * scale. `int-quantized`: `weight` int8 [N, K] with the same scales and zero points.
- GPTQ: `qweight` int32 [K / (32 / b), N] packed along k, `qzeros` int32 [groups, N / (32 / b)] packed along n (the
  gptq format stores zero - 1), `scales` [groups, N], `g_idx` [K]; w = scale * (q - zero).
- AWQ GEMM: `qweight` and `qzeros` int32 packed along n, eight 4-bit values a word in the order 0, 2, 4, 6, 1, 3,
  5, 7; `scales` [groups, N]; w = (q - zero) * scale.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from conveyor.core.quant.formats import ModuleScheme, Scheme
from conveyor.core.quant.weights import QuantWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each 4-bit slot of an AWQ word holds


class MissingTensor(KeyError):
    """A tensor the format needs is not in the checkpoint (its name)."""


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, size: int) -> torch.Tensor:
    """The unsigned values of an int32 tensor packed along `dim`, value j of each word at bits [bits j, bits j +
    bits), the first `size` of them along `dim` (int32)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    p = packed.to(torch.int32)
    if dim == 1:
        vals = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per]
        return vals.reshape(p.shape[0], -1)[:, :size]
    vals = (p.unsqueeze(1) >> shifts[:, None]) & ((1 << bits) - 1)  # [words, per, cols]
    return vals.reshape(-1, p.shape[1])[:size]


def _groups(scale: torch.Tensor, n: int) -> torch.Tensor:
    """A scale or zero point as [N, groups] float32 (one value per tensor or per channel widened)."""
    s = scale.float()
    if s.dim() == 0 or s.numel() == 1:
        return s.reshape(1, 1).expand(n, 1).contiguous()
    return s.reshape(n, -1)


def _act_order(g_idx: torch.Tensor | None, group: int, k: int) -> torch.Tensor | None:
    """The permutation of k that makes act-order's groups contiguous (None where they are already in order)."""
    if g_idx is None:
        return None
    g = g_idx.to(torch.long)
    if torch.equal(g, torch.arange(k) // group):
        return None
    return torch.sort(g, stable=True).indices


def read_linear(scheme: Scheme, ms: ModuleScheme, prefix: str, get: Callable[[str], torch.Tensor | None],
                shape: tuple[int, int]) -> QuantWeight | torch.Tensor:
    """The linear `prefix`'s weight (N, K = shape): a QuantWeight, or the de-quantized float32 weight (FP8).
    MissingTensor where the checkpoint lacks a tensor the format needs; ValueError where one has another shape."""
    def need(name: str) -> torch.Tensor:
        t = get(f"{prefix}.{name}")
        if t is None:
            raise MissingTensor(f"{prefix}.{name}")
        return t

    if scheme.method == "compressed-tensors":
        return _compressed_tensors(ms, need, get, prefix, shape)
    if scheme.method == "gptq":
        return _gptq(ms, need, lambda name: get(f"{prefix}.{name}"), shape, v1=scheme.packing == "gptq")
    return _awq(ms, need, shape)


def _compressed_tensors(ms: ModuleScheme, need, get, prefix: str, shape: tuple[int, int]):
    n, k = shape
    if ms.kind == "fp8":
        w = need("weight").float()
        s = need("weight_scale").float()
        if s.numel() > 1 and s.shape[0] == n and (s.dim() == 1 or s.shape[1] == 1):
            s = s.reshape(n, 1)
        elif ms.group:
            s = s.reshape(n, -1).repeat_interleave(ms.group, dim=1)[:, :k]
        return w * s
    packed = get(f"{prefix}.weight_packed")
    if packed is not None:
        stored = get(f"{prefix}.weight_shape")
        if stored is not None and tuple(int(v) for v in stored.tolist()) != (n, k):
            raise ValueError(f"weight_shape {tuple(stored.tolist())}, not {(n, k)}")
        values = unpack_int32(packed, ms.bits, 1, k)
    else:
        values = need("weight").to(torch.int32) + (1 << (ms.bits - 1))
    if tuple(values.shape) != (n, k):
        raise ValueError(f"{prefix}: weights of shape {tuple(values.shape)}, not {(n, k)}")
    scale = _groups(need("weight_scale"), n)
    zp = get(f"{prefix}.weight_zero_point")
    if ms.kind == "w8a8":
        if scale.shape[1] != 1 or (zp is not None and bool(zp.any())):
            raise ValueError(f"{prefix}: W8A8 weights need one scale per channel and no zero point")
        static = get(f"{prefix}.input_scale")
        if ms.static_input and (static is None or static.numel() != 1):
            raise MissingTensor(f"{prefix}.input_scale")
        input_zero = get(f"{prefix}.input_zero_point")
        if input_zero is not None and bool(input_zero.any()):
            raise ValueError("activation zero points that are not zero for activations the config calls symmetric")
        return QuantWeight("w8a8", (values - 128).to(torch.int8).contiguous(), scale[:, 0].contiguous(),
                           x_scale=float(static.float().item()) if ms.static_input else 0.0)
    groups = scale.shape[1]
    group = -(-k // groups)
    if zp is not None and ms.symmetric and bool(zp.any()):
        raise ValueError("zero points that are not zero for weights the config calls symmetric")
    if zp is None or ms.symmetric:
        zero = torch.full((n, groups), float(1 << (ms.bits - 1)))
    elif zp.dtype == torch.int32 and zp.shape[0] != n:  # pack-quantized: packed along N as zero + 2^(b-1)
        zero = unpack_int32(zp, ms.bits, 0, n).float().reshape(n, groups)
    else:
        zero = _groups(zp, n) + float(1 << (ms.bits - 1))
    g_idx = get(f"{prefix}.weight_g_idx")
    return _weight(values, scale, zero, group, ms.bits, _act_order(g_idx, group, k))


def _weight(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, bits: int,
            perm: torch.Tensor | None) -> QuantWeight:
    """A weight-only QuantWeight; with act-order, k permuted so that each group's k are contiguous."""
    if perm is not None:
        values = values[:, perm]
    return QuantWeight("wq", values.to(torch.uint8).contiguous(), scale.contiguous(), bits, group,
                       zero.contiguous(), None, perm)


def _gptq(ms: ModuleScheme, need, get, shape: tuple[int, int], v1: bool) -> QuantWeight:
    n, k = shape
    values = unpack_int32(need("qweight"), ms.bits, 0, k).t()  # [N, K]
    scales = need("scales").float().t()  # [N, groups]
    groups = scales.shape[1]
    zero = unpack_int32(need("qzeros"), ms.bits, 1, n).t().float()  # [N, groups]
    if v1:
        zero = zero + 1
    if tuple(values.shape) != (n, k) or tuple(zero.shape) != tuple(scales.shape):
        raise ValueError(f"GPTQ tensors of shapes {tuple(values.shape)}, {tuple(zero.shape)}, {tuple(scales.shape)}"
                         f" for a weight of {(n, k)}")
    group = ms.group or k
    if groups != -(-k // group):
        raise ValueError(f"{groups} groups of scales for K={k} in groups of {group}")
    g_idx = need("g_idx") if ms.act_order else get("g_idx")  # (the groups of k; in order without act-order)
    return _weight(values, scales, zero, group, ms.bits, None if g_idx is None else _act_order(g_idx, group, k))


def _awq(ms: ModuleScheme, need, shape: tuple[int, int]) -> QuantWeight:
    n, k = shape
    order = torch.tensor(AWQ_ORDER)
    inverse = torch.argsort(order)

    def columns(packed: torch.Tensor) -> torch.Tensor:  # [rows, N / 8] -> [rows, N]: slot i holds column AWQ_ORDER[i]
        slots = unpack_int32(packed, 4, 1, packed.shape[1] * 8).reshape(packed.shape[0], -1, 8)
        return slots[:, :, inverse].reshape(packed.shape[0], -1)[:, :n]

    values = columns(need("qweight")).t()  # [N, K]
    zero = columns(need("qzeros")).t().float()
    scales = need("scales").float().t()
    if tuple(values.shape) != (n, k) or tuple(zero.shape) != tuple(scales.shape):
        raise ValueError(f"AWQ tensors of shapes {tuple(values.shape)}, {tuple(zero.shape)}, {tuple(scales.shape)} "
                         f"for a weight of {(n, k)}")
    return _weight(values, scales, zero, -(-k // scales.shape[1]), 4, None)
