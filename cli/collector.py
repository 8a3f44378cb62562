"""(process) Python's cyclic garbage collector held off while `conveyor run` imports its libraries and loads the
model, then what they built frozen out of its later passes.

The libraries and the model make a few hundred thousand long-lived objects, and the collector walked all of them
every time their number grew by a quarter: seven full passes during the quickstart's start-up (0.8 s of 28 s on
2 cores, each pass longer than the one before) and one more as the run ended. Held off until the engine is
loaded, then one collection (the little garbage the load left) and `gc.freeze()`: later passes walk only the
objects the run itself makes. At exit they are unfrozen, so the interpreter's shutdown frees them as before (left
frozen, nanobind-based extensions list their functions as leaked). Only the console script's own process is held
(`entry.py`); a Python caller's process is left as it is.
"""

from __future__ import annotations

import atexit
import gc

_held = False


def hold() -> None:
    """Turn the collector off until `release` (the process's entry, before the libraries import)."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def release() -> None:
    """Collect once, freeze what is alive and turn the collector back on, where `hold` turned it off."""
    global _held
    if not _held:
        return
    _held = False
    gc.collect()
    gc.freeze()
    gc.enable()
    atexit.register(gc.unfreeze)  # the interpreter's last collection sees them (extensions check for leaks)
