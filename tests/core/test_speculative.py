"""Speculative decoding in the scheduler: prompt-lookup drafts, which steps carry them, and that a request
finishes with the same tokens with drafts and without, in any batching, under preemption and prefix caching,
and leaks no block.

Pure Python: the model is `FakeRunner` (a draft is accepted where it equals the fake token sampled before it),
and some requests "copy" their prompt so that drafts from it are right. Never imports torch.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_harness import EOS, FakeRunner, assert_no_leaks, check_finished, make_request, step

from conveyor.core import ConfigError, EngineConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.scheduler import Scheduler
from conveyor.core.speculative import (
    MIN_ACCEPTANCE,
    CostCurve,
    NgramIndex,
    SpeculativeConfig,
    Speculator,
)

FREE = CostCurve([(1, 1.0), (1024, 1.0)])  # every row costs nothing more: a draft pays wherever it may be right
STEEP = CostCurve([(1, 1.0), (2, 2.0), (1024, 1024.0)])  # each row costs as much as the first: never


class CopyRunner(FakeRunner):
    """FakeRunner whose `copies` requests generate their prompt over and over (drafts from it are right); the
    others generate the harness's fake tokens (drafts from them are almost always wrong)."""

    def __init__(self, scheduler, copies=(), eos_at=None) -> None:
        super().__init__(scheduler, eos_at)
        self.copies = set(copies)

    def token_for(self, req_id: str, index: int) -> int:
        if req_id in self.copies and self.eos_at.get(req_id) != index:
            prompt = self.prompts[req_id]
            return prompt[index % len(prompt)]
        return super().token_for(req_id, index)


def make(num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, cost=FREE, k=4,
         enable_prefix_caching=True):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
    speculator = None if cost is None else Speculator(SpeculativeConfig(k), cost)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, eos_token_ids=(EOS,), clock=lambda: 0.0,
                     speculator=speculator)


def run(sched, runner, requests):
    for r in requests:
        runner.add(r)
    plans = []
    for _ in range(10_000):
        if not sched.has_unfinished():
            return plans
        plan, _ = step(sched, runner)
        assert not plan.is_empty
        plans.append(plan)
    raise AssertionError("not done")


# -- the n-gram index ----------------------------------------------------------------------------------------------

def test_the_index_proposes_what_followed_the_longest_most_recent_match():
    index = NgramIndex(min_n=2, max_n=4)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # [2, 3] ends at 2 and at 7; [1, 2, 3] only at 2 and 7 too, but the sequence ends [5, 2, 3]: length 2 each,
    # the most recent wins
    assert index.propose(tokens, 3) == [7, 8, 5]
    tokens += [7, 8]  # now ends [2, 3, 7, 8]: the match at 9 (length 4)
    assert index.propose(tokens, 3) == [5, 2, 3]
    assert index.propose(tokens, 1) == [5]


def test_the_index_proposes_nothing_without_an_earlier_match_and_only_what_exists():
    index = NgramIndex(min_n=2, max_n=3)
    assert index.propose([1, 2, 3, 4], 4) == []
    assert index.propose([5], 4) == []
    assert index.propose([1, 2, 1, 2], 4) == [1, 2]  # [1, 2] ended at 1: what followed it, up to the end


def test_the_index_grows_lazily_with_the_sequence():
    index = NgramIndex(min_n=1, max_n=2)
    tokens = [4, 5, 6]
    assert index.propose(tokens, 2) == []
    tokens += [4]
    assert index.propose(tokens, 2) == [5, 6]
    assert index.indexed == len(tokens) - 1


# -- the cost curve ------------------------------------------------------------------------------------------------

def test_the_cost_curve_interpolates_extends_and_never_decreases():
    c = CostCurve([(1, 10.0), (8, 10.0), (16, 20.0), (32, 18.0)])
    assert c(1) == 10.0 and c(4) == 10.0 and c(12) == 15.0
    assert c(32) == 20.0  # a noisy dip is flattened
    assert c(64) == 20.0 and CostCurve([(1, 1.0), (2, 2.0)])(10) == 10.0


# -- scheduling with drafts ----------------------------------------------------------------------------------------

def test_a_copying_request_takes_drafts_and_finishes_in_fewer_steps_with_the_same_tokens():
    prompt = list(range(10, 30))
    alone = make(num_blocks=32, cost=None)
    ref_runner = CopyRunner(alone, copies={"a"})
    ref = make_request("a", prompt=prompt, max_tokens=40, ignore_eos=True)
    ref_steps = len(run(alone, ref_runner, [ref]))
    sched = make(num_blocks=32)
    runner = CopyRunner(sched, copies={"a"})
    req = make_request("a", prompt=prompt, max_tokens=40, ignore_eos=True)
    plans = run(sched, runner, [req])
    assert req.output_token_ids == ref.output_token_ids
    check_finished(req, runner)
    assert_no_leaks(sched)
    assert len(plans) < ref_steps / 3
    assert max(e.num_drafts for p in plans for e in p.scheduled) == 4
    stats = sched.speculator.stats
    assert stats.num_accepted_tokens == req.draft_state.accepted >= 28
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.9


