"""`conveyor run` holds the garbage collector off while the libraries and the model load, then collects once and
freezes what is alive (cli/collector.py): the run writes its rows, the collector is back on for the run, and
the process ends without the leak reports of extensions whose objects were left frozen. A caller's own process is
never held or frozen."""

from __future__ import annotations

import gc

from cli_helpers import entry_in_child, read_rows, tiny_run_argv

from conveyor.cli import collector


def test_a_run_holds_the_collector_through_the_load_and_freezes_what_it_built(tiny_model, tmp_path):
    ids, out, argv = tiny_run_argv(tiny_model, tmp_path, 3, max_tokens=6)
    # Each collection and whether the engine existed yet; then the collector's state after the command.
    proc = entry_in_child(argv, setup="import gc\n"
                                      "from conveyor.io import run as io_run\n"
                                      "seen = []\n"
                                      "loaded = []\n"
                                      "load = io_run.Run.load_engine\n"
                                      "def load_engine(self):\n"
                                      "    loaded.append(gc.isenabled())\n"
                                      "    load(self)\n"
                                      "io_run.Run.load_engine = load_engine\n"
                                      "gc.callbacks.append(lambda phase, info:\n"
                                      "                    phase == 'start' and seen.append(bool(loaded)))\n",
                            after="print('exit', e.code, 'enabled during the load', loaded, 'collections before the load',\n"
                                  "      seen.count(False), 'enabled', gc.isenabled(), 'frozen', gc.get_freeze_count() > 0)\n",
                            fresh=True)  # the libraries' imports are part of what is held
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("exit 0 enabled during the load [False] collections before the load 0 enabled True "
                                   "frozen True"), proc.stdout + proc.stderr
    assert "leaked" not in proc.stderr, proc.stderr
    assert [r["id"] for r in read_rows(out)] == ids


def test_a_caller_process_is_left_as_it_is():
    frozen = gc.get_freeze_count()
    collector.release()  # never held here: nothing to undo
    assert gc.isenabled() and gc.get_freeze_count() == frozen
