"""The tasks besides generation, and what goes into and comes out of the pooling engine. Pure Python.

    embed     a vector per input: the last hidden states pooled (last token, mean, or the first token: cls),
              cut to `dimensions` (Matryoshka) and normalized (L2) where asked
    classify  a sequence-classification head's probabilities (softmax; sigmoid for a single label)
    score     a number per pair of texts: a cross-encoder's sigmoid, or the cosine of two embeddings
    rerank    score, with the documents ranked by it (OpenAI-style /rerank bodies)
    reward    a reward model's raw score(s)
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.core.fields import check_fields, option

POOLING_METHODS = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingOptions:
    """The run's settings for the pooling tasks (a record's own `dimensions` replaces the run's)."""

    pooling: str | None = option(None, choices=POOLING_METHODS)  # None: the checkpoint's, else its kind's
    normalize: bool = option(True)  # embeddings: L2-normalized (OpenAI's are)
    dimensions: int | None = option(None, positive=True)  # embeddings: the first N dimensions (Matryoshka)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True)
class TokenSequence:
    """One input of a pooling request as the model takes it: its token ids, and its token types (a pair's second
    text is type 1 in BERT's tokenizers) where the tokenizer gives them."""

    token_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class PoolingRequest:
    """The inputs of one record: a vector (or a head's output) per sequence; with `pairs`, one cosine score per
    pair of sequences instead (an embedding model asked to score)."""

    req_id: str
    sequences: tuple[TokenSequence, ...]
    dimensions: int | None = None
    normalize: bool = True
    pairs: tuple[tuple[int, int], ...] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


@dataclass(frozen=True, slots=True)
class PoolingOutput:
    """A finished pooling request: one result per sequence (or per pair), as float32 values: an embedding, a
    classifier's probabilities, a score or a reward (a tuple of one), in the request's order."""

    req_id: str
    results: list[tuple[float, ...]]
    num_prompt_tokens: int
    arrival_time: float
    first_scheduled_time: float
    finish_time: float
    error: str | None = None

    @property
    def queue_s(self) -> float:
        return self.first_scheduled_time - self.arrival_time

    @property
    def latency_s(self) -> float:
        return self.finish_time - self.arrival_time
