"""Reasoning sections (`<think>...</think>`): which parser a model's output takes, the tags it uses, where the answer
begins, and the split of a finished text into reasoning and answer. Pure Python.

The parsers are vLLM's (`--reasoning-parser`):

    deepseek_r1  the output is reasoning up to `</think>` (the prompt may already have opened `<think>`); an output
                 that never closes it is all reasoning
    qwen3        `<think>` ... `</think>` in the output, optional: an output that does not open `<think>` is all
                 answer
    auto         picked from the chat template: deepseek_r1 where its generation prompt opens `<think>`, qwen3 where
                 it mentions think tags otherwise

The engine gates on the end tag's token ids (`Reasoning.end_ids`): until the output has generated them, a
request's grammar is not applied and its stop strings are not looked for; the grammar starts from its initial
state at the answer's first token, and stop strings are searched from the answer's first character. A prompt whose
last think tag is the end tag (a template that closed the reasoning itself) starts with the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.core.errors import ConfigError

REASONING_PARSERS = ("auto", "deepseek_r1", "qwen3")
START_TAG, END_TAG = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A request's reasoning section: its parser and its tags' token ids in the model's vocabulary."""

    parser: str  # deepseek_r1 or qwen3
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.parser not in REASONING_PARSERS[1:]:
            raise ConfigError("reasoning_parser", f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                              f"got {self.parser!r}")
        if not self.end_ids or not self.start_ids:
            raise ConfigError("reasoning_parser", "reasoning_parser: the think tags have no token ids")

    def ended_in(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt's last think tag is the end tag: the output starts with the answer."""
        start, end = _last(prompt_token_ids, self.start_ids), _last(prompt_token_ids, self.end_ids)
        return end > start

    def split(self, text: str, answer_start: int | None) -> tuple[str | None, str]:
        """(reasoning or None, answer) of a finished output's text; `answer_start`: the output token where the answer
        began (0: the prompt ended the reasoning), None where the output never generated the end tag."""
        if answer_start == 0:
            return None, text
        head, tag, answer = text.partition(END_TAG)
        if answer_start is None or not tag:  # never closed: cut short while reasoning, or (qwen3) no reasoning
            opened = self.parser == "deepseek_r1" or text.lstrip().startswith(START_TAG)
            return (_without_start(text), "") if opened else (None, text)
        return _without_start(head), answer


def _without_start(text: str) -> str:
    head, tag, rest = text.partition(START_TAG)
    return rest if tag and not head.strip() else text


def _last(ids: Sequence[int], tag: tuple[int, ...]) -> int:
    """The index just past the last occurrence of `tag` in `ids`, or -1."""
    n = len(tag)
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i:i + n]) == tag:
            return i + n
    return -1


def resolve_reasoning(name: str, tokenizer: Any) -> Reasoning:
    """The Reasoning of parser `name` (auto: from the chat template) for `tokenizer`; ConfigError (reasoning_parser)
    where it has no think tags, or auto finds none in the template."""
    if name not in REASONING_PARSERS:
        raise ConfigError("reasoning_parser", f"reasoning_parser {name!r} is not one of {', '.join(REASONING_PARSERS)}")
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # several named templates
        template = "\n".join(str(t) for t in (template.values() if isinstance(template, dict) else template))
    vocab = tokenizer.get_vocab()
    has_tags = END_TAG in template or (START_TAG in vocab and END_TAG in vocab)
    if not has_tags:
        where = "its chat template has no think tags" if name == "auto" else \
            f"its tokenizer has no {START_TAG} / {END_TAG} tokens and its chat template no think tags"
        raise ConfigError("reasoning_parser", f"reasoning_parser {name}: the model's output has no reasoning section "
                          f"({where}); drop the option or use a reasoning model")
    if name == "auto":
        name = "deepseek_r1" if _opens_think(tokenizer) else "qwen3"
    start_ids = tuple(tokenizer.encode(START_TAG, add_special_tokens=False))
    end_ids = tuple(tokenizer.encode(END_TAG, add_special_tokens=False))
    return Reasoning(name, start_ids, end_ids)


def _opens_think(tokenizer: Any) -> bool:
    """Whether the chat template's generation prompt opens the reasoning itself (DeepSeek-R1's templates)."""
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                               tokenize=False)
    except Exception:  # noqa: BLE001 - a template that needs more than one user message: qwen3's parsing is safe
        return False
    return str(prompt).rstrip().endswith(START_TAG)
