"""Request: one prompt's life in the engine (tokens, progress, blocks, status). Pure Python.

Only the scheduler changes a request's status and `num_computed_tokens`; only the block manager
writes `block_ids` and `block_hashes`.
"""

from __future__ import annotations

import enum

from conveyor.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"


FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                      RequestStatus.FINISHED_ERROR})


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # its own data broke a step (Request.error says how); the run goes on


_STATUS_OF_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


class Request:
    """Mutable engine-side state of one request.

    token_ids = prompt tokens followed by output tokens. `num_computed_tokens` of them have K/V in
    the cache: [0, num_computed_tokens) is cached, [num_computed_tokens, num_tokens) still to feed.
    """

    __slots__ = (
        "req_id", "token_ids", "num_prompt_tokens", "sampling", "priority", "status",
        "num_computed_tokens", "num_cached_tokens", "block_ids", "block_hashes", "finish_reason",
        "arrival_time", "first_scheduled_time", "first_token_time", "finish_time", "num_preemptions",
        "logits_state", "output_state", "error", "arrival_seq", "num_overtaken", "draft_state",
    )

    def __init__(self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 priority: int = 0, arrival_time: float = 0.0) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {req_id!r}: the prompt has no tokens")
        self.req_id = req_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.block_ids: list[int] = []  # written by the block manager only
        self.block_hashes: list[int] = []  # chained hashes of full blocks; block manager only
        self.finish_reason: FinishReason | None = None
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        self.logits_state = None  # LogitsState (logits_state.py) where a processor keeps state; advanced on accept
        self.output_state = None  # OutputState (output_processor.py) where the output needs more than its tokens
        self.error: str | None = None  # what failed, where it finished with FinishReason.ERROR
        self.arrival_seq = 0  # its place in the order requests reached the scheduler (set by it)
        self.num_overtaken = 0  # requests that arrived after it admitted before it (sjf's aging; schedule_policy)
        self.draft_state = None  # DraftState (speculative.py) once speculation drafted for it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def max_total_tokens(self) -> int:
        """Most tokens this request can ever hold in the cache."""
        return self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    def finish(self, reason: FinishReason) -> None:
        self.status = _STATUS_OF_REASON[reason]
        self.finish_reason = reason

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
