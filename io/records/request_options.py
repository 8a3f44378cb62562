"""A record's structured-output, logprob and logits-processor fields -> SamplingParams changes.

OpenAI's names (`response_format`, `logprobs` + `top_logprobs`, `logit_bias`, `presence_penalty`,
`frequency_penalty`) and vLLM's (`guided_json`, `guided_regex`, `guided_choice`, `prompt_logprobs`,
`repetition_penalty`, `bad_words`), in a plain record or an OpenAI batch line's body. A bad value raises
ValueError naming the field (the caller makes it the record's error row). The run's own options
(`--json-schema`, `--choice`, `--regex`, `--logprobs`, `--prompt-logprobs`) are the defaults a record's
fields replace. Imports only conveyor.core's public names; the tokenizer is passed in.
"""

from __future__ import annotations

import json
import math
from typing import Any

from conveyor.core import MAX_LOGPROBS, Grammar, schema_error

GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")
FIELDS = (*GRAMMAR_FIELDS, "logprobs", "top_logprobs", "prompt_logprobs", "logit_bias", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "bad_words")
# vLLM request fields conveyor does not implement: an error that names them, never silently ignored.
# (best_of, use_beam_search and spaces_between_special_tokens are accepted at their defaults: AT_DEFAULT.)
UNSUPPORTED = ("guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag",
               "allowed_token_ids", "logits_processors", "best_of", "use_beam_search", "length_penalty",
               "spaces_between_special_tokens")
# The sampling options a plain record may name: vLLM's SamplingParams fields and OpenAI's chat-completions body
# fields. Each one conveyor applies, or refuses (an error naming it unless at a value AT_DEFAULT accepts): a
# plain record's field of one of these names is never taken for data (request_builder checks them).
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


def check_at_default(fields: dict, prefix: str, names) -> None:
    """ValueError naming the first of `names` that `fields` sets to a value AT_DEFAULT does not allow."""
    for name in names:
        if name not in fields:
            continue
        value, allowed = fields[name], AT_DEFAULT.get(name, (None,))
        if not any(type(value) is type(a) and value == a for a in allowed):
            takes = " or ".join(json.dumps(a) for a in allowed if a is not None)
            shown = json.dumps(value, ensure_ascii=False, default=str)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."  # (a list of tools can be long)
            raise ValueError(f"{prefix}{name} is not supported by conveyor" + (
                f" except at its default (got {shown}; it can only be {takes})" if takes else "") + "; remove it")


def changes(fields: dict, prefix: str, tokenizer: Any) -> dict[str, Any]:
    """The SamplingParams fields a record sets, from its own fields; {} where it sets none."""
    check_at_default(fields, prefix, UNSUPPORTED)
    out: dict[str, Any] = {}
    grammar = _grammar(fields, prefix)
    if grammar is not _UNSET:
        out["grammar"] = grammar
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


