"""(triton) The quantized linears of the CUDA backend's lean forward: y = x @ W.T (+ bias) with W kept in its
quantized form (`QuantWeight`) on the device.

Weight-only (W4A16, W8A16, GPTQ, AWQ, GGUF blocks): one program per (BLOCK_M rows, BLOCK_N columns) walks k
BLOCK_K at a time, de-quantizes the tile as the format defines it (((u - z) * s) + o in float32, each weight's group
gathered from its k) and multiplies in float32 (IEEE, no TF32). 4-bit values are held two a byte, k and
k + BLOCK_K / 2 of each BLOCK_K-wide tile in one byte (`pack_tiles`), so a tile's two halves are two dots.

W8A8: x quantized per row in torch (`weights.quantize_rows`, the CPU kernel's rule), an int8 dot with int32 sums
per tile, then ((float) acc * s_x) * s_w (+ bias): the CPU kernel's arithmetic, so the same bits.

UPCAST (Triton's CPU interpreter, which has no bf16 dot) changes nothing here: every dot is float32 or int8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.core.quant.weights import QuantWeight, quantize_rows

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 64


@triton.jit
def _dequant_dot(acc, u, rm, rn, rk, x_ptr, s_ptr, z_ptr, o_ptr, M, N, K, G, GROUPS, HAS_O: tl.constexpr):
    """acc + x[rm, rk] @ w[rn, rk].T, w = ((u - z) * s) + o of each k's group (columns past K or N: zero)."""
    g = rk // G
    gm = (rn[:, None] < N) & (rk[None, :] < K)
    s = tl.load(s_ptr + rn[:, None] * GROUPS + g[None, :], mask=gm, other=0.0)
    z = tl.load(z_ptr + rn[:, None] * GROUPS + g[None, :], mask=gm, other=0.0)
    w = (u - z) * s
    if HAS_O:
        w = w + tl.load(o_ptr + rn[:, None] * GROUPS + g[None, :], mask=gm, other=0.0)
    x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                other=0.0).to(tl.float32)
    return acc + tl.dot(x, tl.trans(w), input_precision="ieee")


@triton.jit
def _wq_kernel(x_ptr, q_ptr, s_ptr, z_ptr, o_ptr, b_ptr, y_ptr, M, N, K, QS, G, GROUPS,
               HAS_O: tl.constexpr, HAS_B: tl.constexpr, BITS: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    HALF: tl.constexpr = BK // 2
    for k0 in range(0, K, BK):
        if BITS == 4:
            for h in tl.static_range(2):
                rk = k0 + h * HALF + tl.arange(0, HALF)
                byte = tl.load(q_ptr + rn[:, None] * QS + (k0 // 2 + tl.arange(0, HALF))[None, :],
                               mask=(rn[:, None] < N) & (rk[None, :] < K), other=0)
                u = ((byte >> (4 * h)) & 0x0F).to(tl.float32)
                acc = _dequant_dot(acc, u, rm, rn, rk, x_ptr, s_ptr, z_ptr, o_ptr, M, N, K, G, GROUPS, HAS_O)
        else:
            rk = k0 + tl.arange(0, BK)
            u = tl.load(q_ptr + rn[:, None] * QS + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                        other=0).to(tl.float32)
            acc = _dequant_dot(acc, u, rm, rn, rk, x_ptr, s_ptr, z_ptr, o_ptr, M, N, K, G, GROUPS, HAS_O)
    if HAS_B:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _i8_kernel(x_ptr, w_ptr, sx_ptr, sw_ptr, b_ptr, y_ptr, M, N, K, HAS_B: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0)
        acc += tl.dot(x, tl.trans(w), out_dtype=tl.int32)
    sx = tl.load(sx_ptr + rm, mask=rm < M, other=1.0)
    sw = tl.load(sw_ptr + rn, mask=rn < N, other=0.0)
    y = (acc.to(tl.float32) * sx[:, None]) * sw[None, :]
    if HAS_B:
        y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def pack_tiles(values: torch.Tensor) -> torch.Tensor:
    """4-bit values [N, K] -> [N, K / 2] bytes: in each BLOCK_K-wide tile of k, byte j holds k = j (low nibble) and
    k = j + BLOCK_K / 2 (high) (K padded to whole tiles with zeros)."""
    n, k = values.shape
    padded = -(-k // BLOCK_K) * BLOCK_K
    v = torch.zeros(n, padded, dtype=torch.uint8, device=values.device)
    v[:, :k] = values
    tiles = v.view(n, -1, 2, BLOCK_K // 2)
    return (tiles[:, :, 0] | (tiles[:, :, 1] << 4)).reshape(n, padded // 2).contiguous()


class TritonQuantLinear:
    """A QuantWeight prepared once for the kernels above (4-bit values packed by tiles), and its call."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.n, self.k = weight.shape
        if weight.kind == "wq":
            self.values = pack_tiles(weight.values) if weight.bits == 4 else weight.values.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q = self.weight
        if q.perm is not None:
            x = x.index_select(1, q.perm)
        m = x.shape[0]
        y = x.new_empty(m, self.n)
        if m == 0:
            return y
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(self.n, BLOCK_N))
        bias = self.bias if self.bias is not None else y
        if q.kind == "w8a8":
            xq, sx = quantize_rows(x, q.x_scale)
            _i8_kernel[grid](xq.to(torch.int8).contiguous(), q.values.contiguous(), sx.reshape(-1).contiguous(),
                             q.scales, bias, y, m, self.n, self.k, HAS_B=self.bias is not None,
                             BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
            return y
        offsets = q.offsets if q.offsets is not None else q.scales
        _wq_kernel[grid](x.contiguous(), self.values, q.scales, q.zeros, offsets, bias, y, m, self.n, self.k,
                         self.values.shape[1], q.group, q.scales.shape[1], HAS_O=q.offsets is not None,
                         HAS_B=self.bias is not None, BITS=q.bits, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
        return y
