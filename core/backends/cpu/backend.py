"""(torch) The CPU backend: conveyor's C++ kernels (`kernels.py`, `csrc/`), exact in float32 and bfloat16.

- KV pool: "plain" (keys [blocks, kv_heads, head_dim, block_size], each block transposed for the kernel's
  vector loop over a block's keys; values [blocks * block_size, kv_heads, head_dim]) or, for bf16 on CPUs
  with bf16 products (AMX tiles or AVX512-BF16; head_dim 64, block size 16), "pairs" (keys [blocks,
  kv_heads, head_dim / 2, block_size, 2], values [blocks, kv_heads, block_size / 2, head_dim, 2]: bf16 pairs
  side by side as the tiles and VDPBF16PS read them). The layout decides the attention arithmetic; every
  row (fresh prompt, later chunk, decode) takes it.
- Per step: each row's request (an index into the step's block tables) and the keys it sees.
- Forward: `FusedDecoder` for the decoder families it covers (`backends/decoder_plan.py`), exact; else the
  model's transformers forward with this attention, whose linears are torch's (not batch-invariant: it says so).
"""

from __future__ import annotations

import torch

from conveyor.core.attention_spec import ModelAttention
from conveyor.core.backends.base import Backend
from conveyor.core.backends.cpu.fused_decoder import FusedDecoder
from conveyor.core.backends.cpu.kernels import build_tag, cpu_identity, cpu_isa, cpu_kernels
from conveyor.core.backends.step import (
    KVLayout,
    SamplerOps,
    Step,
    StepAttention,
    StepRows,
    padded_tables,
    tensor,
)
from conveyor.core.backends.transformers_forward import transformers_forward
from conveyor.core.malloc_tuning import keep_freed_memory

