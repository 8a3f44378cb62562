"""Test helper (torch): the engine's routes on this machine, one per backend and forward, for tests that run
over all of them (`route` fixtures): "cpu" (the C++ kernels, the fused forward), "cpu-transformers" (the
kernels' attention under the model's transformers forward), "torch" (plain torch), "cuda" (Triton attention
and the lean forward, on the CPU under Triton's interpreter: TRITON_INTERPRET=1, which tests/conftest.py sets
where there is no CUDA; benchmarks/gpu_check.sh covers it on a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conveyor.core import EngineConfig
from conveyor.core.backends import available_backends

ROUTES = ("cpu", "cpu-transformers", "torch", "cuda")


def route_config(route: str, config: EngineConfig) -> EngineConfig:
    """`config` along `route`; skips the test where the route does not run here."""
    backend = route.split("-")[0]
    if backend not in available_backends(torch.device("cpu")):  # the tests' models live on the CPU
        pytest.skip(f"the {backend} backend does not run on this CPU")
    return dataclasses.replace(config, backend=backend, fused_forward=not route.endswith("transformers"))
