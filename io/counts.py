"""A count and its noun in agreement ("1 record", "2 records", "1 error row"), for every message that prints one."""

from __future__ import annotations


def counted(count: int, noun: str, thousands: bool = False) -> str:
    """`count` and `noun`, with an "s" for a count other than 1; `thousands`: the count written with commas
    (10,000)."""
    number = f"{count:,}" if thousands else str(count)
    return f"{number} {noun if count == 1 else noun + 's'}"
