"""A run's report: how it ended (`Outcome`), its result (`RunResult`) and the typed summary the CLI renders and
writes as --summary-json (`RunSummary`).

`RunResult` is what `Run.execute` returns: the outcome, the run's totals, the engine's stats and the setup it ran
with. `RunResult.summary()` is the `RunSummary`: plain, frozen data (counts, tokens, times, the model as it ran,
finish reasons, the latency and occupancy figures), `to_json()` for --summary-json, and `merge()` for the driver of
`--executor ray`, which adds its workers' summaries (each worker's latency sketches travel with its summary, so the
driver's percentiles are over every worker's rows). Both are read from the fields: each says how it merges and which
keys it writes (`figure`, its `SummaryRule`). `Outcome.of` is the one rule from error rows to an outcome.
"""

from __future__ import annotations

import enum
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from conveyor.core import Task
from conveyor.io.rows.figures import run_figures

if TYPE_CHECKING:
    from conveyor.io.rows.sink import RunTotals


class Outcome(enum.Enum):
    """How a run ended; the CLI's exit code of the same name says it to a script."""

    OK = "ok"  # every record has a completion
    SOME_ERRORS = "some_errors"  # finished, and some rows are error rows
    STOPPED = "stopped"  # stopped early on purpose (a signal, --max-runtime) after committing what finished

    @classmethod
    def of(cls, errors: int | bool, skip_errors: bool) -> Outcome:
        """How a run that finished ended: SOME_ERRORS where its output holds error rows (`errors`: their count, or
        whether there are any), OK where it has none or `skip_errors` (--on-error skip) left them out."""
        return cls.SOME_ERRORS if errors and not skip_errors else cls.OK


_WORST_FIRST = (Outcome.STOPPED, Outcome.SOME_ERRORS, Outcome.OK)  # a run of several parts ends as its worst
RULE = "conveyor.summary"  # the metadata key of a RunSummary field: its SummaryRule

Getter = Callable[["RunSummary"], Any]


@dataclass(frozen=True)
class SummaryRule:
    """What a RunSummary field says and how it merges. `merge`: the parts' values of a split run (the workers of
    `--executor ray`) -> the run's; None for a latency or occupancy figure, which `run_figures` makes anew from the
    merged `figures_states`. `json`: its --summary-json keys, in order, each with its value; None: the field's own
    name and value. `generation`: only generation has it (a pooling task's JSON leaves its keys out)."""

    merge: Callable[[list[Any]], Any] | None
    json: tuple[tuple[str, Getter], ...] | None = None
    generation: bool = False

    def keys(self, name: str) -> tuple[tuple[str, Getter], ...]:
        """The JSON keys of the field `name` and their values' getters."""
        if self.json is not None:
            return self.json
        return ((name, operator.attrgetter(name)),)


def figure(merge: Callable[[list[Any]], Any] | None, *, json: tuple[tuple[str, Getter], ...] | None = None,
           generation: bool = False, **kwargs: Any) -> Any:
    """A RunSummary field with its SummaryRule (`core.fields.option` does the same for an option)."""
    return field(metadata={RULE: SummaryRule(merge, json, generation)}, **kwargs)


def rule_of(f: Field) -> SummaryRule:
    return f.metadata[RULE]


# The merge rules: the workers run side by side, over the same spec.
def added(values: list[Any]) -> Any:
    return sum(values)


def longest(values: list[Any]) -> Any:
    return max(values)


def first(values: list[Any]) -> Any:
    return values[0]


def worst(values: list[Outcome]) -> Outcome:
    return next(o for o in _WORST_FIRST if o in set(values))


def rates_added(values: list[float]) -> float:
    """The cluster's rate while the workers all run."""
    return round(sum(values), 2)


def averaged(values: list[float]) -> float:
    return sum(values) / len(values)


