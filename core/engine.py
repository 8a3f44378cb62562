"""(torch) Engine: owns the scheduler, block manager, KV pool and model runner; one step at a time.

    plan = scheduler.schedule()                     # pure Python
    result = runner.execute(plan)                   # one forward pass, one sampler call
    finished = scheduler.update_from_output(plan, result)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from conveyor.core.block_manager import BlockManager
from conveyor.core.backends import select_backend
from conveyor.core.config import EngineConfig, parse_memory
from conveyor.core.detokenizer import IncrementalDetokenizer
from conveyor.core.grammar import Grammars
from conveyor.core.kv_cache import KVCache, kv_bytes_per_block
from conveyor.core.logits_state import LogitsState
from conveyor.core.model_runner import ModelRunner
from conveyor.core.outputs import GenerationRequest, RequestOutput
from conveyor.core.request import FinishReason, Request
from conveyor.core.schedule_types import TokenLogprobs
from conveyor.core.scheduler import Scheduler
from conveyor.core.stopping import find_stop_string


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use
    num_preemptions: int
    prefix_cache_hit_rate: float
    num_computed_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    num_steps: int


@dataclass(frozen=True)
class StepInfo:
    """What one step ran: its forward pass's rows and what they were, and its wall time."""
    seconds: float
    num_requests: int  # requests scheduled
    num_tokens: int  # rows of the forward pass
    num_decode_rows: int  # rows that extend a generation by one token
    decode_keys: int  # keys the decode rows attend to, summed
    num_sampled: int  # tokens sampled: one per decode row and per prompt completed


