"""The AVX2 route of the CPU kernels (`--cpu-isa avx2`) where this CPU runs the AVX-512 one: the kernels' own tests
(every shape, M in 1..2048, both dtypes), the decoder families' greedy float32 against transformers and a record's
independence from its batch on the fused forward (float32, and bf16 widened), the engine's exactness in float32 (the
route's default dtype) and in bf16 under a 48-token budget, a request resumed from its tokens so far (greedy and
seeded: the same bits as uninterrupted) and the CLI's route, rerun in a child process on that route (the kernels load
one route per process). Where this CPU has only AVX2 the whole suite runs on it already."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.core.backends.cpu.kernels import cpu_identity, cpu_kernels, route_for

TESTS = Path(__file__).resolve().parents[1]
ON_THE_ROUTE = [
    "core/test_exactness_kernels.py", "core/test_paged_attention.py", "core/test_linear_kernels.py",
    "core/test_cpu_kernels.py", "core/test_sampler.py",
    "core/test_exactness_engine.py::test_among_47_others_in_shuffled_order[float32]",
    "core/test_exactness_engine.py::test_under_forced_preemption[float32]",
    # bf16 widened on this route, in the steps a 48-token budget cuts (as --max-num-batched-tokens 48 does)
    "core/test_exactness_engine.py::test_with_a_48_token_budget_that_chunks_the_prompts[bfloat16]",
    "core/test_model_families.py::test_a_record_does_not_depend_on_its_batch_on_the_fused_route",
    "core/test_continuation.py", "cli/test_cpu_isa.py",
]
FAMILIES = "core/test_model_families.py::test_greedy_float32_equals_transformers"


def _families_on_the_cpu_route() -> list[str]:
    sys.path.insert(0, str(TESTS / "core"))
    from families import CONFIGS

    return [f"{TESTS / FAMILIES}[{name}-cpu]" for name in sorted(CONFIGS)]


def _runs_avx2_as_well() -> bool:
    ops = cpu_kernels()
    return ops is not None and ops.build_isa() != "avx2" and "avx2" in cpu_identity()[1] and \
        "fma" in cpu_identity()[1] and route_for(cpu_identity()[1]) == "native"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # (the suite's 600 s per test would end the worker before the child's own 1500)
@pytest.mark.skipif(not _runs_avx2_as_well(), reason="this CPU runs no other route than the suite's own (AVX2 only, "
                    "or no AVX2)")
def test_the_avx2_route_in_a_child_process():
    args = [*(str(TESTS / t) for t in ON_THE_ROUTE), *_families_on_the_cpu_route()]
    env = {**os.environ, "CONVEYOR_CPU_ISA": "avx2"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *args], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
