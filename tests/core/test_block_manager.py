"""Block manager: pool accounting, ask/commit pairs, ref counts, invariant checks. Never imports torch."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_harness import make_request

from conveyor.core.block_manager import BlockManager


def test_blocks_for_rounds_up():
    bm = BlockManager(8, 4)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_bad_pool_sizes_are_rejected():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_allocate_grow_and_free_keep_the_books():
    bm = BlockManager(8, 4)
    r = make_request("a", 6)
    assert bm.can_allocate([], 6)
    bm.allocate(r, [], 6)
    assert len(r.block_ids) == 2 and bm.num_free_blocks == 6 and bm.usage == pytest.approx(2 / 8)
    assert all(bm.blocks[b].ref_count == 1 for b in r.block_ids)
    bm.check_invariants([r])
    bm.append_slots(r, 8)  # still fits in 2 blocks
    assert len(r.block_ids) == 2
    bm.append_slots(r, 9)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 5
    bm.check_invariants([r])
    bm.free(r)
    assert r.block_ids == [] and bm.num_free_blocks == 8 and bm.usage == 0.0
    bm.check_invariants([])


def test_can_allocate_and_can_append_say_no_when_the_pool_is_short():
    bm = BlockManager(3, 4)
    a = make_request("a", 8)
    assert not bm.can_allocate([], 13)
    assert bm.can_allocate([], 12)
    bm.allocate(a, [], 8)
    assert bm.can_append(a, 12) and not bm.can_append(a, 13)
    assert bm.can_allocate([], 4) and not bm.can_allocate([], 5)


def test_free_twice_is_caught():
    bm = BlockManager(4, 4)
    a = make_request("a", 4)
    bm.allocate(a, [], 4)
    ids = list(a.block_ids)
    bm.free(a)
    a.block_ids = ids  # a stale table, as a buggy caller would keep
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(a)


def test_allocating_twice_is_caught():
    bm = BlockManager(4, 4)
    a = make_request("a", 4)
    bm.allocate(a, [], 4)
    with pytest.raises(AssertionError):
        bm.allocate(a, [], 4)


def test_check_invariants_catches_a_block_both_free_and_used():
    bm = BlockManager(4, 4)
    a = make_request("a", 4)
    bm.allocate(a, [], 4)
    bm.free_queue[a.block_ids[0]] = None
    with pytest.raises(AssertionError, match="free-queue"):
        bm.check_invariants([a])


def test_check_invariants_catches_a_table_that_disagrees_with_ref_counts():
    bm = BlockManager(4, 4)
    a, b = make_request("a", 4), make_request("b", 4)
    bm.allocate(a, [], 4)
    bm.allocate(b, [], 4)
    b.block_ids = list(a.block_ids)  # two tables on one block, ref count 1
    with pytest.raises(AssertionError, match="ref count"):
        bm.check_invariants([a, b])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 5), st.integers(1, 20)),
                max_size=60))
def test_random_alloc_grow_free_sequences_never_leak(ops):
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    live = {}
    for op, i, n in ops:
        r = live.get(i)
        if op == "alloc" and r is None:
            r = make_request(f"q{i}", n)
            if bm.can_allocate([], n):
                bm.allocate(r, [], n)
                live[i] = r
            else:
                assert bm.blocks_for(n) > bm.num_free_blocks
        elif op == "grow" and r is not None:
            target = len(r.block_ids) * 4 + n
            if bm.can_append(r, target):
                bm.append_slots(r, target)
                assert len(r.block_ids) == bm.blocks_for(target)
            else:
                assert bm.blocks_for(target) - len(r.block_ids) > bm.num_free_blocks
        elif op == "free" and r is not None:
            bm.free(live.pop(i))
        bm.check_invariants(list(live.values()))
        assert bm.num_free_blocks + sum(len(r.block_ids) for r in live.values()) == bm.num_blocks
    for r in live.values():
        bm.free(r)
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
