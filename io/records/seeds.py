"""The seeds of a record's requests: from the run seed and the record's id (or, without one, its input index), and
a sample's from its record's. Each is a hash, so it is the same in every process and on every resume. Pure Python.
"""

from __future__ import annotations

import hashlib


def derive_seed(run_seed: int, record_id: str) -> int:
    """A record's seed from the run seed and its id: the same in every process, 0 <= s < 2**63."""
    digest = hashlib.sha256(f"{run_seed}\x00{record_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def index_seed(run_seed: int, index: int) -> int:
    """The seed of a record without an id, from the run seed and its input index; hashed apart from
    derive_seed's ids (\x01, not \x00), so it never equals the seed of a record whose id is that number."""
    digest = hashlib.sha256(f"{run_seed}\x01{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def sample_seed(record_seed: int, sample: int) -> int:
    """The seed of a record's sample `sample` > 0, from the record's effective seed; hashed apart from derive_seed
    and index_seed (\x02), 0 <= s < 2**63. Sample 0 keeps the record's seed: it equals the record's n = 1 output."""
    digest = hashlib.sha256(f"{record_seed}\x02{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
