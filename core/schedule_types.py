"""The plain data that crosses a step: the scheduler's plan and the runner's answer. Pure Python.

Plan objects hold copies, never the scheduler's live lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    req_id: str
    token_ids: tuple[int, ...]  # fed this step: a prefill chunk or one decode token (then its draft tokens, if any)
    start_pos: int  # position of token_ids[0] (= num_computed_tokens before the step)
    block_ids: tuple[int, ...]  # the whole block table, covering start_pos + len(token_ids) slots
    sample: bool  # true when the chunk reaches the last known token, so a token is sampled
    sampling: SamplingParams
    num_output_tokens: int  # tokens generated so far; the sampled one gets this index
    # Prompt logprobs: the prompt tokens that rows 0, 1, ... of this chunk predict (rows predicting a token
    # past the prompt excluded); empty unless the request asks for them.
    prompt_targets: tuple[int, ...] = ()
    # Speculative decoding: the last num_drafts of token_ids are guesses of its next tokens (core/speculative.py),
    # fed after its last token; their rows are sampled too, and each is accepted where it equals the token sampled
    # before it.
    num_drafts: int = 0
    # The request's PromptEmbeds (core/outputs.py) where this chunk feeds prompt tokens of a request that has them:
    # the runner puts their rows in place of the token embeddings at their positions.
    prompt_embeds: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens attended to by the chunk's last query: cached ones plus the chunk."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # running requests first (admission order), then new ones
    num_batched_tokens: int  # sum of len(token_ids) over scheduled
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A token's logprob under the model's own distribution, and the top alternatives (ids, logprobs), best
    first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    # req_id -> the tokens sampled, only where ScheduledRequest.sample was true: one, or where it carried drafts,
    # one per draft accepted (equal to it) and then the token sampled after them
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # of the sampled tokens that asked
    # req_id -> (position of the first prompt token predicted, one entry per prompt_targets token)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # req_id -> what failed while the step processed that request's own data (its logits processors): the
    # request ends as an error, the step's other requests go on
    failed: dict[str, str] = field(default_factory=dict)
