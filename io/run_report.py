"""A run's report: how it ended (`Outcome`), its result (`RunResult`) and the typed summary the CLI renders and
writes as --summary-json (`RunSummary`).

`RunResult` is what `Run.execute` returns: the outcome, the run's totals, the engine's stats and the setup it ran
with. `RunResult.summary()` is the `RunSummary`: plain, frozen data (counts, tokens, times, the model as it ran,
finish reasons, the latency and occupancy figures), `to_json()` for --summary-json, and `merge()` for the driver of
`--executor ray`, which adds its workers' summaries (each worker's latency sketches travel with its summary, so the
driver's percentiles are over every worker's rows).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conveyor.io.rows.figures import run_figures

if TYPE_CHECKING:
    from conveyor.io.rows.sink import RunTotals


class Outcome(enum.Enum):
    """How a run ended; the CLI's exit code of the same name says it to a script."""

    OK = "ok"  # every record has a completion
    SOME_ERRORS = "some_errors"  # finished, and some rows are error rows
    STOPPED = "stopped"  # stopped early on purpose (a signal, --max-runtime) after committing what finished


_WORST_FIRST = (Outcome.STOPPED, Outcome.SOME_ERRORS, Outcome.OK)  # a run of several parts ends as its worst
# The --summary-json keys of what only generation does: a pooling task's summary has none of them.
GENERATION_KEYS = ("completion_tokens", "output_tokens_per_s", "preemptions", "prefix_cache_hit_rate", "draft_tokens",
                   "accepted_draft_tokens", "draft_acceptance_rate", "continued", "tokens_carried_over",
                   "in_flight_saved", "ttft_s", "tpot_s", "mean_running", "occupancy", "finish_reasons",
                   "structured_outputs", "structured_outputs_cut")


def draft_acceptance_rate(draft_tokens: int, accepted: int) -> float | None:
    """Accepted draft tokens over those fed (None where none was: no rate, not a rate of 0)."""
    return round(accepted / draft_tokens, 4) if draft_tokens else None


@dataclass(frozen=True)
class RunSetup:
    """The model as given, where it loaded from, and the dtype, backend and batch cap it ran with (auto resolved);
    None each but the model where it did not load."""

    model: str
    model_path: str | None = None
    dtype: str | None = None
    backend: str | None = None
    max_num_seqs: int | None = None
    task: str = "generate"  # or the pooling task it ran (embed, classify, score, rerank, reward)
    cpu_isa: str | None = None  # the cpu kernels' instructions (amx, avx512bf16, avx512, avx2); None off them
    batch_invariant: bool | None = None  # whether its backend meets the exactness contract; None where none loaded


