"""Record -> engine request: RequestBuilder turns a RawRecord into a BuiltRequest, or into an ErrorRow where the
record cannot be used (never an exception). It reads the record's id, checks a batch line (batch_lines.py), applies
the fields a record may set (request_options.py), builds and tokenizes the prompt (prompts.py), seeds it (seeds.py)
and checks that it fits the model's context. Imports only conveyor.core's public names; the tokenizer is passed
in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from conveyor.core import GenerationRequest, ModelLimits, SamplingParams
from conveyor.io.records import request_options
from conveyor.io.records.batch_lines import batch_body, is_batch_line, served_names
from conveyor.io.records.build_options import BuildOptions
from conveyor.io.records.prompts import PromptTokens
from conveyor.io.records.readers.record import RawRecord
from conveyor.io.records.record_head import ErrorRow, RecordHead, unreadable
from conveyor.io.records.reject import Reject
from conveyor.io.records.seeds import sample_seed

__all__ = ["BuiltRequest", "RequestBuilder"]


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

    def error_row(self, message: str, prompt_tokens: int | None = None) -> ErrorRow:
        """The error row of this request, which could not run or did not finish: `message` starts with the
        record's location ("line 12: ..."); `prompt_tokens` where it was known."""
        return ErrorRow(index=self.index, id=self.id, error=message, kept=self.kept, seed=self.sampling.seed,
                        prompt_tokens=prompt_tokens, digest=self.digest, id_given=self.id_given)


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
        self.prompts = PromptTokens(tokenizer, options)
        self.served_model_names = options.served_model_names or served_names(model)
        # The fields a request is built from are data: never read as sampling options of the same name.
        template = self.prompts.template
        self._refused_names = request_options.refused_names(
            {options.prompt_field, options.messages_field, options.id_field, options.chat_field,
             *(template.fields if template else ())})

    def build(self, raw: RawRecord) -> BuiltRequest | ErrorRow:
        if raw.record is None:
            return unreadable(raw, self.options.keep_fields)
        record, head = raw.record, RecordHead.of(raw, self.options.keep_fields)
        seed = num_tokens = cut = None
        try:
            given_id = head.take_id(record, self.options.id_field)
            fields, prefix = self._request_fields(record)
            seed = request_options.record_seed(fields, prefix, self.options.seed, given_id, raw.index)
            n = request_options.samples(fields, prefix, self.options.n)
            priority = request_options.priority(fields, prefix) if self.priorities else 0
            sampling = request_options.record_sampling(fields, prefix, self.sampling, seed, self.tokenizer,
                                                       self.limits.vocab_size)
            keep = request_options.truncation(fields, prefix, self.options.truncate_prompt_tokens,
                                              sampling.max_tokens, self.limits.max_model_len)
            kind, token_ids = self.prompts.tokens(fields, prefix)
            if keep is not None:  # vLLM's truncate_prompt_tokens: the last `keep` tokens stay
                cut = max(0, len(token_ids) - keep)
                token_ids = token_ids[cut:]
            num_tokens = len(token_ids)
            self._check_length(num_tokens, sampling.max_tokens, truncated=keep is not None)
        except Reject as e:
            return head.error(str(e), seed, num_tokens, cut)
        return BuiltRequest(raw.index, head.id, kind, token_ids, sampling, head.kept, head.id_given, raw.digest, cut,
                            n=n, priority=priority)

    def _request_fields(self, record: dict) -> tuple[dict, str]:
        """The object holding the prompt and overrides, and the prefix that names its fields in messages: the
        record (""), or an OpenAI batch line's body ("body.")."""
        if not is_batch_line(record):
            request_options.check_plain_record(record, self._refused_names)
            return record, ""
        return batch_body(record, self.served_model_names, self.priorities), "body."

    def _check_length(self, num_tokens: int, max_tokens: int, truncated: bool = False) -> None:
        max_len = self.limits.max_model_len
        if num_tokens == 0:
            raise Reject("the prompt has no tokens; give a non-empty prompt")
        fix = ("keep fewer tokens with truncate_prompt_tokens (--truncate-prompt-tokens auto fits the context)"
               if truncated
               else "let conveyor cut the prompt's start with --truncate-prompt-tokens auto")
        if num_tokens > max_len - 1:
            raise Reject(f"prompt is {num_tokens} tokens but the model's context is {max_len}; "
                         f"shorten it to at most {max_len - 1} tokens, or {fix}")
        if num_tokens + max_tokens > max_len:
            raise Reject(f"prompt ({num_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                         f"of {max_len}; lower max_tokens to at most {max_len - num_tokens}, or {fix}")
