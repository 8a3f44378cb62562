"""A stop signal during start-up (while Python imports the libraries, before the run's controller exists) is held,
not fatal: the run then stops as for any SIGTERM (exit 75, nothing lost, resumable), and a command that never
takes it ends by it as it would have."""

from __future__ import annotations

import signal
import subprocess
import sys

from cli_helpers import child_env, entry_in_child, read_rows, run_in_process, tiny_run_argv


def test_a_sigterm_while_the_command_starts_stops_the_run_with_75_and_it_resumes(tiny_model, tmp_path):
    ids, out, argv = tiny_run_argv(tiny_model, tmp_path, 4, max_tokens=8)
    # The entry, with the signal sent where a cron job's could land: after its first line, before the app imports.
    proc = entry_in_child([a for a in argv if a != "--quiet"], setup="import os, signal\n"
                                      "from conveyor.cli import stop_signals\n"
                                      "stop_signals.hold_early_signals()\n"
                                      "os.kill(os.getpid(), signal.SIGTERM)\n", fresh=True)
    assert proc.returncode == 75, proc.stderr
    assert "SIGTERM received" in proc.stderr
    # the stop is taken before the model loads, and nothing claims what did not happen
    assert "conveyor: loading" not in proc.stderr and "every record has a row" not in proc.stderr, proc.stderr
    resumed = run_in_process(*argv[1:])
    assert resumed.code == 0, resumed.err
    assert [r["id"] for r in read_rows(out)] == ids


def test_a_held_signal_that_no_run_takes_ends_the_process_as_it_would_have():
    script = ("import os, signal\n"
              "from conveyor.cli.stop_signals import hold_early_signals, release_held_signals\n"
              "hold_early_signals()\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "print('alive after the signal', flush=True)\n"
              "release_held_signals()\n"
              "print('not reached')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=child_env())
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert proc.stdout == "alive after the signal\n"


def test_a_second_ctrl_c_during_start_up_exits_at_once_with_130():
    script = ("import os, signal\n"
              "from conveyor.cli.stop_signals import hold_early_signals\n"
              "hold_early_signals()\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "print('not reached')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=child_env())
    assert proc.returncode == 130 and proc.stdout == "", proc.stderr


def test_a_signal_after_the_runs_controller_is_gone_leaves_the_runs_exit_code(tiny_model, tmp_path):
    """A SIGTERM that lands once the run has ended (its rows written, its controller uninstalled) is held, and the
    process exits with the run's code, not killed by it."""
    ids, out, argv = tiny_run_argv(tiny_model, tmp_path, 3, max_tokens=4)
    proc = entry_in_child([a for a in argv if a != "--quiet"], setup="import os, signal\n"
                                      "from conveyor.cli import stop_signals\n"
                                      "uninstall = stop_signals.StopController.uninstall\n"
                                      "def late(self):\n"
                                      "    uninstall(self)\n"
                                      "    os.kill(os.getpid(), signal.SIGTERM)\n"
                                      "stop_signals.StopController.uninstall = late\n")
    assert proc.returncode == 0, proc.stderr
    assert [r["id"] for r in read_rows(out)] == ids
