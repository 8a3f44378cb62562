"""Prefix cache: chained block hashes, hits, the one-token-short rule, LRU eviction. Never imports torch."""

from __future__ import annotations

from scheduler_harness import (
    FakeRunner,
    assert_no_leaks,
    check_finished,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)

from conveyor.core.block_manager import BlockManager
from conveyor.core.prefix_hash import ROOT_HASH, extend_block_hashes, hash_block

PREFIX = list(range(100, 112))  # 3 blocks of 4


def _computed(bm: BlockManager, req_id: str, prompt: list[int]):
    """A request whose whole prompt has K/V in the pool, its full blocks registered in the cache."""
    r = make_request(req_id, prompt=prompt)
    cached = bm.find_cached_prefix(r)
    bm.allocate(r, cached, r.num_tokens)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)
    return r


def test_hashes_chain_over_full_blocks_only():
    hashes: list[int] = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7], 4)
    assert hashes == [hash_block(ROOT_HASH, [1, 2, 3, 4])]
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert hashes == [hash_block(ROOT_HASH, [1, 2, 3, 4]), hash_block(hashes[0], [5, 6, 7, 8])]
    # the same block after a different prefix is a different key
    other: list[int] = []
    extend_block_hashes(other, [9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert other[1] != hashes[1]


def test_a_request_sharing_a_three_block_prefix_gets_three_cached_blocks():
    bm = BlockManager(16, 4)
    a = _computed(bm, "a", PREFIX + [1, 2])
    b = make_request("b", prompt=PREFIX + [7, 8, 9])
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_ids[:3]
    bm.allocate(b, hits, b.num_tokens)
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] != a.block_ids[3]
    assert [bm.blocks[i].ref_count for i in b.block_ids] == [2, 2, 2, 1]
    bm.check_invariants([a, b])
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_ids] == [1, 1, 1, 1]
    bm.free(b)
    bm.check_invariants([])


def test_lookup_stops_one_token_short():
    bm = BlockManager(16, 4)
    _computed(bm, "a", PREFIX + [1])
    exactly_two_blocks = make_request("b", prompt=PREFIX[:8])
    assert len(bm.find_cached_prefix(exactly_two_blocks)) == 1  # its last token must still be fed
    assert len(bm.find_cached_prefix(make_request("c", prompt=PREFIX[:9]))) == 2
    assert len(bm.find_cached_prefix(make_request("d", prompt=PREFIX))) == 2
    assert len(bm.find_cached_prefix(make_request("e", prompt=PREFIX + [5]))) == 3


def test_a_divergent_block_ends_the_hit_run():
    bm = BlockManager(16, 4)
    _computed(bm, "a", PREFIX + [1])
    changed = PREFIX[:4] + [0] + PREFIX[5:] + [1]
    assert len(bm.find_cached_prefix(make_request("b", prompt=changed))) == 1


def test_a_hash_hit_with_different_stored_tokens_is_a_miss():
    bm = BlockManager(16, 4)
    a = _computed(bm, "a", PREFIX + [1])
    bm.blocks[a.block_ids[1]].token_ids = (0, 0, 0, 0)  # as if another prefix had collided on the hash
    assert len(bm.find_cached_prefix(make_request("b", prompt=PREFIX + [1]))) == 1


def test_only_computed_full_blocks_are_registered():
    bm = BlockManager(16, 4)
    r = make_request("a", prompt=PREFIX + [1])
    bm.allocate(r, [], r.num_tokens)
    r.num_computed_tokens = 7  # mid-prefill: one full block computed
    bm.cache_full_blocks(r)
    assert [bm.blocks[i].block_hash is not None for i in r.block_ids] == [True, False, False, False]
    assert len(bm.cached) == 1
    r.num_computed_tokens = 13
    bm.cache_full_blocks(r)
    assert len(bm.cached) == 3 and bm.blocks[r.block_ids[3]].block_hash is None


def test_no_caching_when_disabled():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    _computed(bm, "a", PREFIX + [1])
    assert not bm.cached
    assert bm.find_cached_prefix(make_request("b", prompt=PREFIX + [1])) == []


def test_freed_cached_blocks_are_revived_and_count_against_the_free_pool():
    bm = BlockManager(4, 4)
    a = _computed(bm, "a", PREFIX + [1])  # uses all 4 blocks
    a_blocks = list(a.block_ids)
    bm.free(a)
    b = make_request("b", prompt=PREFIX + [2])
    hits = bm.find_cached_prefix(b)
    assert hits == a_blocks[:3]
    assert bm.can_allocate(hits, 13)  # 3 revived + 1 fresh = 4 free
    assert not bm.can_allocate(hits, 17)  # would need a 5th
    bm.allocate(b, hits, 13)
    assert bm.num_free_blocks == 0
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_ids)
    bm.check_invariants([b])


