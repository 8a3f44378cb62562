"""Request: one prompt's life in the engine (tokens, progress, blocks, status, its features' state). Pure Python."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from conveyor.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conveyor.core.logits_state import LogitsState
    from conveyor.core.output_processor import OutputState
    from conveyor.core.schedule_policy import ScheduleState
    from conveyor.core.speculative import DraftState


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
    ERROR = "error"  # it could not run, or its own data broke a step (Request.error says how); the run goes on


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

    Who writes what:
    - the engine makes it (id, prompt, sampling, priority, arrival time; a continued request's earlier
      output tokens) before the scheduler has it;
    - the scheduler moves its `status` (running, preempted), writes its progress (`num_computed_tokens`,
      `num_cached_tokens`, `first_scheduled_time`, `num_preemptions`), appends the tokens the model runner
      sampled (and `first_token_time`), and ends it: a finished status, `finish_reason`, `error` and
      `finish_time` are written in `Scheduler.finish_request` only, which every ending goes through (a stop,
      max_tokens, an error while it ran, its output refused, its grammar failing to compile, a refusal at
      admission, an abort);
    - the block manager writes `block_ids` and `block_hashes`;
    - each feature keeps its state in a slot of its own, of a type its module defines, None until it first
      needs one, and changed only by that module's code (others may read it): `logits_state`
      (logits_state.py: the logits processors and the grammar matcher; made by the engine at admission,
      advanced as the scheduler accepts tokens), `output_state` (output_processor.py), `draft_state`
      (speculative.py) and `schedule_state` (schedule_policy.py: made by the scheduler when it takes the
      request, its aging counted by the sjf policy).
    """

    __slots__ = (
        "req_id", "token_ids", "num_prompt_tokens", "sampling", "priority", "status",
        "num_computed_tokens", "num_cached_tokens", "block_ids", "block_hashes", "finish_reason",
        "arrival_time", "first_scheduled_time", "first_token_time", "finish_time", "num_preemptions", "error",
        "logits_state", "output_state", "draft_state", "schedule_state", "prompt_embeds", "_cache_keys",
    )

    def __init__(self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 priority: int = 0, arrival_time: float = 0.0) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {req_id!r}: the prompt has no tokens")
        self._start(req_id, prompt_token_ids, sampling, priority, arrival_time)

    @classmethod
    def refused(cls, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams, priority: int,
                arrival_time: float) -> Request:
        """A request the engine refused at admission (its prompt may even be empty): it never runs, and exists
        only to end through the scheduler as the others do."""
        request = cls.__new__(cls)
        request._start(req_id, prompt_token_ids, sampling, priority, arrival_time)
        return request

    def _start(self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams, priority: int,
               arrival_time: float) -> None:
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
        self.error: str | None = None  # what failed, where it finished with FinishReason.ERROR
        self.logits_state: LogitsState | None = None  # where a logits processor keeps state (a grammar's matcher)
        self.output_state: OutputState | None = None  # where the output needs more than its tokens
        self.draft_state: DraftState | None = None  # once speculation drafted for it
        self.schedule_state: ScheduleState | None = None  # once the scheduler has it
        self.prompt_embeds = None  # a PromptEmbeds (core/outputs.py): embeddings given for some prompt positions
        self._cache_keys: list[int] | None = None  # cache_keys(), kept up to date as tokens are appended

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

    def cache_keys(self) -> list[int]:
        """The tokens as the prefix cache keys them: the token ids, with each position whose embedding is given
        (`prompt_embeds`) standing as its content's key instead of its placeholder token."""
        embeds = self.prompt_embeds
        if embeds is None:
            return self.token_ids
        keys = self._cache_keys
        if keys is None:
            keys = self._cache_keys = list(self.token_ids[:self.num_prompt_tokens])
            for position, key in zip(embeds.positions, embeds.keys):
                keys[position] = key
        keys.extend(self.token_ids[len(keys):])  # the tokens generated since (given positions are the prompt's)
        return keys

    @property
    def max_total_tokens(self) -> int:
        """Most tokens this request can ever hold in the cache."""
        return self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """Its ending (the scheduler's: `Scheduler.finish_request` is the one caller)."""
        self.status = _STATUS_OF_REASON[reason]
        self.finish_reason = reason
        self.error = error

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