def in_every(values: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The names every part has (a --keep-fields field is missing from the input where no shard found it)."""
    return tuple(name for name in values[0] if all(name in v for v in values))


def reasons_added(values: list[dict[str, int]]) -> dict[str, int]:
    reasons: Counter[str] = Counter()
    for v in values:
        reasons.update(v)
    return _most_first(reasons)


def counts_added(counts: list[dict[str, int] | None]) -> dict[str, int] | None:
    """Count dicts added key by key (the workers' reuse counts); None where none has one."""
    given = [c for c in counts if c is not None]
    if not given:
        return None
    total: Counter[str] = Counter()
    for c in given:
        total.update(c)
    return {key: total[key] for key in given[0]}


def joined(values: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    return tuple(item for v in values for item in v)


def _setup(*names: str) -> tuple[tuple[str, Getter], ...]:
    """JSON keys of the setup's fields, as they are named there."""
    return tuple((name, operator.attrgetter(f"setup.{name}")) for name in names)


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
    latency figures are over the ok rows this process (or, merged, each worker) finished.

    Each field says how it merges and what --summary-json writes of it (`figure`, its SummaryRule); `to_json` and
    `merge` read those, and the JSON's keys come in the fields' order (the order they have always had: a new field
    goes before `outcome`, whose "status" is the last key)."""

    records: int = figure(added)  # rows in the journal: one per record
    samples: int = figure(added)  # output rows: a record with n > 1 has n
    ok: int = figure(added)
    errors: int = figure(added)
    prompt_tokens: int = figure(added)
    completion_tokens: int = figure(added, generation=True)
    load_s: float = figure(longest)  # side by side: the longest, not the sum
    elapsed_s: float = figure(longest)  # generation: from the first record admitted to the last step
    output_tokens_per_s: float = figure(rates_added, generation=True)
    preemptions: int = figure(added, generation=True)
    prefix_cache_hit_rate: float = figure(averaged, generation=True)
    draft_tokens: int = figure(added, generation=True)  # --speculative: fed to the model ...
    accepted_draft_tokens: int = figure(added, generation=True, json=(  # ... and accepted
        ("accepted_draft_tokens", operator.attrgetter("accepted_draft_tokens")),
        ("draft_acceptance_rate", operator.attrgetter("draft_acceptance_rate"))))
    resumed_from: int = figure(added)  # rows already committed when the run started
    continued: int = figure(added, generation=True)  # records continued from an earlier process's partial ...
    tokens_carried_over: int = figure(added, generation=True)  # ... and the tokens those held
    in_flight_saved: int = figure(added, generation=True)  # partials kept at a stop (0 where the run did not stop)
    # --keep-fields that no record of the input had (a column of nulls)
    keep_fields_missing: tuple[str, ...] = figure(in_every, json=(
        ("keep_fields_missing", lambda s: list(s.keep_fields_missing)),))
    wall_s: float = figure(longest)  # from the run's start (before its checks and the model's load) to its result
    setup: RunSetup = figure(first, json=_setup("model", "model_path", "dtype", "backend"))  # every part's the same
    # the latency and occupancy figures (`run_figures`, over every part's rows) ...
    ttft_s: dict[str, float | None] = figure(None, generation=True)
    latency_s: dict[str, float | None] = figure(None)
    queue_s: dict[str, float | None] = figure(None)
    tpot_s: dict[str, float | None] = figure(None, generation=True)
    mean_running: float = figure(None, generation=True)
    occupancy: float = figure(None, generation=True)
    steps: int = figure(None)
    # ok output rows by finish reason ("stop", "length", ...), most first
    finish_reasons: dict[str, int] = figure(reasons_added, generation=True, json=(
        ("finish_reasons", lambda s: dict(s.finish_reasons)),))
    # ok output rows whose request had a grammar (--json-schema, --regex, --choice) ...
    structured_outputs: int = figure(added, generation=True)
    # ... and of those, the ones max_tokens cut before their grammar was complete
    structured_outputs_cut: int = figure(added, generation=True)
    reuse: dict[str, int] | None = figure(counts_added)  # over an input that changed (Reuse): None where not
    retried_errors: int = figure(added)  # --retry-errors: records whose error row of the run's own making was dropped
    # the worst of the parts'; "status", last, after the keys that came before it
    outcome: Outcome = figure(worst, json=(
        *_setup("task"), ("records_per_s", operator.attrgetter("records_per_s")),
        ("prompt_tokens_per_s", operator.attrgetter("prompt_tokens_per_s")), *_setup("cpu_isa", "batch_invariant"),
        ("status", lambda s: s.outcome.value)))
    # ... and what the figures are made of (`RunResult.figures_state`), kept to merge them: no JSON key of its own
    figures_states: tuple[dict[str, Any], ...] = figure(joined, json=(), default=(), repr=False, compare=False)

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
        """The --summary-json object: each field's keys (its SummaryRule), in the fields' order; a pooling task's
        has none of generation's."""
        generation = not Task(self.setup.task).pools
        return {key: value(self) for f in fields(self) if generation or not rule_of(f).generation
                for key, value in rule_of(f).keys(f.name)}

    @classmethod
    def merge(cls, summaries: list[RunSummary]) -> RunSummary:
        """The summary of a run made of `summaries` running side by side (the workers of `--executor ray`): each
        field merged by its rule (counts and tokens added, load and generation time the longest, token rates added,
        prefix-cache hit rates averaged, the setup the first's, the outcome the worst), the latency figures anew
        over every part's rows."""
        if not summaries:
            raise ValueError("RunSummary.merge: no summaries to merge")
        merged = {f.name: rule_of(f).merge([getattr(s, f.name) for s in summaries])
                  for f in fields(cls) if rule_of(f).merge is not None}
        return cls.with_figures(merged.pop("figures_states"), **merged)


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
