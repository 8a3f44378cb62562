"""The exactness contract end to end, on the real embedded model (SmolLM2-135M-Instruct, CPU): 18 records
(chat and raw, short and long, five sharing a system prompt) give bitwise the same first-token logits, and
then the same seeded-sampled tokens and text, alone, among 47 others in shuffled order, with a 48-token
budget (chunked prompts), with their shared prefix served from the cache, and under forced preemption;
and so do their logprobs (each token's and its top two alternatives').
float32 everywhere; bfloat16 where the CPU has native bf16 (AMX or AVX512-BF16), skipped elsewhere."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
from conveyor.core.backends.cpu.kernels import cpu_identity, cpu_kernels
from conveyor.core.engine import Engine

SAMPLE = Path(__file__).resolve().parents[2] / "sample_data" / "chat.jsonl"
MAX_TOKENS = 16
SYSTEM = ("You are a careful assistant for a hardware store. Answer in one or two short sentences, name the aisle "
          "when you can (tools are in aisle 4, paint in aisle 7, garden supplies in aisle 9), and never guess prices.")
SYSTEM_QUESTIONS = ["Where is the paint?", "Do you sell rakes?", "How do I pick a drill?",
                    "What glue works on wood?", "Can I return an opened can of paint?"]
CHATS = ["Explain photosynthesis to a ten-year-old.", "What is the capital of France?", "Write a haiku about rain.",
         "List three uses of vinegar.", "Translate 'thank you' into German."]
LONG = ("The river begins as snowmelt high in the mountains, gathering strength as it falls through narrow "
        "valleys where old stone bridges cross it. ") * 12
RAWS = ["The three primary colors are", "Once upon a time", "def add(a, b):\n    return", "1, 1, 2, 3, 5, 8,",
        LONG + "In short, the river", "Q: What is 12 times 12?\nA:", "Dear Sir or Madam,",
        "The recipe needs flour, eggs and"]


def _native_bf16() -> bool:
    ops = cpu_kernels()
    flags = cpu_identity()[1]
    return ops is not None and ("avx512_bf16" in flags or "amx_bf16" in flags)


# The contract is the cpu backend's (C++ kernels); the torch backend, where they do not run, declines it.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    cpu_kernels() is None, reason="no exact backend here (conveyor's C++ kernels do not run on this CPU)")]
DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not _native_bf16(), reason="this CPU has no native bf16 (AMX or AVX512-BF16)"))]


@pytest.fixture(scope="module", params=DTYPES)
def smollm(request):
    from conveyor.core.model_loader import load_model

    model, tok = load_model("smollm2-135m-instruct", device="cpu", dtype=request.param)
    return model, tok, request.param


def _chat(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def records(smollm):
    """(targets, fillers): name -> GenerationRequest. Targets are compared; fillers only crowd the steps."""
    _, tok, _ = smollm
    prompts = {}
    for i, q in enumerate(SYSTEM_QUESTIONS):
        prompts[f"sys{i}"] = _chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
    for i, q in enumerate(CHATS):
        prompts[f"chat{i}"] = _chat(tok, [{"role": "user", "content": q}])
    for i, text in enumerate(RAWS):
        prompts[f"raw{i}"] = list(tok(text)["input_ids"])
    targets = {n: GenerationRequest(n, p, SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i,
                                                         max_tokens=MAX_TOKENS, logprobs=2))
               for i, (n, p) in enumerate(prompts.items())}
    fillers = {}
    for i, line in enumerate(SAMPLE.read_text(encoding="utf-8").splitlines()[:30]):
        name = f"fill{i}"
        sampling = SamplingParams(temperature=0 if i % 4 == 0 else 1.0, top_k=40 if i % 3 == 0 else 0, seed=i,
                                  max_tokens=4 + i % 16)
        fillers[name] = GenerationRequest(name, _chat(tok, json.loads(line)["messages"]), sampling)
    return targets, fillers


class _FirstLogits:
    """Wraps the runner's sampler: records each request's logits whenever its first token is sampled (again,
    after a preemption that came before it)."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.logits: dict[str, list[torch.Tensor]] = {}

    def sample(self, logits, entries, states=None):
        for i, e in enumerate(entries):
            if e.num_output_tokens == 0:
                self.logits.setdefault(e.req_id, []).append(logits[i].clone())
        return self.sampler.sample(logits, entries, states)


