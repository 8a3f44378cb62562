"""The `conveyor` console script and `python -m conveyor.cli`: stop signals are held from the first instant
(stop_signals.py), and for `conveyor run` the garbage collector until the model is loaded (collector.py); then
the app runs."""

from __future__ import annotations

import sys

from conveyor.cli import collector
from conveyor.cli.stop_signals import hold_early_signals, release_held_signals


def main() -> None:
    hold_early_signals()
    if sys.argv[1:2] == ["run"]:
        collector.hold()
    from conveyor.cli.app import main as run_app

    try:
        run_app()
    finally:
        release_held_signals()
