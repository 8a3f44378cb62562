"""SamplingParams: how one request's tokens are chosen and when it stops; Grammar: what its output must
match.

Validated on construction; every error is a ConfigError (a ValueError) that names the field. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from conveyor.core.errors import ConfigError
from conveyor.core.fields import option
from conveyor.core.reasoning import Reasoning

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice")
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs


@dataclass(frozen=True, slots=True)
class Grammar:
    """A constraint on a request's whole output: `spec` is a JSON schema's text (json_schema), "" (json_object:
    any JSON object), a regular expression (regex), or the JSON text of a list of strings (choice)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ConfigError("grammar",
                              f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ConfigError("grammar", f"grammar spec must be a string, got {self.spec!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation settings (vLLM's names and meanings).

    temperature 0 means greedy; top_k 0 or -1 and top_p 1 and min_p 0 mean "off".
    """

    temperature: float = option(1.0)
    top_p: float = option(1.0)
    top_k: int = option(0)
    min_p: float = option(0.0)
    max_tokens: int = option(256)
    min_tokens: int = option(0)
    seed: int | None = None  # a request's own (the run's seed is BuildOptions.seed, and a record's derives from it)
    stop: tuple[str, ...] = option(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = option(False)
    # Logits processors (conveyor.core.logits_processors), in the order they apply:
    bad_words: tuple[tuple[int, ...], ...] = field(default_factory=tuple)  # token sequences never to complete
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token id, added to its logit)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # ... times how often it was generated
    repetition_penalty: float = option(1.0)  # logits of prompt and generated tokens divided (> 0) or multiplied by it
    grammar: Grammar | None = None  # the output must match it (structured outputs)
    # The output's reasoning section (core/reasoning.py): its grammar and stop strings apply after it, to the answer
    reasoning: Reasoning | None = None
    # Log-probabilities, from the model's own distribution (before any processor, temperature or truncation):
    logprobs: int | None = option(None)  # per generated token: its logprob and this many top alternatives
    prompt_logprobs: int | None = option(None, switch=True)  # per prompt token likewise (the first has none)

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.bad_words, list):
            object.__setattr__(self, "bad_words", tuple(tuple(w) for w in self.bad_words))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in self.logit_bias.items())))
        self.validate()

    @property
    def has_processors(self) -> bool:
        """Whether any logits processor edits this request's logits (min_tokens counts as one)."""
        return bool(self.min_tokens or self.bad_words or self.logit_bias or self.presence_penalty
                    or self.frequency_penalty or self.repetition_penalty != 1.0 or self.grammar is not None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ConfigError("temperature", f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ConfigError("top_k", f"top_k must be >= -1 (0 or -1 turn it off), got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ConfigError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ConfigError("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ConfigError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ConfigError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise ConfigError("stop", f"stop must be a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ConfigError("stop", "stop must not contain an empty string")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ConfigError("stop_token_ids", "stop_token_ids must be a list of non-negative integers, got "
                              f"{self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError("ignore_eos", f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not isinstance(self.bad_words, tuple) or not all(
            isinstance(w, tuple) and w and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in w)
            for w in self.bad_words
        ):
            raise ConfigError("bad_words", f"bad_words must be non-empty token id sequences, got {self.bad_words!r}")
        if not isinstance(self.logit_bias, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], int) and p[0] >= 0 for p in self.logit_bias
        ):
            raise ConfigError("logit_bias", f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        for token, bias in self.logit_bias:
            _check_number(f"logit_bias[{token}]", bias)
            if not -100 <= bias <= 100:
                raise ConfigError("logit_bias", f"logit_bias[{token}] must be in [-100, 100], got {bias}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2 <= value <= 2:
                raise ConfigError(name, f"{name} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= 10:
            raise ConfigError("repetition_penalty",
                              f"repetition_penalty must be in (0, 10] (1 is off), got {self.repetition_penalty}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ConfigError("grammar", f"grammar must be a Grammar, got {self.grammar!r}")
        if self.reasoning is not None and not isinstance(self.reasoning, Reasoning):
            raise ConfigError("reasoning", f"reasoning must be a Reasoning, got {self.reasoning!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ConfigError(name, f"{name} must be between 0 and {MAX_LOGPROBS} alternatives, got {value}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name.split("[")[0], f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(name.split("[")[0], f"{name} must be finite, got {value!r}")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"{name} must be an integer, got {value!r}")
