"""`conveyor status OUTPUT` (or RUN_DIR): how far a run got (each shard's, for a run split by --shard or --executor
ray), whether it is running, and how to resume it."""

from __future__ import annotations

import re
import shlex
import sys
import time
from pathlib import Path

from conveyor.cli.exit_codes import UsageError
from conveyor.io.counts import counted
from conveyor.io.run_rebase import pending_in_changed_input
from conveyor.io.state.run_dir import RunDir
from conveyor.io.state.shards import SHARD_DIR
from conveyor.io.state.status import ShardStatus, run_status
from conveyor.io.storage import info as info_of
from conveyor.io.storage import is_remote


def show_status(output: str, run_dir: str | None) -> int:
    """Print the run's state; exit 0 where it finished (its output written), 75 where it has not (resumable); a
    missing run directory is a usage error (2). `output` may name the run directory itself."""
    output, run_dir = _output_and_run_dir(output, run_dir)
    status = run_status(output, run_dir)
    if status.shards is not None:
        return _show_shards(status.path, status.shards, output)
    info = status.info
    out = sys.stdout
    total = info.get("total")
    done = info.get("num_committed", 0)
    out.write(f"run directory: {status.path}\n")
    if info.get("journal_error"):
        out.write(f"journal: {info['journal_error']}\n")
    if info.get("input_path"):
        out.write(f"input:  {info['input_path']}\nmodel:  {info.get('model')}\n")
    samples = info.get("num_samples", done)
    out.write(f"done:   {done}" + (f" / {total}" if total is not None else "") + f"  (errors {info.get('num_errors', 0)})"
              + (f"  {counted(samples, 'sample')}\n" if samples != done else "\n"))
    if info.get("num_partials"):
        one = info["num_partials"] == 1
        out.write(f"in flight: {info['num_partials']} {'record holds' if one else 'records hold'} "
                  f"{counted(info['partial_tokens'], 'generated token')} (continued where "
                  f"{'it' if one else 'they'} stopped when the run resumes)\n")
    reuse, unknown = pending_in_changed_input(status.path)
    if reuse is not None:
        left = reuse.new + reuse.changed
        out.write(f"input changed since the last run: {left} record{'' if left == 1 else 's'} with no row yet "
                  f"({reuse.describe()}); the same command computes only those\n")
    elif unknown:
        out.write(f"input: {unknown}\n")
    elif total is not None and done < total:
        out.write(f"to do:  {total - done} record{'' if total - done == 1 else 's'} with no row yet\n")
    last = info.get("last_commit_time")
    out.write("last checkpoint: " + (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last)) if last else "none")
              + "\n")
    holder = info.get("lock_holder")
    parts = info.get("parts")
    if parts is not None:
        out.write(f"parts:  {parts['written']} written in {parts['folder']}/ ({counted(parts['records'], 'record', thousands=True)} each)\n")
        written = total is not None and parts["written"] >= max(1, -(-total // parts["records"]))
    else:
        written = info_of(output) is not None if is_remote(output) else Path(output).exists()
    finished = not holder and written and (total is None or done >= total) \
        and not info.get("num_partials") and not info.get("journal_error") and not unknown \
        and (reuse is None or not (reuse.new or reuse.changed or reuse.removed))
    if holder:
        out.write(f"running: yes, process {holder.get('pid')}\n")
    elif finished:
        out.write(f"finished: {output} is written\n" if parts is None else
                  f"finished: every part is written in {parts['folder']}/\n")
    else:
        out.write("running: no\n")
        command = info.get("command")
        if command:
            out.write(f"resume with: {command}\n")
        else:
            out.write(f"resume with: the same `conveyor run ... -o {shlex.quote(output)}` command as before\n")
    return 0 if finished else 75


def _output_and_run_dir(given: str, run_dir: str | None) -> tuple[str, str | None]:
    """(the output, its run directory or None for the default) of `conveyor status GIVEN [--run-dir DIR]`: GIVEN is
    the output, or a run directory (its output read from its manifest); an output in object storage has its state in
    the --run-dir its run was given, never beside it in the store."""
    if run_dir is None and is_remote(given):
        raise UsageError(f"{given}: the state of an output in object storage (its journal and lock) lives in the "
                         "folder its run was given as --run-dir, not in the store; name that folder: "
                         f"conveyor status {shlex.quote(given)} --run-dir DIR (or conveyor status DIR)")
    if run_dir is None and _is_run_dir(Path(given)):
        return _output_of(Path(given)), given
    return given, run_dir


def _is_run_dir(path: Path) -> bool:
    """Whether `path` is a run directory: a run's manifest, or the shard folders of a split run, in it."""
    if not path.is_dir():
        return False
    return RunDir(path).manifest_path.exists() or any(SHARD_DIR.fullmatch(p.name) and p.is_dir()
                                                      for p in path.iterdir())


def _output_of(run_dir: Path) -> str:
    """The output the run of `run_dir` writes: its manifest's (a shard's, for a split run), found beside the run
    directory where that is the output's default one (`<output>.conveyor`, whatever folder the run was started in);
    else the output whose default run directory it is."""
    beside = run_dir.with_name(run_dir.name.removesuffix(".conveyor"))
    for folder in [run_dir, *sorted(p for p in run_dir.iterdir() if SHARD_DIR.fullmatch(p.name) and p.is_dir())]:
        manifest = RunDir(folder).load_manifest()
        if manifest is not None:
            output = manifest.output_path
            if run_dir.name != Path(output).name + ".conveyor":
                return output
            return str(beside) + ("/" if output.endswith("/") else "")
    if run_dir.name.endswith(".conveyor"):
        return str(beside)
    raise UsageError(f"{run_dir}: no manifest in this run directory names its output; name the output too: "
                     f"conveyor status OUTPUT --run-dir {shlex.quote(str(run_dir))}")


def _show_shards(path: Path, shards: list[ShardStatus], output: str) -> int:
    """A run split by --shard (or --executor ray): one line per shard, then the whole."""
    out = sys.stdout
    count = len(shards)
    out.write(f"run directory: {path} ({counted(count, 'shard')})\n")
    done = errors = finished = running = 0
    total: int | None = 0
    missing = []
    known: str | None = None  # a shard's command line
    for one in shards:
        shard, info = one.name, one.info
        if info is None:
            total = None
            out.write(f"shard {shard}: not started\n")
            missing.append(shard)
            continue
        known = known or info.get("command")
        n, e, t = info.get("num_committed", 0), info.get("num_errors", 0), info.get("total")
        done, errors = done + n, errors + e
        total = None if t is None or total is None else total + t
        holder = info.get("lock_holder")
        state = ("finished" if one.finished else
                 f"running (process {holder.get('pid')})" if holder else "stopped")
        finished += state == "finished"
        running += holder is not None
        problem = f"; journal: {info['journal_error']}" if info.get("journal_error") else ""
        out.write(f"shard {shard}: {n}" + (f" / {t}" if t is not None else "") + f" done (errors {e}), {state}"
                  f"{problem}\n")
        if state == "stopped" and info.get("command"):
            out.write(f"  resume with: {info['command']}\n")
    out.write(f"all:    {done}" + (f" / {total}" if total is not None else "") + f"  (errors {errors}); "
              f"{finished} of {counted(count, 'shard')} finished, {running} running\n")
    parts = [one.info.get("parts") for one in shards if one.info is not None]
    if finished == count and parts and all(parts):  # shards that wrote their own part files: nothing to merge
        out.write(f"output: {counted(sum(p['written'] for p in parts), 'part')} written in {parts[0]['folder']}/ by "
                  f"the {counted(count, 'shard')}\n")
        return 0
    if finished == count:
        written = Path(output).exists()
        out.write(f"output: {output} {'written' if written else 'not written yet'} "
                  f"(`conveyor merge {shlex.quote(output)}` writes it from the shards)\n")
        return 0 if written else 75
    else:  # (stopped shards said theirs above)
        if known and _SHARD_ARG.search(known):
            for shard in missing:  # another shard's command, with this shard's --shard
                out.write(f"start shard {shard} with: {_SHARD_ARG.sub(f'--shard {shard}', known, count=1)}\n")
        elif known and missing:
            out.write(f"resume with: {known}\n")
        elif not known:
            out.write("resume with: each unfinished shard's `conveyor run ... --shard I/N` command (or the same "
                      "`--executor ray` command)\n")
    return 75


_SHARD_ARG = re.compile(r"--shard[= ]\d+/\d+")
