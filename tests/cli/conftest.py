"""Fixtures for the CLI tests: torch kept to one thread while these modules run (several torch threads on a
shared 2-core runner spin against each other and make every step 10-20x slower; child processes get
OMP_NUM_THREADS=1 likewise), and no child process outliving its test."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_child_outlives_its_test():
    from cli_helpers import Child

    yield
    Child.kill_all()