def _engine(smollm, **config) -> tuple[Engine, _FirstLogits]:
    model, tok, _ = smollm
    engine = Engine(model, tok, EngineConfig(**config))
    capture = _FirstLogits(engine.runner.sampler)
    engine.runner.sampler = capture
    return engine, capture


def _results(engine, capture, requests):
    outs = {o.req_id: o for o in engine.generate(requests)}
    assert not engine.has_unfinished()
    return outs, capture.logits


@pytest.fixture(scope="module")
def alone(smollm, records):
    """Each target by itself, in an engine without prefix caching: the reference."""
    targets, _ = records
    engine, capture = _engine(smollm, num_kv_blocks=256, enable_prefix_caching=False)
    outs = {}
    for request in targets.values():
        outs.update(_results(engine, capture, [request])[0])
    return outs, capture.logits


def _shuffled(records, seed):
    targets, fillers = records
    requests = list(targets.values()) + list(fillers.values())
    random.Random(seed).shuffle(requests)
    return requests


def _assert_as_alone(alone, outs, logits, targets):
    ref_outs, ref_logits = alone
    for name in targets:
        assert ref_logits[name] and logits[name], name
        for got in logits[name]:
            assert torch.equal(got, ref_logits[name][0]), f"{name}: first-token logits differ from alone"
        assert outs[name].output_token_ids == ref_outs[name].output_token_ids, name
        assert outs[name].text == ref_outs[name].text, name
        assert outs[name].logprobs == ref_outs[name].logprobs, f"{name}: logprobs differ from alone"


def test_the_records_are_varied(records, alone):
    targets, _ = records
    lengths = sorted(len(r.prompt_token_ids) for r in targets.values())
    assert len(targets) >= 16 and lengths[0] < 10 and lengths[-1] > 300
    outs, _ = alone
    assert len({tuple(o.output_token_ids) for o in outs.values()}) == len(targets)


def test_among_47_others_in_shuffled_order(smollm, records, alone):
    engine, capture = _engine(smollm, num_kv_blocks=600)
    outs, logits = _results(engine, capture, _shuffled(records, seed=1))
    _assert_as_alone(alone, outs, logits, records[0])


def test_with_a_48_token_budget_that_chunks_the_prompts(smollm, records, alone):
    engine, capture = _engine(smollm, num_kv_blocks=600, max_num_batched_tokens=48)
    outs, logits = _results(engine, capture, _shuffled(records, seed=2))
    assert sum(len(r.prompt_token_ids) > 48 for r in records[0].values()) >= 6
    _assert_as_alone(alone, outs, logits, records[0])


def test_with_the_shared_prefix_served_from_the_cache(smollm, records, alone):
    model, tok, _ = smollm
    engine, capture = _engine(smollm, num_kv_blocks=600)
    warm = _chat(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}])
    list(engine.generate([GenerationRequest("warm", warm, SamplingParams(temperature=0, max_tokens=2))]))
    outs, logits = _results(engine, capture, _shuffled(records, seed=3))
    assert all(outs[f"sys{i}"].num_cached_tokens >= 32 for i in range(len(SYSTEM_QUESTIONS)))
    _assert_as_alone(alone, outs, logits, records[0])


def test_under_forced_preemption(smollm, records, alone):
    targets, _ = records
    need = max(-(-(len(r.prompt_token_ids) + MAX_TOKENS) // 16) for r in targets.values())
    engine, capture = _engine(smollm, num_kv_blocks=need + 2)
    outs, logits = _results(engine, capture, _shuffled(records, seed=4))
    assert sum(outs[n].num_preemptions > 0 for n in targets) >= 3
    _assert_as_alone(alone, outs, logits, targets)
