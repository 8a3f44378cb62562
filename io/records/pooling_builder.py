"""Record -> pooling request: the builder of the tasks besides generation (embed, classify, score, rerank, reward).

What a record holds, by task:
- embed, classify, reward: a text (`--prompt-field`, `--prompt-template`), or a chat (`messages`, `--chat-field`)
  through the chat template without a generation prompt (a reward model scores the whole conversation);
- score, rerank: `text_1` and `text_2` (vLLM's names; `text_2` may be a list: one score per text), or `query` (or
  `queries`) and `documents`;
- an OpenAI / vLLM batch line: `/v1/embeddings` (`input`: a text, a list of texts, token ids or lists of them;
  `encoding_format`, `dimensions`), `/v1/score` (`text_1`/`text_2` or `queries`/`documents`), `/v1/rerank`
  (`query`, `documents`, `top_n`), `/v1/classify` (`input`).
A record's own `dimensions` and `truncate_prompt_tokens` replace the run's. A field that only generation reads (a
sampling setting, n, a grammar) is an error naming it: it would change nothing. The prompt a checkpoint's
sentence-transformers config prepends to every text (`encode`'s default prompt; a cross-encoder's goes before a
pair's first text) is joined to each text here, before it is tokenized, so its tokens count within the length
limit; token ids are the model's input as given, and a chat, which has no text to prepend it to, is an error row
for such a model. A text too long for the model
without truncation, an empty one, a pair of the wrong shape: the record's error row. Imports only conveyor.core's
public names; the tokenizer is passed in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from conveyor.core import ModelLimits, PoolingOptions, PoolingRequest, SamplingParams, Task, TokenSequence
from conveyor.io.records import request_options
from conveyor.io.records.batch_lines import is_batch_line, line_body, served_names
from conveyor.io.records.build_options import BuildOptions
from conveyor.io.records.prompt_template import PromptTemplate
from conveyor.io.records.prompts import PromptTokens, reject_a_field_without_value
from conveyor.io.records.readers.record import RawRecord, describe
from conveyor.io.records.record_head import ErrorRow, RecordHead, unreadable
from conveyor.io.records.reject import Reject

# What a pooling batch body may hold, by task, beside `model` and `user` (which change nothing).
_BODY_FIELDS = {
    Task.EMBED: {"input", "encoding_format", "dimensions", "truncate_prompt_tokens", "normalize"},
    Task.CLASSIFY: {"input", "truncate_prompt_tokens"},
    Task.SCORE: {"text_1", "text_2", "queries", "documents", "truncate_prompt_tokens"},
    Task.RERANK: {"query", "documents", "top_n", "truncate_prompt_tokens", "return_documents"},
}
_NEUTRAL = {"model", "user"}
ENCODING_FORMATS = ("float", "base64")
# Fields of a plain record that only generation reads: refused for a pooling task, naming them.
_GENERATION_ONLY = tuple(sorted({*request_options.APPLIED, *request_options.VLLM_SAMPLING_FIELDS,
                                 *request_options.OPENAI_CHAT_FIELDS} - set(request_options.REQUEST_METADATA)
                                - {"truncate_prompt_tokens", "messages"}))


@dataclass(frozen=True)
class BuiltPooling:
    """A record built for a pooling task: its request, and what its row and result line need besides the
    results."""

    index: int
    id: str
    kind: Task  # the task (a batch line's url asks for the run's)
    request: PoolingRequest
    kept: dict
    id_given: bool = True
    digest: str | None = None
    prompt_tokens_truncated: int | None = None
    encoding_format: str = "float"  # a batch line's: its embeddings as float lists or base64
    batch_line: bool = False
    multiple: bool = False  # its input was a list (its row holds one result per input)
    documents: tuple[str, ...] = ()  # a rerank line's documents (its result line returns them)
    top_n: int | None = None  # a rerank line's: the best N results only
    sampling: SamplingParams = field(default_factory=SamplingParams)  # (a row's seed column: none)
    n: int = 1

    def to_generation_request(self, sample: int = 0) -> PoolingRequest:
        return self.request

    def error_row(self, message: str, prompt_tokens: int | None = None) -> ErrorRow:
        return ErrorRow(index=self.index, id=self.id, error=message, kept=self.kept, seed=None,
                        prompt_tokens=prompt_tokens, digest=self.digest, id_given=self.id_given)


class PoolingRequestBuilder:
    """Turns RawRecords into BuiltPooling requests or ErrorRows for `task`. `cross_encoder`: a score pair is one
    sequence (the two texts as the tokenizer pairs them) rather than two embeddings compared; `vector_size`: the
    embedding's size (a `dimensions` above it is refused); `prompt`: what the checkpoint prepends to every text."""

    def __init__(self, tokenizer: Any, options: BuildOptions, pooling: PoolingOptions, task: Task,
                 limits: ModelLimits, model: str | None, cross_encoder: bool, vector_size: int | None,
                 prompt: str = "") -> None:
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.options = options
        self.pooling = pooling
        self.task = Task(task)
        self.limits = limits
        self.cross_encoder = cross_encoder
        self.vector_size = vector_size
        self.served_model_names = options.served_model_names or served_names(model)
        self.prompts = PromptTokens(tokenizer, options, generation_prompt=False)
        self.template = PromptTemplate(options.prompt_template) if options.prompt_template is not None else None
        data = {options.prompt_field, options.messages_field, options.id_field, options.chat_field,
                *(self.template.fields if self.template else ())}
        self._refused = tuple(name for name in _GENERATION_ONLY if name not in data)

    def build(self, raw: RawRecord) -> BuiltPooling | ErrorRow:
        if raw.record is None:
            return unreadable(raw, self.options.keep_fields)
        record, head = raw.record, RecordHead.of(raw, self.options.keep_fields)
        num_tokens = None
        try:
            head.take_id(record, self.options.id_field)
            if is_batch_line(record):
                body, _ = line_body(record, self.served_model_names, self.task)
                return self._built(raw, head, *self._body_inputs(body), body, "body.", batch_line=True)
            self._check_plain(record)
            return self._built(raw, head, *self._record_inputs(record), record, "")
        except _TooLong as e:
            num_tokens = e.tokens
            message = str(e)
        except Reject as e:
            message = str(e)
        return head.error(message, None, num_tokens)

    # -- a record's inputs -------------------------------------------------------------------------------------------

    def _check_plain(self, record: dict) -> None:
        for name in self._refused:
            if record.get(name) is not None:
                raise Reject(f"field '{name}' is a generation setting, which --task {self.task} does not use; "
                             "remove it (or rename the field if it is data)")

    def _record_inputs(self, record: dict) -> tuple[list, bool]:
        """(the inputs: texts, chat token ids, or (text, text) pairs; whether the record gave a list)."""
        if self.task.pairs:
            first = _first_present(record, ("text_1", "query", "queries"))
            second = _first_present(record, ("text_2", "documents"))
            if first is None or second is None:
                raise Reject(f"--task {self.task} takes a pair of texts: 'text_1' and 'text_2' (or 'query' and "
                             f"'documents'); the fields are {_fields(record)}")
            return self._pairs(record, first, second, "")
        return [self._one_text(record)], False

    def _one_text(self, record: dict):
        """A plain record's text, or a chat's token ids (through the chat template)."""
        options = self.options
        if self.template is not None and options.prompt_template_as == "prompt":
            try:
                return self._raw(self.template.render(record), "--prompt-template")
            except ValueError as e:
                raise Reject(f"--prompt-template: {e}") from None
        if self.template is not None or any(record.get(name) is not None
                                            for name in (options.chat_field, options.messages_field)):
            if self.prompt:
                raise Reject(f"the model's sentence-transformers config prepends a default prompt "
                             f"({json.dumps(self.prompt)}) to every text, and a chat has no text to prepend it to; "
                             f"give the record's text in '{options.prompt_field}' (or --prompt-template) instead")
            return self.prompts.tokens(record, "")[1]
        value = record.get(options.prompt_field)
        if value is None:
            reject_a_field_without_value(record, (options.prompt_field, options.chat_field, options.messages_field),
                                         what="a text")
            raise Reject(f"no text: expected a '{options.prompt_field}' string (or '{options.messages_field}', a "
                         f"chat), but the fields are {_fields(record)}; name yours with --prompt-field")
        return self._raw(value, options.prompt_field)

    def _raw(self, value: Any, name: str) -> str:
        """A raw text (no chat template, so no system message: --system-prompt is refused, never dropped)."""
        if self.options.system_prompt:
            raise Reject(f"--system-prompt applies to chat messages, but '{name}' is a raw text (no chat template); "
                         "send it as a chat with --chat-field, or drop --system-prompt")
        return _text(value, name)

    def _body_inputs(self, body: dict) -> tuple[list, bool]:
        task = self.task
        unknown = [key for key in body if key not in _BODY_FIELDS[task] | _NEUTRAL]
        if unknown:
            raise Reject(f"body.{unknown[0]} is not read by conveyor's {task} endpoint; remove it (it takes "
                         f"{', '.join(sorted(_BODY_FIELDS[task] | {'model', 'user'}))})")
        if task.pairs:
            names = ("text_1", "text_2") if "text_1" in body or "text_2" in body else \
                ("query", "documents") if task is Task.RERANK else ("queries", "documents")
            if body.get(names[0]) is None or body.get(names[1]) is None:
                raise Reject(f"body.{names[0]} and body.{names[1]} are both needed")
            return self._pairs(body, names[0], names[1], "body.")
        if self.options.system_prompt:
            raise Reject("--system-prompt applies to chat messages, but body.input is raw text (no chat template); "
                         "drop --system-prompt for these lines")
        value = body.get("input")
        if value is None:
            raise Reject("body.input is missing; give a text, a list of texts, or token ids")
        if isinstance(value, str):
            return [_text(value, "body.input")], False
        if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [list(value)], False
        if isinstance(value, list) and value:
            inputs = []
            for i, item in enumerate(value):
                if isinstance(item, str):
                    inputs.append(_text(item, f"body.input[{i}]"))
                elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in item):
                    inputs.append(list(item))
                else:
                    raise Reject(f"body.input[{i}] must be a text or a list of token ids, got {describe(item)}")
            return inputs, True
        raise Reject(f"body.input must be a text, a list of texts, or token ids, got {describe(value)}")

    def _pairs(self, fields: dict, first: str, second: str, prefix: str) -> tuple[list, bool]:
        """(text, text) pairs: one text and one or more others, or two lists of one length, zipped."""
        left, right = fields[first], fields[second]
        lefts = _texts(left, prefix + first)
        rights = _texts(right, prefix + second)
        if len(lefts) != 1 and len(lefts) != len(rights):
            raise Reject(f"{prefix}{first} has {len(lefts)} texts and {prefix}{second} {len(rights)}; give one "
                         f"{first} or as many as {second} (paired in order)")
        pairs = [(lefts[0] if len(lefts) == 1 else lefts[i], r) for i, r in enumerate(rights)]
        return pairs, isinstance(right, list) or isinstance(left, list)

    # -- the request -------------------------------------------------------------------------------------------------

    def _built(self, raw: RawRecord, head: RecordHead, inputs: list, multiple: bool, fields: dict, prefix: str,
               batch_line: bool = False) -> BuiltPooling:
        keep = self._truncation(fields, prefix)
        dimensions, normalize, encoding = self._vector_options(fields, prefix)
        cuts: list[int] = []
        pairs = None
        if self.task.pairs and not self.cross_encoder:  # two embeddings per pair
            texts = list(dict.fromkeys(t for pair in inputs for t in pair))
            sequences = [self._sequence(t, None, keep, cuts, prefix) for t in texts]
            pairs = tuple((texts.index(a), texts.index(b)) for a, b in inputs)
        elif self.task.pairs:
            sequences = [self._sequence(a, b, keep, cuts, prefix) for a, b in inputs]
        else:
            sequences = [self._sequence(t, None, keep, cuts, prefix) for t in inputs]
        request = PoolingRequest(str(raw.index), tuple(sequences), dimensions, normalize, pairs)
        top_n = None
        if self.task is Task.RERANK and fields.get("top_n") is not None:
            top_n = request_options.as_int(prefix + "top_n", fields["top_n"])
            if top_n < 0:
                raise Reject(f"{prefix}top_n must be 0 (every document) or more, got {top_n}")
        documents = tuple(b for _, b in inputs) if self.task is Task.RERANK and batch_line else ()
        return BuiltPooling(raw.index, head.id, self.task, request, head.kept, head.id_given, raw.digest,
                            sum(cuts) if keep is not None else None, encoding, batch_line, multiple, documents,
                            top_n or None)

    def _truncation(self, fields: dict, prefix: str) -> int | None:
        value, name = fields.get("truncate_prompt_tokens"), prefix + "truncate_prompt_tokens"
        if value is None:
            value, name = self.options.truncate_prompt_tokens, "--truncate-prompt-tokens"
        if value is None:
            return None
        if value == "auto" or value == -1:  # vLLM's -1: the model's context
            return self.limits.max_model_len
        keep = request_options.as_int(name, value)
        if keep < 1:
            raise Reject(f"{name} must be at least 1 (the tokens to keep), got {keep}")
        return min(keep, self.limits.max_model_len)

    def _vector_options(self, fields: dict, prefix: str) -> tuple[int | None, bool, str]:
        dimensions, normalize, encoding = self.pooling.dimensions, self.pooling.normalize, "float"
        if self.task is not Task.EMBED:
            for name in ("dimensions", "normalize", "encoding_format"):
                if fields.get(name) is not None:
                    raise Reject(f"{prefix}{name} applies to embeddings, not to --task {self.task}; remove it")
            return None, normalize, encoding
        if fields.get("dimensions") is not None:
            dimensions = request_options.as_int(prefix + "dimensions", fields["dimensions"])
            if dimensions < 1:
                raise Reject(f"{prefix}dimensions must be at least 1, got {dimensions}")
        if dimensions is not None and self.vector_size is not None and dimensions > self.vector_size:
            where = f"{prefix}dimensions" if fields.get("dimensions") is not None else "--dimensions"
            raise Reject(f"{where} {dimensions} is more than the model's {self.vector_size}; give at most "
                         f"{self.vector_size}")
        if fields.get("normalize") is not None:
            normalize = request_options.as_bool(prefix + "normalize", fields["normalize"])
        value = fields.get("encoding_format")
        if value is not None:
            if value not in ENCODING_FORMATS:
                raise Reject(f"{prefix}encoding_format must be float or base64, got {value!r}")
            encoding = value
        return dimensions, normalize, encoding

    def _sequence(self, text, pair: str | None, keep: int | None, cuts: list[int], prefix: str) -> TokenSequence:
        """The token ids (and types) of a text, a pair, or ids given; cut to `keep` tokens by the tokenizer's
        truncation where asked (its special tokens kept), else refused where too long."""
        limit = self.limits.max_model_len
        if isinstance(text, list):  # token ids as given
            ids, types = list(text), None
            if keep is not None and len(ids) > keep:
                cuts.append(len(ids) - keep)
                ids = ids[-keep:]
        else:
            text = self.prompt + text  # (joined as sentence-transformers joins them: its tokens count in the limit)
            whole = self.tokenizer(text, pair, add_special_tokens=True)
            ids = list(whole["input_ids"])
            types = whole.get("token_type_ids")
            if keep is not None and len(ids) > keep:
                cut = self.tokenizer(text, pair, add_special_tokens=True, truncation=True, max_length=keep)
                cuts.append(len(ids) - len(cut["input_ids"]))
                ids, types = list(cut["input_ids"]), cut.get("token_type_ids")
        if not ids:
            raise Reject("an input has no tokens; give a non-empty text")
        if len(ids) > limit:
            prompted = " (with the default prompt the model's sentence-transformers config prepends)" \
                if self.prompt and not isinstance(text, list) else ""
            raise _TooLong(f"an input is {len(ids)} tokens{prompted} but the model takes at most {limit}; shorten "
                           "it, or let conveyor cut it with --truncate-prompt-tokens auto", len(ids))
        if any(not 0 <= t < self.limits.vocab_size for t in ids):
            raise Reject(f"{prefix}input: a token id is outside the model's vocabulary [0, {self.limits.vocab_size})")
        return TokenSequence(tuple(ids), tuple(types) if types is not None and any(types) else None)


class _TooLong(Reject):
    def __init__(self, message: str, tokens: int) -> None:
        super().__init__(message)
        self.tokens = tokens


def _first_present(fields: dict, names: tuple[str, ...]) -> str | None:
    return next((name for name in names if fields.get(name) is not None), None)


def _fields(record: dict) -> str:
    return ", ".join(repr(key) for key in list(record)[:12]) or "none"


def _text(value: Any, name: str) -> str:
    """A raw text input, checked."""
    if not isinstance(value, str):
        raise Reject(f"field '{name}' must be a string, got {describe(value)}")
    if not value.strip():
        raise Reject(f"field '{name}' is empty; give a text or remove the record")
    return value


def _texts(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return [_text(value, name)]
    if isinstance(value, list) and value:
        return [_text(v if isinstance(v, str) else v.get("text") if isinstance(v, dict) else v, f"{name}[{i}]")
                for i, v in enumerate(value)]
    raise Reject(f"field '{name}' must be a text or a non-empty list of texts, got {describe(value)}")
