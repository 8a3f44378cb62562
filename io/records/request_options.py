"""What a record's own fields may set: its request's sampling settings, seed, n, priority and prompt truncation.

A record's fields replace the run's defaults (its options: --temperature, --json-schema, --logprobs, --n, ...).
OpenAI's names (`max_completion_tokens`, `response_format`, `logprobs` + `top_logprobs`, `logit_bias`, the
penalties) and vLLM's (`max_new_tokens`, `guided_json`, `prompt_logprobs`, `repetition_penalty`, `bad_words`, ...)
are read in a plain record and in an OpenAI batch line's body alike (`prefix` "body." names a body's fields in
messages). A known option conveyor does not do is refused naming it, never ignored. A bad value raises Reject
naming the field (the builder makes it the record's error row). Imports only conveyor.core's public names; the
tokenizer is passed in.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

from conveyor.core import MAX_LOGPROBS, SamplingParams
from conveyor.io.records.build_options import MAX_SAMPLES
from conveyor.io.records.readers.record import describe
from conveyor.io.records.reject import Reject
from conveyor.io.records.seeds import derive_seed, index_seed
from conveyor.io.records.structured_output import GRAMMAR_FIELDS, asks_for_grammar, record_grammar

MAX_TOKENS_ALIASES = ("max_tokens", "max_completion_tokens", "max_new_tokens")
FIELDS = (*GRAMMAR_FIELDS, "logprobs", "top_logprobs", "prompt_logprobs", "logit_bias", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "bad_words")
# vLLM request fields conveyor does not implement: an error that names them, never silently ignored.
# (best_of, use_beam_search and spaces_between_special_tokens are accepted at their defaults: AT_DEFAULT.)
UNSUPPORTED = ("guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag",
               "allowed_token_ids", "logits_processors", "best_of", "use_beam_search", "length_penalty",
               "spaces_between_special_tokens")
# The sampling options a plain record may name: vLLM's SamplingParams fields and OpenAI's chat-completions body
# fields. Each one conveyor applies, or refuses (an error naming it unless at a value AT_DEFAULT accepts): a
# plain record's field of one of these names is never taken for data (check_plain_record).
VLLM_SAMPLING_FIELDS = (
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "bad_words", "include_stop_str_in_output", "ignore_eos", "max_tokens",
    "min_tokens", "logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
    "logits_processors", "truncate_prompt_tokens", "output_kind", "guided_decoding", "structured_outputs",
    "logit_bias", "allowed_token_ids", "extra_args")
OPENAI_CHAT_FIELDS = (
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options")
# Of those, the ones that describe the request rather than how to generate it: data in a plain record.
REQUEST_METADATA = ("messages", "model", "metadata", "prompt_cache_key", "safety_identifier", "store", "user")
# Fields accepted only at a value that asks for nothing other than what conveyor does: their defaults, or a
# no-op (tool_choice "none" without tools; a service tier, which only schedules). Any other value is an error
# naming the field and the values it may take, never an option silently dropped. An OpenAI batch body is checked
# for all of them; a plain record for the UNSUPPORTED ones and the sampling names above (its other fields may be
# data of any name).
AT_DEFAULT = {
    "echo": (False,), "suffix": (None,), "best_of": (None, 1), "use_beam_search": (None, False),
    "stream_options": (None,), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False), "functions": (None, []), "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "include_stop_str_in_output": (None, False),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False), "priority": (None, 0),
    "stream": (None, False),
}


def _as_float(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Reject(f"{field} must be a number, got {describe(value)} ({value!r})")
    if not math.isfinite(value):
        raise Reject(f"{field} must be a finite number, got {value!r}")
    return float(value)


def as_int(field: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)  # 64.0 from a float column
    raise Reject(f"{field} must be an integer, got {describe(value)} ({value!r})")


def _as_stop(field: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise Reject(f"{field} must be a string or a list of strings, got {describe(value)}")


def _as_token_ids(field: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return tuple(value)
    raise Reject(f"{field} must be a list of integers, got {describe(value)}")


def as_bool(field: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise Reject(f"{field} must be true or false, got {describe(value)} ({value!r})")


# record key -> (SamplingParams field, converter); "seed" is handled apart (it has a derived default).
_OVERRIDES: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "max_tokens": ("max_tokens", as_int),
    "max_completion_tokens": ("max_tokens", as_int),
    "max_new_tokens": ("max_tokens", as_int),
    "temperature": ("temperature", _as_float),
    "top_p": ("top_p", _as_float),
    "top_k": ("top_k", as_int),
    "min_p": ("min_p", _as_float),
    "min_tokens": ("min_tokens", as_int),
    "stop": ("stop", _as_stop),
    "stop_token_ids": ("stop_token_ids", _as_token_ids),
    "ignore_eos": ("ignore_eos", as_bool),
}
# The fields this module applies (a batch body may hold them; a plain record's are never read as data).
APPLIED = frozenset({"seed", "n", "truncate_prompt_tokens", *_OVERRIDES, *FIELDS})
# The sampling options a plain record's fields may name (vLLM's and OpenAI's) that conveyor does not apply: each is
# an error row naming it unless at a value that asks for nothing (AT_DEFAULT).
_PLAIN_SAMPLING_NAMES = tuple(sorted(
    {*VLLM_SAMPLING_FIELDS, *OPENAI_CHAT_FIELDS, *UNSUPPORTED} - APPLIED - set(REQUEST_METADATA)))


def refused_names(data_fields: set) -> tuple[str, ...]:
    """The refused sampling names a plain record is checked for: all but the fields a request is built from
    (its prompt, messages, id, --chat-field, the template's), which are data whatever their names."""
    return tuple(name for name in _PLAIN_SAMPLING_NAMES if name not in data_fields)


def check_at_default(fields: dict, prefix: str, names) -> None:
    """Reject naming the first of `names` that `fields` sets to a value AT_DEFAULT does not allow."""
    for name in names:
        if name not in fields:
            continue
        value, allowed = fields[name], AT_DEFAULT.get(name, (None,))
        if not any(type(value) is type(a) and value == a for a in allowed):
            takes = " or ".join(json.dumps(a) for a in allowed if a is not None)
            shown = json.dumps(value, ensure_ascii=False, default=str)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."  # (a list of tools can be long)
            raise Reject(f"{prefix}{name} is not supported by conveyor" + (
                f" except at its default (got {shown}; it can only be {takes})" if takes else "") + "; remove it")


def check_plain_record(record: dict, names: tuple[str, ...]) -> None:
    """A plain record (not a batch line) sets none of `names` (refused_names) but at its default."""
    try:
        check_at_default(record, "", names)
    except Reject as e:  # vLLM's or OpenAI's name for an option conveyor does not do
        raise Reject(f"{e} (it names a vLLM/OpenAI sampling option; if it is data, rename the field)") from None


def record_seed(fields: dict, prefix: str, run_seed: int, record_id: str | None, index: int) -> int:
    """The record's `seed`, else derived from the run seed and its id (without an id: its index)."""
    value = fields.get("seed")
    if value is None:
        return derive_seed(run_seed, record_id) if record_id is not None else index_seed(run_seed, index)
    seed = as_int(prefix + "seed", value)
    if not -2**63 <= seed < 2**63:
        raise Reject(f"{prefix}seed must fit in 64 bits (-2**63 <= seed < 2**63), got {seed}")
    return seed


def samples(fields: dict, prefix: str, run_n: int) -> int:
    """The record's n (completions to generate), or the run's --n where it gives none."""
    value = fields.get("n")
    if value is None:
        return run_n
    n = as_int(prefix + "n", value)
    if not 1 <= n <= MAX_SAMPLES:
        raise Reject(f"{prefix}n must be from 1 to {MAX_SAMPLES} (completions per record), got {n}; give a count "
                     f"in that range (for more, repeat the record under other ids)")
    return n


def priority(fields: dict, prefix: str) -> int:
    """The record's priority under --schedule priority (lower runs first; 0 where it gives none)."""
    value = fields.get("priority")
    if value is None:
        return 0
    number = as_int(prefix + "priority", value)
    if not -2**63 <= number < 2**63:
        raise Reject(f"{prefix}priority must fit in 64 bits, got {number}; lower numbers run first")
    return number


def record_sampling(fields: dict, prefix: str, defaults: SamplingParams, seed: int, tokenizer: Any,
                    vocab_size: int) -> SamplingParams:
    """The run's sampling `defaults` with the record's fields applied and its effective `seed`; every token id it
    gives must be below `vocab_size`."""
    present = [key for key in MAX_TOKENS_ALIASES if fields.get(key) is not None]
    if len(present) > 1:
        raise Reject(f"set only one of {', '.join(prefix + key for key in present)}")
    changes: dict[str, Any] = {"seed": seed}
    for key, (name, convert) in _OVERRIDES.items():
        value = fields.get(key)
        if value is not None:  # null means "use the default"
            changes[name] = convert(prefix + key, value)
    changes.update(_field_changes(fields, prefix, tokenizer))
    try:
        sampling = dataclasses.replace(defaults, **changes)
    except ValueError as e:
        raise Reject(f"{prefix}{e}; fix the value or drop the field to use the default") from None
    _check_token_ids(sampling, prefix, vocab_size)
    return sampling


def truncation(fields: dict, prefix: str, run_default: int | str | None, max_tokens: int,
               max_model_len: int) -> int | None:
    """How many of the prompt's last tokens to keep: the record's truncate_prompt_tokens, else the run's
    --truncate-prompt-tokens (`run_default`; "auto", in either: what the context leaves after the record's
    max_tokens); None: all."""
    value, name = fields.get("truncate_prompt_tokens"), prefix + "truncate_prompt_tokens"
    if value is None:
        value, name = run_default, "--truncate-prompt-tokens"
    if value is None:
        return None
    if value == "auto":
        if max_tokens >= max_model_len:
            raise Reject(f"{name} auto: max_tokens ({max_tokens}) leaves no room for a prompt in the model's "
                         f"context of {max_model_len}; lower max_tokens")
        return max_model_len - max_tokens
    keep = as_int(name, value)
    if keep < 1:
        raise Reject(f"{name} must be at least 1 (the prompt tokens to keep), got {keep}")
    return keep


def _check_token_ids(sampling: SamplingParams, prefix: str, vocab: int) -> None:
    """Every token id the request carries is one of the model's (an id past the vocabulary would index the
    logits out of bounds while the request runs)."""
    given = (("stop_token_ids", sampling.stop_token_ids), ("logit_bias", [t for t, _ in sampling.logit_bias]),
             ("bad_words", [t for word in sampling.bad_words for t in word]))
    for name, ids in given:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise Reject(f"{prefix}{name}: {bad} is not a token id of this model (its ids are 0 to {vocab - 1})")


def _field_changes(fields: dict, prefix: str, tokenizer: Any) -> dict[str, Any]:
    """The structured-output, logprob and logits-processor settings a record sets; {} where it sets none."""
    check_at_default(fields, prefix, UNSUPPORTED)
    out: dict[str, Any] = {}
    if asks_for_grammar(fields):
        out["grammar"] = record_grammar(fields, prefix)
    logprobs = _logprobs(fields, prefix)
    if logprobs is not _UNSET:
        out["logprobs"] = logprobs
    value = fields.get("prompt_logprobs")
    if value is not None:
        out["prompt_logprobs"] = _count(prefix + "prompt_logprobs", value, allow_bool=True)
    value = fields.get("logit_bias")
    if value is not None:
        out["logit_bias"] = _logit_bias(prefix + "logit_bias", value)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = fields.get(name)
        if value is not None:
            out[name] = _number(prefix + name, value)
    value = fields.get("bad_words")
    if value is not None:
        out["bad_words"] = _bad_words(prefix + "bad_words", value, tokenizer)
    return out


_UNSET = object()


def _logprobs(fields: dict, prefix: str) -> int | None | object:
    """OpenAI chat: logprobs true/false and top_logprobs N; OpenAI completions: logprobs N."""
    flag, top = fields.get("logprobs"), fields.get("top_logprobs")
    if flag is None and top is None:
        return _UNSET
    if top is not None:
        top = _count(prefix + "top_logprobs", top)
        if flag is False:
            raise Reject(f"{prefix}top_logprobs needs {prefix}logprobs to be true")
    if flag is None or flag is True:
        return top or 0
    if flag is False:
        return None
    n = _count(prefix + "logprobs", flag)
    if top is not None and top != n:
        raise Reject(f"{prefix}logprobs ({n}) and {prefix}top_logprobs ({top}) disagree; give one")
    return n


def _count(field: str, value: Any, allow_bool: bool = False) -> int:
    if isinstance(value, bool):
        if allow_bool:
            return 0 if value else None  # type: ignore[return-value]
        raise Reject(f"{field} must be a number of alternatives (0 to {MAX_LOGPROBS}), got {value!r}")
    if not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise Reject(f"{field} must be a number of alternatives from 0 to {MAX_LOGPROBS}, got {value!r}")
    return value


def _number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Reject(f"{field} must be a finite number, got {value!r}")
    return float(value)


def _logit_bias(field: str, value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise Reject(f"{field} must map token ids to biases, such as {{\"50256\": -100}}, got {value!r}")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise Reject(f"{field}: {key!r} is not a token id") from None
        if token < 0:
            raise Reject(f"{field}: {key!r} is not a token id")
        out[token] = _number(f"{field}[{key}]", bias)
    return out


def _bad_words(field: str, value: Any, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words: each string's tokens, as written and after a space (how it appears mid-text)."""
    if not isinstance(value, list) or not all(isinstance(w, str) and w.strip() for w in value):
        raise Reject(f"{field} must be a list of non-empty strings, got {value!r}")
    sequences: list[tuple[int, ...]] = []
    for word in value:
        for text in (word, " " + word.lstrip()):
            ids = tuple(int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids and ids not in sequences:
                sequences.append(ids)
    return tuple(sequences)
