"""A run's latency figures: percentiles of its rows' timings in bounded memory, for the summary.

`Quantiles` keeps its values exactly up to `EXACT_LIMIT` of them; their percentiles are then numpy's default
(linear interpolation between the two nearest ranks). Past that it folds them into a log-bucket histogram (as
DDSketch): bucket i holds the values in (gamma^(i-1), gamma^i], gamma = (1 + a) / (1 - a), and stands for them as
2 gamma^i / (gamma + 1), within a = `RELATIVE_ERROR` (1%) of each; a percentile is then the value at its rank
(round((count - 1) * p / 100), numpy's "nearest") within 1%, values under `SMALLEST` (1 µs) count as 0. Memory:
at most ~1,400 buckets for values from 1 µs to 10^6 s, however many rows (a 10M-record run's as a 10-record's).
`max` is exact. Sketches merge, exact while the values together stay under the limit (the workers of
`--executor ray` send theirs to the driver).

`LatencyFigures` holds one per summary figure: `queue_s`, `ttft_s`, `latency_s` and `tpot_s` (time per output
token after the first: (latency - ttft) / (completion_tokens - 1), rows with 2 tokens or more), over the ok rows
(every sample's row of a record with n > 1) this process wrote.
"""

from __future__ import annotations

import math
from typing import Any

EXACT_LIMIT = 4096  # values kept exactly, per figure; past it, the histogram
RELATIVE_ERROR = 0.01
SMALLEST = 1e-6  # seconds: smaller values (and 0) count as 0
_GAMMA = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
_LOG_GAMMA = math.log(_GAMMA)


class Quantiles:
    """Percentiles of a stream of non-negative values (see the module docstring for the method and its error)."""

    def __init__(self) -> None:
        self.count = 0
        self.max: float | None = None
        self._exact: list[float] | None = []  # None once folded into the histogram
        self._zeros = 0  # values under SMALLEST, once folded
        self._buckets: dict[int, int] = {}

    def add(self, value: float) -> None:
        self.count += 1
        self.max = value if self.max is None else max(self.max, value)
        if self._exact is not None:
            self._exact.append(value)
            if len(self._exact) > EXACT_LIMIT:
                self._fold()
        else:
            self._bucket(value, 1)

    def merge(self, other: Quantiles) -> None:
        """`other`'s values added to these."""
        if other.count == 0:
            return
        self.count += other.count
        self.max = other.max if self.max is None else max(self.max, other.max)
        if self._exact is not None and other._exact is not None and \
                len(self._exact) + len(other._exact) <= EXACT_LIMIT:
            self._exact.extend(other._exact)
            return
        if self._exact is not None:
            self._fold()
        if other._exact is not None:
            for value in other._exact:
                self._bucket(value, 1)
        else:
            self._zeros += other._zeros
            for index, n in other._buckets.items():
                self._buckets[index] = self._buckets.get(index, 0) + n

    def percentile(self, p: float) -> float | None:
        """The p-th percentile (0 <= p <= 100) of the values; None where there are none."""
        if self.count == 0:
            return None
        if self._exact is not None:
            values = sorted(self._exact)
            position = (len(values) - 1) * p / 100
            low = math.floor(position)
            high = min(low + 1, len(values) - 1)
            return values[low] + (values[high] - values[low]) * (position - low)
        rank = round((self.count - 1) * p / 100)
        seen = self._zeros
        if rank < seen:
            return 0.0
        for index in sorted(self._buckets):
            seen += self._buckets[index]
            if rank < seen:
                return min(2 * _GAMMA ** index / (_GAMMA + 1), self.max)
        return self.max  # (not reached: the counts add up to count)

    def figures(self, percentiles: tuple[int, ...] = (50, 90, 99), with_max: bool = True) -> dict[str, float | None]:
        """{"p50": ..., "p90": ..., "p99": ..., "max": ...} in seconds (6 decimals), None each where no values."""
        out = {f"p{p}": _rounded(self.percentile(p)) for p in percentiles}
        if with_max:
            out["max"] = _rounded(self.max)
        return out

    def state(self) -> dict[str, Any]:
        """The sketch as plain data (to send from a Ray worker); `from_state` makes it again."""
        return {"count": self.count, "max": self.max, "exact": self._exact, "zeros": self._zeros,
                "buckets": dict(self._buckets)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Quantiles:
        q = cls()
        q.count, q.max, q._zeros = state["count"], state["max"], state["zeros"]
        q._exact = None if state["exact"] is None else list(state["exact"])
        q._buckets = {int(i): n for i, n in state["buckets"].items()}
        return q

    def _fold(self) -> None:
        values, self._exact = self._exact, None
        for value in values:
            self._bucket(value, 1)

    def _bucket(self, value: float, n: int) -> None:
        if value < SMALLEST:
            self._zeros += n
            return
        index = math.ceil(math.log(value) / _LOG_GAMMA)
        self._buckets[index] = self._buckets.get(index, 0) + n


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


class LatencyFigures:
    """The percentiles of the ok rows' queue time, time to first token, latency and time per output token."""

    NAMES = ("queue_s", "ttft_s", "latency_s", "tpot_s")

    def __init__(self) -> None:
        self.quantiles = {name: Quantiles() for name in self.NAMES}

    def add_row(self, row: dict[str, Any]) -> None:
        """An output row (one sample's): counted where it is ok and has its timings."""
        if row.get("status") != "ok" or row.get("latency_s") is None:
            return
        q = self.quantiles
        for name in ("queue_s", "ttft_s", "latency_s"):
            if row.get(name) is not None:
                q[name].add(row[name])
        tokens = row.get("completion_tokens") or 0
        if tokens >= 2 and row.get("ttft_s") is not None:
            q["tpot_s"].add(max(row["latency_s"] - row["ttft_s"], 0.0) / (tokens - 1))

    def merge(self, other: LatencyFigures) -> None:
        for name in self.NAMES:
            self.quantiles[name].merge(other.quantiles[name])

    def summary(self) -> dict[str, dict[str, float | None]]:
        """The summary's keys: queue_s, ttft_s, latency_s as {p50, p90, p99, max}; tpot_s as {p50, p99}."""
        q = self.quantiles
        out = {name: q[name].figures() for name in ("ttft_s", "latency_s", "queue_s")}
        out["tpot_s"] = q["tpot_s"].figures((50, 99), with_max=False)
        return out

    def state(self) -> dict[str, Any]:
        return {name: self.quantiles[name].state() for name in self.NAMES}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LatencyFigures:
        figures = cls()
        figures.quantiles = {name: Quantiles.from_state(state[name]) for name in cls.NAMES}
        return figures


def run_figures(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's latency and occupancy keys over one process's `RunResult.figures_state()` or several's (the
    workers of `--executor ray`): the percentiles over all their ok rows; `mean_running` (requests scheduled per
    engine step that ran), `occupancy` (that over max_num_seqs: how full the batch's slots were) and `steps`."""
    latency = LatencyFigures()
    for state in states:
        latency.merge(LatencyFigures.from_state(state["latency"]))
    rows = sum(state["scheduled_rows"] for state in states)
    steps = sum(state["steps"] for state in states)
    slots = sum(state["steps"] * (state["max_num_seqs"] or 0) for state in states)
    return {**latency.summary(), "mean_running": round(rows / steps, 2) if steps else 0.0,
            "occupancy": round(rows / slots, 4) if slots else 0.0, "steps": steps}
