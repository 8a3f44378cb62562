"""RequestBuilder: --chat-field, --prompt-template, --system-prompt with raw prompts, JSON-text messages, prompt
truncation, served model names, batch lines without custom_id, and the sampling names a plain record may not hide."""

from __future__ import annotations

import json

import pytest

from conveyor.core import ModelLimits, SamplingParams
from conveyor.io.records.batch_lines import served_names
from conveyor.io.records.build_options import BuildOptions
from conveyor.io.records.prompt_template import PromptTemplate
from conveyor.io.records.readers.record import RawRecord
from conveyor.io.records.record_head import ErrorRow
from conveyor.io.records.request_builder import BuiltRequest, RequestBuilder

DEFAULTS = SamplingParams(temperature=0.0, max_tokens=16)
CHAT_URL = "/v1/chat/completions"


def build(tokenizer, record, max_model_len=8192, model=None, sampling=DEFAULTS, **options):
    builder = RequestBuilder(tokenizer, BuildOptions(**options), sampling, ModelLimits(max_model_len, len(tokenizer)),
                             model)
    return builder.build(RawRecord(0, 1, record, None))


def chat_ids(tokenizer, messages):
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def error_of(result) -> str:
    assert isinstance(result, ErrorRow), result
    return result.error


# -- --chat-field and --system-prompt ------------------------------------------------------------------

def test_a_chat_field_is_the_user_message_through_the_chat_template(tokenizer):
    built = build(tokenizer, {"question": "What is 2+2?", "topic": "maths"}, chat_field="question")
    assert built.kind == "chat"
    assert built.prompt_token_ids == chat_ids(tokenizer, [{"role": "user", "content": "What is 2+2?"}])
    with_system = build(tokenizer, {"question": "What is 2+2?"}, chat_field="question", system_prompt="Be brief.")
    assert with_system.prompt_token_ids == chat_ids(tokenizer, [{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "What is 2+2?"}])
    number = build(tokenizer, {"question": 42}, chat_field="question")
    assert number.prompt_token_ids == chat_ids(tokenizer, [{"role": "user", "content": "42"}])


def test_a_chat_field_beside_another_prompt_source_is_an_error_naming_both(tokenizer):
    both = error_of(build(tokenizer, {"question": "Hi", "prompt": "raw"}, chat_field="question"))
    assert "'question' (--chat-field)" in both and "'prompt'" in both and "--prompt-field" in both
    both = error_of(build(tokenizer, {"question": "Hi", "messages": []}, chat_field="question"))
    assert "'messages'" in both and "--messages-field" in both
    # The chat field may be the prompt field itself; a record without it falls back to its own prompt or chat.
    assert build(tokenizer, {"prompt": "Hi"}, chat_field="prompt").kind == "chat"
    assert build(tokenizer, {"messages": [{"role": "user", "content": "Hi"}]}, chat_field="question").kind == "chat"
    none = error_of(build(tokenizer, {"other": "x"}, chat_field="question"))
    assert "'question' text (--chat-field)" in none
    for bad, says in (({"question": ""}, "empty"), ({"question": None, "x": 1}, "field 'question' has no value; give the record a prompt"),
                      ({"question": ["a"]}, "must be text or a number")):
        assert says in error_of(build(tokenizer, bad, chat_field="question"))


def test_a_system_prompt_is_never_dropped_from_a_raw_prompt(tokenizer):
    raw = error_of(build(tokenizer, {"prompt": "The sky is"}, system_prompt="Be brief."))
    assert "--system-prompt" in raw and "--chat-field prompt" in raw
    chat = build(tokenizer, {"messages": [{"role": "user", "content": "Hi"}]}, system_prompt="Be brief.")
    assert isinstance(chat, BuiltRequest)  # a mixed input: its chat records get it
    body = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "The sky is"}}
    assert "body.messages" in error_of(build(tokenizer, body, system_prompt="Be brief."))


