"""A run split into shards: the shard's finish (the last shard to finish writes the output), the driver of a run
whose shards run elsewhere (`SplitRun`: `--executor ray`), and `conveyor merge` (`merge_shards`). The rows come
from each shard's journal, merged in input order by `state/shards.py`."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

from conveyor.io.counts import counted
from conveyor.io.errors import SpecError
from conveyor.io.rows.writers import STDOUT, infer_output_format
from conveyor.io.run_checks import check_output, output_folder
from conveyor.io.run_report import Outcome, RunSummary
from conveyor.io.run_spec import RunSpec
from conveyor.io.state.manifest import STATE_FILES
from conveyor.io.state.paths import check_run_paths
from conveyor.io.state.run_dir import RunDir
from conveyor.io.state.shards import MergeResult, Shard, ShardError, ShardSet, mark_done, merge
from conveyor.io.storage import is_remote


def base_run_dir(spec: RunSpec) -> Path:
    """The run directory the user named (a shard's own is a folder inside it)."""
    return Path(spec.state.run_dir or RunDir.default_for(spec.output.path))


def finish_shard(spec: RunSpec, shard: Shard, shard_run_dir: Path, output_format: str, input_records: int,
                 outcome: Outcome, merge_when_done: bool, say: Callable[[str], None]) -> tuple[Outcome, str, bool]:
    """Say `shard` is done (its run directory `shard_run_dir` has a row for each of the `input_records` it read);
    where `merge_when_done` and every shard is done, write the output. (The outcome, what to tell the user, whether
    the output was written.)"""
    mark_done(shard_run_dir, shard, input_records, spec.output.on_error)
    if not merge_when_done:
        return outcome, f"shard {shard} done", False
    output = spec.output.path
    waiting = [name for name, state in ShardSet(base_run_dir(spec), shard.count).status().items() if state != "done"]
    if waiting:
        return outcome, (f"shard {shard} done; waiting for shard{'s' if len(waiting) > 1 else ''} "
                         f"{', '.join(waiting)}: the last to finish writes {output} (or run "
                         f"`conveyor merge {output}` once all are done)"), False
    try:
        merged = merge(base_run_dir(spec), output, output_format)
    except ShardError as e:  # another shard's problem: this one's rows stand (a warning: said even when quiet)
        say(f"warning: shard {shard} done, but {output} cannot be written yet: {e}")
        return outcome, "", False
    return merged.outcome, f"all {counted(shard.count, 'shard')} done: merged {counted(merged.rows, 'row', thousands=True)}", True


class SplitRun:
    """The driver of a run of `spec` whose shards run elsewhere (`--executor ray`): `open` checks the spec and
    makes the run directory the shards' go inside; `finish` adds the shards' summaries and, where none stopped,
    writes the output from them (`merge`)."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.output_format = ""
        self.output_folder: str | None = None
        self.started = time.monotonic()  # the driver's wall time runs from here to the shards' end

    def open(self) -> Path:
        """The run directory (made where it is not yet); SpecError where the spec cannot run split."""
        spec = self.spec
        if spec.state.shard is not None:
            raise SpecError("--shard: not with --executor ray, which runs every shard itself")
        if spec.input.path == "-":
            raise SpecError("--executor ray: every worker reads the input, so it must be a file or dataset, not "
                            "stdin")
        if spec.output.path == STDOUT:
            raise SpecError("-o -: not with --executor ray, which writes the output from its shards; name a file")
        self.output_format = check_output(spec)
        self.output_folder = output_folder(spec)  # shards that write their own part files there: no merge
        run_dir = base_run_dir(spec)
        check_run_paths(spec.input.path, spec.output.path, run_dir, STATE_FILES, folder=self.output_folder is not None)
        if not is_remote(spec.input.path) and not Path(spec.input.path).exists():
            raise SpecError(f"{spec.input.path}: no such input file or directory")
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir

    def finish(self, summaries: list[RunSummary]) -> tuple[RunSummary, MergeResult | None]:
        """The run's summary from its shards' `summaries` (added: `RunSummary.merge`; the wall time the driver's).
        Where a shard stopped, that alone (nothing merged: None); else the output written from the shards
        (`merge`, returned too) and the summary's counts and outcome those of the rows merged (a worker counts only
        its own process's)."""
        summary = RunSummary.merge(summaries)
        if summary.outcome is Outcome.STOPPED:
            return dataclasses.replace(summary, wall_s=self._wall_s()), None
        merged = self.merge()
        skip = merged.skipped_errors
        return dataclasses.replace(
            summary, records=merged.rows + (merged.errors if skip else 0), errors=merged.errors,
            ok=merged.rows - (0 if skip else merged.errors), wall_s=self._wall_s(), outcome=merged.outcome), merged

    def _wall_s(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def merge(self) -> MergeResult:
        """Write the output from this run's finished shards, in input order; where they wrote part files, check and
        count their rows only."""
        return merge(base_run_dir(self.spec), self.spec.output.path, self.output_format,
                     write=self.output_folder is None)


def merge_shards(output: str, run_dir: str | None = None, output_format: str | None = None) -> MergeResult:
    """`conveyor merge`: `output` from the finished shards under `run_dir` (default: the output's); SpecError for a
    folder of part files, which its shards wrote themselves."""
    if output.endswith("/") or os.path.isdir(output):
        raise SpecError(f"{output} is a folder of part files: each shard wrote its own parts there as it finished, "
                        "so there is nothing to merge (`conveyor status` shows them)")
    if output_format is not None:
        output_format = infer_output_format(output, output_format)
    return merge(Path(run_dir) if run_dir else RunDir.default_for(output), output, output_format)
