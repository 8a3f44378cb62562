"""A request stopped mid-generation and continued in another engine (from `Engine.in_flight`) ends as it would
have uninterrupted: its tokens, its logprobs, its stop strings and its processors' state; what it carries is
checked. On a tiny random Llama."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
from conveyor.core.backends.cpu.kernels import cpu_kernels
from conveyor.core.engine import Engine


class _Tokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x4E00 + int(i) % 64) for i in ids)  # few characters: stop strings get hit


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def _requests(sampling: SamplingParams) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(11)
    return [GenerationRequest(f"p{i}", torch.randint(0, 256, (n,), generator=g).tolist(), sampling)
            for i, n in enumerate((9, 23, 14, 31, 6, 18))]


def _engine(tiny, **config) -> Engine:
    return Engine(tiny, _Tokenizer(), EngineConfig(**{"num_kv_blocks": 96, "block_size": 4, **config}))


def _interrupted(tiny, requests, steps: int, **config) -> dict:
    """Run `steps` steps, stop, and continue everything unfinished in a new engine: every request's output."""
    first = _engine(tiny, **config)
    outs = {}
    for request in requests:
        first.add_request(request)
    for _ in range(steps):
        outs.update((o.req_id, o) for o in first.step())
    carried = first.in_flight()
    assert carried and all(len(c.output_token_ids) > 0 for c in carried.values())
    second = _engine(tiny, **config)
    rest = [GenerationRequest(r.req_id, r.prompt_token_ids, r.sampling, output_token_ids=carried[r.req_id].output_token_ids,
                              output_logprobs=carried[r.req_id].output_logprobs)
            if r.req_id in carried else r for r in requests if r.req_id not in outs]
    outs.update((o.req_id, o) for o in second.generate(rest))
    return outs


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, bad_words=[(5,), (7, 8)],
                        logit_bias={9: 2.0}, logprobs=2, stop=["\u4e05\u4e06"])


@pytest.mark.parametrize("steps", [3, 11])
def test_a_continued_request_ends_as_it_would_have_uninterrupted(tiny, steps):
    requests = _requests(GREEDY)
    alone = {o.req_id: o for o in _engine(tiny).generate(requests)}
    continued = _interrupted(tiny, requests, steps)
    for name, out in alone.items():
        assert continued[name].output_token_ids == out.output_token_ids, name
        assert continued[name].text == out.text and continued[name].finish_reason == out.finish_reason, name
        assert [lp.token_id for lp in continued[name].logprobs] == [lp.token_id for lp in out.logprobs], name


@pytest.mark.skipif(cpu_kernels() is None, reason="sampled bits equal across a continuation need the exact cpu "
                    "backend (C++ kernels)")
def test_a_continued_seeded_request_draws_the_same_tokens_with_its_prefix_cached(tiny):
    requests = _requests(SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True, logprobs=1,
                                        presence_penalty=0.5))
    alone = {o.req_id: o for o in _engine(tiny).generate(requests)}
    continued = _interrupted(tiny, requests, 7, max_num_batched_tokens=16)
    for name, out in alone.items():
        assert continued[name].output_token_ids == out.output_token_ids, name
        assert continued[name].logprobs == out.logprobs, name


def test_what_a_continued_request_carries_is_checked(tiny):
    engine = _engine(tiny)
    prompt = [1, 2, 3]
    with pytest.raises(ValueError, match="max_tokens is 4"):
        engine.add_request(GenerationRequest("a", prompt, SamplingParams(max_tokens=4), output_token_ids=(5,) * 4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(GenerationRequest("b", prompt, SamplingParams(max_tokens=9), output_token_ids=(999,)))
    with pytest.raises(ValueError, match="logprobs it carries"):
        engine.add_request(GenerationRequest("c", prompt, SamplingParams(max_tokens=9, logprobs=1),
                                             output_token_ids=(5, 6)))
    assert not engine.has_unfinished()
