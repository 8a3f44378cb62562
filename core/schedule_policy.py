"""Scheduling policies: the order in which waiting requests are admitted, and who is preempted. Pure Python.

A record's output does not depend on the batch around it, so every policy gives the same outputs; a policy only
moves speed and latency. Each one chooses within the waiting queue, which the engine fills up to its look-ahead
window (`EngineConfig.lookahead`). A request that was preempted keeps its place at the front under fcfs, sjf and
lpm (it already holds generated tokens: running it on first bounds its extra work).

- fcfs: arrival order (the scheduler's own queue, untouched).
- priority: lower `Request.priority` first, ties in arrival order (vLLM's convention). The preemption victim is the
  lowest-priority running request (the newest of those); the first waiting request preempts running requests of a
  strictly lower priority while it cannot be admitted (no room in the KV pool, or the sequence cap reached).
- sjf: shortest job first, the job being prompt tokens + max_tokens. Aging: a request that `max_overtaken` later
  arrivals have been admitted ahead of goes first, in arrival order; so no request is overtaken by more than
  `max_overtaken` requests that arrived after it (the scheduler's max_num_seqs: one batch's worth).
- lpm: longest prefix match first: requests whose leading blocks are cached, or being computed by a running request,
  go first, longest match first, and those sharing a first block run together (in the order of their oldest).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.core.block_manager import BlockManager
from conveyor.core.config import SCHEDULES
from conveyor.core.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduleState:
    """A request's place in the policies' orders (`Request.schedule_state`): made by the scheduler when it takes
    the request, its aging counted by sjf."""

    arrival_seq: int  # its place in the order requests reached the scheduler
    num_overtaken: int = 0  # requests that arrived after it admitted before it (sjf's aging)


class Policy:
    """fcfs, and the hooks the others override: all no-ops."""

    preempts_for_waiting = False  # whether the first waiting request may preempt running ones (priority)

    def order_running(self, running: list[Request]) -> None:
        """Reorder `running` in place so that the preemption victim is its last element (fcfs: admission order)."""

    def order_waiting(self, waiting: deque[Request], running: list[Request]) -> None:
        """Reorder `waiting` in place: the scheduler admits from its front."""

    def admitted(self, request: Request, waiting: deque[Request]) -> None:
        """`request` was just admitted ahead of `waiting` (sjf counts who it overtook)."""


class PriorityPolicy(Policy):
    preempts_for_waiting = True

    def order_running(self, running: list[Request]) -> None:
        running.sort(key=_priority_key)

    def order_waiting(self, waiting: deque[Request], running: list[Request]) -> None:
        _sort_deque(waiting, _priority_key)


class ShortestJobPolicy(Policy):
    def __init__(self, max_overtaken: int) -> None:
        self.max_overtaken = max_overtaken

    def order_waiting(self, waiting: deque[Request], running: list[Request]) -> None:
        limit = self.max_overtaken

        def key(r: Request) -> tuple:
            if r.status is RequestStatus.PREEMPTED:
                return (0, 0, 0)  # stable: preempted ones keep their order at the front
            state = r.schedule_state
            if state.num_overtaken >= limit:
                return (1, 0, state.arrival_seq)
            return (2, r.num_prompt_tokens + r.sampling.max_tokens, state.arrival_seq)

        _sort_deque(waiting, key)

    def admitted(self, request: Request, waiting: deque[Request]) -> None:
        seq = request.schedule_state.arrival_seq
        for r in waiting:
            if r.schedule_state.arrival_seq < seq:
                r.schedule_state.num_overtaken += 1


class LongestPrefixPolicy(Policy):
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager

    def order_waiting(self, waiting: deque[Request], running: list[Request]) -> None:
        if len(waiting) < 2:
            return
        bm = self.block_manager
        in_flight = {h for r in running for h in r.block_hashes}  # blocks cached soon (or already)
        match: dict[str, int] = {}
        oldest: dict[object, int] = {}  # first block (or the request itself) -> its oldest waiting member's seq
        for r in waiting:
            hits = len(bm.find_cached_prefix(r))  # also fills r.block_hashes over its full blocks
            while hits < len(r.block_hashes) and r.block_hashes[hits] in in_flight:
                hits += 1
            match[r.req_id] = hits
            group = r.block_hashes[0] if r.block_hashes else r.req_id
            seq = r.schedule_state.arrival_seq
            oldest[group] = min(oldest.get(group, seq), seq)

        def key(r: Request) -> tuple:
            if r.status is RequestStatus.PREEMPTED:
                return (0, 0, 0, 0)
            group = r.block_hashes[0] if r.block_hashes else r.req_id
            return (1, -match[r.req_id], oldest[group], r.schedule_state.arrival_seq)

        _sort_deque(waiting, key)


def make_policy(schedule: str, block_manager: BlockManager, max_num_seqs: int) -> Policy:
    """The policy named `schedule` (one of SCHEDULES)."""
    if schedule == "priority":
        return PriorityPolicy()
    if schedule == "sjf":
        return ShortestJobPolicy(max_overtaken=max_num_seqs)
    if schedule == "lpm":
        return LongestPrefixPolicy(block_manager)
    if schedule == "fcfs":
        return Policy()
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")


def _priority_key(r: Request) -> tuple[int, int]:
    return (r.priority, r.schedule_state.arrival_seq)


def _sort_deque(queue: deque[Request], key: Callable[[Request], tuple]) -> None:
    if len(queue) > 1:
        ordered = sorted(queue, key=key)
        queue.clear()
        queue.extend(ordered)
