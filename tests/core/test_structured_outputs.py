"""Structured outputs and logprobs on the real embedded model (SmolLM2-135M-Instruct, CPU).

64 records with 8 distinct JSON schemas, choices, regexes and unconstrained ones, under preemption and
chunked prompts: every ok row of a schema parses and validates (jsonschema), choices are one of their
labels, regexes match, an output cut by max_tokens says so. Logprobs (generated and prompt tokens) agree
with log_softmax of plain transformers' logits for the same prefix, to 1e-4 in float32.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from conveyor.core import EngineConfig, GenerationRequest, Grammar, SamplingParams
from conveyor.core.engine import Engine

pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
     "required": ["sentiment"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                      "country": {"type": "string", "maxLength": 30}},
     "required": ["city", "country"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "maxItems": 3}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
     "required": ["year"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 25}, "pages": {"type": "integer"}},
     "required": ["title"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 20}, "last": {"type": "string", "maxLength": 20}},
        "required": ["first", "last"], "additionalProperties": False}}, "required": ["person"],
     "additionalProperties": False},
]
QUESTIONS = ["Extract the person: 'Anna Smith is 34 years old.'", "Is this review positive? 'I loved it.'",
             "Where is the Eiffel Tower?", "Is water wet?", "Which colours are in the French flag?",
             "When did the Berlin Wall fall?", "Name a famous book.", "Who wrote Hamlet?"]
CHOICES = ["bug", "feature", "question"]
REGEX = r"[0-9]{3}-[0-9]{4}"


def _close(got: float, want: float) -> bool:
    """Within 1e-4; for a very unlikely token (logprob below -10) within 1e-5 of its size: the logits of
    conveyor's kernels and of torch's differ by float32 rounding, which a log-softmax keeps in absolute terms."""
    return abs(got - want) <= 1e-4 * max(1.0, abs(want) / 10)


def _chat(tok, text):
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def smollm():
    from conveyor.core.model_loader import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="float32")


def _records(tok):
    records = {}
    schema_records = 0
    for i in range(64):
        kind = i % 4
        if kind in (0, 1):  # 32 records over the 8 schemas
            k = schema_records % 8
            schema_records += 1
            grammar = Grammar("json_schema", json.dumps(SCHEMAS[k]))
            prompt = f"{QUESTIONS[k]} Answer in JSON."
        elif kind == 2:
            grammar = Grammar("choice", json.dumps(CHOICES)) if i % 8 == 2 else Grammar("regex", REGEX)
            prompt = "Classify: 'the app crashes'" if i % 8 == 2 else "Give a phone number."
        else:
            grammar, prompt = None, f"Tell me a fact about the number {i}."
        sampling = SamplingParams(temperature=0 if i % 3 else 0.7, seed=i, max_tokens=48 if i != 5 else 4,
                                  grammar=grammar)
        records[f"r{i}"] = GenerationRequest(f"r{i}", _chat(tok, prompt), sampling)
    return records


@pytest.mark.parametrize("config", [dict(num_kv_blocks=40, max_num_batched_tokens=48), dict(num_kv_blocks=600)],
                         ids=["preempted-and-chunked", "roomy"])
def test_every_ok_row_matches_its_grammar(smollm, config):
    model, tok = smollm
    records = _records(tok)
    engine = Engine(model, tok, EngineConfig(**config))
    outs = {o.req_id: o for o in engine.generate(records.values())}
    if config["num_kv_blocks"] == 40:
        assert engine.stats().num_preemptions > 0
    schemas_checked = 0
    for name, request in records.items():
        out, grammar = outs[name], request.sampling.grammar
        if grammar is None:
            assert out.note is None
            continue
        if out.note is not None:
            assert out.finish_reason == "length" and "ran out before the output completed" in out.note, name
            continue
        # a whole match: its grammar ended it (stop), or max_tokens came right at its end (length)
        if grammar.kind == "json_schema":
            jsonschema.validate(json.loads(out.text), json.loads(grammar.spec))
            schemas_checked += 1
        elif grammar.kind == "choice":
            assert out.text in CHOICES
        else:
            assert re.fullmatch(REGEX, out.text), out.text
    assert schemas_checked >= 24
    assert outs["r5"].finish_reason == "length" and outs["r5"].note  # 4 tokens: no schema completes
    if config["num_kv_blocks"] == 600:
        grammars = engine.grammar_admission.grammars
        assert grammars is not None and len(grammars.compile_s) == 8 + 2  # once per distinct grammar


def test_logprobs_agree_with_transformers_log_softmax(smollm):
    model, tok = smollm
    prompts = [_chat(tok, q) for q in ("What is the capital of Italy?", "Write a word that rhymes with cat.")]
    prompts.append(list(tok("The three primary colors are")["input_ids"]))
    samplings = [SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2),
                 SamplingParams(temperature=0.8, seed=5, top_p=0.9, max_tokens=8, logprobs=0, prompt_logprobs=0),
                 SamplingParams(temperature=0, max_tokens=8, logprobs=5, repetition_penalty=1.3)]
    engine = Engine(model, tok, EngineConfig(num_kv_blocks=200))
    outs = {o.req_id: o for o in engine.generate(GenerationRequest(f"q{i}", p, s)
                                                 for i, (p, s) in enumerate(zip(prompts, samplings)))}
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        for i, (prompt, sampling) in enumerate(zip(prompts, samplings)):
            out = outs[f"q{i}"]
            ids = prompt + out.output_token_ids
            with torch.inference_mode():
                ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
            assert len(out.logprobs) == len(out.output_token_ids)
            for k, lp in enumerate(out.logprobs):
                row = ref[len(prompt) + k - 1]
                assert lp.token_id == out.output_token_ids[k]
                assert _close(lp.logprob, row[lp.token_id].item())
                assert len(lp.top) == sampling.logprobs
                for t, v in lp.top:
                    assert _close(v, row[t].item())
                if lp.top:
                    assert lp.top[0][0] == int(row.argmax())
            if sampling.prompt_logprobs is not None:
                assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
                for pos in range(1, len(prompt)):
                    lp = out.prompt_logprobs[pos]
                    assert lp.token_id == prompt[pos]
                    assert _close(lp.logprob, ref[pos - 1, prompt[pos]].item())
                    assert len(lp.top) == sampling.prompt_logprobs
            else:
                assert out.prompt_logprobs is None
    finally:
        model.set_attn_implementation(before)
