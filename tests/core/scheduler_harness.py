"""A fake model runner and helpers to drive the scheduler by hand. Pure Python: never imports torch.

`FakeRunner` stands in for the model runner. It keeps a simulated paged KV pool (slot -> the
(position, token) whose K/V it holds) and checks every plan against it: each chunk continues where
the request's KV left off, the tokens it feeds are the request's prompt + outputs in order, the
slots before `start_pos` (computed earlier or served by the prefix cache) hold exactly the right
tokens, and no request writes into a block it shares. It then "samples" a token that depends only
on the request and the output index, so a request gives the same tokens however it is batched,
chunked or preempted (like the seeded sampler).
"""

from __future__ import annotations

from conveyor.core.block_manager import BlockManager
from conveyor.core.request import FinishReason, Request, RequestStatus
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.schedule_types import RunnerOutput, SchedulerOutput
from conveyor.core.scheduler import Scheduler

EOS = 2
VOCAB = 1000


def make_request(req_id: str, num_tokens: int | None = None, prompt: list[int] | None = None,
                 priority: int = 0, **sampling) -> Request:
    """A request whose prompt is `prompt`, or `num_tokens` ids derived from the id (never EOS)."""
    if prompt is None:
        base = sum(map(ord, req_id)) * 7
        prompt = [10 + (base + i * 13) % (VOCAB - 10) for i in range(num_tokens)]
    sampling.setdefault("max_tokens", 8)
    return Request(req_id, prompt, SamplingParams(**sampling), priority=priority)


def make_scheduler(num_blocks: int, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, enable_prefix_caching: bool = True) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, eos_token_ids=(EOS,), clock=lambda: 0.0)


def fake_token(req_id: str, index: int) -> int:
    """The non-EOS token a request "samples" as its `index`-th output (deterministic, no hash seed)."""
    return 10 + (sum(map(ord, req_id)) * 31 + index * 17) % (VOCAB - 10)