def test_lru_eviction_takes_uncached_blocks_first_then_the_tail_of_a_freed_prefix():
    bm = BlockManager(6, 4)
    a = _computed(bm, "a", PREFIX + [1])  # blocks 0-3; 4 and 5 were never used
    b0, b1, b2, b3 = a.block_ids
    bm.free(a)
    # the uncached partial block goes first, never-used blocks next, then the prefix tail to head
    assert list(bm.free_queue) == [b3, 4, 5, b2, b1, b0]
    other = make_request("o", prompt=[7] * 16)
    bm.allocate(other, bm.find_cached_prefix(other), 16)
    assert other.block_ids == [b3, 4, 5, b2]
    assert bm.blocks[b2].block_hash is None and b2 not in bm.cached.values()
    assert len(bm.find_cached_prefix(make_request("c", prompt=PREFIX + [1]))) == 2  # head survived
    bm.check_invariants([other])


def test_a_recently_freed_prefix_outlives_an_older_one():
    bm = BlockManager(6, 4)
    old = _computed(bm, "old", [1, 2, 3, 4, 5])
    new = _computed(bm, "new", [6, 7, 8, 9, 5])
    bm.free(old)
    bm.free(new)
    filler = make_request("f", prompt=[3] * 20)
    bm.allocate(filler, bm.find_cached_prefix(filler), 20)  # 5 of 6: the two partial blocks, the 2
    # never-used ones, then the least recently freed cached block: old's
    assert bm.find_cached_prefix(make_request("x", prompt=[1, 2, 3, 4, 5])) == []
    assert len(bm.find_cached_prefix(make_request("y", prompt=[6, 7, 8, 9, 5]))) == 1


def test_scheduler_serves_a_shared_prefix_from_the_cache():
    sched = make_scheduler(num_blocks=32, block_size=4)
    runner = FakeRunner(sched)
    first = make_request("first", prompt=PREFIX + [1, 2], max_tokens=3)
    runner.add(first)
    step(sched, runner)
    second = make_request("second", prompt=PREFIX + [3], max_tokens=3)
    runner.add(second)
    plan, _ = step(sched, runner)  # FakeRunner checks that the cached slots hold PREFIX
    entry = [e for e in plan.scheduled if e.req_id == "second"][0]
    assert (entry.start_pos, entry.token_ids) == (12, (3,))
    assert second.num_cached_tokens == 12
    assert list(second.block_ids[:3]) == list(first.block_ids[:3])
    run_to_completion(sched, runner)
    check_finished(first, runner)
    check_finished(second, runner)
    s = sched.stats
    assert s.num_cached_prompt_tokens == 12 and s.num_prefix_hits == 12
    assert s.num_prefix_queries == 14 + 13
    assert s.prefix_cache_hit_rate == 12 / 27
    assert s.num_computed_prompt_tokens == 14 + 1
    assert_no_leaks(sched)


def test_a_request_waits_for_the_prefix_a_running_request_is_computing():
    sched = make_scheduler(num_blocks=32, block_size=4)
    runner = FakeRunner(sched)
    for name in ("a", "b"):
        runner.add(make_request(name, prompt=PREFIX + [1], max_tokens=2))
    plan, _ = step(sched, runner)
    assert [(e.req_id, e.start_pos) for e in plan.scheduled] == [("a", 0)]  # b would compute a's blocks again
    plan, _ = step(sched, runner)
    assert [(e.req_id, e.start_pos) for e in plan.scheduled] == [("a", 13), ("b", 12)]
    a, b = (e.block_ids for e in plan.scheduled)
    assert a[:3] == b[:3] and a[3] != b[3]
    run_to_completion(sched, runner)
    c = make_request("c", prompt=PREFIX + [1], max_tokens=2)  # the cache now holds one copy
    runner.add(c)
    plan, _ = step(sched, runner)
    assert plan.scheduled[0].start_pos == 12
    run_to_completion(sched, runner)
    assert_no_leaks(sched)


def test_generated_tokens_fill_cacheable_blocks_too():
    sched = make_scheduler(num_blocks=32, block_size=4)
    runner = FakeRunner(sched)
    a = make_request("a", prompt=[5, 6, 7], max_tokens=6)
    runner.add(a)
    run_to_completion(sched, runner)
    # a's prompt + first 5 outputs filled two blocks (the 6th output was never fed)
    follow = make_request("f", prompt=a.token_ids[:8] + [1], max_tokens=1)
    runner.prompts["f"] = follow.prompt_token_ids
    sched.add_request(follow)
    plan, _ = step(sched, runner)
    assert plan.scheduled[0].start_pos == 8
    run_to_completion(sched, runner)
    assert_no_leaks(sched)