PLAIN = KVLayout("plain", lambda n, bs, h, d: (n, h, d, bs), lambda n, bs, h, d: (n * bs, h, d))
PAIRS = KVLayout("pairs", lambda n, bs, h, d: (n, h, d // 2, bs, 2), lambda n, bs, h, d: (n, h, bs // 2, d, 2))
LAYOUTS = {layout.name: layout for layout in (PLAIN, PAIRS)}


class CpuAttention(StepAttention):
    """Every row through the paged kernel, which reads K/V in place from the pool."""

    def __init__(self, ops, kv_cache, slot_mapping: torch.Tensor, tables: torch.Tensor, token_req: torch.Tensor,
                 token_ctx: torch.Tensor) -> None:
        self.ops = ops
        self.kv = kv_cache
        self.slot_mapping = slot_mapping  # [T]
        self.tables = tables  # [R, max_blocks] block tables of the step's requests
        self.token_req = token_req  # [T] each row's index into tables
        self.token_ctx = token_ctx  # [T] keys each row sees (its position + 1)

    def store(self, layer, k_new, v_new) -> None:
        k_cache, v_cache = self.kv.keys[layer], self.kv.values[layer]
        self.ops.store_kv(k_new.to(k_cache.dtype), v_new.to(v_cache.dtype), self.slot_mapping, k_cache, v_cache)

    def attend(self, layer, q, k_new, v_new, scale, window=None, softcap=None, sinks=None) -> torch.Tensor:
        k_cache, v_cache = self.kv.keys[layer], self.kv.values[layer]
        out = self.ops.paged_attention(q.to(k_cache.dtype), k_cache, v_cache, self.tables, self.token_req,
                                       self.token_ctx, self.kv.block_size, scale, window or 0, softcap or 0.0,
                                       sinks)
        return out.to(q.dtype)


class CpuBackend(Backend):
    name = "cpu"
    window_alignment = 16  # a window task reads from a 16-aligned key (paged_attention.cpp)

    def __init__(self, model: torch.nn.Module, attention: ModelAttention, fused_forward: bool = True) -> None:
        super().__init__(model, attention)
        if self.device.type != "cpu":
            raise ValueError(f"the cpu backend runs on the CPU, not on {self.device}")
        self.ops = cpu_kernels()
        if self.ops is None:
            raise RuntimeError("the cpu backend needs conveyor's C++ kernels, which are unavailable here")
        keep_freed_memory()
        self.fused, self.unfused_reason = FusedDecoder.build(model, self.attention, self.ops) if fused_forward else \
            (None, "the fused forward was turned off")
        # Only the fused forward's linears are conveyor's exact kernels; torch's under the transformers forward
        # choose their blocking by the step's shape.
        self.exact = self.fused is not None

    def kv_layout(self, head_dim: int, block_size: int, group: int) -> KVLayout:
        return LAYOUTS[kv_layout(self.dtype, head_dim, block_size, group)]

    def prepare(self, rows: StepRows) -> Step:
        token_req: list[int] = []
        token_ctx: list[int] = []
        entries = rows.entries
        for r, e in enumerate(entries):
            n = e.num_tokens
            token_req.extend([r] * n)
            token_ctx.extend(range(e.start_pos + 1, e.start_pos + n + 1))
        tables = padded_tables([e.block_ids for e in entries])
        dev = self.device
        slot_mapping = tensor(rows.slots, dev)
        attention = CpuAttention(self.ops, self.kv_cache, slot_mapping, tensor(tables, dev), tensor(token_req, dev),
                                 tensor(token_ctx, dev))
        return Step(rows, tensor(rows.input_ids, dev), tensor(rows.positions, dev), tensor(rows.logit_rows, dev),
                    attention)

    def forward(self, step: Step) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(step.input_ids, step.positions, step.attention, step.logit_rows, step.embeds)
        return transformers_forward(self.model, step)

    def sampler_ops(self) -> SamplerOps:
        ops = self.ops
        return SamplerOps(argmax=ops.argmax_rows, sample_rows=ops.sample_rows, apply_bitmask=ops.apply_token_bitmask)

    def describe(self) -> str:
        return f"cpu ({self.fused.describe()})" if self.fused is not None else "cpu (transformers forward)"

    def inexact_reason(self) -> str | None:
        if self.fused is not None:
            return None
        return ("its transformers forward's linears are torch's, which choose their blocking by the step's shape (a "
                "one-row matmul takes another kernel than a 64-row one), so a record's output can change with the "
                "records batched around it; the attention is conveyor's exact kernel")

    def note(self) -> str | None:
        return f"no fused forward for this model: {self.unfused_reason}" if self.fused is None else None

    def arithmetic(self) -> str:
        return f"{self.describe()}, {kernels_arithmetic(self.ops, self.dtype)}"

    def cpu_isa(self) -> str | None:
        return cpu_isa()


def kernels_arithmetic(ops, dtype: torch.dtype) -> str:
    """What the kernels `ops` compute `dtype`'s linears with, on which route, and which build of them: the part of a
    row's arithmetic they decide (the fused forward's and the pooling route's alike). The build is named by its tag
    and the CPU it was made for: the compiler tunes for that CPU (-mtune), and where it contracts a multiply and an
    add into one FMA can follow the tuning, so two CPUs on one route need not give the same bits."""
    if dtype == torch.bfloat16:
        linears = ("AMX tiles" if ops.amx_gemm_available() else
                   "AVX512-BF16 pair products" if ops.pair_gemm_available() else "bf16 widened to float32")
    else:
        linears = "float32 FMA panels"
    route = ", AVX2 route" if ops.build_isa() == "avx2" else ""  # its exp, silu and sums are its own
    return f"{linears}{route}, kernels {build_tag()} for {cpu_identity()[0]}"


def kv_layout(dtype: torch.dtype, head_dim: int, block_size: int, group: int) -> str:
    """The layout the kernels read for this model shape: "pairs" where bf16 attention runs as bf16 products
    (AMX tiles or AVX512-BF16; head_dim 64, block size 16), else "plain"."""
    ops = cpu_kernels()
    if ops is not None and ops.kv_pairs(dtype == torch.bfloat16, head_dim, block_size, group):
        return "pairs"
    return "plain"
