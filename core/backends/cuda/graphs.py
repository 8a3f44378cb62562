"""(torch) CUDA graphs of the CUDA backend's forward, one per bucket of step rows, over static index buffers.

`StaticInputs` holds a bucket's index buffers (one int32 tensor, so that a step's indices reach the device
in one copy) and fills them from a step: rows past the step's are padding, which write their K/V to the
scratch slot and belong to no query block (request -1); requests past the step's are empty. `CapturedStep`
captures the forward over those buffers once and replays it. The filling runs on any device (the tests run
it on the CPU); the capture needs CUDA.
"""

from __future__ import annotations

import torch

from conveyor.core.backends.cuda.triton_attention import TritonAttention, block_shape, query_blocks
from conveyor.core.backends.step import StepRows, padded_tables

GRAPH_MAX_TOKENS = 512
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)


class StaticInputs:
    """The index buffers of steps of up to `rows` rows and `max_seqs` requests, on `device`."""

    NAMES = ("input_ids", "positions", "slots", "tables", "seq_lens", "q_start", "qb_seq", "qb_first",
             "logit_rows")

    def __init__(self, rows: int, max_seqs: int, max_blocks: int, group: int, scratch_slot: int,
                 device: torch.device) -> None:
        self.rows = rows
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks
        self.scratch_slot = scratch_slot
        self.block_m, self.block_q = block_shape(group, prefill=False)
        num_query_blocks = rows // self.block_q + max_seqs  # enough for any mix of rows
        sizes = (rows, rows, rows, max_seqs * max_blocks, max_seqs, max_seqs + 1, num_query_blocks,
                 num_query_blocks, max_seqs)
        self.offsets = [0]
        for size in sizes:
            self.offsets.append(self.offsets[-1] + size)
        self.device = device
        self.buffer = torch.zeros(self.offsets[-1], dtype=torch.int32, device=device)
        self.host = torch.zeros(self.offsets[-1], dtype=torch.int32, pin_memory=device.type == "cuda")
        self.views = {name: self.buffer[a:b] for name, a, b in zip(self.NAMES, self.offsets, self.offsets[1:])}
        self.views["tables"] = self.views["tables"].view(max_seqs, max_blocks)
        self.fill(None)

    def _host(self, name: str) -> torch.Tensor:
        i = self.NAMES.index(name)
        return self.host[self.offsets[i]:self.offsets[i + 1]]

    def fill(self, rows: StepRows | None) -> int:
        """Copy the step's indices (None: all padding) into the buffers; returns its number of logit rows."""
        h = self._host
        self.host.zero_()
        h("slots").fill_(self.scratch_slot)
        h("qb_seq").fill_(-1)
        if rows is None:
            self.buffer.copy_(self.host)
            return 0
        entries = rows.entries
        T = len(rows.input_ids)
        if T > self.rows or len(entries) > self.max_seqs or len(rows.logit_rows) > self.max_seqs:
            raise ValueError(f"a step of {T} rows and {len(entries)} requests does not fit a graph of {self.rows} "
                             f"rows and {self.max_seqs} requests")

        def put(name: str, values: list[int], start: int = 0) -> None:
            h(name)[start:start + len(values)] = torch.tensor(values, dtype=torch.int32)

        put("input_ids", rows.input_ids)
        put("positions", rows.positions)
        put("slots", rows.slots)
        padded = padded_tables([e.block_ids for e in entries])  # to the step's longest: the rest stays zero
        h("tables").view(self.max_seqs, self.max_blocks)[:len(entries), :len(padded[0])] = torch.tensor(
            padded, dtype=torch.int32)
        q_start = [0]
        for e in entries:
            q_start.append(q_start[-1] + e.num_tokens)
        put("seq_lens", [e.start_pos + e.num_tokens for e in entries])
        h("q_start").fill_(T)  # requests past the step's are empty
        put("q_start", q_start)
        blocks = query_blocks([e.num_tokens for e in entries], self.block_q)
        put("qb_seq", blocks.seq)
        put("qb_first", blocks.first)
        put("logit_rows", rows.logit_rows)
        self.buffer.copy_(self.host, non_blocking=self.device.type == "cuda")
        return len(rows.logit_rows)


class CapturedStep:
    """The backend's lean forward over one bucket's `StaticInputs`, captured as a CUDA graph."""

    def __init__(self, backend, rows: int) -> None:
        self.backend = backend
        dev = backend.device
        self.inputs = inputs = StaticInputs(rows, min(rows, backend.max_num_seqs), backend.max_blocks, backend.group,
                                            backend.scratch_slot, dev)
        v = inputs.views
        self.long = {name: torch.zeros(v[name].shape, dtype=torch.long, device=dev)
                     for name in ("input_ids", "positions", "slots", "logit_rows")}
        self.attention = TritonAttention(backend.kv_cache, self.long["slots"], v["tables"], v["seq_lens"],
                                         v["q_start"], v["qb_seq"], v["qb_first"], inputs.block_m, inputs.block_q)
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile the kernels and set cuBLAS up outside the capture
                self.logits = self._forward()
        torch.cuda.current_stream(dev).wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=backend.graph_pool):
            self.logits = self._forward()

    def _forward(self) -> torch.Tensor:
        for name, t in self.long.items():
            t.copy_(self.inputs.views[name])
        return self.backend.lean(self.long["input_ids"], self.long["positions"], self.attention,
                                 self.long["logit_rows"])

    def run(self, rows: StepRows) -> torch.Tensor:
        n = self.inputs.fill(rows)
        self.graph.replay()
        # The pinned host buffer is rewritten by the next step: its copy must be done first.
        torch.cuda.current_stream(self.backend.device).synchronize()
        return self.logits[:n]
