"""(torch) Engine: owns the scheduler, block manager, KV pool and model runner; one step at a time.

    ended = grammar_admission.admit_compiled()      # grammar_admission.py: compiled ones join the scheduler
    plan = scheduler.schedule()                     # pure Python
    result = runner.execute(plan)                   # one forward pass, one sampler call
    ended += scheduler.update_from_output(plan, result, outputs.check_stop, outputs.check_output)
    [outputs.output(r) for r in ended]              # output_processor.py: text, logprobs, timings

Every request ends through `Scheduler.finish_request` and comes out as a RequestOutput: those that stop or fail
while they run, those whose grammar did not compile, and those refused at admission (`stream`). `stream` is the
loop every caller runs (the records loop of io/records_run.py, `generate`): requests pulled lazily under the
backpressure bound, one step at a time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from conveyor.core.backends import select_backend
from conveyor.core.block_manager import BlockManager
from conveyor.core.config import EngineConfig, parse_memory
from conveyor.core.engine_api import EngineInfo, EngineStats
from conveyor.core.grammar_admission import GrammarAdmission
from conveyor.core.kv_cache import KVCache
from conveyor.core.logits_state import LogitsState
from conveyor.core.model_runner import ModelRunner
from conveyor.core.model_source import ModelSource
from conveyor.core.output_processor import OutputProcessor
from conveyor.core.outputs import GenerationRequest, InFlight, RequestOutput
from conveyor.core.request import FinishReason, Request
from conveyor.core.scheduler import Scheduler
from conveyor.core.speculative import CostCurve, SpeculativeConfig, Speculator

MEASURED_ROWS = 256  # the speculator's cost curve is measured up to this many rows, and extended linearly past it
MEASURED_CONTEXT = 128  # keys each measured row attends to


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
    """Continuous batching over a paged KV cache for one transformers causal LM (an `engine_api.InferenceEngine`)."""

    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig = EngineConfig()) -> None:
        self.model = model
        self.tokenizer = tokenizer
        param = next(model.parameters())
        # The device's defaults filled in (batch caps, backpressure bound).
        self.config = config = config.for_device(param.device.type)
        self.backend = select_backend(model, config.backend, config.fused_forward, config.max_num_seqs,
                                      config.max_num_batched_tokens)
        shape = self.backend.shape
        self.limits = shape.limits  # what a request must fit: the context, the vocabulary
        self.labels: tuple[str, ...] = ()  # (a classifier's: none here)
        self.max_model_len = shape.max_model_len
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            budget = self.backend.kv_budget(
                None if config.kv_cache_memory is None else parse_memory(config.kv_cache_memory),
                config.gpu_memory_utilization)
            num_blocks = shape.num_kv_blocks(budget, config.block_size, str(param.dtype).removeprefix("torch."))
        layout = self.backend.kv_layout(shape.head_dim, config.block_size, shape.num_heads // shape.num_kv_heads)
        # The backend's own blocks (a scratch block for padding rows) come after the block manager's.
        self.kv_cache = KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                num_blocks + self.backend.spare_blocks(), config.block_size, param.dtype, param.device,
                                layout)
        self.eos_token_ids = eos_ids_of(model, tokenizer)
        # Where every layer slides and the backend reads no key far before a window, blocks out of every window go
        # back to the pool as requests advance.
        window = self.backend.attention.all_slide if self.backend.window_alignment else None
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, window,
                                          math.lcm(self.backend.window_alignment or 1, config.block_size))
        self.runner = ModelRunner(self.backend, self.kv_cache, self.eos_token_ids)
        speculator = self._speculator(num_blocks) if config.speculative is not None else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.eos_token_ids, schedule=config.schedule, speculator=speculator)
        self.outputs = OutputProcessor(tokenizer, speculative=speculator is not None)
        self.grammar_admission = GrammarAdmission(tokenizer, self.limits.vocab_size, config.max_grammar_compile_s,
                                                  config.max_grammar_bytes, self.scheduler, self._admit)
        self.num_generated_tokens = 0
        self.num_scheduled_rows = 0  # requests scheduled, summed over the steps that ran
        # Seconds per phase of step(); perf_counter is cheap enough to keep always on.
        self._timings = {"schedule_s": 0.0, "update_s": 0.0, "output_s": 0.0, "step_s": 0.0, "steps": 0}
        self._last_step = None  # (plan, number of tokens sampled, seconds) of the last step

    def _speculator(self, num_blocks: int) -> Speculator:
        """The speculator, with the cost of this model's forward pass by its rows measured here, now (a second or
        so on a CPU): powers of two up to the most rows a step of decodes and drafts can have."""
        c = self.config
        most = min(c.max_num_batched_tokens, c.max_num_seqs * (1 + c.speculative_tokens), MEASURED_ROWS)
        counts = [1 << i for i in range(most.bit_length()) if 1 << i < most] + [most]
        if len(counts) < 2:
            counts = [1, 2]
        seconds = self.runner.measure_rows(counts, context=MEASURED_CONTEXT, num_blocks=num_blocks)
        return Speculator(SpeculativeConfig(c.speculative_tokens), CostCurve(list(zip(counts, seconds))))

    def arithmetic(self) -> str:
        """What decides a row's bits here beyond the model and the settings (`Backend.arithmetic`)."""
        return self.backend.arithmetic()

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
    def from_pretrained(cls, model: str | ModelSource, config: EngineConfig = EngineConfig()) -> "Engine":
        from conveyor.core.model_loader import load_model

        lm, tokenizer = load_model(model, device=config.device, dtype=config.dtype)
        return cls(lm, tokenizer, config)

    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; raises ValueError (naming the request) if it can never run (`stream` ends such a request
        as an error output instead)."""
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"request {request.req_id!r}: prompt ({len(request.prompt_token_ids)} tokens) + max_tokens "
                f"({request.sampling.max_tokens}) exceeds the model's context of {self.max_model_len} tokens")
        vocab = self.limits.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"request {request.req_id!r}: a prompt token id is outside the vocabulary [0, {vocab})")
        self._check_continued(request)
        if request.prompt_embeds is not None:
            self._check_embeds(request)
        req = Request(request.req_id, request.prompt_token_ids, request.sampling, request.priority,
                      arrival_time=time.monotonic())
        req.token_ids.extend(request.output_token_ids)  # (a continued request: recomputed like a preempted one)
        req.prompt_embeds = request.prompt_embeds
        self.scheduler.check(req)
        if request.sampling.grammar is None:
            self._admit(req, None, request.output_logprobs)
        else:  # compiled off the step loop: the request waits for it there while the others run
            self.grammar_admission.submit(req, request.sampling.grammar, request.output_logprobs)  # ValueError: too big

    def _check_embeds(self, request: GenerationRequest) -> None:
        """Embeddings given for prompt positions: ascending positions inside the prompt, one row of the model's
        hidden size and one cache key for each."""
        embeds, name = request.prompt_embeds, f"request {request.req_id!r}"
        positions, n = embeds.positions, len(request.prompt_token_ids)
        inside = not positions or 0 <= positions[0] and positions[-1] < n
        if not inside or any(b <= a for a, b in zip(positions, positions[1:])):
            raise ValueError(f"{name}: the positions of its given embeddings are not ascending inside its "
                             f"{n}-token prompt")
        hidden = self.backend.shape.hidden_size
        if tuple(embeds.values.shape) != (len(positions), hidden) or len(embeds.keys) != len(positions):
            raise ValueError(f"{name}: {len(positions)} given positions need {len(positions)} rows of {hidden} "
                             f"values and as many cache keys; got values {tuple(embeds.values.shape)} and "
                             f"{len(embeds.keys)} keys")

    def _check_continued(self, request: GenerationRequest) -> None:
        """What a continued request carries must be something this engine could have generated for it."""
        done, s = request.output_token_ids, request.sampling
        if not done:
            return
        name = f"request {request.req_id!r}"
        if len(done) >= s.max_tokens:
            raise ValueError(f"{name} continues after {len(done)} tokens, but its max_tokens is {s.max_tokens}")
        if any(not 0 <= t < self.limits.vocab_size for t in done):
            raise ValueError(f"{name}: a token it generated is outside the vocabulary [0, {self.limits.vocab_size})")
        if (s.logprobs is not None) != (request.output_logprobs is not None) or \
                (request.output_logprobs is not None and len(request.output_logprobs) != len(done)):
            raise ValueError(f"{name}: the logprobs it carries do not match the tokens it generated")

    def _admit(self, req: Request, matcher, output_logprobs) -> None:
        """Into the scheduler, with its logits processors' state (its grammar's matcher, where it has one), and,
        for a continued request, that state and its output's replayed over the tokens it generated before."""
        if LogitsState.needed(req.sampling):
            req.logits_state = LogitsState(req.sampling, req.prompt_token_ids, matcher)
            for token in req.output_token_ids:
                req.logits_state.accept(token)
        self.scheduler.add_request(req)
        self.outputs.start(req, output_logprobs)

    def in_flight(self) -> dict[str, InFlight]:
        """Every unfinished request that has generated tokens (running, waiting after a preemption, or continued
        and waiting for its grammar): what to continue it from in another process."""
        out: dict[str, InFlight] = {}
        for req in [*self.scheduler.requests.values(), *self.grammar_admission.requests()]:
            if req.num_output_tokens:
                out[req.req_id] = InFlight(tuple(req.output_token_ids), self.outputs.logprobs_so_far(req))
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.grammar_admission)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to run, their grammars compiling included (the backpressure bound counts them)."""
        return len(self.scheduler.waiting) + len(self.grammar_admission)

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the requests that ended in it (those whose grammar failed to compile included)."""
        t0 = time.perf_counter()
        ended = self.grammar_admission.admit_compiled()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self.grammar_admission.wait()  # nothing to run until a grammar compiles
            return [self.outputs.output(r) for r in ended]
        t1 = time.perf_counter()
        result = self.runner.execute(plan, self._logits_states(plan))
        t2 = time.perf_counter()
        before = self.scheduler.stats.num_output_tokens
        self.outputs.record(result, self.scheduler.requests)  # (logprobs, before their tokens are accepted)
        ended += self.scheduler.update_from_output(plan, result, self.outputs.check_stop, self.outputs.check_output)
        sampled = self.scheduler.stats.num_output_tokens - before
        t3 = time.perf_counter()
        outputs = [self.outputs.output(r) for r in ended]
        t4 = time.perf_counter()
        self._account(plan, sampled, (t0, t1, t2, t3, t4))
        return outputs

    def _logits_states(self, plan) -> dict:
        """The logits processors' state of the plan's requests that keep one, by request id."""
        requests = self.scheduler.requests
        return {e.req_id: s for e in plan.scheduled if (s := requests[e.req_id].logits_state) is not None}

    def _account(self, plan, sampled: int, times: tuple[float, float, float, float, float]) -> None:
        """The step's counts and its phases' seconds (`times`: its start, then the end of schedule, execute, update
        and output)."""
        t0, t1, t2, t3, t4 = times
        self.num_scheduled_rows += len(plan.scheduled)
        self.num_generated_tokens += sampled
        t = self._timings
        t["schedule_s"] += t1 - t0
        t["update_s"] += t3 - t2
        t["output_s"] += t4 - t3
        t["step_s"] += t4 - t0
        t["steps"] += 1
        self._last_step = (plan, sampled, t4 - t0)

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

    def stream(self, requests: Iterable[GenerationRequest]) -> Iterator[list[RequestOutput]]:
        """The requests through the engine: pulled lazily (never more than `max_waiting` waiting: backpressure,
        so an endless source is fine), one step at a time; yields each step's finished outputs (often none).

        A request the engine can never run (ValueError from `add_request`) ends as it is pulled, through the
        scheduler, as an output with finish_reason "error" and the ValueError's message, yielded on its own before
        the next step. Ends when `requests` is exhausted and every request has finished; a caller that stops iterating stops
        the engine after the step it last saw."""
        source = iter(requests)
        exhausted = False
        while True:
            refused: list[RequestOutput] = []
            while not exhausted and self.num_waiting + len(refused) < self.config.max_waiting:
                request = next(source, None)
                if request is None:
                    exhausted = True
                    break
                try:
                    self.add_request(request)
                except ValueError as e:
                    refused.append(self._refused(request, e))
            if refused:  # (before the step: a caller that stops at one keeps every output it was given)
                yield refused
            if self.has_unfinished():
                yield self.step()
            elif not refused:
                return

    def _refused(self, request: GenerationRequest, error: ValueError) -> RequestOutput:
        """The output of a request refused at admission: ended as an error through the scheduler, never run."""
        req = Request.refused(request.req_id, request.prompt_token_ids, request.sampling, request.priority,
                              arrival_time=time.monotonic())
        self.scheduler.finish_request(req, FinishReason.ERROR, str(error))
        return self.outputs.output(req)

    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[RequestOutput]:
        """`stream`'s outputs one at a time, as they finish (those of requests refused at admission included)."""
        for outputs in self.stream(requests):
            yield from outputs

    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        spec = self.scheduler.speculator.stats if self.scheduler.speculator is not None else None
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
            num_forward_steps=self._timings["steps"],
            num_scheduled_rows=self.num_scheduled_rows,
            num_draft_tokens=spec.num_draft_tokens if spec else 0,
            num_accepted_draft_tokens=spec.num_accepted_tokens if spec else 0,
        )

    def info(self) -> EngineInfo:
        """The model, dtype and backend this engine runs, and its limits."""
        dtype = self.config.dtype
        if dtype == "auto":  # (an engine built without resolving its config: the weights say)
            dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        return EngineInfo(model_path=getattr(getattr(self.model, "config", None), "name_or_path", None) or None,
                          dtype=dtype, backend=self.backend.name, max_num_seqs=self.config.max_num_seqs,
                          max_num_batched_tokens=self.config.max_num_batched_tokens, max_model_len=self.max_model_len,
                          cpu_isa=self.backend.cpu_isa(), batch_invariant=self.backend.inexact_reason() is None)
