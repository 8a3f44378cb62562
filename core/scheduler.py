"""Iteration-level scheduler: which requests run this step, with how many tokens. Pure Python.

Decides; the block manager answers and commits. Apart from preemption and admission (which sets
the prefix-cache hit), only `update_from_output` advances `num_computed_tokens` and appends tokens. Every
request ends in `finish_request`, the one place its status becomes finished: those that stop or fail while they
run (`update_from_output`), and those the engine ends before they ever run (a grammar that did not compile, a
refusal at admission).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from conveyor.core.block_manager import BlockManager
from conveyor.core.config import SCHEDULES
from conveyor.core.errors import failed_while_running, failure
from conveyor.core.request import FinishReason, Request, RequestStatus
from conveyor.core.schedule_policy import ScheduleState, make_policy
from conveyor.core.schedule_types import RunnerOutput, ScheduledRequest, SchedulerOutput
from conveyor.core.speculative import Speculator
from conveyor.core.stopping import check_token_stop


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prefix_queries: int = 0  # prompt tokens looked up in the prefix cache at first admission
    num_prefix_hits: int = 0  # of those, tokens served from the cache
    num_computed_prompt_tokens: int = 0  # prompt tokens actually fed to the model (recompute included)
    num_cached_prompt_tokens: int = 0  # prompt tokens skipped thanks to the prefix cache
    num_steps: int = 0
    num_output_tokens: int = 0  # tokens appended to requests' outputs

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0


class _Budget:
    """What one step may still spend."""

    __slots__ = ("tokens",)

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens


class Scheduler:
    """Queues, token budget, chunked prefill, prefix-cache admission and preemption by recompute.

    `running` is in admission order (the newest at the end: the preemption victim). `waiting` is
    ordered by (priority, arrival); a preempted request goes back to its very front. A `schedule` other than
    fcfs (schedule_policy.py) reorders both queues at the start of each step. With a `speculator`, the step's
    decode rows may carry draft tokens in the token budget and free blocks left once everything else is planned
    (speculative.py): drafts never delay, preempt or displace a request.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: Collection[int] = (), clock=time.monotonic, schedule: str = SCHEDULES[0],
                 speculator: Speculator | None = None) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self.policy = make_policy(schedule, block_manager, max_num_seqs)
        self.speculator = speculator
        self._num_arrived = 0

    # -- queues --------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.check(request)
        self.requests[request.req_id] = request
        request.schedule_state = ScheduleState(self._num_arrived)
        self._num_arrived += 1
        if not self.waiting or request.priority >= self.waiting[-1].priority:
            self.waiting.append(request)
        else:  # rare: keep (priority, arrival) order
            keys = [r.priority for r in self.waiting]
            self.waiting.insert(bisect.bisect_right(keys, request.priority), request)

    def check(self, request: Request) -> None:
        """ValueError naming the request where it can never be added: its id is taken, or it cannot fit the pool."""
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in the engine")
        if self.block_manager.blocks_for(request.max_total_tokens) > self.block_manager.num_blocks:
            raise ValueError(
                f"request {request.req_id!r} needs up to {request.max_total_tokens} tokens of KV cache "
                f"but the pool holds {self.block_manager.num_blocks * self.block_manager.block_size}; "
                "raise num_kv_blocks / kv_cache_memory or lower max_tokens")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step.

        1. Running requests, oldest first: one decode token each, or their next prefill chunk.
           A request that cannot get the block it needs preempts the newest running request
           (possibly itself) until it can.
        2. Unless that preempted someone, waiting requests in order while the token budget, the
           sequence cap and free blocks allow; a prompt larger than the budget left is chunked. A request
           preempted this step (priority: for the waiting request before it) waits for the next one.
        3. With a speculator, draft tokens for the decode rows, in the budget and blocks left.
        """
        budget = _Budget(self.max_num_batched_tokens)
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self.policy.order_running(self.running)
        self.policy.order_waiting(self.waiting, self.running)
        if self.policy.preempts_for_waiting:
            self._preempt_for_waiting(preempted)
            if preempted:
                self.policy.order_waiting(self.waiting, self.running)
        forced = len(preempted)
        self._schedule_running(budget, scheduled, preempted)
        if len(preempted) == forced:  # (preempted to admit the first waiting request: admit it)
            self._schedule_waiting(budget, scheduled, frozenset(preempted))
        if self.speculator is not None and budget.tokens > 0:
            self._add_drafts(budget, scheduled)
        self.stats.num_steps += 1
        return SchedulerOutput(scheduled=scheduled, num_batched_tokens=self.max_num_batched_tokens - budget.tokens,
                               preempted_req_ids=preempted)

    def _schedule_running(self, budget: _Budget, scheduled: list[ScheduledRequest], preempted: list[str]) -> None:
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget.tokens)
            end = request.num_computed_tokens + num_new
            while not self.block_manager.can_append(request, end):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # it preempted itself (fcfs: everything after it is gone too, so this ends the loop)
            self.block_manager.append_slots(request, end)
            scheduled.append(self._plan_entry(request, num_new))
            budget.tokens -= num_new
            i += 1

    def _schedule_waiting(self, budget: _Budget, scheduled: list[ScheduledRequest], victims: frozenset[str]) -> None:
        bm = self.block_manager
        while self.waiting and budget.tokens > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.req_id in victims:
                break  # preempted this step to make room for the requests before it: it waits for the next step
            # A request that wants its prompt's logprobs computes its whole prompt: cached blocks hold K/V, not them.
            cached = [] if request.sampling.prompt_logprobs is not None else bm.find_cached_prefix(request)
            if self._prefix_being_computed(request, len(cached)):
                break  # its next block is being computed by a running request: next step it is a cache hit
            num_cached = len(cached) * bm.block_size
            num_new = min(request.num_tokens - num_cached, budget.tokens)
            if not bm.can_allocate(cached, num_cached + num_new):
                break
            self.waiting.popleft()
            bm.allocate(request, cached, num_cached + num_new)
            if request.status is RequestStatus.WAITING:  # first admission, not a readmission
                self.stats.num_prefix_queries += request.num_prompt_tokens
                self.stats.num_prefix_hits += num_cached
                self.stats.num_cached_prompt_tokens += num_cached
                request.num_cached_tokens = num_cached
                request.first_scheduled_time = self.clock()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._plan_entry(request, num_new))
            budget.tokens -= num_new
            self.policy.admitted(request, self.waiting)

    def _add_drafts(self, budget: _Budget, scheduled: list[ScheduledRequest]) -> None:
        """Draft tokens for the step's decode rows where the speculator finds they pay, in the token budget and the
        free blocks left; their entries are planned again with the drafts after their last token."""
        bm = self.block_manager
        decodes = []
        for e in scheduled:
            if e.sample and e.num_tokens == 1:
                request = self.requests[e.req_id]
                after_first = request.sampling.max_tokens - request.num_output_tokens - 1  # it may still generate
                decodes.append((request, min(budget.tokens, after_first)))
        if not decodes:
            return
        drafts = self.speculator.choose(decodes, self.max_num_batched_tokens - budget.tokens)
        if not drafts:
            return
        for i, e in enumerate(scheduled):
            draft = drafts.get(e.req_id)
            if draft is None:
                continue
            draft = draft[:budget.tokens]
            request = self.requests[e.req_id]
            end = request.num_tokens + len(draft)
            while draft and not bm.can_append(request, end):
                draft.pop()
                end -= 1
            if not draft:
                continue
            bm.append_slots(request, end)
            scheduled[i] = self._plan_entry(request, 1, tuple(draft))
            budget.tokens -= len(draft)

    def _preempt_for_waiting(self, preempted: list[str]) -> None:
        """The priority schedule: while the first waiting request cannot be admitted (no room for its first chunk
        in the KV pool, or the sequence cap reached), preempt the last running request (the lowest priority, the
        newest of those) if its priority is strictly lower (a larger number)."""
        if not self.waiting:
            return
        request, bm = self.waiting[0], self.block_manager
        cached = [] if request.sampling.prompt_logprobs is not None else bm.find_cached_prefix(request)
        if self._prefix_being_computed(request, len(cached)):
            return  # it waits a step for its prefix anyway
        num_cached = len(cached) * bm.block_size
        num_tokens = num_cached + min(request.num_tokens - num_cached, self.max_num_batched_tokens)
        while self.running and self.running[-1].priority > request.priority and (
                len(self.running) >= self.max_num_seqs or not bm.can_allocate(cached, num_tokens)):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.req_id)

    def _prefix_being_computed(self, request: Request, num_hits: int) -> bool:
        """Whether the first full block of `request` past its `num_hits` cached ones is one a running request is
        still prefilling (the same tokens after the same prefix): admitted now, it would compute that block again,
        so it waits for it to be cached (the samples of one prompt prefill it once)."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or request.sampling.prompt_logprobs is not None or \
                num_hits >= (request.num_tokens - 1) // bm.block_size:
            return False
        wanted = request.block_hashes[num_hits]
        for other in self.running:
            first = other.num_computed_tokens // bm.block_size
            if other.num_tokens - other.num_computed_tokens > 1 and \
                    wanted in other.block_hashes[first:other.num_tokens // bm.block_size]:
                return True
        return False

    def _plan_entry(self, request: Request, num_new: int, drafts: tuple[int, ...] = ()) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        if start < request.num_prompt_tokens:
            self.stats.num_computed_prompt_tokens += min(end, request.num_prompt_tokens) - start
        targets: tuple[int, ...] = ()
        if request.sampling.prompt_logprobs is not None and start + 1 < request.num_prompt_tokens:
            targets = tuple(request.token_ids[start + 1:min(end, request.num_prompt_tokens - 1) + 1])
        return ScheduledRequest(
            req_id=request.req_id,
            token_ids=tuple(request.token_ids[start:end]) + drafts,
            start_pos=start,
            block_ids=tuple(request.block_ids),
            sample=end == request.num_tokens,
            sampling=request.sampling,
            num_output_tokens=request.num_output_tokens,
            prompt_targets=targets,
            num_drafts=len(drafts),
            prompt_embeds=request.prompt_embeds if start < request.num_prompt_tokens else None,
        )

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: give back every block, go to the front of WAITING."""
        assert request.status is RequestStatus.RUNNING, request
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1

    # -- after the forward pass ----------------------------------------------------------------

    def update_from_output(self, plan: SchedulerOutput, result: RunnerOutput,
                           check_stop: Callable[[Request], FinishReason | None] | None = None,
                           check_output: Callable[[Request], str | None] | None = None) -> list[Request]:
        """Advance every scheduled request; append sampled tokens; return those that finished.

        A request stops at its grammar's end, at a token stop (EOS, a stop token id, max_tokens), or where
        `check_stop` (the engine's output processor: stop strings) says so after its token was appended; the tokens
        sampled after that one are dropped. One whose own data broke the step (`result.failed`, or its grammar or
        text raising here) ends with ERROR and `request.error`; the others go on. Before a request that stopped is
        finished, `check_output` (the output processor's verdict on its text: it cannot be decoded, or its JSON
        schema refuses it) may say what is wrong with it: it then ends with ERROR instead. A request that carried
        drafts keeps the K/V of those accepted, and gives back the blocks that only its rejected ones needed."""
        finished: list[Request] = []
        now = self.clock()
        bm = self.block_manager
        for entry in plan.scheduled:
            request = self.requests.get(entry.req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted meanwhile
            fed = entry.num_tokens - entry.num_drafts  # the request's own tokens: their K/V are now computed
            if not entry.sample:
                request.num_computed_tokens += fed
                bm.cache_full_blocks(request)
                bm.release_out_of_window(request)
                continue
            reason, appended = None, 0
            why = result.failed.get(entry.req_id)
            if why is None:
                try:
                    for token in result.sampled_token_ids[entry.req_id]:
                        appended += 1
                        reason = self._accept(request, token, now, check_stop)
                        if reason is not None:
                            break
                except Exception as e:  # noqa: BLE001 - one request's data (its grammar, its text), never the run's
                    why = failure("accepting its token", e)
            accepted = max(appended - 1, 0)  # tokens appended before the last: drafts, whose K/V was computed
            request.num_computed_tokens += fed + accepted
            bm.cache_full_blocks(request)
            if entry.num_drafts:
                self.speculator.verified(request, entry.num_drafts, min(accepted, entry.num_drafts))
                bm.trim(request, request.num_tokens)
            bm.release_out_of_window(request)
            self.stats.num_output_tokens += appended
            error = None if why is None else failed_while_running(why)
            if error is None and reason is not None and check_output is not None:
                error = check_output(request)
            if error is not None:
                self.finish_request(request, FinishReason.ERROR, error)
                finished.append(request)
            elif reason is not None:
                self.finish_request(request, reason)
                finished.append(request)
        return finished

    def _accept(self, request: Request, token: int, now: float,
                check_stop: Callable[[Request], FinishReason | None] | None) -> FinishReason | None:
        """Append a sampled token, advance the processors' state, and say whether the request stops."""
        request.token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = now
        state = request.logits_state
        if state is not None:
            state.accept(token)  # the processors' state moves with the accepted tokens only
        reason = FinishReason.STOP if state is not None and state.grammar_done else \
            check_token_stop(request, self.eos_token_ids)
        if reason is None and check_stop is not None:
            reason = check_stop(request)
        return reason

    def finish_request(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request (`error`: what failed, with FinishReason.ERROR): the one place a request's status becomes
        finished. One the scheduler holds leaves its queue and frees its blocks at once, wherever it is; one it
        never took (refused at admission, or its grammar did not compile) only ends."""
        if self.requests.get(request.req_id) is request:
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            self.block_manager.free(request)
            del self.requests[request.req_id]
        request.finish(reason, error)
        request.finish_time = self.clock()

    # -- checks --------------------------------------------------------------------------------

    def check_invariants(self, plan: SchedulerOutput | None = None) -> None:
        live = self.running + list(self.waiting)
        self.block_manager.check_invariants(live)
        assert len(self.running) <= self.max_num_seqs
        assert len({r.req_id for r in live}) == len(live), "a request is queued twice"
        for r in self.waiting:
            assert not r.block_ids, f"waiting {r} holds blocks"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING
            assert len(r.block_ids) * self.block_manager.block_size >= r.num_computed_tokens
        if plan is not None:
            assert plan.num_batched_tokens <= self.max_num_batched_tokens
            assert plan.num_batched_tokens == sum(e.num_tokens for e in plan.scheduled)
            assert len(plan.scheduled) <= self.max_num_seqs
