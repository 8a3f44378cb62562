"""KV block manager: a fixed pool of blocks, per-request block tables, ref counts, prefix cache.

Pure Python (no torch). The block manager answers and commits; the scheduler decides. Only this
module writes `Request.block_ids` and `Request.block_hashes`.
"""

from __future__ import annotations

from collections import OrderedDict

from conveyor.core.prefix_hash import extend_block_hashes
from conveyor.core.request import Request

NULL_BLOCK = -1  # a block table entry given back: its keys are out of every layer's sliding window


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set once the block is full and computed
        self.token_ids: tuple[int, ...] | None = None  # the tokens behind block_hash


class BlockManager:
    """Pool of `num_blocks` blocks of `block_size` token slots each.

    Invariants (see `check_invariants`):
    - every block is either used (ref_count > 0) or in the free queue (ref_count == 0), never both;
    - a free block may keep its hash, so a later prompt with the same prefix can revive it; the
      free queue is LRU: allocation evicts from its front, and a request's tail blocks are queued
      first so they go before its shared prefix;
    - `cached` maps a hash to exactly one block holding that hash.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, window_alignment: int = 1) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Where every layer of the model slides (a query sees its last `window` keys only), a request's blocks
        # wholly before its next query's window are given back (`release_out_of_window`): as NULL_BLOCK in its
        # table. The attention may read keys from a multiple of `window_alignment` below a window's first key (its
        # vector lanes, its tiles): blocks are given back only wholly before that.
        self.window = window
        self.window_alignment = window_alignment
        self.released: dict[str, int] = {}  # req_id -> its table's entries given back (a prefix of it)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by some request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache lookup -------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached run of `request`'s full blocks.

        Stops one token short of the end: the last token must be fed to the model so that it
        yields logits, so at most (num_tokens - 1) // block_size blocks can be hits.
        """
        if not self.enable_prefix_caching:
            return []
        keys = request.cache_keys()
        extend_block_hashes(request.block_hashes, keys, self.block_size)
        max_hits = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for i in range(max_hits):
            block_id = self.cached.get(request.block_hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            start = i * self.block_size
            if block.token_ids != tuple(keys[start:start + self.block_size]):
                break
            hits.append(block_id)
        return hits

    # -- allocation ----------------------------------------------------------------------------

    def can_allocate(self, cached_block_ids: list[int], num_tokens: int) -> bool:
        """Can a new request take `cached_block_ids` plus fresh blocks up to `num_tokens` slots?"""
        num_new = self.blocks_for(num_tokens) - len(cached_block_ids)
        num_revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        return num_new + num_revived <= self.num_free_blocks

    def allocate(self, request: Request, cached_block_ids: list[int], num_tokens: int) -> None:
        assert not request.block_ids, f"{request} already holds blocks"
        assert self.can_allocate(cached_block_ids, num_tokens)
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        request.block_ids = list(cached_block_ids)
        self._grow(request, num_tokens)

    def can_append(self, request: Request, num_tokens: int) -> bool:
        """Can `request`'s table grow to hold `num_tokens` slots?"""
        return self.blocks_for(num_tokens) - len(request.block_ids) <= self.num_free_blocks

    def append_slots(self, request: Request, num_tokens: int) -> None:
        assert self.can_append(request, num_tokens)
        self._grow(request, num_tokens)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back `request`'s blocks past the first `num_tokens` slots (a step's rejected draft tokens held
        them); they hold nothing worth keeping, so they are reused first."""
        keep = self.blocks_for(num_tokens)
        while len(request.block_ids) > keep:
            block_id = request.block_ids.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.block_hash is None, f"block {block_id} trimmed while in use"
            self.free_queue[block_id] = None
            self.free_queue.move_to_end(block_id, last=False)

    def release_out_of_window(self, request: Request) -> None:
        """Give back `request`'s blocks that no query of it will read again: those wholly before the window of its
        next token (at position num_computed_tokens), aligned down to `window_alignment`. Full blocks keep their
        hashes (a later prompt with that prefix may still revive them); their table entries become NULL_BLOCK."""
        if self.window is None:
            return
        first = max(0, request.num_computed_tokens - self.window + 1)  # the next query's first key
        first -= first % self.window_alignment
        upto = min(first // self.block_size, len(request.block_ids))
        done = self.released.get(request.req_id, 0)
        for i in range(done, upto):
            self._release(request.block_ids[i])
            request.block_ids[i] = NULL_BLOCK
        if upto > done:
            self.released[request.req_id] = upto

    def _grow(self, request: Request, num_tokens: int) -> None:
        for _ in range(self.blocks_for(num_tokens) - len(request.block_ids)):
            request.block_ids.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached contents
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
        block.ref_count = 1
        return block_id

    def free(self, request: Request) -> None:
        """Release every block of `request`; tail first, so the tail is evicted before the prefix."""
        for block_id in reversed(request.block_ids):
            if block_id == NULL_BLOCK:
                break  # the entries before it were given back already
            self._release(block_id)
        request.block_ids = []
        self.released.pop(request.req_id, None)

    def _release(self, block_id: int) -> None:
        """One reference fewer; a block nobody holds goes to the free queue (first, where it holds nothing worth
        keeping; last, where its prefix may be revived)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if block.block_hash is None:  # nothing worth keeping: reuse it first
                self.free_queue.move_to_end(block_id, last=False)

    # -- prefix cache registration -------------------------------------------------------------

    def cache_full_blocks(self, request: Request) -> None:
        """Register every full block whose K/V is now computed, so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        keys = request.cache_keys()
        extend_block_hashes(request.block_hashes, keys[: num_full * self.block_size], self.block_size)
        for i in range(self.released.get(request.req_id, 0), num_full):
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is not None:
                continue
            block_hash = request.block_hashes[i]
            start = i * self.block_size
            block.block_hash = block_hash
            block.token_ids = tuple(keys[start:start + self.block_size])
            self.cached.setdefault(block_hash, block.block_id)

    # -- checks --------------------------------------------------------------------------------

    def check_invariants(self, requests: list[Request] | None = None) -> None:
        """Free + used = total; ref counts match the live block tables; the hash map is consistent."""
        refs = [0] * self.num_blocks
        for request in requests or ():
            live = [b for b in request.block_ids if b != NULL_BLOCK]
            assert len(set(live)) == len(live), f"{request} holds a block twice"
            for block_id in request.block_ids:
                if block_id != NULL_BLOCK:
                    refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref count {block.ref_count}"
            if requests is not None:
                assert block.ref_count == refs[block.block_id], (
                    f"block {block.block_id}: ref count {block.ref_count}, tables hold it {refs[block.block_id]}x")
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), (
                f"block {block.block_id} free-queue membership disagrees with ref count {block.ref_count}")
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash
