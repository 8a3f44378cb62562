"""Speculative decoding changes no output bit, on the real embedded model: 14 records (passages to copy, list or
quote, where drafts are right, and chats, where they mostly are not), greedy and seeded, with logprobs, stop
strings, a JSON schema, penalties, min_tokens and bad words among them, give the same tokens, text and logprobs
with --speculative ngram as without, at 4 rows (drafts ride along), under forced preemption and with a cached
prefix; float32, and bfloat16 where the CPU has native bf16. Each speculative run must accept draft tokens, or
it would prove nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.core import EngineConfig, GenerationRequest, Grammar, SamplingParams
from conveyor.core.backends.cpu.kernels import cpu_kernels, native_bf16
from conveyor.core.engine import Engine
from conveyor.core.model_runner import ModelRunner

SAMPLE = Path(__file__).resolve().parents[2] / "sample_data"
MAX_TOKENS = 40
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
                     "required": ["name", "year"]})

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    cpu_kernels() is None, reason="no exact backend here (conveyor's C++ kernels do not run on this CPU)")]


@pytest.fixture(autouse=True)
def _drafts_ride_along(monkeypatch):
    """The engine sizes drafts by the forward's cost per row, timed as it starts: on a busy machine that timing can
    make drafts look not worth it (one run accepted 7 tokens instead of hundreds). A flat cost (one more row costs
    nothing, as at 4 decode rows on a CPU) keeps every likely draft in, so each run tests the outputs with drafts;
    which drafts pay under which costs is tests/core/test_speculative.py's."""
    monkeypatch.setattr(ModelRunner, "measure_rows", lambda self, counts, **kw: [1.0] * len(counts))


def _native_bf16() -> bool:
    return native_bf16()  # (the kernels' route: bf16 widened on the AVX2 one drafts its own, other text)


DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not _native_bf16(), reason="this CPU has no native bf16 (AMX or AVX512-BF16)"))]


@pytest.fixture(scope="module", params=DTYPES)
def smollm(request):
    from conveyor.core.model_loader import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype=request.param)


def _chat(tok, text: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


SAMPLINGS = [
    dict(temperature=0),
    dict(temperature=0.8, top_p=0.95, seed=11, logprobs=2),
    dict(temperature=0, stop=["bridge", "\n\n"]),
    dict(temperature=0.7, seed=5, repetition_penalty=1.15, frequency_penalty=0.2),
    dict(temperature=0, min_tokens=30, logprobs=0),
    dict(temperature=1.0, top_k=20, seed=3),
    dict(temperature=0, grammar=Grammar("json_schema", SCHEMA)),
]


@pytest.fixture(scope="module")
def requests(smollm):
    _, tok = smollm
    grounded = [json.loads(line) for line in (SAMPLE / "extract.jsonl").read_text(encoding="utf-8").splitlines()]
    picks = [r for r in grounded if r["task"] in ("copy", "numbers", "rewrite")][:7]
    chats = [json.loads(line) for line in (SAMPLE / "chat.jsonl").read_text(encoding="utf-8").splitlines()][:7]
    texts = [r["messages"][0]["content"] for r in picks + chats]
    out = []
    for i, text in enumerate(texts):
        params = dict(SAMPLINGS[i % len(SAMPLINGS)])
        if i == 9:
            params["bad_words"] = tuple(tuple(tok(w, add_special_tokens=False)["input_ids"]) for w in (" the",))
        out.append(GenerationRequest(f"r{i}", _chat(tok, text), SamplingParams(max_tokens=MAX_TOKENS, **params)))
    return out


def _run(smollm, requests, **config):
    model, tok = smollm
    engine = Engine(model, tok, EngineConfig(max_num_seqs=4, **config))
    outs = {o.req_id: o for o in engine.generate(requests)}
    assert not engine.has_unfinished() and len(outs) == len(requests)
    assert all(o.error is None for o in outs.values()), [o.error for o in outs.values() if o.error]
    return outs, engine.stats()


@pytest.fixture(scope="module")
def reference(smollm, requests):
    return _run(smollm, requests)[0]


def _assert_same(reference, outs):
    for name, ref in reference.items():
        got = outs[name]
        assert got.output_token_ids == ref.output_token_ids, name
        assert got.text == ref.text, name
        assert got.finish_reason == ref.finish_reason, name
        assert got.logprobs == ref.logprobs, f"{name}: logprobs differ"


def test_speculation_gives_the_same_outputs(smollm, requests, reference):
    outs, stats = _run(smollm, requests, speculative="ngram")
    _assert_same(reference, outs)
    assert stats.num_accepted_draft_tokens > 100, "drafts were meant to be accepted"
    assert sum(o.num_accepted_draft_tokens for o in outs.values()) == stats.num_accepted_draft_tokens
    assert stats.num_generated_tokens == sum(o.num_output_tokens for o in outs.values())


def test_speculation_gives_the_same_outputs_with_more_draft_tokens_under_forced_preemption(smollm, requests,
                                                                                            reference):
    need = max(-(-(len(r.prompt_token_ids) + MAX_TOKENS) // 16) for r in requests)
    outs, stats = _run(smollm, requests, speculative="ngram", num_speculative_tokens=8, num_kv_blocks=need + 3)
    _assert_same(reference, outs)
    assert stats.num_preemptions > 0 and stats.num_accepted_draft_tokens > 0


def test_speculation_gives_the_same_outputs_with_a_cached_prefix_and_a_tight_token_budget(smollm, requests,
                                                                                         reference):
    model, tok = smollm
    engine = Engine(model, tok, EngineConfig(max_num_seqs=4, speculative="ngram", max_num_batched_tokens=24))
    warm = requests[0].prompt_token_ids[:-3]  # most of the first record's prompt, cached before it runs
    list(engine.generate([GenerationRequest("warm", warm, SamplingParams(temperature=0, max_tokens=2))]))
    outs = {o.req_id: o for o in engine.generate(requests)}
    _assert_same(reference, outs)
    assert outs["r0"].num_cached_tokens >= 32 and engine.stats().num_accepted_draft_tokens > 0
