"""The samples of one prompt prefill it once: a waiting request whose next prompt block a running request is still
computing waits a step and then takes it from the prefix cache. Never imports torch."""

from __future__ import annotations

from scheduler_harness import (
    FakeRunner,
    assert_no_leaks,
    check_finished,
    make_request,
    make_scheduler,
    run_to_completion,
)

PROMPT = list(range(100, 123))  # 23 tokens: 5 full blocks of 4 and 3 tokens more


def _run_samples(n: int, prompt: list[int], **kw):
    s = make_scheduler(num_blocks=64, **kw)
    runner = FakeRunner(s)
    requests = [make_request("r" if k == 0 else f"r/{k}", prompt=list(prompt), max_tokens=5) for k in range(n)]
    for r in requests:
        runner.add(r)
    finished = run_to_completion(s, runner)
    assert sorted(r.req_id for r in finished) == sorted(r.req_id for r in requests)
    for r in finished:
        check_finished(r, runner)
    assert_no_leaks(s)
    return s.stats


def test_n_samples_compute_the_prompts_full_blocks_once():
    stats = _run_samples(4, PROMPT)
    full = (len(PROMPT) - 1) // 4 * 4  # the cacheable part: the last token is always fed
    assert stats.num_computed_prompt_tokens == len(PROMPT) + 3 * (len(PROMPT) - full)
    assert stats.num_cached_prompt_tokens == 3 * full


def test_a_prompt_chunked_over_steps_is_still_computed_once():
    stats = _run_samples(3, PROMPT, max_num_batched_tokens=8)
    full = (len(PROMPT) - 1) // 4 * 4
    assert stats.num_computed_prompt_tokens == len(PROMPT) + 2 * (len(PROMPT) - full)


def test_without_prefix_caching_every_sample_computes_its_prompt():
    stats = _run_samples(3, PROMPT, enable_prefix_caching=False)
    assert stats.num_computed_prompt_tokens == 3 * len(PROMPT)


def test_different_prompts_are_admitted_together():
    s = make_scheduler(num_blocks=64)
    runner = FakeRunner(s)
    for name in ("a", "b", "c"):
        runner.add(make_request(name, num_tokens=10, max_tokens=3))
    plan = s.schedule()
    assert sorted(e.req_id for e in plan.scheduled) == ["a", "b", "c"]