def run_grammar(json_schema_text: str | None, choice: tuple[str, ...], regex: str | None) -> Grammar | None:
    """The run's grammar from --json-schema (the file's text), --choice or --regex; ValueError naming the
    option where it is invalid or more than one is given."""
    given = [name for name, v in (("--json-schema", json_schema_text), ("--choice", choice), ("--regex", regex)) if v]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} both constrain the output; give one")
    if json_schema_text is not None:
        try:
            schema = json.loads(json_schema_text)
        except ValueError as e:
            raise ValueError(f"the file is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ValueError("the file must hold a JSON schema object")
        problem = schema_error(schema)
        if problem is not None:
            raise ValueError(f"not a valid JSON schema ({problem}); fix the schema")
        return Grammar("json_schema", json.dumps(schema, sort_keys=True))
    if choice:
        return Grammar("choice", json.dumps(list(choice), ensure_ascii=False))
    if regex:
        return Grammar("regex", regex)
    return None


_UNSET = object()


def _grammar(fields: dict, prefix: str) -> Grammar | None | object:
    given = [name for name in GRAMMAR_FIELDS if fields.get(name) is not None]
    if not given:
        return _UNSET
    if len(given) > 1:
        raise ValueError(f"set only one of {', '.join(prefix + g for g in given)}: each constrains the whole output")
    name = given[0]
    value = fields[name]
    field = prefix + name
    if name == "response_format":
        return _response_format(field, value)
    if name == "guided_json":
        return Grammar("json_schema", _schema_text(field, value))
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{field} must be a non-empty regular expression string, got {value!r}")
        return Grammar("regex", value)
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise ValueError(f"{field} must be a non-empty list of non-empty strings, got {value!r}")
    return Grammar("choice", json.dumps(value, ensure_ascii=False))


def _response_format(field: str, value: Any) -> Grammar | None:
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be an object such as {{\"type\": \"json_object\"}}, got {value!r}")
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise ValueError(f"{field}.{extra[0]} is not supported; {field} takes type and json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind != "json_schema":
        raise ValueError(f"{field}.type must be text, json_object or json_schema, got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError(f"{field}.json_schema must be an object with name and schema, got {spec!r}")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ValueError(f"{field}.json_schema.{unknown[0]} is not supported; it takes name, description, schema "
                         "and strict")
    if "schema" not in spec:
        raise ValueError(f"{field}.json_schema.schema is missing; give the JSON schema the output must match")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{field}.json_schema.strict must be true or false, got {strict!r}")
    return Grammar("json_schema", _schema_text(f"{field}.json_schema.schema", spec["schema"]))


def _schema_text(field: str, value: Any) -> str:
    """A schema object, or its JSON text, as canonical JSON text (equal schemas compile once)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{field} is a string but not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a JSON schema object, got {value!r}")
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _logprobs(fields: dict, prefix: str) -> int | None | object:
    """OpenAI chat: logprobs true/false and top_logprobs N; OpenAI completions: logprobs N."""
    flag, top = fields.get("logprobs"), fields.get("top_logprobs")
    if flag is None and top is None:
        return _UNSET
    if top is not None:
        top = _count(prefix + "top_logprobs", top)
        if flag is False:
            raise ValueError(f"{prefix}top_logprobs needs {prefix}logprobs to be true")
    if flag is None or flag is True:
        return top or 0
    if flag is False:
        return None
    n = _count(prefix + "logprobs", flag)
    if top is not None and top != n:
        raise ValueError(f"{prefix}logprobs ({n}) and {prefix}top_logprobs ({top}) disagree; give one")
    return n


def _count(field: str, value: Any, allow_bool: bool = False) -> int:
    if isinstance(value, bool):
        if allow_bool:
            return 0 if value else None  # type: ignore[return-value]
        raise ValueError(f"{field} must be a number of alternatives (0 to {MAX_LOGPROBS}), got {value!r}")
    if not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{field} must be a number of alternatives from 0 to {MAX_LOGPROBS}, got {value!r}")
    return value


def _number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{field} must be a finite number, got {value!r}")
    return float(value)


def _logit_bias(field: str, value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise ValueError(f"{field} must map token ids to biases, such as {{\"50256\": -100}}, got {value!r}")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{field}: {key!r} is not a token id") from None
        if token < 0:
            raise ValueError(f"{field}: {key!r} is not a token id")
        out[token] = _number(f"{field}[{key}]", bias)
    return out


def _bad_words(field: str, value: Any, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words: each string's tokens, as written and after a space (how it appears mid-text)."""
    if not isinstance(value, list) or not all(isinstance(w, str) and w.strip() for w in value):
        raise ValueError(f"{field} must be a list of non-empty strings, got {value!r}")
    sequences: list[tuple[int, ...]] = []
    for word in value:
        for text in (word, " " + word.lstrip()):
            ids = tuple(int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids and ids not in sequences:
                sequences.append(ids)
    return tuple(sequences)
