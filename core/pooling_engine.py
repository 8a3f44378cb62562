"""(torch) PoolingEngine: the engine of the pooling tasks (embed, classify, score, rerank, reward).

There is nothing to generate and no KV cache to keep: a request is one or more token sequences, each run once
through the model (`pooling_model.PoolingModel`). The engine takes up to `lookahead` requests at a time (pulled
lazily: backpressure, as the generation engine), orders their sequences longest first, and packs them into steps of
at most `max_num_batched_tokens` tokens and `max_num_seqs` sequences (a longer sequence runs alone); a request's
output comes out as soon as its last sequence has run. On the packed route a sequence's result does not depend on
the ones packed with it, so the outputs are the same bits in any batch and across a resume.

Per sequence, the task's result, float32: an embedding (pooled, cut to `dimensions`, L2-normalized where asked), a
classifier's probabilities (softmax; a sigmoid for one label), a cross-encoder's score, a reward model's raw
logits; with `pairs` (an embedding model asked to score), the cosine of each pair's two embeddings.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from conveyor.core.config import EngineConfig
from conveyor.core.engine_api import EngineInfo, EngineStats
from conveyor.core.model_source import ModelSource
from conveyor.core.outputs import ModelLimits
from conveyor.core.pooling_model import PoolingModel, load_pooling_model
from conveyor.core.pooling_params import PoolingOutput, PoolingRequest, TokenSequence
from conveyor.core.task import Task

DEFAULT_LOOKAHEAD = 256  # requests whose sequences are ordered together


@dataclass
class _Pending:
    request: PoolingRequest
    arrival: float
    first_scheduled: float | None = None
    results: dict[int, torch.Tensor] | None = None


class PoolingEngine:
    def __init__(self, model: PoolingModel, tokenizer, task: str, config: EngineConfig, max_model_len: int,
                 prompt: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.prompt = prompt  # what the checkpoint's sentence-transformers config prepends to every text (the builder)
        self.task = Task(task)
        self.config = config = config.for_device(model.device.type)
        self.lookahead = config.lookahead or DEFAULT_LOOKAHEAD
        self.max_model_len = max_model_len
        vocab = int(getattr(model.model.config, "vocab_size", 0) or len(tokenizer))
        self.limits = ModelLimits(max_model_len, vocab)
        self.labels = model.kind.labels  # a classifier's, per class
        self.cross_encoder = model.kind.classifier  # a score pair is one sequence (else two embeddings compared)
        self.vector_size = None if model.kind.classifier else int(model.model.config.hidden_size)
        self.exact = model.exact_packing
        self._pending: dict[str, _Pending] = {}
        self._waiting = 0
        self.num_tokens = 0
        self.num_steps = 0
        self.num_sequences = 0
        self._timings = {"forward_s": 0.0, "pool_s": 0.0, "step_s": 0.0, "steps": 0}

    @classmethod
    def from_pretrained(cls, model: str | ModelSource, task: Task, config: EngineConfig,
                        pooling: str | None) -> PoolingEngine:
        loaded, tokenizer, settings, context = load_pooling_model(model, task, config.device, config.dtype, pooling)
        return cls(loaded, tokenizer, task, config, context, settings.prompt)

    # -- what the run asks of any engine -------------------------------------------------------------------------

    def arithmetic(self) -> str:
        """What decides a result's bits here beyond the model and the settings: the route and the kernels."""
        if not self.exact:
            return self.model.describe()
        return f"{self.model.describe()}, {self.model.packed.arithmetic(self.model.dtype)}"

    def in_flight(self) -> dict:
        """Nothing is half-done between steps: a stopped request runs again whole."""
        return {}

    def enable_profiling(self) -> None:
        """(Every step is timed: a step is one forward pass, far longer than its two clock reads.)"""

    def profile(self) -> dict[str, float]:
        return dict(self._timings)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=self._waiting, kv_usage=0.0, num_preemptions=0,
                           prefix_cache_hit_rate=0.0, num_computed_prompt_tokens=self.num_tokens,
                           num_cached_prompt_tokens=0, num_generated_tokens=0, num_steps=self.num_steps,
                           num_forward_steps=self.num_steps, num_scheduled_rows=self.num_sequences)

    def info(self) -> EngineInfo:
        dtype = str(self.model.dtype).removeprefix("torch.")
        path = getattr(self.model.model.config, "name_or_path", None) or None
        return EngineInfo(model_path=path, dtype=dtype, backend=self.model.describe(),
                          max_num_seqs=self.config.max_num_seqs,
                          max_num_batched_tokens=self.config.max_num_batched_tokens, max_model_len=self.max_model_len,
                          cpu_isa=self.model.packed.cpu_isa() if self.exact else None, batch_invariant=self.exact)

    # -- the loop ------------------------------------------------------------------------------------------------

    def stream(self, requests: Iterable[PoolingRequest]) -> Iterator[list[PoolingOutput]]:
        """Each window of up to `lookahead` requests, pulled lazily, its sequences packed longest first; yields
        each step's finished outputs (a request refused at admission on its own, before the next step)."""
        source = iter(requests)
        while True:
            window: list[PoolingRequest] = []
            refused: list[PoolingOutput] = []
            for request in source:
                error = self._check(request)
                if error is not None:
                    now = time.monotonic()
                    refused.append(PoolingOutput(request.req_id, [], request.num_tokens, now, now, now, error))
                else:
                    window.append(request)
                    self._pending[request.req_id] = _Pending(request, time.monotonic(), results={})
                if len(window) >= self.lookahead:
                    break
            if refused:
                yield refused
            if not window:
                if not refused:
                    return
                continue
            yield from self._run_window(window)

    def _check(self, request: PoolingRequest) -> str | None:
        if not request.sequences:
            return f"request {request.req_id!r} has no input"
        vocab = self.limits.vocab_size
        for s in request.sequences:
            if not s.token_ids:
                return f"request {request.req_id!r}: an input has no tokens"
            if len(s.token_ids) > self.max_model_len:
                return (f"request {request.req_id!r}: an input of {len(s.token_ids)} tokens exceeds the model's "
                        f"context of {self.max_model_len}")
            if any(not 0 <= t < vocab for t in s.token_ids):
                return f"request {request.req_id!r}: a token id is outside the vocabulary [0, {vocab})"
        return None

    def _run_window(self, window: list[PoolingRequest]) -> Iterator[list[PoolingOutput]]:
        items = [(r.req_id, i, s) for r in window for i, s in enumerate(r.sequences)]
        items.sort(key=lambda item: -len(item[2].token_ids))  # longest first (stable: arrival order among equals)
        self._waiting = len(window)
        budget, most = self.config.max_num_batched_tokens, self.config.max_num_seqs
        at = 0
        while at < len(items):
            step = [items[at]]
            tokens = len(items[at][2].token_ids)
            at += 1
            while at < len(items) and len(step) < most and tokens + len(items[at][2].token_ids) <= budget:
                step.append(items[at])
                tokens += len(items[at][2].token_ids)
                at += 1
            yield self._step(step, tokens)

    def _step(self, step: list[tuple[str, int, TokenSequence]], tokens: int) -> list[PoolingOutput]:
        t0 = time.perf_counter()
        now = time.monotonic()
        for req_id, _, _ in step:
            pending = self._pending[req_id]
            if pending.first_scheduled is None:
                pending.first_scheduled = now
        try:
            results = self.model.run([s for _, _, s in step])
            error = None
        except Exception as e:  # noqa: BLE001 - a step that fails fails its requests, not the run
            results, error = None, f"the model's forward failed on it ({type(e).__name__}: {e})"
        t1 = time.perf_counter()
        done: list[PoolingOutput] = []
        for k, (req_id, i, _) in enumerate(step):
            pending = self._pending.get(req_id)
            if pending is None:  # (an earlier sequence of it failed)
                continue
            if error is not None:
                done.append(self._finish(pending, error))
                continue
            pending.results[i] = results[k]
            if len(pending.results) == len(pending.request.sequences):
                done.append(self._finish(pending, None))
        t2 = time.perf_counter()
        self.num_steps += 1
        self.num_tokens += tokens
        self.num_sequences += len(step)
        self._waiting = len(self._pending)
        t = self._timings
        t["forward_s"] += t1 - t0
        t["pool_s"] += t2 - t1
        t["step_s"] += t2 - t0
        t["steps"] += 1
        return done

    def _finish(self, pending: _Pending, error: str | None) -> PoolingOutput:
        request = pending.request
        del self._pending[request.req_id]
        values: list[tuple[float, ...]] = []
        if error is None:
            raw = [pending.results[i] for i in range(len(request.sequences))]
            values = [tuple(v.tolist()) for v in self._results(request, raw)]
        return PoolingOutput(request.req_id, values, request.num_tokens, pending.arrival,
                             pending.first_scheduled or pending.arrival, time.monotonic(), error)

    def _results(self, request: PoolingRequest, raw: list[torch.Tensor]) -> list[torch.Tensor]:
        """The task's results from each sequence's raw output (a pooled vector, or a head's logits)."""
        kind = self.model.kind
        if kind.classifier:
            if self.task is Task.REWARD:
                return raw
            if self.task.pairs:
                return [torch.sigmoid(v) if kind.score_activation == "sigmoid" else v for v in raw]
            return [torch.sigmoid(v) if v.numel() == 1 else torch.softmax(v, dim=0) for v in raw]
        vectors = [embedding(v, request.dimensions, request.normalize) for v in raw]
        if request.pairs is None:
            return vectors
        return [torch.nn.functional.cosine_similarity(vectors[a], vectors[b], dim=0).reshape(1)
                for a, b in request.pairs]


def embedding(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """A pooled vector as an embedding: its first `dimensions` values (Matryoshka), then L2-normalized."""
    if dimensions is not None:
        vector = vector[:dimensions].clone()
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector
