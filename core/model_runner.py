"""(torch) SchedulerOutput -> one flat forward pass -> logits at sample positions -> RunnerOutput.

Receives a built model and plain plan data; never a path, a record or a Request.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection

import torch

from conveyor.core.attention import ATTN_IMPLEMENTATION, GatheredRows, PagedBatch
from conveyor.core.cpu_kernels import cpu_kernels, kernels_missing_reason
from conveyor.core.exactness import inexact_reason
from conveyor.core.fused_llama import FusedLlama
from conveyor.core.kv_cache import KVCache
from conveyor.core.logits_state import LogitsState
from conveyor.core.logprobs import token_logprobs
from conveyor.core.malloc_tuning import keep_freed_memory
from conveyor.core.sampler import Sampler
from conveyor.core.schedule_types import RunnerOutput, ScheduledRequest, SchedulerOutput


_warned_inexact = False


def _warn_inexact(device: torch.device) -> None:
    """One line on stderr, once per process, where the engine takes the torch route, which does not meet the
    exactness contract."""
    global _warned_inexact
    if _warned_inexact:
        return
    _warned_inexact = True
    where = "on this GPU" if device.type != "cpu" else f"here ({kernels_missing_reason()})"
    sys.stderr.write(f"conveyor: without conveyor's C++ kernels {where}, results are not batch-invariant: "
                     f"{inexact_reason('torch')}\n")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, eos_token_ids: Collection[int],
                 fused_forward: bool = True) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = next(model.parameters()).device
        # The C++ kernels run on the CPU only; elsewhere (CUDA) the gather fallback is used.
        ops = None
        if self.device.type == "cpu":
            ops = cpu_kernels()
            keep_freed_memory()
        self.sampler = Sampler(eos_token_ids, argmax=None if ops is None else ops.argmax_rows,
                               sample_rows=None if ops is None else ops.sample_rows,
                               apply_bitmask=None if ops is None else ops.apply_token_bitmask)
        if ops is None:
            _warn_inexact(self.device)
        self.kernel = None if ops is None else ops.paged_attention
        self.store_kv = None if ops is None else ops.store_kv
        if kv_cache.layout != "plain" and ops is None:
            raise ValueError(f"a {kv_cache.layout!r} KV pool needs conveyor's CPU kernels, which are unavailable")
        # Llama-family models on the CPU run a fused forward; others the transformers forward.
        self.fused = FusedLlama.build(model, ops) if fused_forward else None
        self.timings: dict[str, float] | None = None  # seconds per phase, when profiling

    def enable_profiling(self) -> None:
        self.timings = {"prepare_s": 0.0, "forward_s": 0.0, "sample_s": 0.0}

    def _tick(self, key: str, since: float) -> float:
        """Charge the time since `since` to `key`; waits for the device so the split is honest."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.timings[key] += now - since
        return now

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, states: dict[str, LogitsState] | None = None) -> RunnerOutput:
        """One forward pass and one sampler call; `states` holds the logits-processor state of the requests that
        have one (by req_id)."""
        if plan.is_empty:
            return RunnerOutput(sampled_token_ids={})
        impl = getattr(self.model.config, "_attn_implementation", None)
        # Through transformers' forward, any other attention ignores the paged cache: wrong tokens, silently.
        if self.fused is None and impl != ATTN_IMPLEMENTATION:
            raise RuntimeError(f"the model's attention implementation is {impl!r}, not {ATTN_IMPLEMENTATION!r}; "
                               "it was changed after the engine was built")
        profiling = self.timings is not None
        t = time.perf_counter() if profiling else 0.0
        input_ids, positions, batch, sample_rows, prompt_rows = self._prepare(plan.scheduled)
        if profiling:
            t = self._tick("prepare_s", t)
        logit_rows = sample_rows if prompt_rows is None else torch.cat([sample_rows, prompt_rows])
        if self.fused is not None:
            logits = self.fused(input_ids, positions, batch, logit_rows)
        else:
            logits = self.model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
                logits_to_keep=logit_rows,
                conveyor_batch=batch,
            ).logits[0]
        if profiling:
            t = self._tick("forward_s", t)
        num_sampled = len(sample_rows)
        prompt_logprobs = self._prompt_logprobs(plan.scheduled, logits[num_sampled:]) if prompt_rows is not None else {}
        sampled_entries = [e for e in plan.scheduled if e.sample]
        row_states = [states.get(e.req_id) for e in sampled_entries] if states else None
        token_ids, logprobs = self.sampler.sample(logits[:num_sampled], sampled_entries, row_states)
        if profiling:
            self._tick("sample_s", t)
        return RunnerOutput(sampled_token_ids={e.req_id: t for e, t in zip(sampled_entries, token_ids)},
                            logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _prompt_logprobs(entries: list[ScheduledRequest], logits: torch.Tensor) -> dict:
        """The logprobs of each chunk's prompt targets, from their rows' logits (in entry order)."""
        out = {}
        at = 0
        for e in entries:
            n = len(e.prompt_targets)
            if n:
                found = token_logprobs(logits[at:at + n], e.prompt_targets, [e.sampling.prompt_logprobs] * n)
                out[e.req_id] = (e.start_pos + 1, found)
                at += n
        return out

    def _prepare(self, entries: list[ScheduledRequest]):
        """Flatten the step: token ids, positions, slot mapping and the attention's index tensors."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []  # rows whose logits give prompt logprobs (their targets, in entry order)
        fresh_chunks: list[tuple[int, int]] = []
        paged: list[tuple[int, ScheduledRequest]] = []  # (first row, entry) attending through the pool
        for e in entries:
            row = len(input_ids)
            input_ids.extend(e.token_ids)
            pos = range(e.start_pos, e.start_pos + e.num_tokens)
            positions.extend(pos)
            table = e.block_ids
            slots.extend([table[p // bs] * bs + p % bs for p in pos])
            if e.sample:
                sample_rows.append(row + e.num_tokens - 1)
            prompt_rows.extend(range(row, row + len(e.prompt_targets)))
            if e.start_pos == 0 and e.num_tokens > 1 and self.kernel is None:
                fresh_chunks.append((row, row + e.num_tokens))
            else:
                paged.append((row, e))
        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        batch = PagedBatch(keys=self.kv_cache.keys, values=self.kv_cache.values, slot_mapping=slot_mapping,
                           slot_block=slot_mapping // bs, slot_offset=slot_mapping % bs, block_size=bs,
                           kernel=self.kernel, store_kv=self.store_kv, fresh_chunks=fresh_chunks)
        if self.kernel is not None:
            self._kernel_tensors(batch, paged)
        elif paged:
            batch.gathered = self._gathered_tensors(paged)
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                batch,
                torch.tensor(sample_rows, dtype=torch.long, device=dev),
                torch.tensor(prompt_rows, dtype=torch.long, device=dev) if prompt_rows else None)

    def _kernel_tensors(self, batch: PagedBatch, paged: list[tuple[int, ScheduledRequest]]) -> None:
        """The kernel's view of the step: every row, its request's block table and the keys it sees."""
        token_req: list[int] = []
        token_ctx: list[int] = []
        max_blocks = max(len(e.block_ids) for _, e in paged)
        tables = []
        for r, (_, e) in enumerate(paged):
            n = e.num_tokens
            token_req.extend([r] * n)
            token_ctx.extend(range(e.start_pos + 1, e.start_pos + n + 1))
            tables.append(list(e.block_ids) + [0] * (max_blocks - len(e.block_ids)))
        dev = self.device
        batch.tables = torch.tensor(tables, dtype=torch.long, device=dev)  # [R, max_blocks]
        batch.token_req = torch.tensor(token_req, dtype=torch.long, device=dev)
        batch.token_ctx = torch.tensor(token_ctx, dtype=torch.long, device=dev)

    def _gathered_tensors(self, paged: list[tuple[int, ScheduledRequest]]) -> list[GatheredRows]:
        """Fallback without the kernel: one padded gather for all decodes, one per continuing chunk."""
        dev = self.device
        out = []
        decodes = [(row, e) for row, e in paged if e.num_tokens == 1]
        if decodes:
            lens = [e.context_len for _, e in decodes]
            slots = self._slots([e.block_ids for _, e in decodes], max(lens))
            lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
            mask = torch.arange(max(lens), device=dev).unsqueeze(0) < lens_t.unsqueeze(1)
            out.append(GatheredRows(torch.tensor([row for row, _ in decodes], dtype=torch.long, device=dev),
                                    slots, mask[:, None, None, :], is_decode=True))
        for row, e in paged:
            if e.num_tokens == 1:
                continue
            ctx = e.context_len
            q_pos = torch.arange(e.start_pos, ctx, device=dev).unsqueeze(1)
            mask = torch.arange(ctx, device=dev).unsqueeze(0) <= q_pos  # query at p sees keys [0, p]
            out.append(GatheredRows(slice(row, row + e.num_tokens), self._slots([e.block_ids], ctx),
                                    mask[None, None], is_decode=False))
        return out

    def _slots(self, tables: list[tuple[int, ...]], length: int) -> torch.Tensor:
        """[len(tables), length] pool slots of the first `length` tokens of each table (padded with 0)."""
        bs = self.block_size
        num_blocks = -(-length // bs)
        padded = torch.tensor([list(t[:num_blocks]) + [0] * (num_blocks - len(t[:num_blocks])) for t in tables],
                              dtype=torch.long, device=self.device)
        offsets = torch.arange(bs, device=self.device)
        return (padded.unsqueeze(2) * bs + offsets).reshape(len(tables), num_blocks * bs)[:, :length]
