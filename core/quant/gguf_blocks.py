"""(torch, numpy) GGUF's quantized blocks read into a `QuantWeight`, for the block types whose de-quantized value is
((u - z) * s) + o per group of k, as gguf-py's own de-quantization computes it in float32 (the bits transformers'
GGUF load gives):

    Q8_0   x * d                     (32 a block; u = x + 128, z = 128)
    Q4_0   d * (q - 8)               (32 a block)
    Q4_1   (d * q) + m               (32 a block)
    Q5_0   d * (q - 16)              (32 a block, the fifth bit apart)
    Q5_1   (d * q) + m               (32 a block)
    Q4_K   (d * sc) * q - (dmin * m) (256 a block, 8 groups of 32, 6-bit sc and m)
    Q5_K   as Q4_K with a fifth bit
    Q6_K   (d * sc) * (q - 32)       (256 a block, 16 groups of 16, 8-bit sc)

4-bit types stay 4 bits; 5- and 6-bit values are held in a byte each.
"""

from __future__ import annotations

import numpy as np
import torch

from conveyor.core.quant.weights import QuantWeight

KEPT = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
QK_K = 256


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[blocks, n * width / 2] bytes -> [blocks, n * width]: each run of width / 2 bytes gives its low nibbles then
    its high ones (ggml's order)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, width // 2) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _fifth_bit(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: the 32 high bits of a block, [blocks, 4] bytes -> [blocks, 32]."""
    bits = qh.copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 12 bytes of 6-bit scales and mins -> ([blocks, 8], [blocks, 8])."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = np.split(s, 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8), mn.reshape(n, 8)


def decode(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, int]:
    """[blocks, type size] bytes of one type -> (u [blocks, per], s [blocks, groups], z [blocks, groups],
    o [blocks, groups] or None, group)."""
    n = blocks.shape[0]
    if kind == "Q8_0":
        d, x = blocks[:, :2], blocks[:, 2:]
        u = (x.copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return u, _f16(d), np.full((n, 1), 128.0, np.float32), None, 32
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(blocks[:, :2])
        at = 2
        m = None
        if kind.endswith("_1"):
            m, at = _f16(blocks[:, 2:4]), 4
        u = _nibbles(blocks[:, at + (4 if kind.startswith("Q5") else 0):], 32)
        if kind.startswith("Q5"):
            u = u | (_fifth_bit(blocks[:, at:at + 4]) << np.uint8(4))
        zero = {"Q4_0": 8.0, "Q5_0": 16.0}.get(kind, 0.0)
        return u, d, np.full((n, 1), zero, np.float32), m, 32
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scales(blocks[:, 4:16])
        rest = blocks[:, 16:]
        if kind == "Q5_K":
            qh, qs = rest[:, :QK_K // 8], rest[:, QK_K // 8:]
        else:
            qh, qs = None, rest
        u = _nibbles(qs, 64)
        if qh is not None:
            high = qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            u = u | ((high & np.uint8(1)).reshape(n, -1) << np.uint8(4))
        s = d * sc.astype(np.float32)
        o = -(dmin * mn.astype(np.float32))
        return u, s, np.zeros((n, 8), np.float32), o, 32
    if kind == "Q6_K":
        ql, qh = blocks[:, :QK_K // 2], blocks[:, QK_K // 2:QK_K // 2 + QK_K // 4]
        scales = blocks[:, QK_K // 2 + QK_K // 4:QK_K // 2 + QK_K // 4 + QK_K // 16].copy().view(np.int8)
        d = _f16(blocks[:, -2:])
        low = (ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        high = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        u = low.reshape(n, -1, 32) | (high.reshape(n, -1, 32) << np.uint8(4))
        s = d * scales.astype(np.float32)
        return u.reshape(n, -1), s, np.full((n, 16), 32.0, np.float32), None, 16
    raise ValueError(f"GGUF type {kind} is not kept in its blocks")


def quant_weight(data: np.ndarray, kind: str, shape: tuple[int, int], rows: np.ndarray | None = None) -> QuantWeight:
    """The GGUF tensor's raw blocks (`data`, rows of bytes) as a QuantWeight of [N, K] = `shape`, its rows taken in
    the order `rows` where given (the row permutation transformers applies to the de-quantized tensor)."""
    import gguf

    n, k = shape
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    u, s, z, o, group = decode(np.ascontiguousarray(data).reshape(-1, size), kind)
    bits = 4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8

    def per_row(a):
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a.reshape(n, -1)))

    values, scales, zeros, offsets = per_row(u), per_row(s), per_row(z), per_row(o)
    if tuple(values.shape) != (n, k):
        raise ValueError(f"{kind} blocks give {tuple(values.shape)}, not {(n, k)}")
    if rows is not None:
        idx = torch.from_numpy(rows)
        values, scales, zeros = values[idx], scales[idx], zeros[idx]
        offsets = None if offsets is None else offsets[idx]
    return QuantWeight("wq", values.contiguous(), scales.float().contiguous(), bits, group, zeros.float().contiguous(),
                       None if offsets is None else offsets.float().contiguous())