def test_a_messages_column_of_json_text_is_parsed(tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    built = build(tokenizer, {"messages": json.dumps(messages)})
    assert built.kind == "chat" and built.prompt_token_ids == chat_ids(tokenizer, messages)
    bad = error_of(build(tokenizer, {"messages": "[{\"role\": "}))
    assert "field 'messages' is text but not JSON" in bad
    assert "must be a list" in error_of(build(tokenizer, {"messages": "\"Hi\""}))
    twice = error_of(build(tokenizer, {"messages": '[{"role": "user", "content": "a", "content": "b"}]'}))
    assert "field 'messages' is text but not JSON" in twice and 'the key "content" appears twice' in twice


# -- --prompt-template ---------------------------------------------------------------------------------

def test_a_template_builds_a_raw_prompt_or_the_user_message(tokenizer):
    template = "Question ({topic}): {question}\nAnswer in {n} words. {{literal}}"
    record = {"question": "Why is the sky blue?", "topic": "science", "n": 5}
    text = "Question (science): Why is the sky blue?\nAnswer in 5 words. {literal}"
    raw = build(tokenizer, record, prompt_template=template)
    assert raw.kind == "completion" and raw.prompt_token_ids == tokenizer(text)["input_ids"]
    chat = build(tokenizer, record, prompt_template=template, prompt_template_as="chat", system_prompt="Be brief.")
    assert chat.kind == "chat" and chat.prompt_token_ids == chat_ids(
        tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}])
    # A field the template reads is data, even when it is named like the prompt field.
    assert build(tokenizer, {"prompt": "x"}, prompt_template="Say: {prompt}").kind == "completion"


def test_a_template_field_missing_or_null_is_an_error_row_naming_it(tokenizer):
    missing = error_of(build(tokenizer, {"question": "Hi"}, prompt_template="{question} {topic}"))
    assert "--prompt-template" in missing and "field 'topic' is missing" in missing
    null = error_of(build(tokenizer, {"question": "Hi", "topic": None}, prompt_template="{question} {topic}"))
    assert "field 'topic' is null" in null
    other = error_of(build(tokenizer, {"question": "Hi", "prompt": "x"}, prompt_template="{question}"))
    assert "--prompt-template" in other and "'prompt'" in other


@pytest.mark.parametrize("bad", ["{a.b}", "{a[0]}", "{a!r}", "{a:>9}", "{}", "only text", "lone {", "}"])
def test_a_template_takes_field_names_only(bad):
    with pytest.raises(ValueError):
        PromptTemplate(bad)


# -- truncation ----------------------------------------------------------------------------------------

def test_truncation_keeps_the_last_tokens_and_says_how_many_were_cut(tokenizer):
    prompt = " ".join(["word"] * 50)
    full = tokenizer(prompt)["input_ids"]
    assert len(full) > 20
    plain = build(tokenizer, {"prompt": prompt})
    assert plain.prompt_tokens_truncated is None and plain.prompt_token_ids == full
    cut = build(tokenizer, {"prompt": prompt, "truncate_prompt_tokens": 20})
    assert cut.prompt_token_ids == full[-20:] and cut.prompt_tokens_truncated == len(full) - 20
    short = build(tokenizer, {"prompt": "Hi", "truncate_prompt_tokens": 20})
    assert short.prompt_tokens_truncated == 0
    run_wide = build(tokenizer, {"prompt": prompt}, truncate_prompt_tokens=10)
    assert run_wide.prompt_token_ids == full[-10:]
    own = build(tokenizer, {"prompt": prompt, "truncate_prompt_tokens": 30}, truncate_prompt_tokens=10)
    assert own.prompt_token_ids == full[-30:]  # the record's own value wins
    for bad in (0, -1, "all", 1.5):
        error = error_of(build(tokenizer, {"prompt": prompt, "truncate_prompt_tokens": bad}))
        assert "truncate_prompt_tokens" in error


