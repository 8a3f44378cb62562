"""`conveyor status OUTPUT`: how far a run got, whether it is running, and how to resume it."""

from __future__ import annotations

import shlex
import sys
import time

from conveyor.cli.exit_codes import UsageError
from conveyor.cli.run_info import read_run_info


def show_status(output: str, run_dir: str | None) -> int:
    from conveyor.io.run_dir import RunDir

    path = run_dir or RunDir.default_for(output)
    rd = RunDir(path)
    if not rd.path.exists():
        raise UsageError(f"{path}: no run directory here; has `conveyor run ... -o {output}` been started?")
    info = rd.summary()
    info.update(read_run_info(rd.path))
    out = sys.stdout
    total = info.get("total")
    done = info.get("num_committed", 0)
    out.write(f"run directory: {rd.path}\n")
    if info.get("journal_error"):
        out.write(f"journal: {info['journal_error']}\n")
    if info.get("input_path"):
        out.write(f"input:  {info['input_path']}\nmodel:  {info.get('model')}\n")
    out.write(f"done:   {done}" + (f" / {total}" if total is not None else "") + f"  (errors {info.get('num_errors', 0)})\n")
    last = info.get("last_commit_time")
    out.write("last checkpoint: " + (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last)) if last else "none")
              + "\n")
    holder = info.get("lock_holder")
    if holder:
        out.write(f"running: yes, process {holder.get('pid')}\n")
    else:
        out.write("running: no\n")
        command = info.get("command")
        if command:
            out.write(f"resume with: {command}\n")
        else:
            out.write(f"resume with: the same `conveyor run ... -o {shlex.quote(output)}` command as before\n")
    return 0
