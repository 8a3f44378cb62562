"""Sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds, min_tokens bans."""

from __future__ import annotations

import random

import pytest
import torch

from conveyor.core.sampler import Sampler, uniform_for
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.schedule_types import ScheduledRequest

EOS = 2
VOCAB = 50


def _entry(sampling: SamplingParams, num_output_tokens: int = 0, req_id: str = "r") -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=(1,), start_pos=5, block_ids=(0,), sample=True,
                            sampling=sampling, num_output_tokens=num_output_tokens)


def _logits(rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * scale


@pytest.fixture(params=["torch", "kernels"])
def sampler(request) -> Sampler:
    """The torch ops, and conveyor's C++ kernels (argmax and sampling) where they build."""
    if request.param == "torch":
        return Sampler([EOS])
    from conveyor.core.backends.cpu.kernels import cpu_kernels

    ops = cpu_kernels()
    if ops is None:
        pytest.skip("conveyor's C++ CPU kernels are unavailable here")
    return Sampler([EOS], argmax=ops.argmax_rows, sample_rows=ops.sample_rows)


def test_greedy_is_argmax(sampler):
    logits = _logits(16)
    entries = [_entry(SamplingParams(temperature=0)) for _ in range(16)]
    assert sampler(logits.clone(), entries) == logits.argmax(dim=-1).tolist()


def test_sampler_does_not_need_a_float32_input(sampler):
    logits = _logits(4).to(torch.bfloat16)
    assert sampler(logits, [_entry(SamplingParams(temperature=0))] * 4) == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("params", [
    dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=1, top_p=0.5, min_p=0.3),
], ids=["top_k=1", "top_p tiny", "min_p=1", "all three"])
def test_truncation_to_one_token_equals_greedy(sampler, params):
    logits = _logits(32, seed=1)
    entries = [_entry(SamplingParams(temperature=1.0, seed=s, **params), num_output_tokens=s) for s in range(32)]
    assert sampler(logits.clone(), entries) == logits.argmax(dim=-1).tolist()


def test_seeded_sampling_is_deterministic(sampler):
    logits = _logits(8, scale=1.0)
    entries = [_entry(SamplingParams(seed=100 + i, top_p=0.9), num_output_tokens=i) for i in range(8)]
    assert sampler(logits.clone(), entries) == sampler(logits.clone(), entries)


def test_seeded_sampling_is_independent_of_batch_composition_and_row_order(sampler):
    logits = _logits(12, seed=3, scale=1.0)
    params = [SamplingParams(seed=s, temperature=0.9, top_k=20, top_p=0.95, min_p=0.01) for s in range(6)]
    params += [SamplingParams(temperature=0), SamplingParams(temperature=1.3, seed=77, min_tokens=3),
               SamplingParams(seed=5, temperature=0.5), SamplingParams(), SamplingParams(temperature=0.7, seed=1),
               SamplingParams(seed=9, top_k=3)]
    entries = [_entry(p, num_output_tokens=i % 4, req_id=f"r{i}") for i, p in enumerate(params)]
    alone = {i: sampler(logits[i:i + 1].clone(), [entries[i]])[0] for i in range(12) if params[i].seed is not None}
    together = sampler(logits.clone(), entries)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = sampler(logits[perm].clone(), [entries[i] for i in perm])
    for i, token in alone.items():
        assert together[i] == token
        assert shuffled[perm.index(i)] == token
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]  # the greedy rows among the sampled ones
    assert greedy and all(together[i] == logits[i].argmax().item() for i in greedy)


def test_different_seeds_give_different_tokens(sampler):
    logits = torch.zeros(64, VOCAB)  # uniform: every draw picks its own token
    tokens = sampler(logits, [_entry(SamplingParams(seed=s)) for s in range(64)])
    assert len(set(tokens)) > 20


def test_the_draw_depends_on_the_output_index(sampler):
    logits = torch.zeros(32, VOCAB)
    tokens = sampler(logits, [_entry(SamplingParams(seed=7), num_output_tokens=n) for n in range(32)])
    assert len(set(tokens)) > 10


