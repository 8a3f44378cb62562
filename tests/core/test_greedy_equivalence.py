"""The correctness anchor on the real embedded model (SmolLM2-135M-Instruct, float32, CPU).

Greedy engine output equals `model.generate` for each prompt alone, token for token, also when the
KV pool is small enough to force preemption, when prompts are chunked, and when prompts share a
cached system prompt. Seeded sampling does not depend on the batch around a request.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
from conveyor.core.backends.cpu.kernels import cpu_kernels
from conveyor.core.engine import Engine

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
EOS = 2  # <|im_end|>

SYSTEM = (
    "You are the reference desk assistant of a small public library in a coastal town. You answer "
    "questions from visitors politely and briefly, in plain English, without jargon. When a question is "
    "about opening hours, the library is open from nine in the morning to six in the evening on weekdays "
    "and from ten to four on Saturdays; it is closed on Sundays and public holidays. Members may borrow up "
    "to eight books at a time for three weeks, and renew them twice online. If you do not know an answer, "
    "say so and suggest asking a librarian at the front desk."
)
SYSTEM_QUESTIONS = [
    "When are you open on Saturday?",
    "How many books can I borrow?",
    "Can I renew a book online?",
    "Are you open on Sundays?",
    "Who can help me find a book about boats?",
]
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence what photosynthesis is.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish.",
]
LONG_TEXT = (
    "The history of the printing press begins long before Johannes Gutenberg set up his workshop in Mainz. "
    "Woodblock printing was practised in China by the seventh century, and movable type made of baked clay "
    "was described by the scholar Shen Kuo, who credited an artisan named Bi Sheng with its invention in the "
    "eleventh century. Metal movable type appeared in Korea in the thirteenth century, and the oldest "
    "surviving book printed with it dates from 1377. In Europe, however, books were still copied by hand in "
    "monasteries and, increasingly, by professional scribes working for universities and wealthy patrons. "
    "Gutenberg's contribution, around 1440, was not a single invention but a system: a hand mould for casting "
    "type quickly and uniformly, an alloy of lead, tin and antimony that melted at a low temperature and "
    "cooled without shrinking, an oil-based ink that clung to metal, and a press adapted from those used to "
    "make wine and paper. Together these made it possible to print hundreds of identical pages a day. Within "
    "fifty years, presses were running in more than two hundred and fifty European cities, and perhaps twenty "
    "million volumes had been printed. The consequences were enormous. Prices of books fell, literacy spread, "
    "scholars could compare identical copies of a text, and new ideas travelled faster than any authority "
    "could contain them. Historians still debate how much the press caused the Reformation, the scientific "
    "revolution and the rise of vernacular literature, but few doubt that it changed them all."
)
RAW_TEXTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "1, 2, 3, 4, 5,",
    LONG_TEXT,
    LONG_TEXT[:600] + " In summary,",
]


def _ids(encoded) -> list[int]:
    """transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.fixture(scope="session")
def smollm():
    from conveyor.core.model_loader import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def prompts(smollm):
    _, tok = smollm
    chat = lambda msgs: _ids(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    out = {}
    for i, q in enumerate(SYSTEM_QUESTIONS):
        out[f"sys{i}"] = chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
    for i, q in enumerate(CHAT_QUESTIONS):
        out[f"chat{i}"] = chat([{"role": "user", "content": q}])
    out["chat_long"] = chat([{"role": "user", "content": "Summarise this text in two sentences.\n\n" + LONG_TEXT}])
    for i, text in enumerate(RAW_TEXTS):
        out[f"raw{i}"] = _ids(tok(text))
    return out


@torch.inference_mode()
def _generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """model.generate for one prompt alone, with transformers' own attention, cut after the first EOS."""
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens)[0, len(prompt):].tolist()
    finally:
        model.set_attn_implementation(before)
    return out[:out.index(EOS) + 1] if EOS in out else out


@pytest.fixture(scope="module")
def references(smollm, prompts):
    model, _ = smollm
    return {name: _generate(model, p, MAX_TOKENS) for name, p in prompts.items()}


def _run(smollm, prompts: dict[str, list[int]], config: EngineConfig, sampling=GREEDY):
    model, tok = smollm
    engine = Engine(model, tok, config)
    outs = {o.req_id: o for o in engine.generate(GenerationRequest(n, p, sampling) for n, p in prompts.items())}
    assert set(outs) == set(prompts) and not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    return outs, engine.stats()


def _assert_same(outs, references):
    mismatched = [n for n in references if outs[n].output_token_ids != references[n]]
    assert not mismatched, "engine != generate for " + ", ".join(
        f"{n}: {outs[n].output_token_ids} vs {references[n]}" for n in mismatched)
    for n, ref in references.items():
        assert outs[n].finish_reason == ("stop" if ref[-1] == EOS else "length")


