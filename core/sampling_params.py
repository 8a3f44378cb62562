"""SamplingParams: how one request's tokens are chosen and when it stops.

Validated on construction; every error is a ValueError that names the field. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation settings (vLLM's names and meanings).

    temperature 0 means greedy; top_k 0 or -1 and top_p 1 and min_p 0 mean "off".
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 256
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= -1 (0 or -1 turn it off), got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain an empty string")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