def test_truncation_at_the_context_edge(tokenizer):
    prompt = " ".join(["word"] * 80)
    n = len(tokenizer(prompt)["input_ids"])
    context = 64
    over = error_of(build(tokenizer, {"prompt": prompt}, max_model_len=context))
    assert f"prompt is {n} tokens" in over and "--truncate-prompt-tokens auto" in over
    auto = build(tokenizer, {"prompt": prompt}, max_model_len=context, truncate_prompt_tokens="auto")
    assert len(auto.prompt_token_ids) == context - 16 and auto.prompt_tokens_truncated == n - (context - 16)
    own = build(tokenizer, {"prompt": prompt, "max_tokens": 40}, max_model_len=context, truncate_prompt_tokens="auto")
    assert len(own.prompt_token_ids) + 40 == context  # auto: what the record's own max_tokens leaves
    exact = build(tokenizer, {"prompt": prompt, "max_tokens": 1}, max_model_len=context, truncate_prompt_tokens="auto")
    assert len(exact.prompt_token_ids) == context - 1
    fits = build(tokenizer, {"prompt": prompt}, max_model_len=n + 16, truncate_prompt_tokens="auto")
    assert fits.prompt_tokens_truncated == 0 and len(fits.prompt_token_ids) == n
    no_room = error_of(build(tokenizer, {"prompt": prompt, "max_tokens": context}, max_model_len=context,
                             truncate_prompt_tokens="auto"))
    assert "--truncate-prompt-tokens auto" in no_room and "leaves no room" in no_room
    record_auto = build(tokenizer, {"prompt": prompt, "truncate_prompt_tokens": "auto"}, max_model_len=context)
    assert len(record_auto.prompt_token_ids) == context - 16
    too_many = build(tokenizer, {"prompt": prompt, "truncate_prompt_tokens": 60}, max_model_len=context)
    assert isinstance(too_many, ErrorRow) and too_many.prompt_tokens_truncated == n - 60
    assert "exceeds the model's context" in too_many.error and "truncate_prompt_tokens" in too_many.error


def test_truncation_of_a_chat_cuts_the_templated_prompt(tokenizer):
    messages = [{"role": "user", "content": " ".join(["word"] * 40)}]
    full = chat_ids(tokenizer, messages)
    body = {"custom_id": "c", "url": CHAT_URL, "body": {"messages": messages, "truncate_prompt_tokens": 12}}
    built = build(tokenizer, body)
    assert built.prompt_token_ids == full[-12:] and built.prompt_tokens_truncated == len(full) - 12


# -- batch-file fidelity -------------------------------------------------------------------------------

def test_a_body_model_must_be_a_served_name(tokenizer):
    line = {"custom_id": "c", "url": CHAT_URL, "body": {"model": "gpt-4o-mini",
                                                        "messages": [{"role": "user", "content": "Hi"}]}}
    refused = error_of(build(tokenizer, line, model="smollm2-135m-instruct"))
    assert '"gpt-4o-mini"' in refused and "--served-model-name gpt-4o-mini" in refused
    assert isinstance(build(tokenizer, line, model="smollm2-135m-instruct",
                            served_model_names=("gpt-4o-mini", "other")), BuiltRequest)
    for name in ("/models/SmolLM2-135M-Instruct/", "SmolLM2-135M-Instruct"):
        line["body"]["model"] = name
        assert isinstance(build(tokenizer, line, model="/models/SmolLM2-135M-Instruct/"), BuiltRequest)
    line["body"]["model"] = "smollm2-135m-instruct"  # the default names are replaced by the ones given
    assert "--served-model-name" in error_of(build(tokenizer, line, model="smollm2-135m-instruct",
                                                   served_model_names=("gpt-4o-mini",)))
    del line["body"]["model"]
    assert isinstance(build(tokenizer, line, model="smollm2-135m-instruct"), BuiltRequest)


def test_served_names_default_to_the_model_and_its_last_part():
    assert served_names("smollm2-135m-instruct") == ("smollm2-135m-instruct",)
    assert served_names("HuggingFaceTB/SmolLM2-135M") == ("HuggingFaceTB/SmolLM2-135M", "SmolLM2-135M")
    assert served_names("/m/model.gguf") == ("/m/model.gguf", "model.gguf", "model")
    assert served_names(None) == ()


def test_a_batch_line_without_custom_id_is_an_error_naming_it(tokenizer):
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    for line in ({"url": CHAT_URL, "body": chat}, {"method": "POST", "body": chat}, {"url": CHAT_URL}):
        result = build(tokenizer, line)
        assert "custom_id" in error_of(result) and result.id == "0"
    assert "no 'body'" in error_of(build(tokenizer, {"custom_id": "c", "url": CHAT_URL}))
    # A plain record's "url" or "body" that is not an OpenAI request is data.
    data = build(tokenizer, {"prompt": "Summarize:", "url": "https://example.com", "body": "An email."})
    assert isinstance(data, BuiltRequest)