def test_the_workload_is_varied(prompts, references):
    lengths = sorted(map(len, prompts.values()))
    assert len(prompts) >= 16 and lengths[0] < 10 and lengths[-1] > 300
    assert all(len(prompts[f"sys{i}"]) > 100 for i in range(len(SYSTEM_QUESTIONS)))
    assert any(r[-1] == EOS for r in references.values())  # some stop at EOS,
    assert any(len(r) == MAX_TOKENS and EOS not in r for r in references.values())  # some at max_tokens


def test_france(smollm, prompts, references):
    _, tok = smollm
    assert "Paris" in tok.decode(references["chat0"], skip_special_tokens=True)
    outs, _ = _run(smollm, {"chat0": prompts["chat0"]}, EngineConfig(num_kv_blocks=16))
    assert "Paris" in outs["chat0"].text and outs["chat0"].finish_reason == "stop"


def test_stop_string_on_real_text(smollm, prompts, references):
    _, tok = smollm
    ref_text = tok.decode(references["chat0"], skip_special_tokens=True)
    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["Paris"])
    outs, _ = _run(smollm, {"chat0": prompts["chat0"]}, EngineConfig(num_kv_blocks=16), sampling)
    out = outs["chat0"]
    assert out.finish_reason == "stop" and out.text == ref_text[:ref_text.index("Paris")]
    assert out.output_token_ids == references["chat0"][:len(out.output_token_ids)]
    assert "Paris" in tok.decode(out.output_token_ids) and EOS not in out.output_token_ids


@pytest.mark.parametrize("fused_forward", [True, False], ids=["fused-forward", "transformers-forward"])
def test_engine_equals_generate(smollm, prompts, references, fused_forward):
    outs, stats = _run(smollm, prompts, EngineConfig(num_kv_blocks=320, fused_forward=fused_forward))
    assert stats.num_preemptions == 0
    _assert_same(outs, references)


def test_engine_equals_generate_under_preemption(smollm, prompts, references):
    need = max(-(-(len(p) + MAX_TOKENS) // 16) for p in prompts.values())
    outs, stats = _run(smollm, prompts, EngineConfig(num_kv_blocks=need + 8))
    assert stats.num_preemptions > 0
    _assert_same(outs, references)


def test_engine_equals_generate_with_chunked_prefill(smollm, prompts, references):
    assert sum(len(p) > 64 for p in prompts.values()) >= 6
    outs, _ = _run(smollm, prompts, EngineConfig(num_kv_blocks=320, max_num_batched_tokens=64))
    _assert_same(outs, references)


def test_prefix_cache_serves_the_shared_system_prompt(smollm, prompts, references):
    names = [f"sys{i}" for i in range(len(SYSTEM_QUESTIONS))]
    outs, stats = _run(smollm, {n: prompts[n] for n in names}, EngineConfig(num_kv_blocks=128, max_num_seqs=3))
    assert stats.num_cached_prompt_tokens > 0 and stats.prefix_cache_hit_rate > 0
    assert outs[names[0]].num_cached_tokens == 0  # the first computes the shared system prompt, once: the others
    assert all(outs[n].num_cached_tokens >= 96 for n in names[1:])  # wait for it (a step) and take it from the cache
    _assert_same(outs, {n: references[n] for n in names})


@pytest.mark.skipif(cpu_kernels() is not None, reason="tests/core/test_exactness_engine.py covers it bit for bit "
                    "where the exact cpu backend runs")
def test_seeded_sampling_does_not_depend_on_the_batch(smollm, prompts):
    target = SamplingParams(temperature=0.8, top_p=0.95, seed=4242, max_tokens=16)
    name = "chat1"
    alone, _ = _run(smollm, {name: prompts[name]}, EngineConfig(num_kv_blocks=32), target)
    names = sorted(n for n, p in prompts.items() if len(p) < 150)
    crowd = {}
    for i in range(31):  # other prompts, other seeds, some greedy, submitted before and after the target
        other = names[(i * 7) % len(names)]
        crowd[f"o{i}-{other}"] = (prompts[other], SamplingParams(temperature=0 if i % 5 == 0 else 1.0, seed=i,
                                                                  max_tokens=16))
        if i == 19:
            crowd[name] = (prompts[name], target)
    model, tok = smollm
    engine = Engine(model, tok, EngineConfig(num_kv_blocks=400))
    outs = {o.req_id: o for o in engine.generate(GenerationRequest(n, p, s) for n, (p, s) in crowd.items())}
    assert len(outs) == 32
    tokens = outs[name].output_token_ids
    assert tokens == alone[name].output_token_ids
    assert len(tokens) > 4
