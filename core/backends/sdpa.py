"""(torch) The torch backend: plain torch on any device, the reference the other backends are checked against.

The model's transformers forward with this attention: a fresh prompt chunk (nothing cached before it) attends
within itself in one causal SDPA call; every other row gathers its request's K/V from the pool into padded
tensors for SDPA (one gather for all decodes, one per continuing chunk). KV pool: the "flash" layout. It does
not meet the exactness contract (torch picks its kernels by the step's shape) and says so when chosen; the
engine takes it where no other backend runs (no C++ compiler, a CPU without AVX-512 or AVX2 + FMA, CONVEYOR_NO_KERNELS=1,
`--backend torch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from conveyor.core.backends.base import Backend
from conveyor.core.backends.step import (
    FLASH,
    KVLayout,
    Step,
    StepAttention,
    StepRows,
    flash_rows,
    padded_tables,
    store_flash,
    tensor,
)
from conveyor.core.backends.transformers_forward import transformers_forward
from conveyor.core.schedule_types import ScheduledRequest


@dataclass
class GatheredRows:
    """K/V gathered from the pool into padded tensors for SDPA: either n one-token queries (decodes: mask
    [n, 1, 1, L]) or one prefill chunk continuing a cached prefix (rows [start, end), slots [1, L], mask
    [1, 1, n, L])."""

    rows: torch.Tensor | slice  # rows of the flat batch
    slots: torch.Tensor  # [b, L] pool slots to gather (padded with slot 0)
    key_pos: torch.Tensor  # [1, L] each gathered key's position
    query_pos: torch.Tensor  # [b, 1, n, 1] each query's position
    lens: torch.Tensor  # [b, 1, 1, 1] keys each request has (padding past them)
    is_decode: bool

    def mask(self, window: int | None) -> torch.Tensor:
        """Bool, True = attend: keys up to the query's position (and within its last `window`)."""
        k = self.key_pos.view(1, 1, 1, -1)
        ok = (k <= self.query_pos) & (k < self.lens)
        return ok & (k > self.query_pos - window) if window else ok


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [b, H, n, D], k / v [b, Hkv, L, D], mask bool [b or 1, 1, n, L] (None: causal, n == L) -> [b, H, n, D].
    SDPA where it computes the layer's attention; with a softcap or sinks, the eager form transformers writes."""
    if softcap is None and sinks is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n = q.shape[2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores - scores.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return probs.to(v.dtype) @ v


class SdpaAttention(StepAttention):
    def __init__(self, kv_cache, slot_mapping: torch.Tensor, fresh_chunks: list[tuple[int, int]],
                 gathered: list[GatheredRows]) -> None:
        self.kv = kv_cache
        self.slot_mapping = slot_mapping
        self.fresh_chunks = fresh_chunks  # [start, end) rows of prompt chunks with nothing cached
        self.gathered = gathered  # every other row
        self._masks: dict = {}  # (gathered rows' index or chunk length, window) -> mask: once a step, not a layer

    def store(self, layer, k_new, v_new) -> None:
        store_flash(self.kv, layer, self.slot_mapping, k_new, v_new)

    def attend(self, layer, q, k_new, v_new, scale, window=None, softcap=None, sinks=None) -> torch.Tensor:
        k_pool, v_pool = flash_rows(self.kv, layer)  # [slots, Hkv, D]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for i, g in enumerate(self.gathered):
            k = k_pool[g.slots].transpose(1, 2).to(q.dtype)  # [b, Hkv, L, D]
            v = v_pool[g.slots].transpose(1, 2).to(q.dtype)
            qb = q[g.rows].unsqueeze(2) if g.is_decode else q[g.rows].transpose(0, 1).unsqueeze(0)
            key = ("gathered", i, window)
            if key not in self._masks:
                self._masks[key] = g.mask(window)
            o = attention(qb, k, v, self._masks[key], scale, softcap, sinks)
            out[g.rows] = o.squeeze(2) if g.is_decode else o[0].transpose(0, 1)
        for start, end in self.fresh_chunks:
            qc, kc, vc = (t[start:end].transpose(0, 1).unsqueeze(0).to(q.dtype) for t in (q, k_new, v_new))
            mask = None
            if window:
                key = ("fresh", end - start, window)
                if key not in self._masks:
                    pos = torch.arange(end - start, device=q.device)
                    self._masks[key] = ((pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window))[
                        None, None]
                mask = self._masks[key]
            o = attention(qc, kc, vc, mask, scale, softcap, sinks)
            out[start:end] = o[0].transpose(0, 1)
        return out


class TorchBackend(Backend):
    name = "torch"
    exact = False

    def kv_layout(self, head_dim: int, block_size: int, group: int) -> KVLayout:
        return FLASH

    def prepare(self, rows: StepRows) -> Step:
        fresh: list[tuple[int, int]] = []
        paged: list[tuple[int, ScheduledRequest]] = []  # (first row, entry) attending through the pool
        row = 0
        for e in rows.entries:
            if e.start_pos == 0 and e.num_tokens > 1:
                fresh.append((row, row + e.num_tokens))
            else:
                paged.append((row, e))
            row += e.num_tokens
        dev = self.device
        attention = SdpaAttention(self.kv_cache, tensor(rows.slots, dev), fresh, self._gathered(paged))
        return Step(rows, tensor(rows.input_ids, dev), tensor(rows.positions, dev), tensor(rows.logit_rows, dev),
                    attention)

    def forward(self, step: Step) -> torch.Tensor:
        return transformers_forward(self.model, step)

    def note(self) -> str | None:
        if self.device.type != "cpu":
            return None
        from conveyor.core.backends.cpu.kernels import kernels_missing_reason

        reason = kernels_missing_reason()  # None where they run: `--backend torch` was asked for
        return f"conveyor's C++ kernels are not used here: {reason}" if reason else None

    def _gathered(self, paged: list[tuple[int, ScheduledRequest]]) -> list[GatheredRows]:
        dev = self.device
        out = []
        decodes = [(row, e) for row, e in paged if e.num_tokens == 1]
        if decodes:
            lens = [e.context_len for _, e in decodes]
            slots = self._slots([e.block_ids for _, e in decodes], max(lens))
            n = len(decodes)
            out.append(GatheredRows(tensor([row for row, _ in decodes], dev), slots,
                                    torch.arange(max(lens), device=dev).unsqueeze(0),
                                    tensor([e.start_pos for _, e in decodes], dev).view(n, 1, 1, 1),
                                    tensor(lens, dev).view(n, 1, 1, 1), True))
        for row, e in paged:
            if e.num_tokens == 1:
                continue
            ctx = e.context_len
            out.append(GatheredRows(slice(row, row + e.num_tokens), self._slots([e.block_ids], ctx),
                                    torch.arange(ctx, device=dev).unsqueeze(0),
                                    torch.arange(e.start_pos, ctx, device=dev).view(1, 1, -1, 1),
                                    tensor([ctx], dev).view(1, 1, 1, 1), False))
        return out

    def _slots(self, tables: list[tuple[int, ...]], length: int) -> torch.Tensor:
        """[len(tables), length] pool slots of the first `length` tokens of each table (padded with 0)."""
        bs = self.kv_cache.block_size
        num_blocks = -(-length // bs)
        padded = tensor(padded_tables(tables, num_blocks), self.device)
        offsets = torch.arange(bs, device=self.device)
        return (padded.unsqueeze(2) * bs + offsets).reshape(len(tables), num_blocks * bs)[:, :length]
