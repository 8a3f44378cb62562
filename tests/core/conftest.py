"""Shared setup for tests/core. Imports no torch itself, so the pure-Python test files stay torch-free."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Run torch on one thread when a torch test module was collected.

    The test machine's cores are shared with other jobs; with two intra-op threads, torch's workers
    spin at barriers while the other core is busy elsewhere, which made forward passes 5-10x slower.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    yield
