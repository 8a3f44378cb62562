"""Record -> engine request: finds the prompt or chat, applies the chat template, tokenizes, and merges
per-record sampling overrides. A record that cannot be used becomes an ErrorRow, never an exception.
Imports only conveyor.core's public names; the tokenizer is passed in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from conveyor.core import ConfigError, GenerationRequest, ModelLimits, SamplingParams
from conveyor.io.records import request_options
from conveyor.io.records.prompt_template import PromptTemplate, field_text
from conveyor.io.records.readers.record import RawRecord, describe, first_line

ROLES = ("assistant", "developer", "system", "tool", "user")
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
MAX_TOKENS_ALIASES = ("max_tokens", "max_completion_tokens", "max_new_tokens")
MAX_SAMPLES = 128  # completions per record (n): more is a typo or a job for another input
TEMPLATE_AS = ("prompt", "chat")  # --prompt-template-as: a raw prompt, or the user message of a chat


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
    n: int = 1  # completions per record (a record's own `n` replaces it); sample k > 0 is seeded by sample_seed
    chat_field: str | None = None  # a field whose text is the user message of a chat (through the chat template)
    prompt_template: str | None = None  # "{field}" placeholders filled from the record (prompt_template.py)
    prompt_template_as: str = TEMPLATE_AS[0]  # what the template builds: a raw "prompt" or the "chat" user message
    truncate_prompt_tokens: int | str | None = None  # keep a prompt's last K tokens; "auto": what max_tokens leaves
    served_model_names: tuple[str, ...] = ()  # an OpenAI body's model must be one; (): the model's name and path
    chat_template: str | None = None  # builds chat prompts instead of the tokenizer's own (Jinja text)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_fields", tuple(self.keep_fields))
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_SAMPLES:
            raise ConfigError("n", f"n must be an integer from 1 to {MAX_SAMPLES} (completions per record), "
                              f"got {self.n!r}")
        object.__setattr__(self, "served_model_names", tuple(self.served_model_names))


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
    prompt_tokens_truncated: int | None = None  # tokens cut from the prompt's start; None: no truncation asked
    n: int = 1  # completions (samples) to generate for it
    priority: int = 0  # its `priority` field under --schedule priority (lower runs first)

    def to_generation_request(self, sample: int = 0) -> GenerationRequest:
        """The engine request of sample `sample` (0 <= sample < n): sample 0 is the record's request as it is with
        n = 1 (its id the index, its seed the record's); sample k > 0 has id "index/k" and seed sample_seed(seed, k)."""
        if sample == 0:
            return GenerationRequest(req_id=str(self.index), prompt_token_ids=self.prompt_token_ids,
                                     sampling=self.sampling, priority=self.priority)
        return GenerationRequest(req_id=f"{self.index}/{sample}", prompt_token_ids=self.prompt_token_ids,
                                 sampling=dataclasses.replace(self.sampling,
                                                              seed=sample_seed(self.sampling.seed, sample)),
                                 priority=self.priority)


@dataclass(frozen=True)
class ErrorRow:
    index: int
    id: str
    error: str  # starts with the location: "line 12: ..." or "record 12: ..." (0-based index)
    kept: dict
    seed: int | None  # the effective seed when it could be worked out
    prompt_tokens: int | None = None  # known when the error came after tokenizing
    digest: str | None = None  # the input record's digest, where the reader gave one
    prompt_tokens_truncated: int | None = None  # tokens cut from the prompt's start, where it was truncated


def derive_seed(run_seed: int, record_id: str) -> int:
    """A record's seed from the run seed and its id: the same in every process, 0 <= s < 2**63."""
    digest = hashlib.sha256(f"{run_seed}\x00{record_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def index_seed(run_seed: int, index: int) -> int:
    """The seed of a record without an id, from the run seed and its input index; hashed apart from
    derive_seed's ids (\x01, not \x00), so it never equals the seed of a record whose id is that number."""
    digest = hashlib.sha256(f"{run_seed}\x01{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def sample_seed(record_seed: int, sample: int) -> int:
    """The seed of a record's sample `sample` > 0, from the record's effective seed; hashed apart from derive_seed
    and index_seed (\x02), 0 <= s < 2**63. Sample 0 keeps the record's seed: it equals the record's n = 1 output."""
    digest = hashlib.sha256(f"{record_seed}\x02{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class _Reject(Exception):
    """Internal: the record cannot be used; the message says why and what to do (no location)."""


class RequestBuilder:
    """Turns RawRecords into BuiltRequests or ErrorRows. Holds no per-run state of its own: `sampling` are the
    run's defaults a record's fields override (their seed replaced per record), `limits` what a request must fit
    (the model's context, its vocabulary: every token id a record gives is checked against it). `model` is the run's
    --model: an OpenAI body's model must be one of its names (`served_names`) unless options name others.
    `priorities` (--schedule priority): a record's `priority` field (a plain record's or a body's) is an integer
    that orders the requests (lower first); otherwise a plain record's `priority` is data, and a body's is refused
    unless 0."""

    def __init__(self, tokenizer: Any, options: BuildOptions, sampling: SamplingParams, limits: ModelLimits,
                 model: str | None = None, priorities: bool = False) -> None:
        self.tokenizer = tokenizer
        self.priorities = priorities
        self.options = options
        self.sampling = sampling
        self.limits = limits
        self.template = PromptTemplate(options.prompt_template) if options.prompt_template is not None else None
        self.served_model_names = options.served_model_names or served_names(model)
        # The fields a request is built from are data: never read as sampling options of the same name.
        data = {options.prompt_field, options.messages_field, options.id_field, options.chat_field,
                *(self.template.fields if self.template else ())}
        self._sampling_names = tuple(name for name in _PLAIN_SAMPLING_NAMES if name not in data)

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
        seed = num_tokens = cut = None
        try:
            fields, prefix = self._request_fields(record)
            seed = self._seed(fields, prefix, record_id if id_given else None, raw.index)
            n = self._samples(fields, prefix)
            priority = self._priority(fields, prefix)
            sampling = self._sampling(fields, prefix, seed)
            keep = self._truncation(fields, prefix, sampling.max_tokens)
            kind, token_ids = self._tokenize(fields, prefix)
            if keep is not None:  # vLLM's truncate_prompt_tokens: the last `keep` tokens stay
                cut = max(0, len(token_ids) - keep)
                token_ids = token_ids[cut:]
            num_tokens = len(token_ids)
            self._check_length(num_tokens, sampling.max_tokens, truncated=keep is not None)
        except _Reject as e:
            return ErrorRow(raw.index, record_id, f"{where}: {e}", kept, seed, num_tokens, raw.digest, cut)
        return BuiltRequest(raw.index, record_id, kind, token_ids, sampling, kept, id_given, raw.digest, cut, n=n,
                            priority=priority)

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
        if not _is_batch_line(record):
            try:
                request_options.check_at_default(record, "", self._sampling_names)
            except ValueError as e:  # vLLM's or OpenAI's name for an option conveyor does not do
                raise _Reject(f"{e} (it names a vLLM/OpenAI sampling option; if it is data, rename the field)") from None
            return record, ""
        if record.get("custom_id") is None:
            raise _Reject("the line is an OpenAI batch request (it has 'url' or 'body') but no 'custom_id'; give every "
                          "line a unique custom_id (its result line carries it)")
        if "body" not in record:
            raise _Reject("the line has no 'body'; give the OpenAI request body (an object with messages or prompt)")
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
        if body.get("stream") not in (None, False):
            raise _Reject("body.stream is not supported in a batch; remove it")
        model = body.get("model")
        if model is not None and self.served_model_names and model not in self.served_model_names:
            raise _Reject(f"body.model {json.dumps(model, ensure_ascii=False)} is not the model this run serves "
                          f"({', '.join(self.served_model_names)}); to answer it with this run's model, add "
                          f"--served-model-name {model if isinstance(model, str) else 'NAME'}, or fix body.model")
        unknown = [key for key in body if key not in _BODY_FIELDS]
        if unknown:
            at_default = request_options.AT_DEFAULT.keys()
            raise _Reject(f"body.{unknown[0]} is not supported by conveyor; remove it (supported: "
                          f"{', '.join(sorted(_BODY_FIELDS - at_default))}; at their defaults only: "
                          f"{', '.join(sorted(at_default))})")
        at_default = [name for name in request_options.AT_DEFAULT if not (name == "priority" and self.priorities)]
        try:
            request_options.check_at_default(body, "body.", at_default)
        except ValueError as e:
            hint = " (or order the requests by it with --schedule priority)" if str(e).startswith("body.priority ") \
                else ""
            raise _Reject(f"{e}{hint}") from None
        return body, "body."

    def _priority(self, fields: dict, prefix: str) -> int:
        """The record's priority under --schedule priority (0 where it gives none); 0 otherwise."""
        value = fields.get("priority") if self.priorities else None
        if value is None:
            return 0
        priority = _as_int(prefix + "priority", value)
        if not -2**63 <= priority < 2**63:
            raise _Reject(f"{prefix}priority must fit in 64 bits, got {priority}; lower numbers run first")
        return priority

    def _seed(self, fields: dict, prefix: str, record_id: str | None, index: int) -> int:
        value = fields.get("seed")
        if value is None:
            return derive_seed(self.options.seed, record_id) if record_id is not None else index_seed(
                self.options.seed, index)
        seed = _as_int(prefix + "seed", value)
        if not -2**63 <= seed < 2**63:
            raise _Reject(f"{prefix}seed must fit in 64 bits (-2**63 <= seed < 2**63), got {seed}")
        return seed

    def _samples(self, fields: dict, prefix: str) -> int:
        """The record's n (completions to generate), or the run's --n where it gives none."""
        value = fields.get("n")
        if value is None:
            return self.options.n
        n = _as_int(prefix + "n", value)
        if not 1 <= n <= MAX_SAMPLES:
            raise _Reject(f"{prefix}n must be from 1 to {MAX_SAMPLES} (completions per record), got {n}; give a count "
                          f"in that range (for more, repeat the record under other ids)")
        return n

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
        if not is_openai and (self.template is not None or fields.get(self.options.chat_field) is not None):
            return self._built_prompt(fields, prompt_key, messages_key)
        prompt, messages = fields.get(prompt_key), fields.get(messages_key)
        if prompt is not None and messages is not None:
            raise _Reject(f"the record has both '{prefix}{prompt_key}' and '{prefix}{messages_key}'; keep one")
        if messages is not None:
            if isinstance(messages, str) and messages.lstrip().startswith("[") and not is_openai:  # a CSV or
                # Parquet column of JSON text
                messages = _json_messages(messages, messages_key)
            return "chat", self._chat_tokens(messages, prefix + messages_key)
        if prompt is not None:
            return "completion", self._prompt_tokens(prompt, prefix + prompt_key)
        present = ", ".join(repr(key) for key in list(fields)[:12]) or "none"
        chat_field = f"a '{self.options.chat_field}' text (--chat-field), " if self.options.chat_field else ""
        raise _Reject(f"no prompt: expected {chat_field}a '{prefix}{prompt_key}' string or a '{prefix}{messages_key}' "
                      f"list of chat messages, but the fields are {present}; name yours with --chat-field, "
                      "--prompt-field or --messages-field")

    def _built_prompt(self, fields: dict, prompt_key: str, messages_key: str) -> tuple[str, list[int]]:
        """The prompt --prompt-template or --chat-field builds from a plain record's fields."""
        options, template = self.options, self.template
        source = "--prompt-template" if template is not None else f"'{options.chat_field}' (--chat-field)"
        reads = template.fields if template is not None else (options.chat_field,)
        other = next((key for key in (messages_key, prompt_key) if key not in reads and fields.get(key) is not None),
                     None)
        if other is not None:
            option = "--messages-field" if other == messages_key else "--prompt-field"
            raise _Reject(f"the record has both {source} and '{other}' to build its prompt from; keep one (or name "
                          f"another field with {option})")
        try:
            text = template.render(fields) if template is not None else field_text(fields, options.chat_field)
        except ValueError as e:
            raise _Reject(f"{source}: {e}") from None
        if not text.strip():
            raise _Reject(f"{source} gives an empty prompt; give the field a text or remove the record")
        if template is not None and options.prompt_template_as == TEMPLATE_AS[0]:
            return "completion", self._prompt_tokens(text, "--prompt-template")
        return "chat", self._chat_tokens([{"role": "user", "content": text}], reads[0] if template is None else
                                         "--prompt-template")

    def _prompt_tokens(self, prompt: Any, field: str) -> list[int]:
        if not isinstance(prompt, str):
            raise _Reject(f"field '{field}' must be a string, got {describe(prompt)}")
        if not prompt.strip():
            raise _Reject(f"field '{field}' is empty; give a prompt or remove the record")
        if self.options.system_prompt:  # a raw prompt has no system message: never dropped without a word
            fix = ("add --prompt-template-as chat" if field == "--prompt-template" else
                   f"send it to {OPENAI_URLS[0]} as body.messages" if field.startswith("body.") else
                   f"send it as a chat message with --chat-field {field}")
            raise _Reject(f"--system-prompt applies to chat messages, but '{field}' is a raw prompt (no chat "
                          f"template, no system message); {fix}, or drop --system-prompt")
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def _chat_tokens(self, messages: Any, field: str) -> list[int]:
        messages = _checked_messages(messages, field)
        template = self.options.chat_template
        if template is None and not has_chat_template(self.tokenizer):
            raise _Reject(f"'{field}' is a chat, and the model has no chat template to build its prompt with; give "
                          "one with --chat-template FILE, or send raw prompts")
        system_prompt = self.options.system_prompt
        if system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     chat_template=template)
        except Exception as e:  # templates raise what they like (jinja errors, ValueError, ...)
            raise _Reject(f"the chat template rejected '{field}' ({first_line(e)}); check the messages' "
                          "roles and order") from None
        # transformers 5 returns a BatchEncoding; older versions a plain list.
        token_ids = out["input_ids"] if isinstance(out, Mapping) else out
        if token_ids and isinstance(token_ids[0], list):
            token_ids = token_ids[0]
        return [int(t) for t in token_ids]

    def _truncation(self, fields: dict, prefix: str, max_tokens: int) -> int | None:
        """How many of the prompt's last tokens to keep: the record's truncate_prompt_tokens, else the run's
        --truncate-prompt-tokens ("auto", in either: what the context leaves after the record's max_tokens);
        None: all."""
        value, name = fields.get("truncate_prompt_tokens"), prefix + "truncate_prompt_tokens"
        if value is None:
            value, name = self.options.truncate_prompt_tokens, "--truncate-prompt-tokens"
        if value is None:
            return None
        max_len = self.limits.max_model_len
        if value == "auto":
            if max_tokens >= max_len:
                raise _Reject(f"{name} auto: max_tokens ({max_tokens}) leaves no room for a prompt in the model's "
                              f"context of {max_len}; lower max_tokens")
            return max_len - max_tokens
        keep = _as_int(name, value)
        if keep < 1:
            raise _Reject(f"{name} must be at least 1 (the prompt tokens to keep), got {keep}")
        return keep

    def _check_length(self, num_tokens: int, max_tokens: int, truncated: bool = False) -> None:
        max_len = self.limits.max_model_len
        if num_tokens == 0:
            raise _Reject("the prompt has no tokens; give a non-empty prompt")
        fix = ("keep fewer tokens with truncate_prompt_tokens (--truncate-prompt-tokens auto fits the context)"
               if truncated
               else "let conveyor cut the prompt's start with --truncate-prompt-tokens auto")
        if num_tokens > max_len - 1:
            raise _Reject(f"prompt is {num_tokens} tokens but the model's context is {max_len}; "
                          f"shorten it to at most {max_len - 1} tokens, or {fix}")
        if num_tokens + max_tokens > max_len:
            raise _Reject(f"prompt ({num_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                          f"of {max_len}; lower max_tokens to at most {max_len - num_tokens}, or {fix}")


def served_names(model: str | None) -> tuple[str, ...]:
    """The model names an OpenAI body may give by default: the run's --model as given, and its last part (a
    folder's or a hub id's name; a .gguf file's name, with and without the extension)."""
    if not model:
        return ()
    name = model.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    return tuple(dict.fromkeys(n for n in (model, name, name.removesuffix(".gguf")) if n))


def _is_batch_line(record: dict) -> bool:
    """An OpenAI batch request line: it has a body object, an OpenAI url, or a custom_id with a body (a plain
    record's "url" or "body" of other kinds, a web page's address or an email's text, is data)."""
    url = record.get("url")
    return (isinstance(record.get("body"), dict) or (isinstance(url, str) and url.startswith("/v1/"))
            or ("custom_id" in record and "body" in record))


def _json_messages(text: str, field: str) -> Any:
    """A messages field holding JSON text (a CSV cell, a Parquet string column), parsed."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise _Reject(f"field '{field}' is text but not JSON of a list of chat messages ({first_line(e)}); write it "
                      "as [{\"role\": \"user\", \"content\": ...}]") from None


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


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
_BODY_FIELDS = frozenset({"messages", "prompt", "seed", "n", "stream", "truncate_prompt_tokens",
                          *request_options.REQUEST_METADATA, *_OVERRIDES, *request_options.FIELDS,
                          *request_options.AT_DEFAULT})
# The sampling options a plain record's fields may name (vLLM's and OpenAI's) that conveyor does not apply: each is
# an error row naming it unless at a value that asks for nothing (request_options.AT_DEFAULT).
_APPLIED = frozenset({"seed", "n", "truncate_prompt_tokens", *_OVERRIDES, *request_options.FIELDS})
_PLAIN_SAMPLING_NAMES = tuple(sorted(
    {*request_options.VLLM_SAMPLING_FIELDS, *request_options.OPENAI_CHAT_FIELDS, *request_options.UNSUPPORTED}
    - _APPLIED - set(request_options.REQUEST_METADATA)))

