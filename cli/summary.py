"""The end of `conveyor run`: io's `RunSummary` rendered as the summary table, its warnings, the step-time profile,
--summary-json, and the outcome's exit code. `conveyor run` and the driver of `--executor ray` both end here."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from conveyor.cli.exit_codes import ExitCode, UsageError
from conveyor.cli.notes import say
from conveyor.core import Task
from conveyor.io.counts import counted
from conveyor.io.run_report import Outcome, RunSummary

EXIT_CODES = {Outcome.OK: ExitCode.OK, Outcome.SOME_ERRORS: ExitCode.SOME_ERRORS, Outcome.STOPPED: ExitCode.STOPPED}


def exit_code(outcome: Outcome) -> int:
    return int(EXIT_CODES[outcome])


@dataclass(frozen=True)
class Ending:
    """What the end of a run says beside its summary. `message`: beside the table, on stderr; `ended`: how the run
    ended, at the end of --quiet's closing line, after the records with a row of `total` (where known); `wrote`:
    where the output went, said last (not with --quiet; "" where none was written); `table`: False where nothing was
    computed (a table of zeros would say nothing: the message and the warnings alone); `stream`: the table's and the
    profile's (stdout by default; stderr where stdout carries the output); `profile`: the step-time profile, where
    asked for."""

    message: str
    ended: str
    total: int | None
    wrote: str = ""
    table: bool = True
    stream: TextIO | None = None
    profile: dict[str, float] | None = None


def report(summary: RunSummary, ending: Ending, quiet: bool, summary_json: str | None) -> int:
    """The end of a run, in this process or on Ray: the summary table (with --quiet, the warnings and errors and one
    closing line for a cron job's log), the profile, --summary-json, where the output went; the outcome's exit
    code."""
    if quiet:
        print_warnings(summary)
        say(closing_line(summary.records, ending.total, summary.errors, ending.ended))
    elif ending.table:
        print_summary(summary, ending.message, ending.stream)
    else:
        if ending.message:
            say(ending.message)
        print_warnings(summary)
    if ending.profile:
        print_profile(ending.profile, ending.stream or sys.stdout)
    if summary_json:
        write_summary_json(summary_json, summary)
    if ending.wrote and not quiet:
        say(ending.wrote)
    return exit_code(summary.outcome)


def print_summary(summary: RunSummary, message: str, stream=None) -> None:
    """The summary table on `stream` (stdout by default), then `message` and the warnings on stderr."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="conveyor run summary", show_header=False, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in [*_task_rows(summary), *_resume_rows(summary)]:
        table.add_row(name, str(value))
    stream = stream or sys.stdout
    console = Console(file=stream, width=max(60, Console().width if stream.isatty() else 80))
    console.print(table)
    if message:
        sys.stderr.write(f"conveyor: {message}\n")
    print_warnings(summary)


def _task_rows(s: RunSummary) -> list[tuple[str, object]]:
    """The table's rows of what the run's task did: a pooling task's records and their tokens, nothing generated."""
    if not Task(s.setup.task).pools:
        return [
            ("records", s.records if s.samples == s.records else f"{s.records} ({counted(s.samples, 'sample')})"),
            ("ok", s.ok), ("errors", s.errors),
            *_finish_reason_rows(s),
            ("prompt tokens", s.prompt_tokens), ("completion tokens", s.completion_tokens),
            ("model load", f"{s.load_s:.1f} s"), ("generation", f"{s.elapsed_s:.1f} s"),
            ("output tokens/s", f"{s.output_tokens_per_s:.1f}"), ("preemptions", s.preemptions),
            ("prefix-cache hit rate", f"{s.prefix_cache_hit_rate:.1%}"),
            *_figure_rows(s),
        ]
    return [
        ("task", s.setup.task), ("records", s.records if s.samples == s.records else
                                 f"{s.records} ({counted(s.samples, 'row')})"),
        ("ok", s.ok), ("errors", s.errors), ("tokens", s.prompt_tokens),
        ("model load", f"{s.load_s:.1f} s"), ("compute", f"{s.elapsed_s:.1f} s"),
        ("records/s", f"{s.records_per_s:.1f}"), ("tokens/s", f"{s.prompt_tokens_per_s:.1f}"),
        *_figure_rows(s),
    ]


def _resume_rows(s: RunSummary) -> list[tuple[str, object]]:
    """The table's rows of what the run took over from earlier ones and left to later ones, where it did."""
    rows: list[tuple[str, object]] = []
    if s.reuse is not None:
        rows.append(("input changed", f"reused {s.reuse['reused']}, new {s.reuse['new']}, changed "
                                      f"{s.reuse['changed']}, removed {s.reuse['removed']}"))
    if s.retried_errors:
        rows.append(("errors retried", s.retried_errors))
    if s.resumed_from:
        rows.append(("resumed from", s.resumed_from))
    if s.continued:
        rows.append(("continued", f"{counted(s.continued, 'record')}, {counted(s.tokens_carried_over, 'token')} "
                                  "carried over"))
    if s.in_flight_saved:
        rows.append(("in flight, saved", f"{counted(s.in_flight_saved, 'record')} (continued when the run resumes)"))
    return rows


def _finish_reason_rows(s: RunSummary) -> list[tuple[str, str]]:
    """'stop 30, length 20' over the ok rows finished here (a resumed run's earlier rows are not in it)."""
    if not s.finish_reasons:
        return []
    name = "finish reasons" + (" (since the resume)" if s.resumed_from else "")
    return [(name, ", ".join(f"{reason} {count}" for reason, count in s.finish_reasons.items()))]


def _figure_rows(s: RunSummary) -> list[tuple[str, str]]:
    """The summary table's rows of wall time, model and the latency and occupancy figures (where it has them)."""
    rows = [("wall time", f"{s.wall_s:.1f} s")]
    setup = s.setup
    if setup.model:
        ran = ", ".join(value for value in (setup.dtype, setup.backend, setup.cpu_isa) if value)
        rows.append(("model", f"{setup.model} ({ran})" if ran else setup.model))
    if setup.batch_invariant is False:  # the backend said why on stderr as the run started
        rows.append(("batch-invariant", "no: a record's output can change with its batch"))
    for figures, name in ((s.ttft_s, "time to first token"), (s.latency_s, "latency"), (s.queue_s, "queue time"),
                          (s.tpot_s, "time per output token")):
        if any(v is not None for v in figures.values()):
            rows.append((f"{name} {'/'.join(figures)}", _seconds(list(figures.values()))))
    if s.draft_tokens:
        rows.append(("draft tokens accepted", f"{s.accepted_draft_tokens} of {s.draft_tokens} "
                                              f"({s.draft_acceptance_rate:.0%})"))
    if s.steps and not Task(setup.task).pools:
        rows.append(("mean running (occupancy)", f"{s.mean_running:.1f} ({s.occupancy:.0%})"))
    if s.steps:
        rows.append(("engine steps", str(s.steps)))
    return rows


def _seconds(values: list[float | None]) -> str:
    """'12.3 / 20.1 ms', or in seconds where one is 1 s or more."""
    scale, unit = (1, "s") if max(v or 0 for v in values) >= 1 else (1000, "ms")
    return " / ".join("-" if v is None else f"{v * scale:.{3 if unit == 's' else 1}f}" for v in values) + f" {unit}"


def print_warnings(summary: RunSummary) -> None:
    """What a user should act on, on stderr (said with --quiet too): a --keep-fields field no record had (its
    column is all null: a typo, most likely), and structured outputs that max_tokens cut (ok rows that may not
    parse)."""
    for name in summary.keep_fields_missing:
        sys.stderr.write(f"conveyor: warning: keep field {name!r} was in no record (its column is all null); check "
                         "--keep-fields\n")
    if summary.structured_outputs_cut:
        sys.stderr.write(
            f"conveyor: warning: {summary.structured_outputs_cut} of {summary.structured_outputs} structured-output "
            "rows were cut by max_tokens (finish_reason length) and may not match their schema, regex or choice; "
            "raise --max-tokens (each such row's error column says so)\n")


def closing_line(records: int, total: int | None, errors: int, ended: str) -> str:
    """--quiet's one line, for a cron job's log: the records with a row (of how many, where known), the errors, and
    how the run ended."""
    done = f"{records}/{total}" if total is not None else str(records)
    have = "record has" if (total if total is not None else records) == 1 else "records have"
    return f"{done} {have} a row ({counted(errors, 'error')}); {ended}"


def print_profile(profile: dict, out) -> None:
    total = profile.get("step_s", 0.0) or 1e-9
    out.write("step time breakdown:\n")
    for key, value in profile.items():
        if key.endswith("_s") and key != "step_s":
            out.write(f"  {key[:-2]:<12} {value:9.3f} s  {value / total:6.1%}\n")
    out.write(f"  {'total':<12} {total:9.3f} s over {counted(int(profile.get('steps', 0)), 'step')}\n")


def check_summary_path(path: str | None) -> None:
    """--summary-json must name a file in a folder that exists: checked before the run, not after it."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"--summary-json {path}: is a folder; name a file")
    if not target.absolute().parent.is_dir():
        raise UsageError(f"--summary-json {path}: the folder {target.absolute().parent} does not exist; create it "
                         "or choose another path")


def write_summary_json(path: str, summary: RunSummary) -> None:
    try:
        Path(path).write_text(json.dumps(summary.to_json(), indent=2) + "\n", encoding="utf-8")
    except OSError as e:  # the run's result stands; only its summary file is missing
        sys.stderr.write(f"conveyor: warning: could not write --summary-json {path} ({e.strerror or e}); the run's "
                         "exit code is unchanged\n")
