"""The exactness contract, which every route of the engine's forward pass meets or declines. Pure Python.

A record's output is a function of its prompt, its parameters and its seed only: the same alone, among
any other records, with its prompt chunked at any token budget, with its prefix served from the cache,
after any number of preemptions, and across a resume. Greedy or sampled, in every default dtype.

What a route must do for that, in every operation on the path (linears at every row count, attention,
norms, rotary, the LM head, the sampler):

1. Each row's result is the same bits whatever else is in the step. A reduction runs in one fixed order
   per row (for a linear, one chain over k; for attention, its own keys in key order), which depends
   neither on the number of rows, nor on the thread count, nor on where the row sits in the step. No
   route is chosen by the step's row count; work is split between threads by output, never by a
   reduction.
2. A query row takes one arithmetic whether it comes in a fresh prompt, a later chunk or a decode: the
   attention path is a property of the KV pool (its layout), never of the rows.
3. Position-dependent inputs are functions of the position only (the rotary table is computed once per
   position, not per step).
4. Sampling draws from (seed, output index) and the row's own logits only (`sampler.uniform_for`).

Backends (`core/backends`), and whether they meet it: the cpu backend's fused forward (conveyor's C++ kernels,
every decoder family it covers) in float32 and bfloat16 does, tested bitwise in
tests/core/test_exactness_kernels.py (each kernel, random row counts), tests/core/test_exactness_engine.py (real
records through the engine in every configuration) and tests/core/test_model_families.py (every family). The cpu
backend under a model's transformers forward (torch's linears), and the torch and cuda backends
(`INEXACT_ROUTES`), do not, and say so when chosen (`inexact_reason`).
"""

from __future__ import annotations

# backend -> why it does not meet the contract; backends not listed meet it.
INEXACT_ROUTES: dict[str, str] = {
    "torch": "torch's matmul and attention kernels choose their blocking by the shape of the step (a one-row "
             "matmul takes another kernel than a 64-row one; fresh prompts go to SDPA, other rows gather), so a "
             "record's output can change with the records batched around it",
    "cuda": "cuBLAS chooses a matmul's kernel, and so its reduction order, by the step's row count (its paged "
            "attention is batch-invariant), so a record's output can change with the records batched around it",
}


def inexact_reason(route: str) -> str | None:
    """Why `route` does not meet the contract, or None where it does."""
    return INEXACT_ROUTES.get(route)
