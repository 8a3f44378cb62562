"""What goes into the engine (GenerationRequest), what a request must fit (ModelLimits) and what comes out
(RequestOutput). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.core.sampling_params import SamplingParams
from conveyor.core.schedule_types import TokenLogprobs


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a request must fit: the model's context and its vocabulary."""

    max_model_len: int  # tokens a request may hold, prompt + output
    vocab_size: int  # token ids are 0 <= id < vocab_size


@dataclass(frozen=True, slots=True)
class PromptEmbeds:
    """Embeddings that stand in for the token embeddings at some prompt positions (an image's features, from its
    vision tower and projector): `positions` ascending, `values` their rows ([len(positions), hidden], a tensor: opaque
    here), and `keys`, one int per position standing for its content in the prefix cache (from the image's digest, so
    two prompts share blocks only where their images are the same)."""

    positions: tuple[int, ...]
    values: Any
    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A tokenized prompt and how to continue it. Lower `priority` runs earlier; ties run FIFO."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    # What an earlier process generated for it before it stopped (`Engine.in_flight`): it continues from there,
    # recomputed like a preempted request, and ends as it would have uninterrupted.
    output_token_ids: tuple[int, ...] = ()
    output_logprobs: tuple[TokenLogprobs, ...] | None = None  # theirs, where it asks for logprobs
    prompt_embeds: PromptEmbeds | None = None  # embeddings given for some prompt positions (images)


@dataclass(frozen=True, slots=True)
class InFlight:
    """A request still generating: what it has generated so far (`Engine.in_flight`), to continue it later."""

    output_token_ids: tuple[int, ...]
    output_logprobs: tuple[TokenLogprobs, ...] | None  # one per output token, where it asks for logprobs


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished request, however it ended (`Scheduler.finish_request`: a stop, max_tokens, an error while it ran,
    its grammar not compiling, a refusal at admission). Times are `time.monotonic()` seconds; derived durations are
    properties; a request that never ran has every time at the moment it ended."""

    req_id: str
    output_token_ids: list[int]
    text: str  # detokenized output, special tokens skipped, trimmed at a stop string (the answer, after reasoning)
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose K/V came from the prefix cache
    num_preemptions: int
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finish_time: float
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per output token, where asked for
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # one per prompt token (the first: None)
    reasoning: str | None = None  # the output's reasoning section, where its sampling has a parser and it had one
    note: str | None = None  # what a user should know about an ok output (a grammar that did not complete)
    error: str | None = None  # finish_reason "error": why it could not run, or what failed while it ran
    # Speculative decoding (None where it is off): draft tokens fed for it in this process, and of those, the
    # accepted ones (tokens of its output that took no step of their own)
    num_draft_tokens: int | None = None
    num_accepted_draft_tokens: int | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def queue_s(self) -> float:
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def latency_s(self) -> float:
        return self.finish_time - self.arrival_time
