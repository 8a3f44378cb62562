"""Record -> engine request: finds the prompt or chat, applies the chat template, tokenizes, and merges
per-record sampling overrides. A record that cannot be used becomes an ErrorRow, never an exception.
Imports only conveyor.core's public names; the tokenizer is passed in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from conveyor.core import GenerationRequest, ModelLimits, SamplingParams
from conveyor.io import request_options
from conveyor.io.readers.record import RawRecord, describe, first_line

ROLES = ("assistant", "developer", "system", "tool", "user")
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
MAX_TOKENS_ALIASES = ("max_tokens", "max_completion_tokens", "max_new_tokens")


@dataclass(frozen=True)
class BuildOptions:
    """How records become requests (the sampling defaults and the model's context come apart: RequestBuilder)."""

    seed: int = 0  # the run seed; a record's effective seed is derive_seed(seed, id) unless it sets one
    # (a record without an id: index_seed(seed, index))
    system_prompt: str | None = None  # prepended to chat records that have no system message
    prompt_field: str = "prompt"  # the field holding a raw prompt
    messages_field: str = "messages"  # the field holding chat messages
    id_field: str = "id"  # the field holding the record's id
    keep_fields: tuple[str, ...] = ()  # input fields copied to the output row

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_fields", tuple(self.keep_fields))


@dataclass(frozen=True)
class BuiltRequest:
    index: int  # 0-based input position
    id: str  # the record's id, or its index as a string where it has none
    kind: str  # "chat" or "completion"
    prompt_token_ids: list[int]
    sampling: SamplingParams  # sampling.seed is the effective seed, always set
    kept: dict  # keep_fields -> the record's values (None where missing)
    id_given: bool = True  # False: the id is the index; it is not checked against other records' ids
    digest: str | None = None  # the input record's digest, where the reader gave one

    def to_generation_request(self) -> GenerationRequest:
        return GenerationRequest(req_id=str(self.index), prompt_token_ids=self.prompt_token_ids,
                                 sampling=self.sampling)


@dataclass(frozen=True)
class ErrorRow:
    index: int
    id: str
    error: str  # starts with the location: "line 12: ..." or "record 12: ..." (0-based index)
    kept: dict
    seed: int | None  # the effective seed when it could be worked out
    prompt_tokens: int | None = None  # known when the error came after tokenizing
    digest: str | None = None  # the input record's digest, where the reader gave one


def derive_seed(run_seed: int, record_id: str) -> int:
    """A record's seed from the run seed and its id: the same in every process, 0 <= s < 2**63."""
    digest = hashlib.sha256(f"{run_seed}\x00{record_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def index_seed(run_seed: int, index: int) -> int:
    """The seed of a record without an id, from the run seed and its input index; hashed apart from
    derive_seed's ids (\x01, not \x00), so it never equals the seed of a record whose id is that number."""
    digest = hashlib.sha256(f"{run_seed}\x01{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class _Reject(Exception):
    """Internal: the record cannot be used; the message says why and what to do (no location)."""


class RequestBuilder:
    """Turns RawRecords into BuiltRequests or ErrorRows. Holds no per-run state of its own: `sampling` are the
    run's defaults a record's fields override (their seed replaced per record), `limits` what a request must fit
    (the model's context, its vocabulary: every token id a record gives is checked against it)."""

    def __init__(self, tokenizer: Any, options: BuildOptions, sampling: SamplingParams, limits: ModelLimits) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.sampling = sampling
        self.limits = limits

    def build(self, raw: RawRecord) -> BuiltRequest | ErrorRow:
        where = f"line {raw.line}" if raw.line is not None else f"record {raw.index}"
        if raw.record is None:
            kept = dict.fromkeys(self.options.keep_fields)
            return ErrorRow(raw.index, str(raw.index), raw.error or f"{where}: the record could not be read",
                            kept, None, digest=raw.digest)
        record = raw.record
        kept = {name: record.get(name) for name in self.options.keep_fields}
        try:
            record_id = self._record_id(record)
        except _Reject as e:  # a batch line's error keeps its custom_id as given ("" too): lines are matched by it
            custom_id = record.get("custom_id") if "body" in record else None
            shown = custom_id if isinstance(custom_id, str) else str(raw.index)
            return ErrorRow(raw.index, shown, f"{where}: {e}", kept, None, digest=raw.digest)
        id_given = record_id is not None
        if record_id is None:
            record_id = str(raw.index)
        seed = num_tokens = None
        try:
            fields, prefix = self._request_fields(record)
            seed = self._seed(fields, prefix, record_id if id_given else None, raw.index)
            sampling = self._sampling(fields, prefix, seed)
            kind, token_ids = self._tokenize(fields, prefix)
            num_tokens = len(token_ids)
            self._check_length(num_tokens, sampling.max_tokens)
        except _Reject as e:
            return ErrorRow(raw.index, record_id, f"{where}: {e}", kept, seed, num_tokens, raw.digest)
        return BuiltRequest(raw.index, record_id, kind, token_ids, sampling, kept, id_given, raw.digest)

    def _record_id(self, record: dict) -> str | None:
        """The record's own id, or None where it has none."""
        name = self.options.id_field
        value = record.get(name)
        if value is None:
            value, name = record.get("custom_id"), "custom_id"
        if value is None:
            return None
        if isinstance(value, str) and value:
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        raise _Reject(f"field '{name}' must be a non-empty string or an integer, got {describe(value)}; "
                      "fix it or choose another field with --id-field")

    def _request_fields(self, record: dict) -> tuple[dict, str]:
        """The object holding the prompt and overrides: the record, or an OpenAI batch line's body."""
        if "body" not in record or ("custom_id" not in record and "url" not in record):
            n = record.get("n")
            if isinstance(n, int) and not isinstance(n, bool) and n != 1:
                raise _Reject(f"n = {n} is not supported: conveyor writes one completion per record; drop the field, "
                              "or repeat the record under other ids")
            return record, ""
        body = record["body"]
        if not isinstance(body, dict):
            raise _Reject(f"field 'body' must be an object (an OpenAI request body), got {describe(body)}")
        method = record.get("method")
        if method is not None and method != "POST":
            raise _Reject(f"method {method!r} is not supported; batch lines are POST requests (\"method\": \"POST\")")
        url = record.get("url")
        if url is None:
            raise _Reject(f"the line has no 'url'; give the endpoint it calls: {' or '.join(OPENAI_URLS)}")
        if url not in OPENAI_URLS:
            raise _Reject(f"url {url!r} is not supported; use {' or '.join(OPENAI_URLS)}")
        takes, other = ("messages", "prompt") if url == OPENAI_URLS[0] else ("prompt", "messages")
        if other in body and takes not in body:
            raise _Reject(f"url {url} takes body.{takes}, not body.{other}; use {OPENAI_URLS[url == OPENAI_URLS[0]]} "
                          f"for a {other}, or send body.{takes}")
        if body.get("n") not in (None, 1):
            raise _Reject(f"body.n = {body['n']!r} is not supported; send one request line per completion")
        if body.get("stream") not in (None, False):
            raise _Reject("body.stream is not supported in a batch; remove it")
        unknown = [key for key in body if key not in _BODY_FIELDS]
        if unknown:
            at_default = request_options.AT_DEFAULT.keys()
            raise _Reject(f"body.{unknown[0]} is not supported by conveyor; remove it (supported: "
                          f"{', '.join(sorted(_BODY_FIELDS - at_default))}; at their defaults only: "
                          f"{', '.join(sorted(at_default))})")
        try:
            request_options.check_at_default(body, "body.", request_options.AT_DEFAULT)
        except ValueError as e:
            raise _Reject(str(e)) from None
        return body, "body."

    def _seed(self, fields: dict, prefix: str, record_id: str | None, index: int) -> int:
        value = fields.get("seed")
        if value is None:
            return derive_seed(self.options.seed, record_id) if record_id is not None else index_seed(
                self.options.seed, index)
        seed = _as_int(prefix + "seed", value)
        if not -2**63 <= seed < 2**63:
            raise _Reject(f"{prefix}seed must fit in 64 bits (-2**63 <= seed < 2**63), got {seed}")
        return seed

    def _sampling(self, fields: dict, prefix: str, seed: int) -> SamplingParams:
        present = [key for key in MAX_TOKENS_ALIASES if fields.get(key) is not None]
        if len(present) > 1:
            raise _Reject(f"set only one of {', '.join(prefix + key for key in present)}")
        changes: dict[str, Any] = {"seed": seed}
        for key, (name, convert) in _OVERRIDES.items():
            value = fields.get(key)
            if value is not None:  # null means "use the default"
                changes[name] = convert(prefix + key, value)
        try:
            changes.update(request_options.changes(fields, prefix, self.tokenizer))
        except ValueError as e:
            raise _Reject(str(e)) from None
        try:
            sampling = dataclasses.replace(self.sampling, **changes)
        except ValueError as e:
            raise _Reject(f"{prefix}{e}; fix the value or drop the field to use the default") from None
        self._check_token_ids(sampling, prefix)
        return sampling

    def _check_token_ids(self, sampling: SamplingParams, prefix: str) -> None:
        """Every token id the request carries is one of the model's (an id past the vocabulary would index the
        logits out of bounds while the request runs)."""
        vocab = self.limits.vocab_size
        given = (("stop_token_ids", sampling.stop_token_ids), ("logit_bias", [t for t, _ in sampling.logit_bias]),
                 ("bad_words", [t for word in sampling.bad_words for t in word]))
        for name, ids in given:
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise _Reject(f"{prefix}{name}: {bad} is not a token id of this model (its ids are 0 to {vocab - 1})")

    def _tokenize(self, fields: dict, prefix: str) -> tuple[str, list[int]]:
        is_openai = bool(prefix)
        prompt_key = "prompt" if is_openai else self.options.prompt_field
        messages_key = "messages" if is_openai else self.options.messages_field
        prompt, messages = fields.get(prompt_key), fields.get(messages_key)
        if prompt is not None and messages is not None:
            raise _Reject(f"the record has both '{prefix}{prompt_key}' and '{prefix}{messages_key}'; keep one")
        if messages is not None:
            return "chat", self._chat_tokens(messages, prefix + messages_key)
        if prompt is not None:
            return "completion", self._prompt_tokens(prompt, prefix + prompt_key)
        present = ", ".join(repr(key) for key in list(fields)[:12]) or "none"
        raise _Reject(f"no prompt: expected a '{prefix}{prompt_key}' string or a '{prefix}{messages_key}' list of "
                      f"chat messages, but the fields are {present}; name yours with --prompt-field "
                      "or --messages-field")

    def _prompt_tokens(self, prompt: Any, field: str) -> list[int]:
        if not isinstance(prompt, str):
            raise _Reject(f"field '{field}' must be a string, got {describe(prompt)}")
        if not prompt.strip():
            raise _Reject(f"field '{field}' is empty; give a prompt or remove the record")
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def _chat_tokens(self, messages: Any, field: str) -> list[int]:
        messages = _checked_messages(messages, field)
        system_prompt = self.options.system_prompt
        if system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # templates raise what they like (jinja errors, ValueError, ...)
            raise _Reject(f"the chat template rejected '{field}' ({first_line(e)}); check the messages' "
                          "roles and order") from None
        # transformers 5 returns a BatchEncoding; older versions a plain list.
        token_ids = out["input_ids"] if isinstance(out, Mapping) else out
        if token_ids and isinstance(token_ids[0], list):
            token_ids = token_ids[0]
        return [int(t) for t in token_ids]

    def _check_length(self, num_tokens: int, max_tokens: int) -> None:
        max_len = self.limits.max_model_len
        if num_tokens == 0:
            raise _Reject("the prompt has no tokens; give a non-empty prompt")
        if num_tokens > max_len - 1:
            raise _Reject(f"prompt is {num_tokens} tokens but the model's context is {max_len}; "
                          f"shorten it to at most {max_len - 1} tokens")
        if num_tokens + max_tokens > max_len:
            raise _Reject(f"prompt ({num_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                          f"of {max_len}; lower max_tokens to at most {max_len - num_tokens}")


def _checked_messages(messages: Any, field: str) -> list[dict]:
    """The chat messages, each content a string: OpenAI-style lists of text parts
    ([{"type": "text", "text": ...}, ...]) are joined with newlines, as vLLM does for string-content
    templates. Anything else is rejected, naming the message and part at fault."""
    if not isinstance(messages, list):
        raise _Reject(f"field '{field}' must be a list of chat messages, got {describe(messages)}")
    if not messages:
        raise _Reject(f"field '{field}' is an empty list; give at least one message")
    checked = []
    for i, message in enumerate(messages):
        at = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise _Reject(f"{at} must be an object with 'role' and 'content', got {describe(message)}")
        role = message.get("role")
        if not isinstance(role, str):
            raise _Reject(f"{at}.role must be a string, got {describe(role)}")
        if role not in ROLES:
            raise _Reject(f"{at}.role {role!r} is not one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            content = _joined_text_parts(content, f"{at}.content")
        elif not isinstance(content, str):
            raise _Reject(f"{at}.content must be a string or a list of text parts, got {describe(content)}")
        checked.append(message if content is message["content"] else {**message, "content": content})
    if not any(m["content"].strip() for m in checked):
        raise _Reject(f"every message in '{field}' has empty content; give a prompt or remove the record")
    return checked


def _joined_text_parts(parts: list, at: str) -> str:
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            what = f"a part of type {kind!r}" if isinstance(kind, str) else describe(part)
            raise _Reject(f"{at}[{k}] is {what}; only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                          "can be sent to a text model")
        if not isinstance(part.get("text"), str):
            raise _Reject(f"{at}[{k}].text must be a string, got {describe(part.get('text'))}")
        texts.append(part["text"])
    return "\n".join(texts)


def _as_float(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Reject(f"{field} must be a number, got {describe(value)} ({value!r})")
    if not math.isfinite(value):
        raise _Reject(f"{field} must be a finite number, got {value!r}")
    return float(value)


def _as_int(field: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)  # 64.0 from a float column
    raise _Reject(f"{field} must be an integer, got {describe(value)} ({value!r})")


def _as_stop(field: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise _Reject(f"{field} must be a string or a list of strings, got {describe(value)}")


def _as_token_ids(field: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return tuple(value)
    raise _Reject(f"{field} must be a list of integers, got {describe(value)}")


def _as_bool(field: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _Reject(f"{field} must be true or false, got {describe(value)} ({value!r})")


# record key -> (SamplingParams field, converter); "seed" is handled apart (it has a derived default).
_OVERRIDES: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "max_tokens": ("max_tokens", _as_int),
    "max_completion_tokens": ("max_tokens", _as_int),
    "max_new_tokens": ("max_tokens", _as_int),
    "temperature": ("temperature", _as_float),
    "top_p": ("top_p", _as_float),
    "top_k": ("top_k", _as_int),
    "min_p": ("min_p", _as_float),
    "min_tokens": ("min_tokens", _as_int),
    "stop": ("stop", _as_stop),
    "stop_token_ids": ("stop_token_ids", _as_token_ids),
    "ignore_eos": ("ignore_eos", _as_bool),
}

# What an OpenAI batch body may hold: the request itself, its generation settings (OpenAI's and vLLM's names)
# and fields that do not change the output ("model": the run's --model answers; "user", "metadata", "store").
_BODY_FIELDS = frozenset({"messages", "prompt", "seed", "n", "stream", "model", "user", "metadata", "store",
                          *_OVERRIDES, *request_options.FIELDS, *request_options.AT_DEFAULT})