@dataclass(frozen=True)
class RunSummary:
    """What a run did, as the summary table and --summary-json say it. Counts of records, samples, ok and error
    rows, tokens and the model's setup are the run's; `finish_reasons`, the structured-output counts and the
    latency figures are over the ok rows this process (or, merged, each worker) finished."""

    outcome: Outcome
    records: int  # rows in the journal: one per record
    samples: int  # output rows: a record with n > 1 has n
    ok: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    load_s: float
    elapsed_s: float  # generation: from the first record admitted to the last step
    output_tokens_per_s: float
    preemptions: int
    prefix_cache_hit_rate: float
    draft_tokens: int  # --speculative: fed to the model ...
    accepted_draft_tokens: int  # ... and accepted
    resumed_from: int  # rows already committed when the run started
    continued: int  # records continued from an earlier process's partial ...
    tokens_carried_over: int  # ... and the tokens those held
    in_flight_saved: int  # partials kept at a stop (0 where the run did not stop)
    reuse: dict[str, int] | None  # over an input that changed (journal_rebase.Reuse): None where it had not
    retried_errors: int  # --retry-errors: records whose error row of the run's own making was dropped
    keep_fields_missing: tuple[str, ...]  # --keep-fields that no record of the input had (a column of nulls)
    wall_s: float  # from the run's start (before its checks and the model's load) to its result
    setup: RunSetup
    finish_reasons: dict[str, int]  # ok output rows by finish reason ("stop", "length", ...), most first
    structured_outputs: int  # ok output rows whose request had a grammar (--json-schema, --regex, --choice)
    structured_outputs_cut: int  # of those, the ones max_tokens cut before their grammar was complete
    # the latency and occupancy figures (`run_figures`) ...
    ttft_s: dict[str, float | None]
    latency_s: dict[str, float | None]
    queue_s: dict[str, float | None]
    tpot_s: dict[str, float | None]
    mean_running: float
    occupancy: float
    steps: int
    # ... and what they are made of (`RunResult.figures_state`), kept to merge them
    figures_states: tuple[dict[str, Any], ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def with_figures(cls, figures_states: tuple[dict[str, Any], ...], **fields: Any) -> RunSummary:
        """A summary of `fields` and the figures of `figures_states` (`run_figures`)."""
        return cls(**fields, **run_figures(list(figures_states)), figures_states=tuple(figures_states))

    @property
    def records_per_s(self) -> float:
        """Records this process (or, merged, the workers together) gave a row, per second of generation."""
        done = self.records - self.resumed_from
        return round(done / self.elapsed_s, 2) if self.elapsed_s > 0 else 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        """The prompt tokens of this process's ok rows per second of generation (a pooling task's speed)."""
        return round(self.prompt_tokens / self.elapsed_s, 1) if self.elapsed_s > 0 else 0.0

    @property
    def draft_acceptance_rate(self) -> float | None:
        return draft_acceptance_rate(self.draft_tokens, self.accepted_draft_tokens)

    def to_json(self) -> dict[str, Any]:
        """The --summary-json object: the keys of the run's task (a pooling task's has no GENERATION_KEYS)."""
        s = self.setup
        out = {
            "records": self.records, "samples": self.samples, "ok": self.ok, "errors": self.errors,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "load_s": self.load_s, "elapsed_s": self.elapsed_s, "output_tokens_per_s": self.output_tokens_per_s,
            "preemptions": self.preemptions, "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "draft_tokens": self.draft_tokens, "accepted_draft_tokens": self.accepted_draft_tokens,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "resumed_from": self.resumed_from, "continued": self.continued,
            "tokens_carried_over": self.tokens_carried_over, "in_flight_saved": self.in_flight_saved,
            "keep_fields_missing": list(self.keep_fields_missing), "wall_s": self.wall_s,
            "model": s.model, "model_path": s.model_path, "dtype": s.dtype, "backend": s.backend,
            "ttft_s": self.ttft_s, "latency_s": self.latency_s, "queue_s": self.queue_s, "tpot_s": self.tpot_s,
            "mean_running": self.mean_running, "occupancy": self.occupancy, "steps": self.steps,
            "finish_reasons": dict(self.finish_reasons), "structured_outputs": self.structured_outputs,
            "structured_outputs_cut": self.structured_outputs_cut,
            "reuse": self.reuse, "retried_errors": self.retried_errors,
            "task": s.task, "records_per_s": self.records_per_s, "prompt_tokens_per_s": self.prompt_tokens_per_s,
            "cpu_isa": s.cpu_isa, "batch_invariant": s.batch_invariant,
            "status": self.outcome.value,
        }
        return out if s.task == "generate" else {key: value for key, value in out.items() if key not in GENERATION_KEYS}

    @classmethod
    def merge(cls, summaries: list[RunSummary]) -> RunSummary:
        """The summary of a run made of `summaries` running side by side (the workers of `--executor ray`): counts
        and tokens added, load and generation time the longest, the rates the cluster's (token rates added,
        prefix-cache hit rates averaged), the latency figures over every part's rows; the setup is the first's
        (every part runs the same spec), the outcome the worst."""
        if not summaries:
            raise ValueError("RunSummary.merge: no summaries to merge")
        first = summaries[0]

        def total(name: str) -> int:
            return sum(getattr(s, name) for s in summaries)

        reasons: Counter[str] = Counter()
        for s in summaries:
            reasons.update(s.finish_reasons)
        missing = [name for name in first.keep_fields_missing
                   if all(name in s.keep_fields_missing for s in summaries)]
        outcomes = {s.outcome for s in summaries}
        return cls.with_figures(
            tuple(state for s in summaries for state in s.figures_states),
            outcome=next(o for o in _WORST_FIRST if o in outcomes),
            **{name: total(name) for name in (
                "records", "samples", "ok", "errors", "prompt_tokens", "completion_tokens", "preemptions",
                "draft_tokens", "accepted_draft_tokens", "resumed_from", "continued", "tokens_carried_over",
                "in_flight_saved", "structured_outputs", "structured_outputs_cut", "retried_errors")},
            reuse=_added([s.reuse for s in summaries]),
            load_s=max(s.load_s for s in summaries), elapsed_s=max(s.elapsed_s for s in summaries),
            output_tokens_per_s=round(sum(s.output_tokens_per_s for s in summaries), 2),  # while they all run
            prefix_cache_hit_rate=sum(s.prefix_cache_hit_rate for s in summaries) / len(summaries),
            keep_fields_missing=tuple(missing), wall_s=max(s.wall_s for s in summaries), setup=first.setup,
            finish_reasons=_most_first(reasons))


def _added(counts: list[dict[str, int] | None]) -> dict[str, int] | None:
    """Count dicts added key by key (the workers' reuse counts); None where none has one."""
    given = [c for c in counts if c is not None]
    if not given:
        return None
    total: Counter[str] = Counter()
    for c in given:
        total.update(c)
    return {key: total[key] for key in given[0]}


def _most_first(counts: Counter[str]) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


@dataclass
class RunResult:
    """What `Run.execute` returns."""

    status: Outcome
    totals: RunTotals
    setup: RunSetup  # the model as it ran
    engine_stats: Any = None  # the engine's EngineStats, where it ran
    message: str = ""  # what to tell the user beside the summary
    profile: dict[str, float] = field(default_factory=dict)  # seconds per step phase, where asked for
    output_written: bool = False  # the output file was written (a shard writes it only when it merges)
    keep_fields_missing: tuple[str, ...] = ()  # --keep-fields that no record of the input had (a column of nulls)
    wall_s: float = 0.0  # from the run's start (before its checks and the model's load) to this result
    written: str = ""  # what was written, where it was not one file named by -o (a folder's parts)

    def figures_state(self) -> dict[str, Any]:
        """What the summary's latency and occupancy figures are made of (`run_figures`), as plain data: a Ray
        worker's travels with its summary to the driver, whose figures are then over every worker's rows."""
        s = self.engine_stats
        return {"latency": self.totals.latency.state(), "scheduled_rows": s.num_scheduled_rows if s else 0,
                "steps": s.num_forward_steps if s else 0,
                "max_num_seqs": self.setup.max_num_seqs}

    def summary(self) -> RunSummary:
        t = self.totals
        s = self.engine_stats
        return RunSummary.with_figures(
            (self.figures_state(),),  # over the ok rows this process wrote
            outcome=self.status, records=t.done, samples=t.samples, ok=t.ok, errors=t.errors,
            prompt_tokens=t.prompt_tokens, completion_tokens=t.completion_tokens, load_s=round(t.load_s, 3),
            elapsed_s=round(t.elapsed_s, 3), output_tokens_per_s=round(t.output_tokens_per_s, 2),
            preemptions=s.num_preemptions if s else 0,
            prefix_cache_hit_rate=round(s.prefix_cache_hit_rate, 4) if s else 0.0,
            draft_tokens=s.num_draft_tokens if s else 0, accepted_draft_tokens=s.num_accepted_draft_tokens if s else 0,
            resumed_from=t.resumed_from, continued=t.continued, tokens_carried_over=t.tokens_carried_over,
            in_flight_saved=t.in_flight_saved if self.status is Outcome.STOPPED else 0,
            reuse=t.reuse, retried_errors=t.retried_errors,
            keep_fields_missing=tuple(self.keep_fields_missing), wall_s=round(self.wall_s, 3),
            setup=self.setup, finish_reasons=_most_first(Counter(t.finish_reasons)),
            structured_outputs=t.structured_outputs, structured_outputs_cut=t.structured_outputs_cut)
