"""(torch) SchedulerOutput -> one flat forward pass -> logits at sample positions -> RunnerOutput.

Receives a built model and plain plan data; never a path, a record or a Request.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import torch

from conveyor.core.attention import PagedBatch, PrefillChunk
from conveyor.core.kv_cache import KVCache
from conveyor.core.sampler import Sampler
from conveyor.core.schedule_types import RunnerOutput, ScheduledRequest, SchedulerOutput


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, eos_token_ids: Collection[int]) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = next(model.parameters()).device
        self.sampler = Sampler(eos_token_ids)
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
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        if plan.is_empty:
            return RunnerOutput(sampled_token_ids={})
        profiling = self.timings is not None
        t = time.perf_counter() if profiling else 0.0
        input_ids, positions, batch, sample_rows = self._prepare(plan.scheduled)
        if profiling:
            t = self._tick("prepare_s", t)
        out = self.model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            logits_to_keep=sample_rows,
            conveyor_batch=batch,
        )
        if profiling:
            t = self._tick("forward_s", t)
        sampled_entries = [e for e in plan.scheduled if e.sample]
        token_ids = self.sampler(out.logits[0], sampled_entries)
        if profiling:
            self._tick("sample_s", t)
        return RunnerOutput(sampled_token_ids={e.req_id: t for e, t in zip(sampled_entries, token_ids)})

    def _prepare(self, entries: list[ScheduledRequest]):
        """Flatten the step: token ids, positions, slot mapping, decode and prefill index tensors."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[tuple[int, ...]] = []
        decode_lens: list[int] = []
        prefill_specs: list[tuple[int, int, ScheduledRequest]] = []
        for e in entries:
            row = len(input_ids)
            input_ids.extend(e.token_ids)
            pos = range(e.start_pos, e.start_pos + e.num_tokens)
            positions.extend(pos)
            table = e.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if e.sample:
                sample_rows.append(row + e.num_tokens - 1)
            if e.num_tokens == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(e.context_len)
            else:
                prefill_specs.append((row, row + e.num_tokens, e))
        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        decode = self._decode_tensors(decode_tables, decode_lens) if decode_rows else (None, None)
        prefills = [self._prefill_chunk(start, end, e) for start, end, e in prefill_specs]
        batch = PagedBatch(
            kv_cache=self.kv_cache.layers,
            slot_mapping=slot_mapping,
            decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=dev) if decode_rows else None,
            decode_slots=decode[0],
            decode_mask=decode[1],
            prefills=prefills,
            is_all_decode=not prefill_specs,
        )
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                batch,
                torch.tensor(sample_rows, dtype=torch.long, device=dev))

    def _decode_tensors(self, tables: list[tuple[int, ...]], lens: list[int]):
        bs = self.block_size
        dev = self.device
        max_len = max(lens)
        max_blocks = -(-max_len // bs)
        padded = torch.tensor([t[:max_blocks] + (0,) * (max_blocks - len(t[:max_blocks])) for t in tables],
                              dtype=torch.long, device=dev)  # [B, max_blocks]
        offsets = torch.arange(bs, device=dev)
        slots = (padded.unsqueeze(2) * bs + offsets).reshape(len(tables), max_blocks * bs)[:, :max_len]
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        mask = torch.arange(max_len, device=dev).unsqueeze(0) < lens_t.unsqueeze(1)  # [B, max_len]
        return slots, mask[:, None, None, :]

    def _prefill_chunk(self, q_start: int, q_end: int, e: ScheduledRequest) -> PrefillChunk:
        if e.start_pos == 0:
            return PrefillChunk(q_start, q_end, 0, None, None)
        bs = self.block_size
        dev = self.device
        ctx = e.context_len
        num_blocks = -(-ctx // bs)
        table = torch.tensor(e.block_ids[:num_blocks], dtype=torch.long, device=dev)
        ctx_slots = (table.unsqueeze(1) * bs + torch.arange(bs, device=dev)).reshape(-1)[:ctx]
        # query i sits at position start_pos + i and sees keys [0, start_pos + i]
        q_pos = torch.arange(e.start_pos, ctx, device=dev).unsqueeze(1)
        mask = torch.arange(ctx, device=dev).unsqueeze(0) <= q_pos  # [n, ctx]
        return PrefillChunk(q_start, q_end, e.start_pos, ctx_slots, mask)
