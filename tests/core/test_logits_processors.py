"""The logits-processor seam: each processor's edit, their order, rows without processors left alone, the
grammar mask (C++ and torch), and processor state across preemption (a tiny random Llama)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conveyor.core import EngineConfig, GenerationRequest, Grammar, SamplingParams
from conveyor.core.backends.cpu.kernels import cpu_kernels
from conveyor.core.engine import Engine
from conveyor.core.logits_processors import Processors
from conveyor.core.logits_state import LogitsState
from conveyor.core.schedule_types import ScheduledRequest

V = 64
EOS = 2


def _entry(sampling: SamplingParams, outputs: int = 0, req_id: str = "r") -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=(5,), start_pos=3, block_ids=(0,), sample=True,
                            sampling=sampling, num_output_tokens=outputs)


def _state(sampling: SamplingParams, prompt=(), accepted=()) -> LogitsState:
    state = LogitsState(sampling, list(prompt))
    for t in accepted:
        state.accept(t)
    return state


def test_rows_without_processors_are_left_alone_and_plan_nothing():
    processors = Processors((EOS,))
    entries = [_entry(SamplingParams(temperature=0)), _entry(SamplingParams(top_p=0.5, seed=1))]
    assert processors.plan(entries, [None, None]) == []
    logits = torch.randn(2, V)
    before = logits.clone()
    processors.apply(logits, entries, [None, None])
    assert torch.equal(logits, before)


def test_each_processor_edits_only_its_rows_in_order():
    processors = Processors((EOS,))
    s_min = SamplingParams(min_tokens=3, stop_token_ids=[7])
    s_bias = SamplingParams(logit_bias={4: 5.0, EOS: 100.0}, min_tokens=1)
    s_pen = SamplingParams(logit_bias={9: 2.0}, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    s_bad = SamplingParams(bad_words=[(11,), (12, 13)])
    entries = [_entry(s_min, 1), _entry(s_bias, 0), _entry(s_pen, 2), _entry(s_bad, 1), _entry(SamplingParams())]
    states = [None, None, _state(s_pen, prompt=[9], accepted=[9, 9]), _state(s_bad, accepted=[12]), None]
    logits = torch.randn(5, V).abs() + 0.5  # positive: the repetition penalty divides
    want = logits.clone()
    processors.apply(logits, entries, states)
    assert [type(p).__name__ for p, _ in processors.plan(entries, states)] == [
        "MinTokens", "BadWords", "LogitBias", "Penalties"]
    assert logits[0, EOS] == logits[0, 7] == float("-inf")  # min_tokens: EOS and the stop id banned
    assert logits[1, EOS] == float("-inf") and logits[1, 4] == want[1, 4] + 5.0  # banned before any bias
    # bias first, then repetition (seen: prompt 9), then presence + frequency x 2 generated 9s
    assert torch.isclose(logits[2, 9], (want[2, 9] + 2.0) / 2.0 - 0.5 - 0.25 * 2)
    assert logits[3, 11] == float("-inf") and logits[3, 13] == float("-inf") and logits[3, 12] == want[3, 12]
    untouched = [(0, 5), (1, 9), (2, 4), (3, 14)]
    assert all(logits[r, c] == want[r, c] for r, c in untouched) and torch.equal(logits[4], want[4])


def test_a_bad_word_of_several_tokens_is_banned_only_after_its_prefix():
    processors = Processors((EOS,))
    s = SamplingParams(bad_words=[(12, 13, 14)])
    for accepted, banned in (((), False), ((12,), False), ((12, 13), True), ((12, 13, 5), False)):
        logits = torch.zeros(1, V)
        processors.apply(logits, [_entry(s)], [_state(s, accepted=accepted)])
        assert (logits[0, 14] == float("-inf")) == banned, accepted


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from conveyor.core.model_loader import ensure_embedded

    return AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m-instruct"))


@pytest.mark.parametrize("kernel", [True, False], ids=["c++", "torch"])
def test_the_grammar_mask_leaves_only_the_grammars_next_tokens(tokenizer, kernel):
    from conveyor.core.grammar import Grammars

    ops = cpu_kernels()
    if kernel and ops is None:
        pytest.skip("no C++ kernels here")
    vocab = 49152
    grammars = Grammars(tokenizer, vocab)
    s = SamplingParams(grammar=Grammar("choice", json.dumps(["bug", "feature"])))
    processors = Processors((EOS,), ops.apply_token_bitmask if kernel else None)
    entries = [_entry(SamplingParams()), _entry(s)]
    states = [None, LogitsState(s, [], grammars.matcher(s.grammar))]
    logits = torch.randn(2, vocab)
    plain = logits[0].clone()
    processors.apply(logits, entries, states)
    allowed = sorted(tokenizer.decode([i]) for i in torch.isfinite(logits[1]).nonzero().flatten().tolist())
    assert allowed == sorted(["b", "bu", "bug", "f", "fe", "feat", "feature"])
    assert torch.equal(logits[0], plain)
    with pytest.raises(ValueError, match="invalid regex"):
        grammars.matcher(Grammar("regex", "a(b"))


# -- state across preemption, on a tiny random Llama -----------------------------------------------------

class _Tokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x4E00 + int(i)) for i in ids)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.skipif(cpu_kernels() is None, reason="bitwise across preemption needs the exact cpu backend (C++ kernels)")
def test_processor_state_and_logprobs_survive_preemption(tiny):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (30, 41, 25, 37, 50, 33)]
    sampling = SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True, repetition_penalty=1.6,
                              presence_penalty=0.7, frequency_penalty=0.3, bad_words=[(5,), (7, 8)],
                              logit_bias={9: 3.0}, logprobs=2)

    def run(**config):
        engine = Engine(tiny, _Tokenizer(), EngineConfig(**config))
        outs = {o.req_id: o for o in engine.generate(GenerationRequest(f"p{i}", p, sampling)
                                                     for i, p in enumerate(prompts))}
        return outs, engine.stats().num_preemptions

    alone, _ = run(num_kv_blocks=128, block_size=4)
    squeezed, preemptions = run(num_kv_blocks=24, block_size=4, max_num_batched_tokens=16)
    assert preemptions > 0
    for name, out in alone.items():
        assert squeezed[name].output_token_ids == out.output_token_ids, name
        assert squeezed[name].logprobs == out.logprobs, name
        assert 5 not in out.output_token_ids
        assert len(out.logprobs) == 24 and all(len(lp.top) == 2 for lp in out.logprobs)


# -- one request's data breaking a step ends that request, never the run ----------------------------------------

def test_a_request_whose_processor_raises_ends_as_an_error_and_the_others_go_on(tiny):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (12, 17, 9)]
    fine = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={3: 1.0})
    broken = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=(999999,), min_tokens=2)

    def run(requests):
        engine = Engine(tiny, _Tokenizer(), EngineConfig(num_kv_blocks=64, block_size=4))
        outs = {o.req_id: o for o in engine.generate(requests)}
        assert not engine.has_unfinished() and engine.stats().kv_usage == 0.0  # nothing left holding blocks
        return outs

    alone = run([GenerationRequest("a", prompts[0], fine), GenerationRequest("c", prompts[2], fine)])
    outs = run([GenerationRequest("a", prompts[0], fine), GenerationRequest("b", prompts[1], broken),
                GenerationRequest("c", prompts[2], fine)])
    assert outs["b"].finish_reason == "error" and outs["b"].text == ""
    assert outs["b"].error.startswith("the request failed while it ran (MinTokens failed: IndexError")
    for name in ("a", "c"):
        assert outs[name].error is None and outs[name].finish_reason == "length"
        assert len(outs[name].output_token_ids) == len(alone[name].output_token_ids) == 6


def test_a_failed_row_leaves_the_other_rows_edits_alone():
    processors = Processors((EOS,))
    ok = SamplingParams(logit_bias={4: 5.0})
    bad = SamplingParams(logit_bias={10**9: 1.0})  # past any vocabulary
    logits = torch.zeros(3, 64)
    failed = processors.apply(logits, [_entry(ok), _entry(bad), _entry(ok)], [None, None, None])
    assert list(failed) == [1] and failed[1].startswith("LogitBias failed: IndexError")
    assert logits[0, 4] == logits[2, 4] == 5.0 and int((logits != 0).sum()) == 2