# Every sampling option a plain record may name: vLLM's SamplingParams fields and OpenAI's chat body fields.
VLLM_SAMPLING_PARAMS = [
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "bad_words", "include_stop_str_in_output", "ignore_eos", "max_tokens",
    "min_tokens", "logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
    "logits_processors", "truncate_prompt_tokens", "output_kind", "guided_decoding", "structured_outputs",
    "logit_bias", "allowed_token_ids", "extra_args"]
OPENAI_CHAT_BODY = [
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_logprobs", "top_p", "user", "verbosity", "web_search_options"]
# Applied: a value that changes the request. (n, samples per record, has tests of its own.)
APPLIED = {
    "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "temperature": 0.7, "top_p": 0.5,
    "top_k": 5, "min_p": 0.1, "seed": 7, "stop": ["x"], "stop_token_ids": [5], "bad_words": ["sky"],
    "ignore_eos": True, "max_tokens": 3, "min_tokens": 2, "logprobs": 2, "prompt_logprobs": 1,
    "truncate_prompt_tokens": 1, "logit_bias": {"5": 1.0}, "max_completion_tokens": 3, "top_logprobs": 2,
    "response_format": {"type": "json_object"}}
# What the request is, not how it is generated: in a plain record, data like any other field ("messages" is the
# chat itself).
DATA = {"model", "metadata", "prompt_cache_key", "safety_identifier", "store", "user"}
# Not done by conveyor: an error row naming the field (unless at a value that asks for nothing different).
REFUSED = {
    "best_of": 2, "include_stop_str_in_output": True, "detokenize": False, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "logits_processors": ["f"], "output_kind": 1,
    "guided_decoding": {"regex": "a"}, "structured_outputs": {"regex": "a"}, "allowed_token_ids": [1],
    "extra_args": {"a": 1}, "audio": {"voice": "x"}, "function_call": "auto-x", "functions": [{"name": "f"}],
    "modalities": ["audio"], "parallel_tool_calls": "yes", "prediction": {"type": "content"},
    "reasoning_effort": "high", "service_tier": "flex", "stream": True, "stream_options": {"a": 1},
    "tool_choice": "required", "tools": [{"type": "function"}], "verbosity": "low",
    "web_search_options": {}}


def test_every_sampling_name_of_a_plain_record_is_applied_or_refused(tokenizer):
    names = set(VLLM_SAMPLING_PARAMS) | set(OPENAI_CHAT_BODY)
    assert names == set(APPLIED) | DATA | set(REFUSED) | {"n", "messages"}
    base = build(tokenizer, {"prompt": "The sky is blue", "seed": 0})
    for name, value in APPLIED.items():
        built = build(tokenizer, {"prompt": "The sky is blue", "seed": 0, name: value})
        assert isinstance(built, BuiltRequest), (name, built)
        assert (built.sampling, built.prompt_token_ids) != (base.sampling, base.prompt_token_ids), name
    for name in DATA:
        built = build(tokenizer, {"prompt": "The sky is blue", "seed": 0, name: "some data"})
        assert isinstance(built, BuiltRequest) and built.sampling == base.sampling, name
    for name, value in REFUSED.items():
        error = error_of(build(tokenizer, {"prompt": "The sky is blue", name: value}))
        assert f"{name} is not supported" in error, (name, error)
    # At a value that asks for nothing different, or null, such a field is accepted.
    for name, value in (("best_of", 1), ("skip_special_tokens", True), ("stream", False), ("tools", []),
                        ("detokenize", None)):
        assert isinstance(build(tokenizer, {"prompt": "The sky is blue", name: value}), BuiltRequest), name


def test_a_field_the_prompt_is_built_from_is_data_whatever_its_name(tokenizer):
    built = build(tokenizer, {"tools": "a hammer"}, chat_field="tools")
    assert isinstance(built, BuiltRequest)
    built = build(tokenizer, {"audio": "a podcast", "verbosity": "high"}, prompt_template="{audio} ({verbosity})")
    assert isinstance(built, BuiltRequest)