def test_where_each_row_costs_as_much_as_the_first_no_draft_is_proposed():
    sched = make(num_blocks=32, cost=STEEP)
    runner = CopyRunner(sched, copies={"a"})
    req = make_request("a", prompt=list(range(10, 30)), max_tokens=20, ignore_eos=True)
    plans = run(sched, runner, [req])
    assert all(e.num_drafts == 0 for p in plans for e in p.scheduled)
    assert req.draft_state is None  # not even looked up


def test_drafts_stay_within_max_tokens_the_token_budget_and_the_free_blocks():
    sched = make(num_blocks=8, block_size=4, max_num_batched_tokens=3, k=8)
    runner = CopyRunner(sched, copies={"a"})
    req = make_request("a", prompt=list(range(10, 22)), max_tokens=9, ignore_eos=True)
    plans = run(sched, runner, [req])
    for p in plans:
        assert p.num_batched_tokens <= 3
    assert req.num_output_tokens == 9
    assert max(e.num_drafts for p in plans for e in p.scheduled) == 2
    check_finished(req, runner)
    assert_no_leaks(sched)


def test_a_request_whose_drafts_are_rejected_pauses_drafting_then_tries_again():
    speculator = Speculator(SpeculativeConfig(4), FREE)
    req = make_request("b", prompt=[11, 12, 13] * 4, max_tokens=60)
    assert speculator.choose([(req, 4)], 1) == {"b": [11, 12, 13, 11]}
    for _ in range(4):  # every draft rejected at its first token
        assert speculator.choose([(req, 4)], 1)
        speculator.verified(req, 4, 0)
    assert speculator._chance(req.draft_state, speculator.global_rate()) < MIN_ACCEPTANCE
    assert speculator.choose([(req, 4)], 1) == {}
    state = req.draft_state
    assert (state.resume_at, state.pause, state.tried) == (16, 32, 0)
    req.token_ids.extend([11, 12, 13] * 6)  # 18 tokens later: past its pause
    assert speculator.choose([(req, 4)], 1) == {"b": [11, 12, 13, 11]}
    assert speculator.stats.num_tried_tokens == 4 and speculator.stats.num_accepted_tokens == 0


def test_a_stop_among_accepted_drafts_drops_the_tokens_after_it():
    sched = make(num_blocks=32)
    prompt = list(range(10, 20))
    runner = CopyRunner(sched, copies={"a"}, eos_at={"a": 13})
    req = make_request("a", prompt=prompt, max_tokens=30)
    run(sched, runner, [req])
    assert req.num_output_tokens == 14 and req.output_token_ids[-1] == EOS
    check_finished(req, runner)
    assert_no_leaks(sched)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4]))
    prefixes = [draw(st.lists(st.integers(10, 30), min_size=block_size, max_size=4 * block_size)) for _ in range(2)]
    requests = []
    for i in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from([[], *prefixes]))
        suffix = draw(st.lists(st.integers(10, 30), min_size=0 if prefix else 1, max_size=12))
        requests.append(dict(req_id=f"r{i}", prompt=prefix + suffix, max_tokens=draw(st.integers(1, 24)),
                             copies=draw(st.booleans()), eos_at=draw(st.none() | st.integers(0, 23))))
    need = max(-(-(len(r["prompt"]) + r["max_tokens"]) // block_size) for r in requests)
    return dict(block_size=block_size, num_blocks=need + draw(st.integers(0, 8)), k=draw(st.integers(1, 6)),
                max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(1, 40)),
                requests=requests)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads())
def test_with_drafts_every_request_finishes_with_its_own_tokens_and_no_leaks(w):
    """The harness checks each plan against its simulated KV pool: every chunk continues where the request's
    valid K/V ends (a rejected draft's never counts), and no block is shared while written."""
    sched = make(w["num_blocks"], w["block_size"], w["max_num_seqs"], w["max_num_batched_tokens"], k=w["k"])
    runner = CopyRunner(sched, copies={r["req_id"] for r in w["requests"] if r["copies"]},
                        eos_at={r["req_id"]: r["eos_at"] for r in w["requests"] if r["eos_at"] is not None})
    requests = [make_request(r["req_id"], prompt=r["prompt"], max_tokens=r["max_tokens"]) for r in w["requests"]]
    run(sched, runner, requests)
    assert_no_leaks(sched)
    for r in requests:
        check_finished(r, runner)
    s = sched.speculator.stats
    assert s.num_accepted_tokens <= s.num_tried_tokens <= s.num_draft_tokens


@pytest.mark.parametrize("kwargs, field", [
    (dict(speculative="medusa"), "speculative"),
    (dict(num_speculative_tokens=3), "num_speculative_tokens"),
    (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative="ngram", num_speculative_tokens=33), "num_speculative_tokens"),
])
def test_a_speculation_setting_that_cannot_work_is_a_config_error_naming_its_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kwargs)
    assert e.value.field == field and field in str(e.value)