def eos_ids_of(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class Engine:
    """Continuous batching over a paged KV cache for one transformers causal LM."""

    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig = EngineConfig()) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        mc = model.config
        self.max_model_len = int(getattr(mc, "max_position_embeddings", 1 << 30))
        num_layers = mc.num_hidden_layers
        num_kv_heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        param = next(model.parameters())
        self.backend = select_backend(model, config.backend, config.fused_forward, config.max_num_seqs,
                                      config.max_num_batched_tokens)
        per_block = kv_bytes_per_block(num_layers, num_kv_heads, head_dim, config.block_size, param.dtype)
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            budget = self.backend.kv_budget(
                None if config.kv_cache_memory is None else parse_memory(config.kv_cache_memory),
                config.gpu_memory_utilization)
            num_blocks = budget // per_block
            if num_blocks < 1:
                raise ValueError(f"the KV cache budget ({budget} bytes) holds no block; one block needs "
                                 f"{per_block} bytes (--kv-cache-memory)")
        layout = self.backend.kv_layout(head_dim, config.block_size, mc.num_attention_heads // num_kv_heads)
        # The backend's own blocks (a scratch block for padding rows) come after the block manager's.
        self.kv_cache = KVCache(num_layers, num_kv_heads, head_dim, num_blocks + self.backend.spare_blocks(),
                                config.block_size, param.dtype, param.device, layout)
        self.eos_token_ids = eos_ids_of(model, tokenizer)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.eos_token_ids)
        self.runner = ModelRunner(self.backend, self.kv_cache, self.eos_token_ids)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._grammars: Grammars | None = None  # made on the first request with a grammar
        self._logprobs: dict[str, list[TokenLogprobs]] = {}  # req_id -> one per output token so far
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}  # req_id -> one per prompt token
        self.num_generated_tokens = 0
        # Seconds per phase of step(); perf_counter is cheap enough to keep always on.
        self._timings = {"schedule_s": 0.0, "update_s": 0.0, "output_s": 0.0, "step_s": 0.0, "steps": 0}
        self._last_step = None  # (plan, number of tokens sampled, seconds) of the last step

    def enable_profiling(self) -> None:
        """Also split the runner's time into prepare / forward / sample (waits for the device)."""
        self.runner.enable_profiling()

    def profile(self) -> dict[str, float]:
        """Seconds spent per phase of `step()` (schedule, prepare, forward, sample, update, output)."""
        t = self._timings
        out = {"schedule_s": t["schedule_s"], **(self.runner.timings or {}), "update_s": t["update_s"],
               "output_s": t["output_s"], "step_s": t["step_s"], "steps": t["steps"]}
        return out

    @classmethod
    def from_pretrained(cls, model: str, config: EngineConfig = EngineConfig()) -> "Engine":
        from conveyor.core.model_loader import load_model

        lm, tokenizer = load_model(model, device=config.device, dtype=config.dtype)
        return cls(lm, tokenizer, config)

    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; raises ValueError (naming the request) if it can never run."""
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"request {request.req_id!r}: prompt ({len(request.prompt_token_ids)} tokens) + max_tokens "
                f"({request.sampling.max_tokens}) exceeds the model's context of {self.max_model_len} tokens")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"request {request.req_id!r}: a prompt token id is outside the vocabulary [0, {vocab})")
        req = Request(request.req_id, request.prompt_token_ids, request.sampling, request.priority,
                      arrival_time=time.monotonic())
        sampling = request.sampling
        if LogitsState.needed(sampling):
            matcher = None
            if sampling.grammar is not None:
                if self._grammars is None:
                    self._grammars = Grammars(self.tokenizer, vocab)
                matcher = self._grammars.matcher(sampling.grammar)  # ValueError naming the problem
            req.logits_state = LogitsState(sampling, request.prompt_token_ids, matcher)
        self.scheduler.add_request(req)
        if sampling.stop:
            self._detokenizers[req.req_id] = IncrementalDetokenizer(self.tokenizer)
        if sampling.logprobs is not None:
            self._logprobs[req.req_id] = []
        if sampling.prompt_logprobs is not None:
            self._prompt_logprobs[req.req_id] = [None] * len(request.prompt_token_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the requests that finished in it."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        t1 = time.perf_counter()
        requests = self.scheduler.requests
        states = {e.req_id: s for e in plan.scheduled if (s := requests[e.req_id].logits_state) is not None}
        result = self.runner.execute(plan, states)
        t2 = time.perf_counter()
        self.num_generated_tokens += len(result.sampled_token_ids)
        for req_id, lp in result.logprobs.items():
            self._logprobs[req_id].append(lp)
        for req_id, (first, found) in result.prompt_logprobs.items():
            slots = self._prompt_logprobs[req_id]
            for position, lp in enumerate(found, first):
                if slots[position] is None:  # a recompute after preemption gives the same values again
                    slots[position] = lp
        finished = self.scheduler.update_from_output(plan, result)
        if self._detokenizers:
            finished += self._check_stop_strings(result.sampled_token_ids, finished)
        t3 = time.perf_counter()
        outputs = [self._output(r) for r in finished]
        t4 = time.perf_counter()
        t = self._timings
        t["schedule_s"] += t1 - t0
        t["update_s"] += t3 - t2
        t["output_s"] += t4 - t3
        t["step_s"] += t4 - t0
        t["steps"] += 1
        self._last_step = (plan, len(result.sampled_token_ids), t4 - t0)
        return outputs

    @property
    def last_step(self) -> StepInfo | None:
        """The last step that ran (None before the first); worked out only when asked."""
        if self._last_step is None:
            return None
        plan, sampled, seconds = self._last_step
        decodes = [e for e in plan.scheduled if e.num_tokens == 1 and e.num_output_tokens > 0]
        return StepInfo(seconds=seconds, num_requests=len(plan.scheduled), num_tokens=plan.num_batched_tokens,
                        num_decode_rows=len(decodes), decode_keys=sum(e.start_pos + 1 for e in decodes),
                        num_sampled=sampled)

    def _check_stop_strings(self, sampled: dict[str, int], already: list[Request]) -> list[Request]:
        done = {r.req_id for r in already}
        stopped = []
        for req_id in sampled:
            detok = self._detokenizers.get(req_id)
            if detok is None or req_id in done:
                continue
            request = self.scheduler.requests[req_id]
            delta = detok.update(request.output_token_ids)
            if not delta or request.num_output_tokens < request.sampling.min_tokens:
                continue
            if find_stop_string(detok.text, request.sampling.stop, len(delta)) is not None:
                self.scheduler.finish_request(request, FinishReason.STOP)
                stopped.append(request)
        return stopped

    def _output(self, request: Request) -> RequestOutput:
        self._detokenizers.pop(request.req_id, None)
        logprobs = self._logprobs.pop(request.req_id, None)
        prompt_logprobs = self._prompt_logprobs.pop(request.req_id, None)
        note = None
        state = request.logits_state
        if state is not None and state.matcher is not None:
            if request.finish_reason is FinishReason.LENGTH and not state.grammar_complete:
                note = (f"max_tokens ({request.sampling.max_tokens}) ran out before the output completed its "
                        f"{request.sampling.grammar.kind.replace('_', ' ')}: the output is incomplete")
            elif state.grammar_failed:
                note = "the grammar allowed no token the model could continue with: the output stops there"
        output_ids = request.output_token_ids
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        if request.sampling.stop:
            cut = find_stop_string(text, request.sampling.stop, len(text))
            if cut is not None:
                text = text[:cut]
        first_sched = request.first_scheduled_time or request.arrival_time
        return RequestOutput(
            req_id=request.req_id,
            output_token_ids=output_ids,
            text=text,
            finish_reason=request.finish_reason.value,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            arrival_time=request.arrival_time,
            first_scheduled_time=first_sched,
            first_token_time=request.first_token_time or request.finish_time,
            finish_time=request.finish_time,
            logprobs=None if logprobs is None else tuple(logprobs),
            prompt_logprobs=None if prompt_logprobs is None else tuple(prompt_logprobs),
            note=note,
        )

    def abort(self, req_id: str) -> None:
        request = self.scheduler.requests.get(req_id)
        if request is not None:
            self.scheduler.finish_request(request, FinishReason.ABORT)
            self._detokenizers.pop(req_id, None)
            self._logprobs.pop(req_id, None)
            self._prompt_logprobs.pop(req_id, None)

    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[RequestOutput]:
        """Pull requests lazily (never more than `max_waiting` queued), yield results as they finish.

        A request the engine cannot run at all (ValueError from `add_request`) propagates.
        """
        source = iter(requests)
        exhausted = False
        while True:
            while not exhausted and self.num_waiting < self.config.max_waiting:
                nxt = next(source, None)
                if nxt is None:
                    exhausted = True
                    break
                self.add_request(nxt)
            if not self.has_unfinished():
                if exhausted:
                    return
                continue
            yield from self.step()

    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.block_manager.usage,
            num_preemptions=s.num_preemptions,
            prefix_cache_hit_rate=s.prefix_cache_hit_rate,
            num_computed_prompt_tokens=s.num_computed_prompt_tokens,
            num_cached_prompt_tokens=s.num_cached_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_steps=s.num_steps,
        )
