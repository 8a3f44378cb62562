"""Scheduler: token budget, chunked prefill, preemption, priorities, aborts, random workloads.

Pure Python: requests are built from numbers and the model is `FakeRunner`. Never imports torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_harness import (
    EOS,
    FakeRunner,
    assert_no_leaks,
    check_finished,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)

from conveyor.core.request import FinishReason, Request, RequestStatus
from conveyor.core.sampling_params import SamplingParams


def test_importing_the_pure_python_engine_leaves_torch_unloaded():
    code = ("import sys, conveyor.core, conveyor.core.scheduler, conveyor.core.block_manager, "
            "conveyor.core.stopping, conveyor.core.request, conveyor.core.schedule_types; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_single_request_prefills_then_decodes_to_max_tokens():
    sched = make_scheduler(num_blocks=8)
    runner = FakeRunner(sched)
    runner.add(make_request("a", 6, max_tokens=4))
    plan, finished = step(sched, runner)
    [e] = plan.scheduled
    assert (e.start_pos, e.num_tokens, e.sample) == (0, 6, True)
    assert not finished
    for pos in (6, 7, 8):
        plan, finished = step(sched, runner)
        [e] = plan.scheduled
        assert (e.start_pos, e.num_tokens, e.sample) == (pos, 1, True)
    [r] = finished
    assert r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 4
    check_finished(r, runner)
    assert_no_leaks(sched)


def test_chunked_prefill_spans_steps_and_samples_only_on_the_last_chunk():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    runner = FakeRunner(sched)
    r = make_request("long", 20, max_tokens=2)
    runner.add(r)
    chunks = []
    for _ in range(3):
        plan, _ = step(sched, runner)
        [e] = plan.scheduled
        chunks.append((e.start_pos, e.num_tokens, e.sample))
        assert plan.num_batched_tokens == e.num_tokens <= 8
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert r.num_output_tokens == 1 and r.num_computed_tokens == 20
    run_to_completion(sched, runner)
    check_finished(r, runner)
    assert_no_leaks(sched)


def test_running_decodes_go_first_and_a_new_prompt_gets_the_rest_of_the_budget():
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=8)
    runner = FakeRunner(sched)
    runner.add(make_request("a", 3, max_tokens=10))
    step(sched, runner)
    runner.add(make_request("b", 30, max_tokens=2))
    plan, _ = step(sched, runner)
    assert [(e.req_id, e.start_pos, e.num_tokens, e.sample) for e in plan.scheduled] == [
        ("a", 3, 1, True), ("b", 0, 7, False)]
    plan, _ = step(sched, runner)
    assert [(e.req_id, e.start_pos, e.num_tokens) for e in plan.scheduled] == [("a", 4, 1), ("b", 7, 7)]
    run_to_completion(sched, runner)
    assert_no_leaks(sched)


def _run_until_preemption(sched, runner, max_steps=50):
    for _ in range(max_steps):
        plan, _ = step(sched, runner)
        if plan.preempted_req_ids:
            return plan
    raise AssertionError("no preemption happened")


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_preemption_takes_the_newest_puts_it_first_in_waiting_and_recomputes_it(enable_prefix_caching):
    # 6 blocks of 4. a: 9 prompt tokens (3 blocks), b: 8 (2 blocks). b's decode takes the last free
    # block in step 2; in step 5, a crosses into its 4th block and must preempt b, the newest.
    sched = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=enable_prefix_caching)
    runner = FakeRunner(sched)
    a = make_request("a", 9, max_tokens=12)
    b = make_request("b", 8, max_tokens=12)
    runner.add(a)
    runner.add(b)
    for _ in range(4):
        step(sched, runner)
    c = make_request("c", 3, max_tokens=1)  # would fit once b's blocks are back
    runner.add(c)
    b_tokens_before = list(b.token_ids)
    plan = _run_until_preemption(sched, runner)
    assert plan.preempted_req_ids == ["b"]
    assert [e.req_id for e in plan.scheduled] == ["a"]  # c is not admitted in a step that preempted
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and not b.block_ids
    assert b.num_preemptions == 1 and sched.stats.num_preemptions == 1
    assert list(sched.waiting) == [b, c]
    assert b.token_ids == b_tokens_before and b.num_output_tokens == 4

    while True:  # b comes back before c, with prompt + its 4 generated tokens
        plan, _ = step(sched, runner)
        ids = [e.req_id for e in plan.scheduled]
        if "b" in ids or "c" in ids:
            break
    entry = plan.scheduled[ids.index("b")]
    assert "c" not in ids or ids.index("c") > ids.index("b")
    assert entry.sample and entry.start_pos + entry.num_tokens == len(b_tokens_before)
    assert list(entry.token_ids) == b_tokens_before[entry.start_pos:]
    if enable_prefix_caching:
        assert entry.start_pos > 0  # its freed prompt blocks were still cached
    else:
        assert entry.start_pos == 0
    for r in run_to_completion(sched, runner) + [a]:
        check_finished(r, runner)
    assert b.num_output_tokens == 12 and a.num_output_tokens == 12
    if not enable_prefix_caching:  # b's prompt was fed twice
        assert sched.stats.num_computed_prompt_tokens == 9 + 8 + 3 + 8
    assert_no_leaks(sched)


def test_preemption_victims_are_taken_newest_first_among_three():
    sched = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    reqs = [make_request(name, 3, max_tokens=7) for name in ("x", "y", "z")]  # 10 tokens = 5 blocks each
    for r in reqs:
        runner.add(r)
    victims = []
    while sched.has_unfinished():
        plan, _ = step(sched, runner)  # check_plan asserts victims are the newest admitted
        victims += plan.preempted_req_ids
    assert victims and victims[0] == "z"
    for r in reqs:
        check_finished(r, runner)
    assert_no_leaks(sched)


def test_a_request_can_preempt_itself_when_it_is_the_newest():
    # 5 blocks of 2: after the prefills one is free; a takes it, then b needs one and is the newest.
    sched = make_scheduler(num_blocks=5, block_size=2, max_num_seqs=2)
    runner = FakeRunner(sched)
    a, b = make_request("a", 4, max_tokens=6), make_request("b", 4, max_tokens=6)
    runner.add(a)
    runner.add(b)
    plan = _run_until_preemption(sched, runner)
    assert plan.preempted_req_ids == ["b"] and [e.req_id for e in plan.scheduled] == ["a"]
    run_to_completion(sched, runner)
    check_finished(a, runner)
    check_finished(b, runner)
    assert_no_leaks(sched)


def test_lower_priority_value_runs_first_and_ties_run_in_arrival_order():
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    runner = FakeRunner(sched)
    for name, prio in [("p2a", 2), ("p0a", 0), ("p1", 1), ("p0b", 0), ("p2b", 2), ("p1b", 1)]:
        runner.add(make_request(name, 3, priority=prio, max_tokens=1))
    order = []
    while sched.has_unfinished():
        plan, _ = step(sched, runner)
        order += [e.req_id for e in plan.scheduled]
    assert order == ["p0a", "p0b", "p1", "p1b", "p2a", "p2b"]
    assert_no_leaks(sched)


def test_sequence_cap_and_token_budget_are_respected():
    sched = make_scheduler(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=5)
    runner = FakeRunner(sched)
    for i in range(5):
        runner.add(make_request(f"r{i}", 7, max_tokens=3))
    while sched.has_unfinished():
        plan, _ = step(sched, runner)
        assert len(plan.scheduled) <= 2 and len(sched.running) <= 2
        assert plan.num_batched_tokens <= 5
    assert_no_leaks(sched)


def test_eos_finishes_a_request_and_frees_its_blocks_at_once():
    sched = make_scheduler(num_blocks=8)
    runner = FakeRunner(sched, eos_at={"a": 2})
    a = make_request("a", 5, max_tokens=10)
    runner.add(a)
    finished = run_to_completion(sched, runner)
    assert finished == [a]
    assert a.finish_reason is FinishReason.STOP and a.status is RequestStatus.FINISHED_STOPPED
    assert a.output_token_ids[-1] == EOS and a.num_output_tokens == 3
    assert_no_leaks(sched)


def test_eos_before_min_tokens_and_with_ignore_eos_does_not_stop():
    sched = make_scheduler(num_blocks=8)
    runner = FakeRunner(sched, eos_at={"min": 1, "ign": 1})
    runner.add(make_request("min", 3, max_tokens=6, min_tokens=3))
    runner.add(make_request("ign", 3, max_tokens=6, ignore_eos=True))
    for r in run_to_completion(sched, runner):
        assert r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 6
        assert r.output_token_ids[1] == EOS
        check_finished(r, runner)
    assert_no_leaks(sched)


def test_aborts_while_waiting_running_and_during_the_forward_pass():
    sched = make_scheduler(num_blocks=16, max_num_seqs=2)
    runner = FakeRunner(sched)
    reqs = {n: make_request(n, 6, max_tokens=8) for n in ("run", "mid", "wait")}
    for r in reqs.values():
        runner.add(r)
    step(sched, runner)
    assert reqs["wait"].status is RequestStatus.WAITING
    sched.finish_request(reqs["wait"], FinishReason.ABORT)
    sched.finish_request(reqs["run"], FinishReason.ABORT)
    sched.check_invariants()
    assert not reqs["run"].block_ids
    plan, finished = step(sched, runner, mid_step=lambda: sched.finish_request(reqs["mid"], FinishReason.ABORT))
    assert [e.req_id for e in plan.scheduled] == ["mid"] and finished == []
    assert reqs["mid"].num_output_tokens == 1  # the token sampled after the abort was dropped
    for r in reqs.values():
        assert r.finish_reason is FinishReason.ABORT and r.status is RequestStatus.FINISHED_ABORTED
    assert_no_leaks(sched)


def test_add_request_rejects_a_request_that_can_never_fit_the_pool():
    sched = make_scheduler(num_blocks=4, block_size=4)  # 16 token slots
    with pytest.raises(ValueError, match=r"'big'.*17 tokens.*16"):
        sched.add_request(make_request("big", 10, max_tokens=7))
    assert not sched.has_unfinished()
    runner = FakeRunner(sched)
    fits = make_request("fits", 10, max_tokens=6)
    runner.add(fits)
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("fits", 3))
    run_to_completion(sched, runner)
    check_finished(fits, runner)
    assert_no_leaks(sched)


def test_check_invariants_catches_a_corrupted_ref_count():
    sched = make_scheduler(num_blocks=8)
    runner = FakeRunner(sched)
    runner.add(make_request("a", 5))
    step(sched, runner)
    sched.block_manager.blocks[sched.running[0].block_ids[0]].ref_count += 1
    with pytest.raises(AssertionError):
        sched.check_invariants()


def test_a_request_the_scheduler_never_took_ends_there_and_leaves_the_one_it_holds_under_its_id_alone():
    sched = make_scheduler(num_blocks=8)
    runner = FakeRunner(sched)
    held = make_request("a", 6, max_tokens=4)
    runner.add(held)
    step(sched, runner)
    blocks = list(held.block_ids)
    refused = Request.refused("a", [], SamplingParams(), priority=0, arrival_time=0.0)  # (its prompt may be empty)
    sched.finish_request(refused, FinishReason.ERROR, "request id 'a' is already in the engine")
    assert refused.status is RequestStatus.FINISHED_ERROR and refused.error == "request id 'a' is already in the engine"
    assert refused.finish_time == 0.0 and refused.num_prompt_tokens == 0
    assert sched.requests["a"] is held and held.block_ids == blocks and held.status is RequestStatus.RUNNING
    [done] = run_to_completion(sched, runner)
    assert done is held and done.finish_reason is FinishReason.LENGTH and done.error is None
    check_finished(held, runner)
    assert_no_leaks(sched)


def test_a_stopped_request_whose_output_is_refused_ends_as_an_error_before_its_blocks_go_back():
    sched = make_scheduler(num_blocks=8)
    runner = FakeRunner(sched)
    runner.add(make_request("a", 6, max_tokens=2))
    runner.add(make_request("b", 6, max_tokens=2))
    seen = []

    def check_output(request):
        seen.append((request.req_id, request.status, bool(request.block_ids)))
        return "the output does not match its JSON schema: 7 is not allowed" if request.req_id == "b" else None

    finished = []
    while sched.has_unfinished():
        plan = sched.schedule()
        finished += sched.update_from_output(plan, runner.execute(plan), check_output=check_output)
    assert seen == [("a", RequestStatus.RUNNING, True), ("b", RequestStatus.RUNNING, True)]
    a, b = finished
    assert (a.finish_reason, a.error) == (FinishReason.LENGTH, None)
    assert (b.finish_reason, b.status) == (FinishReason.ERROR, RequestStatus.FINISHED_ERROR)
    assert b.error == "the output does not match its JSON schema: 7 is not allowed" and b.num_output_tokens == 2
    assert_no_leaks(sched)


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="no tokens"):
        Request("e", [], SamplingParams())


# -- random workloads ---------------------------------------------------------------------------

SMALL_VOCAB = st.integers(10, 16)  # few distinct ids, so prompts and outputs often share blocks


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    prefixes = [draw(st.lists(SMALL_VOCAB, min_size=1, max_size=24)) for _ in range(2)]
    requests = []
    for i in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from([[], *prefixes]))
        suffix = draw(st.lists(SMALL_VOCAB, min_size=0 if prefix else 1, max_size=20))
        max_tokens = draw(st.integers(1, 10))
        requests.append(dict(
            req_id=f"r{i}", prompt=prefix + suffix, max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens)), ignore_eos=draw(st.booleans()),
            priority=draw(st.integers(0, 2)), arrival=draw(st.integers(0, 12)),
            eos_at=draw(st.none() | st.integers(0, max_tokens - 1))))
    need = max(-(-(len(r["prompt"]) + r["max_tokens"]) // block_size) for r in requests)
    return dict(
        block_size=block_size,
        num_blocks=need + draw(st.integers(0, 6)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 40)),
        enable_prefix_caching=draw(st.booleans()),
        requests=requests,
        aborts=draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, len(requests) - 1), st.booleans()),
                             max_size=3)),
    )


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_with_correct_tokens_and_no_leaks(w):
    sched = make_scheduler(w["num_blocks"], w["block_size"], w["max_num_seqs"], w["max_num_batched_tokens"],
                           w["enable_prefix_caching"])
    runner = FakeRunner(sched, eos_at={r["req_id"]: r["eos_at"] for r in w["requests"] if r["eos_at"] is not None})
    requests = {r["req_id"]: make_request(r["req_id"], prompt=r["prompt"], priority=r["priority"],
                                          max_tokens=r["max_tokens"], min_tokens=r["min_tokens"],
                                          ignore_eos=r["ignore_eos"]) for r in w["requests"]}
    arrivals = sorted(w["requests"], key=lambda r: r["arrival"])
    aborted = set()

    def abort(index):
        r = requests[f"r{index}"]
        if r.req_id in sched.requests:
            sched.finish_request(r, FinishReason.ABORT)
            aborted.add(r.req_id)

    t = 0
    while arrivals or sched.has_unfinished():
        assert t < 5000, "the workload did not finish"
        while arrivals and arrivals[0]["arrival"] <= t:
            runner.add(requests[arrivals.pop(0)["req_id"]])
        mid = [i for (at, i, is_mid) in w["aborts"] if at == t and is_mid]
        for at, i, is_mid in w["aborts"]:
            if at == t and not is_mid:
                abort(i)
        if sched.has_unfinished():
            plan, _ = step(sched, runner, mid_step=lambda mid=mid: [abort(i) for i in mid])
            assert not plan.is_empty, "nothing scheduled while requests wait"
        t += 1

    assert_no_leaks(sched)
    assert sched.stats.num_preemptions == sum(r.num_preemptions for r in requests.values())
    for r in requests.values():
        assert r.is_finished
        check_finished(r, runner)
        assert (r.finish_reason is FinishReason.ABORT) == (r.req_id in aborted)
        _check_fed_tokens(r, runner)


def _check_fed_tokens(request: Request, runner: FakeRunner) -> None:
    """The chunks fed since the last (re)admission cover prompt + outputs, in order, up to the last token."""
    fed = runner.fed.get(request.req_id, [])
    if not fed:
        assert request.finish_reason is FinishReason.ABORT
        return
    segment_start = 0
    for i, (start, _) in enumerate(fed):
        if i == 0 or start != fed[i - 1][0] + len(fed[i - 1][1]):
            segment_start = i
    start = fed[segment_start][0]
    tokens = [t for _, chunk in fed[segment_start:] for t in chunk]
    everything = request.token_ids
    if request.finish_reason is FinishReason.ABORT:
        assert tokens == everything[start:start + len(tokens)]
    else:  # the last sampled token is never fed
        assert tokens == everything[start:-1]
    if request.num_preemptions == 0 and request.num_cached_tokens == 0:
        assert start == 0
