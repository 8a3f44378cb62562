"""A count and its noun in agreement ("1 record", "2 records", "1 error row"), for every message that prints one."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str | None = None, thousands: bool = False) -> str:
    """`count` and `noun`, or its `plural` (the noun with an "s" where not given) for a count other than 1;
    `thousands`: the count written with commas (10,000)."""
    number = f"{count:,}" if thousands else str(count)
    return f"{number} {noun if count == 1 else plural or noun + 's'}"