class FakeRunner:
    """Checks each plan against a simulated KV pool, then samples `fake_token` (or EOS where asked)."""

    def __init__(self, scheduler: Scheduler, eos_at: dict[str, int] | None = None) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.block_manager.block_size
        self.eos_at = eos_at or {}  # req_id -> output index at which EOS is sampled
        self.prompts: dict[str, list[int]] = {}
        self.pool: dict[int, tuple[int, int]] = {}  # slot -> (position, token)
        self.next_pos: dict[str, int] = {}  # req_id -> where its next chunk must start
        self.fed: dict[str, list[tuple[int, tuple[int, ...]]]] = {}  # req_id -> [(start_pos, tokens)]
        self.num_samples: dict[str, int] = {}

    def add(self, request: Request) -> None:
        self.prompts[request.req_id] = request.prompt_token_ids
        self.scheduler.add_request(request)

    def token_for(self, req_id: str, index: int) -> int:
        return EOS if self.eos_at.get(req_id) == index else fake_token(req_id, index)

    def expected_tokens(self, req_id: str, num_output: int) -> list[int]:
        return self.prompts[req_id] + [self.token_for(req_id, i) for i in range(num_output)]

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        bs = self.block_size
        blocks = self.scheduler.block_manager.blocks
        for req_id in plan.preempted_req_ids:
            self.next_pos.pop(req_id, None)
        ids = [e.req_id for e in plan.scheduled]
        assert len(set(ids)) == len(ids), f"a request is scheduled twice: {ids}"
        assert not set(ids) & set(plan.preempted_req_ids), "a preempted request is scheduled in the same step"
        sampled = {}
        for e in plan.scheduled:
            expected = self.expected_tokens(e.req_id, e.num_output_tokens)
            start, end = e.start_pos, e.start_pos + e.num_tokens
            known_end = end - e.num_drafts  # drafts are fed after the request's known tokens
            assert e.num_tokens > 0
            if e.req_id in self.next_pos:
                assert start == self.next_pos[e.req_id], f"{e.req_id}: chunk starts at {start}, KV ends at " \
                                                         f"{self.next_pos[e.req_id]}"
            else:  # (re)admission: from 0, or from a block-aligned prefix-cache hit
                assert start % bs == 0, f"{e.req_id}: admitted at {start}, not a block boundary"
            assert known_end <= len(expected), f"{e.req_id}: feeds past its known tokens"
            assert list(e.token_ids[:e.num_tokens - e.num_drafts]) == expected[start:known_end], \
                f"{e.req_id}: wrong tokens fed at {start}"
            assert e.sample == (known_end == len(expected)), f"{e.req_id}: sample={e.sample} at [{start}, {end})"
            assert not e.num_drafts or (e.sample and known_end - start == 1), f"{e.req_id}: drafts off a decode row"
            assert len(e.block_ids) * bs >= end, f"{e.req_id}: block table too short for {end} tokens"
            for p in range(start):  # computed earlier, or served by the prefix cache
                slot = e.block_ids[p // bs] * bs + p % bs
                assert self.pool.get(slot) == (p, expected[p]), (
                    f"{e.req_id}: slot of position {p} holds {self.pool.get(slot)}, want {(p, expected[p])}")
            for p, token in zip(range(start, end), e.token_ids):  # (a rejected draft leaves a wrong token)
                block = blocks[e.block_ids[p // bs]]
                assert block.ref_count == 1, f"{e.req_id} writes into shared block {block.block_id}"
                self.pool[block.block_id * bs + p % bs] = (p, token)
            self.next_pos[e.req_id] = known_end
            self.fed.setdefault(e.req_id, []).append((start, tuple(e.token_ids)))
            if e.sample:
                tokens = [self.token_for(e.req_id, e.num_output_tokens)]
                drafts = e.token_ids[e.num_tokens - e.num_drafts:]
                for i, draft in enumerate(drafts):  # a draft is accepted where it equals the token sampled before it
                    if tokens[-1] != draft:
                        break
                    tokens.append(self.token_for(e.req_id, e.num_output_tokens + i + 1))
                self.next_pos[e.req_id] = known_end + len(tokens) - 1
                sampled[e.req_id] = tokens
                self.num_samples[e.req_id] = self.num_samples.get(e.req_id, 0) + 1
        return RunnerOutput(sampled_token_ids=sampled)


def check_plan(scheduler: Scheduler, plan: SchedulerOutput, running_before: list[str]) -> None:
    """Invariants of one plan beyond `Scheduler.check_invariants`; `running_before` in admission order."""
    scheduler.check_invariants(plan)
    assert plan.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert len(plan.scheduled) <= scheduler.max_num_seqs
    if plan.preempted_req_ids:  # nobody is admitted in a step that preempted
        admitted = {e.req_id for e in plan.scheduled} - set(running_before)
        assert not admitted, f"admitted {admitted} in a step that preempted {plan.preempted_req_ids}"
        for req_id in plan.preempted_req_ids:
            r = scheduler.requests[req_id]
            assert r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0 and not r.block_ids
        assert [r.req_id for r in list(scheduler.waiting)[:len(plan.preempted_req_ids)]] == \
            list(reversed(plan.preempted_req_ids)), "preempted requests are not at the front of WAITING"
        newest_first = running_before[::-1][:len(plan.preempted_req_ids)]
        assert plan.preempted_req_ids == newest_first, "the victims are not the newest admitted"
    for e in plan.scheduled:
        assert scheduler.requests[e.req_id].status is RequestStatus.RUNNING


def step(scheduler: Scheduler, runner: FakeRunner, mid_step=None) -> tuple[SchedulerOutput, list[Request]]:
    """schedule -> check -> fake forward pass -> [mid_step()] -> update -> check."""
    running_before = [r.req_id for r in scheduler.running]
    plan = scheduler.schedule()
    check_plan(scheduler, plan, running_before)
    result = runner.execute(plan)
    if mid_step is not None:  # e.g. an abort that lands while the forward pass runs
        mid_step()
    finished = scheduler.update_from_output(plan, result)
    scheduler.check_invariants()
    return plan, finished


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> list[Request]:
    finished: list[Request] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished
        plan, done = step(scheduler, runner)
        assert not plan.is_empty, f"stuck: nothing scheduled with {len(scheduler.requests)} unfinished"
        finished += done
    raise AssertionError(f"not done after {max_steps} steps")


def check_finished(request: Request, runner: FakeRunner) -> None:
    """A finished request's outputs are the runner's tokens, and it stopped for the right reason."""
    n = request.num_output_tokens
    assert request.prompt_token_ids == runner.prompts[request.req_id]
    assert request.output_token_ids == [runner.token_for(request.req_id, i) for i in range(n)]
    sp = request.sampling
    if request.finish_reason is FinishReason.STOP:
        assert request.output_token_ids[-1] == EOS and n >= sp.min_tokens and not sp.ignore_eos
    elif request.finish_reason is FinishReason.LENGTH:
        assert n == sp.max_tokens
        assert sp.ignore_eos or EOS not in request.output_token_ids[max(sp.min_tokens - 1, 0):-1]
    else:
        assert request.finish_reason is FinishReason.ABORT
    assert request.is_finished and not request.block_ids


def assert_no_leaks(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    bm.check_invariants([])
    scheduler.check_invariants()
