"""(triton) Paged attention for every row of a step in one launch, reading K/V in place from the pool.

One program per (query block, KV head): a query block is up to BLOCK_Q consecutive query rows of one request
times the GROUP query heads that share the KV head (BLOCK_M = BLOCK_Q * GROUP rows, padded); it walks its
request's keys TILE at a time through the block table, from key 0 to the last key its rows see, with an
online softmax (float32 running max, sum and accumulator). Fresh prompts, later chunks and decodes take the
same path; a row's keys, their order and the tiling depend on the row's request only, never on the other
rows in the step, and a tile a row cannot see adds exact zeros.

The query blocks are described from the host (`QueryBlocks`: each block's request and first row), so a
program finds its rows without a search, and a CUDA graph can replay a fixed grid whose unused blocks have
request -1. Pool layout: "flash", keys and values [num_blocks, block_size, kv_heads, head_dim].

float32 runs its dot products in IEEE float32 (no TF32). UPCAST (Triton's CPU interpreter, which has no bf16
dot) widens bf16/fp16 K, V and queries to float32 before the dots.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from conveyor.core.backends.step import StepAttention, store_flash

TILE = 32  # keys per iteration


@triton.jit
def _tanh(x):
    """tanh in float32 (Cephes' tanhf: an odd polynomial below |x| = 0.625, 1 - 2 / (exp(2|x|) + 1) above)."""
    ax = tl.abs(x)
    z = x * x
    p = (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
    small = (p - 3.33332819422e-1) * z * x + x
    large = 1.0 - 2.0 / (tl.exp(2.0 * ax) + 1.0)
    large = tl.where(x < 0, -large, large)
    return tl.where(ax < 0.625, small, large)


@triton.jit
def _paged_attention(out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, q_start_ptr, qb_seq_ptr, qb_first_ptr,
                     sinks_ptr, scale, window, softcap, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb,
                     stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, stride_table,
                     WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, FP32: tl.constexpr,
                     UPCAST: tl.constexpr):
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(qb_seq_ptr + qb)
    if seq < 0:  # a padding block of a replayed graph
        return
    first = tl.load(qb_first_ptr + qb)  # the block's first query, counted within its request's rows
    row0 = tl.load(q_start_ptr + seq)
    n_q = tl.load(q_start_ptr + seq + 1) - row0
    seq_len = tl.load(seq_lens_ptr + seq)  # keys in the pool once this step is stored
    ctx = seq_len - n_q  # keys before the step's first row of this request

    m = tl.arange(0, BLOCK_M)
    qi = first + m // GROUP
    head = kvh * GROUP + m % GROUP
    q_ok = (m < BLOCK_Q * GROUP) & (qi < n_q)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    q_rows = (row0 + qi).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    last = tl.minimum(first + BLOCK_Q, n_q) - 1  # the block's last query
    keys_seen = ctx + last + 1
    if SINKS:  # the sink as a key of logit sinks[head] and value 0: the online softmax starts from it
        m_i = tl.load(sinks_ptr + head).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    lo = ctx * 0
    if WINDOW:  # the block's first query sees keys from ctx + first + 1 - window on; tiles before them are skipped
        lo = tl.maximum(ctx + first + 1 - window, 0) // TILE_N * TILE_N
    for start in range(lo, keys_seen, TILE_N):
        t = start + tl.arange(0, TILE_N)
        t_ok = t < keys_seen
        blk = tl.load(table + t // PAGE, mask=t_ok, other=0).to(tl.int64)
        off = (t % PAGE).to(tl.int64)
        k = tl.load(k_ptr + blk[None, :] * stride_kb + off[None, :] * stride_kp + kvh * stride_kh + d[:, None],
                    mask=d_ok[:, None] & t_ok[None, :], other=0.0)  # [HEAD_PAD, TILE_N]
        v = tl.load(v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vp + kvh * stride_vh + d[None, :],
                    mask=t_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, HEAD_PAD]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if FP32:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale
        if SOFTCAP:
            s = _tanh(s / softcap) * softcap
        visible = (t[None, :] <= ctx + qi[:, None]) & q_ok[:, None]
        if WINDOW:
            visible = visible & (t[None, :] > ctx + qi[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])


def block_shape(group: int, prefill: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): 16 rows for decode-only steps (one query per request), 64 where prompts come; at
    least one whole group of heads."""
    block_m = max(64 if prefill else 16, triton.next_power_of_2(group))
    return block_m, block_m // group


@dataclass
class QueryBlocks:
    """The launch's query blocks: block b covers rows first[b] .. first[b] + BLOCK_Q - 1 of request seq[b]."""

    seq: list[int]
    first: list[int]


def query_blocks(num_queries: list[int], block_q: int) -> QueryBlocks:
    seq: list[int] = []
    first: list[int] = []
    for r, n in enumerate(num_queries):
        for f in range(0, n, block_q):
            seq.append(r)
            first.append(f)
    return QueryBlocks(seq, first)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    tables: torch.Tensor, seq_lens: torch.Tensor, q_start: torch.Tensor, qb_seq: torch.Tensor,
                    qb_first: torch.Tensor, scale: float, block_m: int, block_q: int, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """out, q [T, H, D]; k_pool, v_pool [num_blocks, block_size, Hkv, D]; tables [R, max_blocks] (int32);
    seq_lens [R] keys per request after this step; q_start [R + 1] each request's first row; qb_seq / qb_first
    [num_query_blocks] (see QueryBlocks); the layer's window, softcap and sinks ([H] float32) where it has them
    (`StepAttention.attend`). Writes out's rows of every query block and returns out."""
    _, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_pool.shape
    group = heads // kv_heads
    if q.stride(2) != 1 or k_pool.stride(3) != 1 or v_pool.stride(3) != 1 or out.stride(2) != 1:
        raise ValueError("paged_attention: head_dim must be the innermost, contiguous dimension")
    grid = (qb_seq.shape[0], kv_heads)
    _paged_attention[grid](
        out, q, k_pool, v_pool, tables, seq_lens, q_start, qb_seq, qb_first,
        q if sinks is None else sinks.contiguous(), scale, window or 0, softcap or 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        tables.stride(0),
        WINDOW=bool(window), SOFTCAP=bool(softcap), SINKS=sinks is not None, GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=max(16, triton.next_power_of_2(head_dim)), PAGE=page,
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=TILE, FP32=q.dtype == torch.float32,
        UPCAST=interpreting() and q.dtype != torch.float32)
    return out


class TritonAttention(StepAttention):
    """A step's attention through `paged_attention` (the CUDA backend's, eager or in a captured graph)."""

    def __init__(self, kv_cache, slot_mapping: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                 q_start: torch.Tensor, qb_seq: torch.Tensor, qb_first: torch.Tensor, block_m: int,
                 block_q: int) -> None:
        self.kv = kv_cache
        self.slot_mapping = slot_mapping
        self.tables = tables
        self.seq_lens = seq_lens
        self.q_start = q_start
        self.qb_seq = qb_seq
        self.qb_first = qb_first
        self.block_m = block_m
        self.block_q = block_q

    def store(self, layer, k_new, v_new) -> None:
        store_flash(self.kv, layer, self.slot_mapping, k_new, v_new)

    def attend(self, layer, q, k_new, v_new, scale, window=None, softcap=None, sinks=None) -> torch.Tensor:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        return paged_attention(out, q.contiguous(), self.kv.keys[layer], self.kv.values[layer], self.tables,
                               self.seq_lens, self.q_start, self.qb_seq, self.qb_first, scale, self.block_m,
                               self.block_q, window, softcap, sinks)
