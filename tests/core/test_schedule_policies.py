"""Scheduling policies (fcfs, priority, sjf, lpm): the order requests are admitted in, who is preempted, and that
every policy finishes every request with the same tokens and leaks nothing.

Pure Python: requests are built from numbers and the model is `FakeRunner`. Never imports torch.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scheduler_harness import (
    FakeRunner,
    assert_no_leaks,
    check_finished,
    make_request,
    step,
)

from conveyor.core import SCHEDULES, ConfigError, EngineConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.request import RequestStatus
from conveyor.core.scheduler import Scheduler

EOS = 2


def make(schedule: str, num_blocks: int, block_size: int = 4, max_num_seqs: int = 8,
         max_num_batched_tokens: int = 64, enable_prefix_caching: bool = True) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, eos_token_ids=(EOS,), clock=lambda: 0.0,
                     schedule=schedule)


def policy_step(sched: Scheduler, runner: FakeRunner):
    """One step under any policy: the harness's step checks fcfs's own order, so this checks the invariants only."""
    plan = sched.schedule()
    sched.check_invariants(plan)
    for e in plan.scheduled:
        assert sched.requests[e.req_id].status is RequestStatus.RUNNING
    finished = sched.update_from_output(plan, runner.execute(plan))
    sched.check_invariants()
    return plan, finished


def admission_order(sched: Scheduler, runner: FakeRunner) -> list[str]:
    """Request ids in the order they were first scheduled, run to completion."""
    order: list[str] = []
    for _ in range(10_000):
        if not sched.has_unfinished():
            return order
        plan, _ = policy_step(sched, runner)
        order += [e.req_id for e in plan.scheduled if e.req_id not in order]
    raise AssertionError("not done")


# -- every policy: same tokens, no leaks ---------------------------------------------------------------------------

SMALL_VOCAB = st.integers(10, 40)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4]))
    prefixes = [draw(st.lists(SMALL_VOCAB, min_size=block_size, max_size=4 * block_size)) for _ in range(2)]
    requests = []
    for i in range(draw(st.integers(1, 12))):
        prefix = draw(st.sampled_from([[], *prefixes]))
        suffix = draw(st.lists(SMALL_VOCAB, min_size=0 if prefix else 1, max_size=16))
        requests.append(dict(req_id=f"r{i}", prompt=prefix + suffix, max_tokens=draw(st.integers(1, 10)),
                             priority=draw(st.integers(0, 3)), arrival=draw(st.integers(0, 10)),
                             eos_at=draw(st.none() | st.integers(0, 9))))
    need = max(-(-(len(r["prompt"]) + r["max_tokens"]) // block_size) for r in requests)
    return dict(block_size=block_size, num_blocks=need + draw(st.integers(0, 8)),
                max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(1, 40)),
                requests=requests)


def _request(req_id, prompt, max_tokens, priority, arrival):
    return dict(req_id=req_id, prompt=prompt, max_tokens=max_tokens, priority=priority, arrival=arrival, eos_at=None)


# Found by this test: under priority, r0 (priority 1) was preempted for r3 (priority 0), and in the same step, with
# its first block still cached, admitted again behind r3 (the harness refuses a plan that preempts and schedules
# one request). Its victims now wait for the next step.
@pytest.mark.parametrize("schedule", SCHEDULES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads())
@example(w=dict(block_size=4, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=16, requests=[
    _request("r0", [10, 10, 10, 11], 4, 1, 2), _request("r1", [10, 10, 10, 12], 1, 0, 2),
    _request("r2", [10, 10, 10, 11], 7, 0, 0), _request("r3", [10] * 13, 1, 0, 5),
    _request("r4", [10, 10, 10, 11], 1, 0, 0), *(_request(f"r{i}", [10], 1, 0, 0) for i in (5, 6, 7)),
    _request("r8", [10, 10, 10, 12, 10, 10, 10, 10, 10, 10, 10], 4, 0, 2)]))
def test_every_policy_finishes_every_request_with_its_own_tokens_and_no_leaks(schedule, w):
    sched = make(schedule, w["num_blocks"], w["block_size"], w["max_num_seqs"], w["max_num_batched_tokens"])
    runner = FakeRunner(sched, eos_at={r["req_id"]: r["eos_at"] for r in w["requests"] if r["eos_at"] is not None})
    requests = {r["req_id"]: make_request(r["req_id"], prompt=r["prompt"], max_tokens=r["max_tokens"],
                                          priority=r["priority"] if schedule == "priority" else 0)
                for r in w["requests"]}
    arrivals = sorted(w["requests"], key=lambda r: r["arrival"])
    t = 0
    while arrivals or sched.has_unfinished():
        assert t < 5000, "the workload did not finish"
        while arrivals and arrivals[0]["arrival"] <= t:
            runner.add(requests[arrivals.pop(0)["req_id"]])
        if sched.has_unfinished():
            plan, _ = policy_step(sched, runner)
            assert not plan.is_empty, "nothing scheduled while requests wait"
        t += 1
    assert_no_leaks(sched)
    for r in requests.values():
        check_finished(r, runner)


def test_fcfs_is_the_default_and_plans_exactly_as_the_scheduler_without_a_schedule():
    plans = []
    for sched in (make("fcfs", 12, max_num_seqs=3, max_num_batched_tokens=10),
                  Scheduler(BlockManager(12, 4), 3, 10, eos_token_ids=(EOS,), clock=lambda: 0.0)):
        runner = FakeRunner(sched)
        for i in range(6):
            runner.add(make_request(f"r{i}", 5 + 3 * i, max_tokens=6))
        seen = []
        while sched.has_unfinished():
            plan, _ = step(sched, runner)  # the harness's fcfs checks: victims newest, readmitted first
            seen.append(plan)
        plans.append(seen)
        assert_no_leaks(sched)
    assert plans[0] == plans[1]
    assert any(p.preempted_req_ids for p in plans[0])  # the pool is small enough to preempt
    assert EngineConfig().schedule == "fcfs"


# -- priority ------------------------------------------------------------------------------------------------------

def test_priority_admits_lower_values_first_and_ties_in_arrival_order():
    sched = make("priority", 32, max_num_seqs=1)
    runner = FakeRunner(sched)
    for name, prio in [("p2a", 2), ("p0a", 0), ("p1", 1), ("p0b", 0), ("p2b", 2)]:
        runner.add(make_request(name, 3, priority=prio, max_tokens=2))
    assert admission_order(sched, runner) == ["p0a", "p0b", "p1", "p2a", "p2b"]
    assert_no_leaks(sched)


def test_a_higher_priority_arrival_preempts_the_lowest_priority_running_request_when_memory_is_short():
    sched = make("priority", 6, block_size=4, max_num_seqs=4)
    runner = FakeRunner(sched)
    low = make_request("low", 8, priority=5, max_tokens=8)  # 2 blocks each after their prefill: 2 of 6 free
    mid = make_request("mid", 8, priority=3, max_tokens=8)
    runner.add(low)
    runner.add(mid)  # the newest admitted
    policy_step(sched, runner)
    assert sorted(r.req_id for r in sched.running) == ["low", "mid"]
    urgent = make_request("urgent", 12, priority=0, max_tokens=4)  # its prompt needs 3 blocks
    runner.add(urgent)
    plan, _ = policy_step(sched, runner)
    assert plan.preempted_req_ids == ["low"]  # the lowest priority, not the newest admitted
    assert "urgent" in [e.req_id for e in plan.scheduled]
    assert low.status is RequestStatus.PREEMPTED and list(sched.waiting) == [low]
    admission_order(sched, runner)
    for r in (low, mid, urgent):
        check_finished(r, runner)
    assert_no_leaks(sched)


def test_an_equal_priority_arrival_waits_instead_of_preempting():
    sched = make("priority", 6, block_size=4, max_num_seqs=4)
    runner = FakeRunner(sched)
    runner.add(make_request("a", 8, priority=1, max_tokens=8))
    runner.add(make_request("b", 8, priority=1, max_tokens=8))
    policy_step(sched, runner)
    runner.add(make_request("c", 12, priority=1, max_tokens=4))
    plan, _ = policy_step(sched, runner)
    assert not plan.preempted_req_ids and [r.req_id for r in sched.waiting] == ["c"]


def test_priority_preempts_for_a_waiting_request_when_the_sequence_cap_is_reached():
    sched = make("priority", 64, max_num_seqs=2)
    runner = FakeRunner(sched)
    runner.add(make_request("a", 4, priority=2, max_tokens=8))
    runner.add(make_request("b", 4, priority=1, max_tokens=8))
    policy_step(sched, runner)
    runner.add(make_request("c", 4, priority=0, max_tokens=8))
    plan, _ = policy_step(sched, runner)
    assert plan.preempted_req_ids == ["a"]
    assert sorted(r.req_id for r in sched.running) == ["b", "c"]


def test_under_memory_pressure_priority_preempts_the_lowest_priority_running_request():
    sched = make("priority", 6, block_size=4, max_num_seqs=4)
    runner = FakeRunner(sched)
    runner.add(make_request("hi", 4, priority=0, max_tokens=8))  # grows to 3 blocks
    runner.add(make_request("lo", 4, priority=9, max_tokens=8))
    runner.add(make_request("mid", 4, priority=4, max_tokens=8))
    victims = []
    while sched.has_unfinished():
        plan, _ = policy_step(sched, runner)
        victims += plan.preempted_req_ids
    assert victims and victims[0] == "lo"
    assert "hi" not in victims
    assert_no_leaks(sched)


# -- sjf -----------------------------------------------------------------------------------------------------------

def test_sjf_admits_the_shortest_prompt_plus_max_tokens_first():
    sched = make("sjf", 64, max_num_seqs=1)
    sched.policy.max_overtaken = 10  # (max_num_seqs by default: 1 here would age every request at once)
    runner = FakeRunner(sched)
    for name, n, mt in [("long", 12, 8), ("short", 3, 2), ("mid", 6, 4), ("tiny", 2, 1)]:
        runner.add(make_request(name, n, max_tokens=mt))
    assert admission_order(sched, runner) == ["tiny", "short", "mid", "long"]
    assert_no_leaks(sched)


def test_sjf_aging_bounds_how_many_later_arrivals_overtake_a_long_request():
    max_num_seqs = 2
    sched = make("sjf", 64, max_num_seqs=max_num_seqs)
    runner = FakeRunner(sched)
    runner.add(make_request("long", 20, max_tokens=8))
    order: list[str] = []
    for i in range(12):  # a steady stream of shorter requests arriving after it
        runner.add(make_request(f"s{i}", 2, max_tokens=1))
        plan, _ = policy_step(sched, runner)
        order += [e.req_id for e in plan.scheduled if e.req_id not in order]
    order += [r for r in admission_order(sched, runner) if r not in order]
    assert order.index("long") <= max_num_seqs  # overtaken by at most max_num_seqs later arrivals
    assert_no_leaks(sched)


# -- lpm -----------------------------------------------------------------------------------------------------------

def test_lpm_runs_requests_sharing_a_cached_prefix_together():
    sched = make("lpm", 64, block_size=4, max_num_seqs=1)
    runner = FakeRunner(sched)
    a, b = list(range(10, 22)), list(range(30, 42))  # two 3-block prefixes
    runner.add(make_request("a0", prompt=a + [50], max_tokens=1))
    for i in range(1, 4):
        runner.add(make_request(f"b{i}", prompt=b + [50 + i], max_tokens=1))
        runner.add(make_request(f"a{i}", prompt=a + [50 + i], max_tokens=1))
    order = admission_order(sched, runner)
    assert order[:4] == ["a0", "a1", "a2", "a3"]  # a0's prefix is cached: its group goes first
    assert order[4:] == ["b1", "b2", "b3"]
    assert_no_leaks(sched)


def test_fcfs_interleaves_the_same_groups_in_input_order():
    sched = make("fcfs", 64, block_size=4, max_num_seqs=1)
    runner = FakeRunner(sched)
    a, b = list(range(10, 22)), list(range(30, 42))
    runner.add(make_request("a0", prompt=a + [50], max_tokens=1))
    for i in range(1, 3):
        runner.add(make_request(f"b{i}", prompt=b + [50 + i], max_tokens=1))
        runner.add(make_request(f"a{i}", prompt=a + [50 + i], max_tokens=1))
    assert admission_order(sched, runner) == ["a0", "b1", "a1", "b2", "a2"]


# -- configuration -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field, says", [
    (dict(schedule="random"), "schedule", "schedule must be one of fcfs, priority, sjf, lpm"),
    (dict(lookahead=256), "lookahead", "fcfs runs requests in input order"),
    (dict(schedule="sjf", lookahead=0), "lookahead", "lookahead must be a positive integer"),
    (dict(schedule="sjf", lookahead=100, max_waiting=50), "lookahead", "give one"),
    (dict(schedule="lpm", enable_prefix_caching=False), "schedule", "prefix caching is off"),
])
def test_a_schedule_setting_that_cannot_work_is_a_config_error_naming_its_field(kwargs, field, says):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kwargs)
    assert e.value.field == field and says in str(e.value)


def test_lookahead_sets_how_many_requests_wait_and_defaults_to_twice_the_batch():
    assert EngineConfig(schedule="sjf").for_device("cpu").max_waiting == 128
    assert EngineConfig(schedule="sjf", max_num_seqs=8).for_device("cpu").max_waiting == 64
    assert EngineConfig(schedule="lpm", lookahead=1000).for_device("cpu").max_waiting == 1000
