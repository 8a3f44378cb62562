"""Reasoning sections: the parsers' split of a text, the choice of a parser from a tokenizer, and the engine's gating
(a grammar and stop strings apply to the answer only, replayed when a request continues) on a tiny random Llama
whose tokenizer has think tags (`think_model`); the model rarely closes its reasoning by itself, so a logit bias
or the tokens a continued request carries script it."""

from __future__ import annotations

import pytest

from conveyor.core import ConfigError, EngineConfig, GenerationRequest, Grammar, SamplingParams
from conveyor.core.reasoning import Reasoning, resolve_reasoning

R1 = Reasoning("deepseek_r1", (1,), (2,))
QWEN3 = Reasoning("qwen3", (1,), (2,))


@pytest.mark.parametrize("parser, text, answer_start, expected", [
    (R1, "<think>plan</think>42", 3, ("plan", "42")),
    (R1, "plan</think>\n\n42", 3, ("plan", "\n\n42")),  # the prompt opened <think>
    (R1, "still thinking", None, ("still thinking", "")),  # never closed: all reasoning
    (QWEN3, "<think>plan</think>42", 3, ("plan", "42")),
    (QWEN3, "42", None, (None, "42")),  # no reasoning: all answer
    (QWEN3, "<think>still", None, ("still", "")),  # cut short while reasoning
    (R1, "42 </think> x", 0, (None, "42 </think> x")),  # the prompt closed it: all answer
])
def test_split(parser, text, answer_start, expected):
    assert parser.split(text, answer_start) == expected


def test_a_prompt_whose_last_think_tag_closes_starts_with_the_answer():
    assert R1.ended_in([5, 1, 7, 2, 9]) and not R1.ended_in([5, 2, 1, 7]) and not R1.ended_in([5, 6])


class _Tok:
    def __init__(self, vocab, template):
        self.vocab, self.chat_template = vocab, template

    def get_vocab(self):
        return self.vocab

    def encode(self, text, add_special_tokens=False):
        return [self.vocab[text]] if text in self.vocab else [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "<|user|>x<|assistant|>" + ("<think>\n" if "open" in self.chat_template else "")


def test_resolve_picks_from_the_template_and_refuses_a_model_without_think_tags():
    tags = {"<think>": 7, "</think>": 8}
    assert resolve_reasoning("auto", _Tok(tags, "... </think> ...")) == Reasoning("qwen3", (7,), (8,))
    assert resolve_reasoning("auto", _Tok(tags, "open </think>")).parser == "deepseek_r1"
    assert resolve_reasoning("deepseek_r1", _Tok(tags, "")).parser == "deepseek_r1"  # the tokens suffice
    for name in ("auto", "qwen3"):
        with pytest.raises(ConfigError, match=f"reasoning_parser {name}: .*no reasoning section") as e:
            resolve_reasoning(name, _Tok({}, "plain template"))
        assert e.value.named("--reasoning-parser").startswith(f"--reasoning-parser {name}:")


# -- the engine -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_parts(think_model):
    from conveyor.core.engine import Engine

    def make():
        return Engine.from_pretrained(str(think_model), EngineConfig(num_kv_blocks=64, block_size=16, dtype="float32"))

    first = make()
    tok = first.tokenizer
    return make, first, tok, resolve_reasoning("auto", tok)


def _one(engine, request):
    (out,) = list(engine.generate([request]))
    return out


def test_the_grammar_waits_for_the_end_of_the_reasoning(engine_parts):
    _, engine, tok, reasoning = engine_parts
    end = reasoning.end_ids[0]
    thought = tuple(tok.encode("<think>stop and think", add_special_tokens=False))
    sampling = SamplingParams(temperature=0, max_tokens=12, reasoning=reasoning, logit_bias={end: 100},
                              grammar=Grammar("choice", '["yes", "no"]'))
    out = _one(engine, GenerationRequest("a", tok.encode("Is it?"), sampling, output_token_ids=thought))
    # </think> is no choice's token: the grammar did not apply before it; after it, the answer is a choice
    assert out.output_token_ids[len(thought)] == end
    assert out.reasoning == "stop and think" and out.text in ("yes", "no") and out.finish_reason == "stop"
    # a json schema's answer is validated (it is the answer that parses, not the reasoning)
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    s = SamplingParams(temperature=0, max_tokens=40, reasoning=reasoning, logit_bias={end: 100},
                       grammar=Grammar("json_schema", schema))
    out = _one(engine, GenerationRequest("j", tok.encode("Is it?"), s, output_token_ids=thought))
    assert out.error is None and out.reasoning == "stop and think"
    if out.note is None:
        import json

        assert isinstance(json.loads(out.text)["a"], int)


def test_stop_strings_are_looked_for_in_the_answer_only(engine_parts):
    _, engine, tok, reasoning = engine_parts
    r1 = Reasoning("deepseek_r1", reasoning.start_ids, reasoning.end_ids)
    word = tok.encode(" stop", add_special_tokens=False)[0]
    s = SamplingParams(temperature=0, max_tokens=6, reasoning=r1, stop=["stop"], logit_bias={word: 100})
    prompt = tok.encode("Go")
    reasoning_only = _one(engine, GenerationRequest("r", prompt, s))
    assert reasoning_only.finish_reason == "length" and reasoning_only.reasoning == " stop" * 6
    assert reasoning_only.text == ""
    answered = _one(engine, GenerationRequest("a", prompt, s, output_token_ids=tuple(r1.end_ids)))
    assert answered.finish_reason == "stop" and answered.text == " " and answered.reasoning == ""
    # without a parser the same request stops at once
    plain = _one(engine, GenerationRequest("p", prompt, SamplingParams(temperature=0, max_tokens=6, stop=["stop"],
                                                                      logit_bias={word: 100})))
    assert plain.num_output_tokens == 1 and plain.text == " "


def test_a_continued_request_replays_the_reasoning_state(engine_parts):
    """Stopped before, at and after the end tag, and continued in a new engine: the same tokens, text and
    reasoning as uninterrupted (the grammar's and the stop strings' start replayed)."""
    make, engine, tok, reasoning = engine_parts
    end = reasoning.end_ids[0]
    thought = tuple(tok.encode("<think>a b", add_special_tokens=False))
    prompts = [tok.encode(f"Question {i}?") for i in range(4)]
    # sampled (seeded): the random model's logits are nearly flat, so this bias closes the reasoning after a few
    # tokens, at another place in each request
    requests = [GenerationRequest(f"q{i}", p, SamplingParams(
        seed=i, max_tokens=16, reasoning=reasoning, logit_bias={end: 8}, stop=['"'], grammar=Grammar("json_object")),
        output_token_ids=thought) for i, p in enumerate(prompts)]
    whole = {o.req_id: o for o in engine.generate(requests)}
    assert len({o.output_token_ids.index(end) for o in whole.values() if end in o.output_token_ids}) > 1
    for steps in (1, 4, 7, 10):
        first = make()
        for r in requests:
            first.add_request(r)
        outs = {}
        for _ in range(steps):
            outs.update((o.req_id, o) for o in first.step())
        carried = first.in_flight()
        second = make()
        rest = [GenerationRequest(r.req_id, r.prompt_token_ids, r.sampling,
                                  output_token_ids=carried[r.req_id].output_token_ids)
                for r in requests if r.req_id not in outs]
        outs.update((o.req_id, o) for o in second.generate(rest))
        for req_id, o in whole.items():
            got = outs[req_id]
            assert (got.output_token_ids, got.text, got.reasoning, got.finish_reason) == \
                (o.output_token_ids, o.text, o.reasoning, o.finish_reason), (steps, req_id)
