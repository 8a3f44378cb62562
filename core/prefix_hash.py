"""Chained hash over one full KV block of token ids, the key of the prefix cache. Pure Python.

hash(block i) = hash((hash(block i-1), tokens of block i)): equal hashes mean equal prefixes up
to and including the block (the block manager also compares the stored tokens on a hit).
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT_HASH = 0x5EED


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    return hash((parent_hash, tuple(token_ids)))


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int) -> None:
    """Append to `hashes` the hashes of every full block of `token_ids` not yet hashed."""
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
