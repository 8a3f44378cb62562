"""(torch) The CUDA backend: Triton paged attention over a "flash" pool, a lean forward, CUDA graphs for the
steps of up to GRAPH_MAX_TOKENS rows, the KV pool sized from free GPU memory.

- Per step, one host-to-device copy: every index list of the step (token ids, positions, slots, block
  tables, each request's rows and keys, the query blocks, logit rows) packed into one int32 buffer (a
  graph's is pinned and reused).
- Steps of up to GRAPH_MAX_TOKENS rows whose logit rows are their sampled rows replay a CUDA graph captured
  (lazily, once) for the smallest bucket of rows that holds them: the step's indices are copied into the
  graph's static buffers, padding rows write their K/V to a scratch block of their own and belong to no query
  block. Larger steps and steps that want prompt logprobs run eagerly.
- The decoder families of `decoder_plan` take `forward.DecoderForward` (graphs where no layer is MoE); other
  architectures their transformers forward with this attention (eager, no graphs).
- Not batch-invariant: cuBLAS picks a matmul's kernel (and its reduction order) by the step's shape.
It also runs on a CPU under TRITON_INTERPRET=1 (Triton's interpreter; no graphs, no pinned memory): that is
how CI tests it.
"""

from __future__ import annotations

import bisect

import torch

from conveyor.core.attention_spec import ModelAttention
from conveyor.core.backends.base import Backend
from conveyor.core.backends.cuda.forward import DecoderForward, table_positions
from conveyor.core.backends.cuda.graphs import GRAPH_BUCKETS, GRAPH_MAX_TOKENS, CapturedStep
from conveyor.core.backends.cuda.triton_attention import TILE, TritonAttention, block_shape, query_blocks
from conveyor.core.backends.decoder_plan import decoder_plan
from conveyor.core.backends.step import FLASH, KVLayout, Step, StepRows, padded_tables
from conveyor.core.backends.transformers_forward import transformers_forward
from conveyor.core.errors import ConfigError

MARGIN = 512 << 20  # cuBLAS workspaces, Triton, the allocator's slack: kept out of the KV pool


class CudaBackend(Backend):
    name = "cuda"
    exact = False
    window_alignment = TILE  # a window block of queries reads from a TILE-aligned key (triton_attention.py)

    def __init__(self, model: torch.nn.Module, attention: ModelAttention, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048) -> None:
        super().__init__(model, attention)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.group = self.shape.num_heads // self.shape.num_kv_heads
        plan, self.unfused_reason = decoder_plan(model, self.attention)
        self.lean = DecoderForward(model, plan, self.attention) if plan is not None else None
        self.use_graphs = self.device.type == "cuda" and self.lean is not None and not self.lean.has_moe
        self.graphs: dict[int, CapturedStep] = {}
        self.graph_pool = None
        self.graph_replays = 0

    def kv_layout(self, head_dim: int, block_size: int, group: int) -> KVLayout:
        return FLASH

    def spare_blocks(self) -> int:
        return 1  # the scratch block padding rows write to

    def kv_budget(self, kv_cache_memory: int | None, gpu_memory_utilization: float | None) -> int:
        if kv_cache_memory is not None or self.device.type != "cuda":
            return super().kv_budget(kv_cache_memory, gpu_memory_utilization)
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = self.activation_bytes() + MARGIN
        budget = int(total * gpu_memory_utilization) - (total - free) - reserve
        if budget <= 0:
            raise ConfigError("gpu_memory_utilization",
                              f"{total / 2**30:.1f} GiB x {gpu_memory_utilization} leaves no room for a KV cache "
                              f"after the memory in use ({(total - free) / 2**30:.1f} GiB) and the activations "
                              f"({reserve / 2**30:.1f} GiB); raise it, lower --max-num-batched-tokens, or give "
                              "--kv-cache-memory", gpu_memory_utilization)
        return budget

    def activation_bytes(self) -> int:
        """An upper estimate of one step's activations at max_num_batched_tokens rows (the residual stream and
        a layer's temporaries, float32 norms) and max_num_seqs rows of logits through the sampler."""
        shape = self.shape
        elem = self.dtype.itemsize
        hidden, inter, head_dim = shape.hidden_size, shape.intermediate_size, shape.head_dim
        qkv = (shape.num_heads + 2 * shape.num_kv_heads) * head_dim
        per_row = (4 * hidden + qkv + shape.num_heads * head_dim + 3 * inter) * elem + 8 * hidden
        logits = max(self.max_num_seqs, 1) * shape.vocab_size * (elem + 12)
        return 2 * self.max_num_batched_tokens * per_row + 2 * logits

    def bind(self, kv_cache) -> None:
        super().bind(kv_cache)
        self.scratch_slot = (kv_cache.num_blocks - 1) * kv_cache.block_size
        self.max_blocks = -(-table_positions(self.model) // kv_cache.block_size)

    # -- per step ----------------------------------------------------------------------------------------

    def prepare(self, rows: StepRows) -> Step:
        entries = rows.entries
        T = len(rows.input_ids)
        graphable = (self.use_graphs and T <= GRAPH_MAX_TOKENS and len(rows.logit_rows) == rows.num_sampled
                     and not rows.embed_rows
                     and len(entries) <= self.max_num_seqs and self.lean.covers(max(rows.positions)))
        if graphable:
            return Step(rows, None, None, None, None, extra={"graph_rows": T})
        prefill = any(e.num_tokens > 1 for e in entries)
        block_m, block_q = block_shape(self.group, prefill)
        counts = [e.num_tokens for e in entries]
        blocks = query_blocks(counts, block_q)
        padded = padded_tables([e.block_ids for e in entries])
        max_blocks = len(padded[0])
        tables = [b for row in padded for b in row]
        q_start = [0]
        for n in counts:
            q_start.append(q_start[-1] + n)
        seq_lens = [e.start_pos + e.num_tokens for e in entries]
        if self.lean is not None and not self.lean.covers(max(rows.positions)):
            self.lean.reserve(max(rows.positions) + 1)
        ids, pos, slots, tables_t, seq_t, start_t, qb_seq, qb_first, logit_rows = _upload(
            [rows.input_ids, rows.positions, rows.slots, tables, seq_lens, q_start, blocks.seq, blocks.first,
             rows.logit_rows], self.device)
        attention = TritonAttention(self.kv_cache, slots.long(), tables_t.view(len(entries), max_blocks), seq_t,
                                    start_t, qb_seq, qb_first, block_m, block_q)
        return Step(rows, ids.long(), pos.long(), logit_rows.long(), attention)

    def forward(self, step: Step) -> torch.Tensor:
        if "graph_rows" in step.extra:
            return self._replay(step.rows)
        if self.lean is not None:
            return self.lean(step.input_ids, step.positions, step.attention, step.logit_rows, step.embeds)
        return transformers_forward(self.model, step)

    # -- CUDA graphs ----------------------------------------------------------------------------------------

    def _replay(self, rows: StepRows) -> torch.Tensor:
        bucket = GRAPH_BUCKETS[bisect.bisect_left(GRAPH_BUCKETS, len(rows.input_ids))]
        graph = self.graphs.get(bucket)
        if graph is None:
            if self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()
            graph = self.graphs[bucket] = CapturedStep(self, bucket)
        self.graph_replays += 1
        return graph.run(rows)

    def describe(self) -> str:
        family = self.lean.plan.family if self.lean is not None else ""
        forward = f"lean {family} forward, CUDA graphs" if self.use_graphs else (
            f"lean {family} forward" if self.lean is not None else "transformers forward")
        return f"cuda ({forward})"

    def arithmetic(self) -> str:
        where = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "Triton's interpreter"
        return f"{self.describe()} on {where}, torch {torch.__version__}"


def _upload(arrays: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """The lists as int32 tensors on `device`, through one host-to-device copy (a few KiB: pinning a buffer per
    step would cost more than the copy)."""
    buffer = torch.tensor([x for a in arrays for x in a], dtype=torch.int32).to(device)
    out = []
    at = 0
    for a in arrays:
        out.append(buffer[at:at + len(a)])
        at += len(a)
    return out
