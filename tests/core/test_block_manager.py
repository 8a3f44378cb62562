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


def test_blocks_wholly_before_every_window_go_back_and_keep_their_prefix():
    """A model whose layers all slide (window 6): a request's blocks wholly before its next token's window
    (aligned down to the backend's 4-key read alignment) go back to the pool as it advances, as NULL_BLOCK entries
    of its table; full ones keep their hashes for a later prompt with the same prefix; freeing the request gives
    back only the rest."""
    from conveyor.core.block_manager import NULL_BLOCK

    bm = BlockManager(8, 2, window=6, window_alignment=4)
    r = make_request("a", 12)
    bm.allocate(r, [], 12)
    r.num_computed_tokens = 12
    bm.cache_full_blocks(r)
    bm.release_out_of_window(r)  # next token at 12 sees keys 7..12: aligned down to 4, blocks of keys 0-3 go
    assert r.block_ids[:2] == [NULL_BLOCK, NULL_BLOCK] and NULL_BLOCK not in r.block_ids[2:]
    assert bm.num_free_blocks == 8 - 6 + 2
    bm.check_invariants([r])
    other = make_request("b", prompt=list(r.prompt_token_ids))  # the same prompt: its first blocks are still cached
    assert len(bm.find_cached_prefix(other)) == (12 - 1) // 2
    bm.release_out_of_window(r)  # nothing new
    assert bm.num_free_blocks == 4
    r.token_ids.extend(range(100, 108))  # eight tokens generated
    bm.append_slots(r, 20)
    r.num_computed_tokens = 20
    bm.cache_full_blocks(r)
    bm.release_out_of_window(r)  # keys from 15, aligned: 12: six blocks of keys 0-11 given back
    assert r.block_ids[:6] == [NULL_BLOCK] * 6 and bm.num_free_blocks == 8 - 4
    bm.check_invariants([r])
    bm.free(r)
    assert bm.num_free_blocks == 8 and r.block_ids == []
    bm.check_invariants([])


def test_without_a_window_nothing_goes_back_early():
    bm = BlockManager(8, 2)
    r = make_request("a", 12)
    bm.allocate(r, [], 12)
    r.num_computed_tokens = 12
    bm.release_out_of_window(r)
    assert bm.num_free_blocks == 2 and -1 not in r.block_ids
