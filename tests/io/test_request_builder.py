"""RequestBuilder: record shapes, ids, seeds, per-record overrides, OpenAI lines and every error row."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.core import GenerationRequest, ModelLimits, SamplingParams
from conveyor.io.records.build_options import BuildOptions
from conveyor.io.records.readers import open_reader
from conveyor.io.records.readers.record import RawRecord
from conveyor.io.records.record_head import ErrorRow
from conveyor.io.records.request_builder import BuiltRequest, RequestBuilder
from conveyor.io.records.seeds import derive_seed

SAMPLE_DATA = Path(__file__).resolve().parents[2] / "sample_data"
DEFAULTS = SamplingParams(temperature=0.0, max_tokens=16)


def make_builder(tokenizer, max_model_len=8192, **options):
    return RequestBuilder(tokenizer, BuildOptions(**options), DEFAULTS, ModelLimits(max_model_len, len(tokenizer)))


def build(tokenizer, record, index=4, line=5, **options):
    return make_builder(tokenizer, **options).build(RawRecord(index, line, record, None))


def chat_ids(tokenizer, messages):
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def error_of(result) -> str:
    assert isinstance(result, ErrorRow), result
    return result.error


# -- shapes --------------------------------------------------------------------------------------

def test_raw_prompt(tokenizer):
    built = build(tokenizer, {"id": "p1", "prompt": "The three primary colors are"})
    assert isinstance(built, BuiltRequest)
    assert (built.index, built.id, built.kind) == (4, "p1", "completion")
    assert built.prompt_token_ids == tokenizer("The three primary colors are", add_special_tokens=True)["input_ids"]
    assert built.sampling == SamplingParams(temperature=0.0, max_tokens=16, seed=derive_seed(0, "p1"))


def test_chat_and_system_prompt(tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    built = build(tokenizer, {"messages": messages})
    assert built.kind == "chat" and built.prompt_token_ids == chat_ids(tokenizer, messages)
    assert all(isinstance(t, int) for t in built.prompt_token_ids)

    with_system = build(tokenizer, {"messages": messages}, system_prompt="Be brief.")
    expected = chat_ids(tokenizer, [{"role": "system", "content": "Be brief."}, *messages])
    assert with_system.prompt_token_ids == expected != built.prompt_token_ids

    own = [{"role": "system", "content": "Talk like a pirate."}, *messages]
    kept_own = build(tokenizer, {"messages": own}, system_prompt="Be brief.")
    assert kept_own.prompt_token_ids == chat_ids(tokenizer, own)


def test_chat_content_as_openai_text_parts(tokenizer):
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    built = build(tokenizer, {"messages": parts})
    assert built.prompt_token_ids == chat_ids(tokenizer, [{"role": "system", "content": "Be brief."},
                                                          {"role": "user", "content": "Hi\nthere"}])
    assert parts[1]["content"][0] == {"type": "text", "text": "Hi"}  # the record itself is left as it was


def test_custom_field_names_and_keep_fields(tokenizer):
    record = {"key": 7, "text": "Hello", "category": "demo", "meta": {"a": 1}}
    built = build(tokenizer, record, prompt_field="text", id_field="key", keep_fields=("category", "meta", "gone"))
    assert built.id == "7" and built.kind == "completion"
    assert built.kept == {"category": "demo", "meta": {"a": 1}, "gone": None}
    convo = build(tokenizer, {"conv": [{"role": "user", "content": "x"}]}, messages_field="conv")
    assert convo.kind == "chat"


def test_to_generation_request(tokenizer):
    built = build(tokenizer, {"id": "x", "prompt": "Hello"}, index=12)
    request = built.to_generation_request()
    assert isinstance(request, GenerationRequest)
    assert (request.req_id, request.prompt_token_ids, request.sampling) == ("12", built.prompt_token_ids,
                                                                           built.sampling)


# -- ids and seeds -------------------------------------------------------------------------------

def test_ids(tokenizer):
    assert build(tokenizer, {"id": "abc", "custom_id": "c", "prompt": "x"}).id == "abc"
    assert build(tokenizer, {"id": 17, "prompt": "x"}).id == "17"
    assert build(tokenizer, {"custom_id": "c", "prompt": "x"}).id == "c"
    assert build(tokenizer, {"prompt": "x"}, index=9).id == "9"
    for bad in ([1], True, 1.5, ""):
        result = build(tokenizer, {"id": bad, "prompt": "x"}, index=3, line=4)
        assert result.id == "3" and result.seed is None
        assert error_of(result).startswith("line 4: field 'id' must be a non-empty string or an integer")


def test_derive_seed_is_stable_across_processes():
    assert derive_seed(0, "a") == 3426483283761622585
    assert derive_seed(42, "chat-0001") == 150569747573118572
    code = "from conveyor.io.records.seeds import derive_seed; print(derive_seed(42, 'chat-0001'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"})
    assert int(out.stdout) == derive_seed(42, "chat-0001")
    seeds = {derive_seed(s, i) for s in range(5) for i in ("a", "b", "c", "1", "01")}
    assert len(seeds) == 25 and all(0 <= s < 2**63 for s in seeds)


def test_effective_seed(tokenizer):
    assert build(tokenizer, {"id": "a", "prompt": "x"}, seed=42).sampling.seed == derive_seed(42, "a")
    assert build(tokenizer, {"id": "a", "prompt": "x", "seed": 5}, seed=42).sampling.seed == 5
    assert build(tokenizer, {"id": "a", "prompt": "x", "seed": 5.0}).sampling.seed == 5
    error = build(tokenizer, {"id": "a", "prompt": "x", "seed": 2**64})
    assert error.seed is None and "seed must fit in 64 bits" in error.error
    # An error after the seed is known still reports it.
    assert build(tokenizer, {"id": "a", "text": "x"}, seed=1).seed == derive_seed(1, "a")


# -- per-record sampling overrides ---------------------------------------------------------------

def test_overrides(tokenizer):
    record = {"prompt": "x", "max_tokens": 8, "temperature": 1, "top_p": 0.9, "top_k": 40.0, "min_p": 0.05,
              "min_tokens": 2, "stop": "END", "stop_token_ids": [7, 8], "ignore_eos": True}
    sampling = build(tokenizer, record).sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p,
            sampling.min_tokens, sampling.stop, sampling.stop_token_ids, sampling.ignore_eos) == (
        8, 1.0, 0.9, 40, 0.05, 2, ("END",), (7, 8), True)
    assert build(tokenizer, {"prompt": "x", "max_completion_tokens": 5}).sampling.max_tokens == 5
    assert build(tokenizer, {"prompt": "x", "max_new_tokens": 6}).sampling.max_tokens == 6
    assert build(tokenizer, {"prompt": "x", "stop": ["a", "b"]}).sampling.stop == ("a", "b")
    assert build(tokenizer, {"prompt": "x", "temperature": None}).sampling.temperature == 0.0  # null: default


@pytest.mark.parametrize("override, message", [
    ({"temperature": "hot"}, "line 5: temperature must be a number, got a string ('hot')"),
    ({"temperature": True}, "line 5: temperature must be a number, got a boolean"),
    ({"top_p": math.nan}, "line 5: top_p must be a finite number"),
    ({"max_tokens": 2.5}, "line 5: max_tokens must be an integer, got a number (2.5)"),
    ({"max_tokens": "10"}, "line 5: max_tokens must be an integer, got a string"),
    ({"stop": [1]}, "line 5: stop must be a string or a list of strings"),
    ({"stop_token_ids": "1"}, "line 5: stop_token_ids must be a list of integers"),
    ({"ignore_eos": "yes"}, "line 5: ignore_eos must be true or false"),
    ({"temperature": -1}, "line 5: temperature must be >= 0"),
    ({"top_p": 0}, "line 5: top_p must be in (0, 1]"),
    ({"max_tokens": 0}, "line 5: max_tokens must be >= 1"),
    ({"min_tokens": 20}, "line 5: min_tokens (20) must be <= max_tokens (16)"),
    ({"max_tokens": 5, "max_new_tokens": 6}, "line 5: set only one of max_tokens, max_new_tokens"),
])
def test_bad_override_is_an_error_row(tokenizer, override, message):
    result = build(tokenizer, {"id": "r", "prompt": "x", "category": "c", **override}, keep_fields=("category",))
    assert error_of(result).startswith(message)
    assert result.id == "r" and result.index == 4 and result.kept == {"category": "c"}
    assert result.seed == derive_seed(0, "r")


# -- OpenAI batch lines --------------------------------------------------------------------------

def test_openai_chat_line(tokenizer):
    messages = [{"role": "user", "content": "Hello"}]
    line = {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": messages, "max_completion_tokens": 9, "temperature": 0.5,
                     "top_p": 0.8, "seed": 3, "stop": "\n"}}
    built = build(tokenizer, line)
    assert (built.id, built.kind) == ("request-1", "chat")
    assert built.prompt_token_ids == chat_ids(tokenizer, messages)
    s = built.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (9, 0.5, 0.8, 3, ("\n",))


def test_openai_completion_line_and_errors(tokenizer):
    line = {"custom_id": "c1", "url": "/v1/completions", "body": {"prompt": "Once upon a time", "max_tokens": 4}}
    built = build(tokenizer, line, prompt_field="text")  # OpenAI bodies always use 'prompt'
    assert (built.kind, built.sampling.max_tokens) == ("completion", 4)
    assert error_of(build(tokenizer, {"custom_id": "c", "url": "/v1/embeddings", "body": {"input": "x"}})
                    ).startswith("line 5: url /v1/embeddings asks for --task embed, but this run does generation")
    assert error_of(build(tokenizer, {"custom_id": "c", "url": "/v1/images", "body": {"prompt": "x"}})
                    ).startswith("line 5: url '/v1/images' is not supported")
    url = "/v1/completions"
    assert "field 'body' must be an object" in error_of(build(tokenizer, {"custom_id": "c", "body": "x"}))
    assert build(tokenizer, {"custom_id": "c", "url": url, "body": {"prompt": "x", "n": 2}}).n == 2
    assert "body.n must be from 1 to 128" in error_of(
        build(tokenizer, {"custom_id": "c", "url": url, "body": {"prompt": "x", "n": 129}}))
    assert error_of(build(tokenizer, {"custom_id": "c", "url": url, "body": {"prompt": "x", "temperature": "warm"}})
                    ).startswith("line 5: body.temperature must be a number")
    missing = error_of(build(tokenizer, {"custom_id": "c", "url": url, "body": {"model": "m"}}))
    assert "'body.prompt'" in missing and "'body.messages'" in missing


@pytest.mark.parametrize("line, says", [
    ({"custom_id": "c", "body": {"prompt": "x"}}, "the line has no 'url'"),
    ({"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}, "method 'GET'"),
    ({"custom_id": "c", "url": "/v1/chat/completions", "body": {"prompt": "x"}},
     "url /v1/chat/completions takes body.messages, not body.prompt"),
    ({"custom_id": "c", "url": "/v1/completions", "body": {"messages": [{"role": "user", "content": "x"}]}},
     "url /v1/completions takes body.prompt, not body.messages"),
    ({"custom_id": "", "url": "/v1/completions", "body": {"prompt": "x"}}, "field 'custom_id' must be a non-empty"),
])
def test_a_malformed_batch_line_is_an_error_line_keeping_its_custom_id(tokenizer, line, says):
    result = build(tokenizer, line, index=13)
    assert says in error_of(result) and result.id == line["custom_id"]


def test_a_plain_records_n_asks_for_that_many_samples(tokenizer):
    assert build(tokenizer, {"prompt": "x", "n": 3}).n == 3
    assert build(tokenizer, {"prompt": "x", "n": 1}).n == 1
    assert "n must be from 1 to 128" in error_of(build(tokenizer, {"prompt": "x", "n": 0}))


@pytest.mark.parametrize("override, field", [
    ({"stop_token_ids": [2, 999999]}, "stop_token_ids: 999999"),
    ({"logit_bias": {"49152": 1.0}}, "logit_bias: 49152"),
])
def test_every_token_id_a_record_gives_is_checked_against_the_vocabulary(tokenizer, override, field):
    result = build(tokenizer, {"prompt": "Say hi:", "min_tokens": 1, **override})
    assert error_of(result).startswith(f"line 5: {field} is not a token id of this model (its ids are 0 to 49151)")
    body = {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "x", **override}}
    assert f"body.{field} is not a token id" in error_of(build(tokenizer, body))


def test_openai_fields_at_their_defaults_are_accepted_and_others_named(tokenizer):
    defaults = {"echo": False, "stream_options": None, "tools": [], "tool_choice": "none", "parallel_tool_calls":
                True, "service_tier": "auto", "skip_special_tokens": True, "include_stop_str_in_output": False,
                "best_of": 1, "use_beam_search": False, "modalities": ["text"], "priority": 0}
    line = {"custom_id": "c", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **defaults}}
    built = build(tokenizer, line)
    assert isinstance(built, BuiltRequest) and built.sampling.max_tokens == 3
    for name, value, says in [("echo", True, "(got true; it can only be false)"),
                              ("best_of", 2, "(got 2; it can only be 1)"),
                              ("skip_special_tokens", False, "it can only be true"),
                              ("reasoning_effort", "low", "conveyor; remove it"),
                              ("priority", "0", '(got "0"; it can only be 0)'),
                              ("tools", [{"type": "function"}], 'got [{"type": "function"}]')]:
        error = error_of(build(tokenizer, {**line, "body": {**line["body"], name: value}}))
        assert error.startswith(f"line 5: body.{name} is not supported by conveyor") and says in error, error
    # in a plain record only the vLLM names are request fields: any other name may be a data column
    assert isinstance(build(tokenizer, {"prompt": "x", "echo": True, "priority": "high"}), BuiltRequest)
    assert isinstance(build(tokenizer, {"prompt": "x", "best_of": 1}), BuiltRequest)
    assert "best_of is not supported by conveyor except at its default (got 3" in error_of(
        build(tokenizer, {"prompt": "x", "best_of": 3}))


def test_sample_data_builds_without_errors(tokenizer):
    builder = make_builder(tokenizer, max_model_len=8192)
    kinds = {}
    for name in ("chat.jsonl", "prompts.jsonl", "openai_batch.jsonl"):
        results = [builder.build(raw) for raw in open_reader(str(SAMPLE_DATA / name))]
        assert results and all(isinstance(r, BuiltRequest) for r in results), name
        assert len({r.id for r in results}) == len(results)
        kinds[name] = {r.kind for r in results}
    assert kinds == {"chat.jsonl": {"chat"}, "prompts.jsonl": {"completion"}, "openai_batch.jsonl": {"chat"}}


# -- error rows ----------------------------------------------------------------------------------

def test_unparsed_record_passes_its_error_through(tokenizer):
    raw = RawRecord(6, 7, None, "line 7: invalid JSON (Expecting ',' delimiter at column 12)")
    result = make_builder(tokenizer, keep_fields=("a", "b")).build(raw)
    assert result == ErrorRow(6, "6", "line 7: invalid JSON (Expecting ',' delimiter at column 12)",
                              {"a": None, "b": None}, None)


@pytest.mark.parametrize("record, message", [
    ({"text": "x", "label": 1}, "line 5: no prompt: expected a 'prompt' string or a 'messages' list of chat "
                                "messages, but the fields are 'text', 'label'"),
    ({"prompt": None, "label": 1}, "line 5: field 'prompt' has no value; give the record a prompt or remove it"),
    ({"messages": None}, "line 5: field 'messages' has no value"),
    ({"prompt": ""}, "line 5: field 'prompt' is empty"),
    ({"prompt": " \n\t"}, "line 5: field 'prompt' is empty"),
    ({"prompt": 12}, "line 5: field 'prompt' must be a string, got a number"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "line 5: the record has both 'prompt' and"),
    ({"messages": "hi"}, "line 5: field 'messages' must be a list of chat messages, got a string"),
    ({"messages": []}, "line 5: field 'messages' is an empty list"),
    ({"messages": [{"role": "user", "content": "a"}, "b"]}, "line 5: messages[1] must be an object"),
    ({"messages": [{"role": "robot", "content": "a"}]}, "line 5: messages[0].role 'robot' is not one of"),
    ({"messages": [{"content": "a"}]}, "line 5: messages[0].role must be a string, got null"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user"}]},
     "line 5: messages[1].content must be a string or a list of text parts, got null"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]},
     "line 5: messages[0].content[0] is a part of type 'image_url'; only text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]},
     "line 5: messages[0].content[1] is a string; only text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "line 5: messages[0].content[0].text must be a string, got null"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": " "}]}]},
     "line 5: every message in 'messages' has empty content"),
    ({"messages": [{"role": "user", "content": " "}]}, "line 5: every message in 'messages' has empty content"),
])
def test_bad_record_is_an_error_row(tokenizer, record, message):
    result = build(tokenizer, record)
    assert error_of(result).startswith(message)
    assert result.id == "4"


def test_location_is_the_record_index_without_a_line(tokenizer):
    assert error_of(build(tokenizer, {"prompt": ""}, index=12, line=None)).startswith("record 12: field 'prompt'")


def test_prompt_too_long_for_the_context(tokenizer):
    prompt = "word " * 40
    num_tokens = len(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    result = build(tokenizer, {"prompt": prompt}, max_model_len=num_tokens)
    assert error_of(result) == (f"line 5: prompt is {num_tokens} tokens but the model's context is {num_tokens}; "
                                f"shorten it to at most {num_tokens - 1} tokens, or let conveyor cut the prompt's "
                                "start with --truncate-prompt-tokens auto")
    assert result.prompt_tokens == num_tokens
    result = build(tokenizer, {"prompt": prompt, "max_tokens": 10}, max_model_len=num_tokens + 4)
    assert error_of(result).endswith("lower max_tokens to at most 4, or let conveyor cut the prompt's start with "
                                     "--truncate-prompt-tokens auto")
    assert isinstance(build(tokenizer, {"prompt": prompt, "max_tokens": 4}, max_model_len=num_tokens + 4),
                      BuiltRequest)


def test_a_built_requests_error_row_carries_its_record(tokenizer):
    built = build(tokenizer, {"id": "p1", "prompt": "Hello", "topic": "t"}, keep_fields=("topic",))
    assert built.error_row("line 5: it broke") == ErrorRow(4, "p1", "line 5: it broke", {"topic": "t"},
                                                           built.sampling.seed, id_given=True)
    assert built.error_row("line 5: it broke", prompt_tokens=3).prompt_tokens == 3