def test_uniform_for_is_a_fixed_function_in_unit_interval():
    values = [uniform_for(seed, i) for seed in range(50) for i in range(50)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert uniform_for(3, 4) == uniform_for(3, 4) != uniform_for(4, 3)
    assert 0.45 < sum(values) / len(values) < 0.55


def test_min_tokens_bans_eos_and_stop_ids_until_reached(sampler):
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 7] = 9.0
    logits[0, 8] = 8.0
    greedy_min = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7])
    assert sampler(logits.clone(), [_entry(greedy_min, num_output_tokens=0)]) == [8]
    assert sampler(logits.clone(), [_entry(greedy_min, num_output_tokens=2)]) == [8]
    assert sampler(logits.clone(), [_entry(greedy_min, num_output_tokens=3)]) == [EOS]
    # sampling respects the ban too, whatever the seed (unbanned, EOS would win 2 draws in 3)
    for seed in range(20):
        sp = SamplingParams(temperature=1.0, min_tokens=1, seed=seed)
        assert sampler(logits.clone(), [_entry(sp)]) != [EOS]
    # ignore_eos: EOS is a plain token, not banned
    assert sampler(logits.clone(), [_entry(SamplingParams(temperature=0, min_tokens=3, ignore_eos=True))]) == [EOS]


def test_min_tokens_ban_applies_only_to_its_own_row(sampler):
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 10.0
    entries = [_entry(SamplingParams(temperature=0, min_tokens=2), req_id="a"),
               _entry(SamplingParams(temperature=0), req_id="b")]
    tokens = sampler(logits, entries)
    assert tokens[0] != EOS and tokens[1] == EOS


def _frequencies(sampler, logits_row: torch.Tensor, params: dict, n: int = 4000) -> torch.Tensor:
    logits = logits_row.unsqueeze(0).repeat(n, 1)
    tokens = sampler(logits, [_entry(SamplingParams(seed=s, **params)) for s in range(n)])
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.numel()).float() / n


ROW = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def test_temperature_one_matches_softmax(sampler):
    freq = _frequencies(sampler, ROW, dict(temperature=1.0))
    assert torch.allclose(freq, torch.softmax(ROW, -1), atol=0.03)


def test_temperature_sharpens_and_flattens(sampler):
    for t in (0.5, 2.0):
        freq = _frequencies(sampler, ROW, dict(temperature=t))
        assert torch.allclose(freq, torch.softmax(ROW / t, -1), atol=0.03)


def test_top_k_keeps_the_k_most_likely(sampler):
    freq = _frequencies(sampler, ROW, dict(top_k=3))
    want = torch.zeros(8)
    want[:3] = torch.softmax(ROW[:3], -1)
    assert torch.allclose(freq, want, atol=0.03) and freq[3:].sum() == 0


def test_top_p_keeps_the_smallest_prefix_reaching_p(sampler):
    probs = torch.softmax(ROW, -1)  # 0.39, 0.24, 0.14, 0.09, ...
    freq = _frequencies(sampler, ROW, dict(top_p=0.7))
    want = torch.zeros(8)
    want[:3] = probs[:3] / probs[:3].sum()  # 0.39 + 0.24 < 0.7 <= + 0.14
    assert torch.allclose(freq, want, atol=0.03) and freq[3:].sum() == 0


def test_min_p_drops_tokens_below_a_fraction_of_the_top(sampler):
    probs = torch.softmax(ROW, -1)
    freq = _frequencies(sampler, ROW, dict(min_p=0.3))  # keeps p >= 0.3 * 0.39: the first three
    keep = probs >= 0.3 * probs[0]
    assert keep.tolist() == [True, True, True, False, False, False, False, False]
    want = torch.where(keep, probs, torch.zeros(8))
    assert torch.allclose(freq, want / want.sum(), atol=0.03) and freq[3:].sum() == 0


def test_unseeded_sampling_still_follows_the_distribution(sampler):
    random.seed(0)
    logits = ROW.unsqueeze(0).repeat(4000, 1)
    tokens = sampler(logits, [_entry(SamplingParams(temperature=1.0))] * 4000)
    freq = torch.bincount(torch.tensor(tokens), minlength=8).float() / 4000
    assert torch.allclose(freq, torch.softmax(ROW, -1), atol=0.03)
