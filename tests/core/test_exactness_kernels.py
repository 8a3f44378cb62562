"""The exactness contract at the kernel level (conveyor.core.exactness), as a property: for a random number
of rows M in 1..2048 and a random mix of rows, every row of every route's linear, attention (with a layer's window,
softcap and sinks), element-wise and MoE kernels equals that row computed alone, bitwise, in float32 and bfloat16. The batch runs on
two threads, each row alone on one.

On a CPU with AMX the routes of CPUs without tiles (bf16 pair products) are checked too, in a child
process with CONVEYOR_NO_AMX=1 (the kernels read it once per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pools import filled_pool

from conveyor.core.backends.cpu.kernels import cpu_kernels
from conveyor.core.backends.cpu.linears import pack_amx, pack_pairs, pack_panels

ops = cpu_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ kernels here (no compiler, or a CPU without "
                                                    "AVX-512): the torch fallback does not claim exactness")

EXAMPLES = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _linear_routes():
    routes = [("panel-f32", torch.float32, pack_panels, "panel_gemm"),
              ("panel-bf16", torch.bfloat16, pack_panels, "panel_gemm")]
    if ops is not None and ops.pair_gemm_available():
        routes.append(("pairs-bf16", torch.bfloat16, pack_pairs, "pair_gemm"))
    if ops is not None and ops.amx_gemm_available():
        routes.append(("amx-bf16", torch.bfloat16, pack_amx, "amx_gemm"))
    return routes


def _attention_routes():
    routes = [("plain", torch.float32), ("plain", torch.bfloat16)]
    if ops is not None and ops.kv_pairs(True, 64, 16, 3):
        routes.append(("pairs", torch.bfloat16))
    return routes


def _threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


@pytest.mark.parametrize("route", _linear_routes(), ids=lambda r: r[0])
@EXAMPLES
@given(m=st.integers(1, 2048), k=st.sampled_from([64, 96, 576]), seed=st.integers(0, 2**16))
@example(m=2048, k=576, seed=1)
@example(m=1100, k=96, seed=2)
def test_every_row_of_a_linear_equals_that_row_alone(route, m, k, seed):
    _, dtype, pack, name = route
    gemm = getattr(ops, name)
    n = 80  # two full panels and a partial one
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if seed % 2 else None
    x = torch.randn(m, k, generator=g).to(dtype)
    packed = pack(w)
    before = _threads(2)
    try:
        full = gemm(x, packed, n, bias)
        torch.set_num_threads(1)
        alone = torch.cat([gemm(x[i:i + 1], packed, n, bias) for i in range(m)])
    finally:
        torch.set_num_threads(before)
    differ = (full != alone).any(dim=1).nonzero().flatten().tolist()
    assert not differ, f"rows {differ[:10]} of {m} differ from the same rows alone"


@st.composite
def _step(draw):
    """A step of up to 2048 rows: requests with contexts of up to 700 keys, each contributing a decode row or
    a run of consecutive prompt rows (a fresh prompt from position 0 or a later chunk), in random order."""
    total = draw(st.one_of(st.integers(1, 2048), st.just(2048)))
    rows: list[tuple[int, int]] = []  # (request, keys the row sees)
    contexts: list[int] = []
    while len(rows) < total:
        r = len(contexts)
        kind = draw(st.sampled_from(["decode", "fresh", "chunk"]))
        n = 1 if kind == "decode" else draw(st.integers(1, min(300, total - len(rows))))
        start = 0 if kind == "fresh" else draw(st.integers(0, 400))
        contexts.append(start + n)
        rows.extend((r, start + 1 + j) for j in range(n))
    return contexts, rows[:total]


@pytest.mark.parametrize("route", _attention_routes(), ids=lambda r: f"{r[0]}-{str(r[1])[6:]}")
@EXAMPLES
@given(step=_step(), heads=st.sampled_from([(9, 3), (4, 1), (8, 8)]), seed=st.integers(0, 2**16),
       window=st.sampled_from([0, 0, 1, 17, 64, 250]), softcap=st.sampled_from([0.0, 0.0, 4.0]),
       sinks=st.booleans())
def test_every_row_of_attention_equals_that_row_alone(route, step, heads, seed, window, softcap, sinks):
    """Also with a layer's sliding window, softcap and sinks (a window row starts its keys at a 16-aligned
    block of its own, whatever rows share its task)."""
    layout, dtype = route
    H, Hkv = heads
    D, bs = 64, 16
    contexts, rows = step
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // bs) for c in contexts) + 1
    keys = torch.randn(num_blocks * bs, Hkv, D, generator=g).to(dtype)
    values = torch.randn(num_blocks * bs, Hkv, D, generator=g).to(dtype)
    kv = filled_pool(keys, values, bs, layout)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    max_blocks = max(-(-c // bs) for c in contexts)
    tables, at = [], 0
    for c in contexts:
        b = -(-c // bs)
        tables.append(perm[at:at + b] + [0] * (max_blocks - b))
        at += b
    tables = torch.tensor(tables)
    q = torch.randn(len(rows), H, D, generator=g).to(dtype)
    reqs = torch.tensor([r for r, _ in rows])
    ctxs = torch.tensor([c for _, c in rows])
    args = (kv.keys[0], kv.values[0], tables)
    variant = (window, softcap, torch.randn(H, generator=g) if sinks else None)
    before = _threads(2)
    try:
        full = ops.paged_attention(q, *args, reqs, ctxs, bs, D ** -0.5, *variant)
        torch.set_num_threads(1)
        alone = torch.cat([ops.paged_attention(q[i:i + 1], *args, reqs[i:i + 1], ctxs[i:i + 1], bs, D ** -0.5,
                                               *variant) for i in range(len(rows))])
    finally:
        torch.set_num_threads(before)
    differ = (full != alone).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert not differ, f"rows {differ[:10]} of {len(rows)} differ from the same rows alone"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@EXAMPLES
@given(m=st.integers(1, 2048), seed=st.integers(0, 2**16))
def test_every_row_of_the_element_wise_kernels_equals_that_row_alone(dtype, m, seed):
    """RMSNorm (with and without the residual add, its weight in the dtype or in float32), q/k norms in place,
    SiLU(gate) * up, GELU-tanh(gate) * up, the logit softcap and the greedy argmax."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, 576, generator=g).to(dtype)
    delta = torch.randn(m, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    wf = 1.0 + torch.randn(576, generator=g)
    wh = torch.randn(64, generator=g).to(dtype)
    gu = (torch.randn(m, 2 * 200, generator=g) * 3).to(dtype)
    logits = torch.randn(m, 1000, generator=g).to(dtype)
    qkv = torch.randn(m, 9 * 64, generator=g).to(dtype)
    capped = (logits * 20).contiguous()
    before = _threads(2)
    try:
        summed, heads = h.clone(), qkv.clone()
        ops.norm_runs(heads, 64, 6, 64, wh, 1e-6)  # six heads from the second: q/k norms in place
        ops.softcap(capped, 30.0)
        full = (ops.rms_norm(h, None, w, 1e-5), ops.rms_norm(summed, delta, w, 1e-5), ops.silu_mul(gu),
                ops.argmax_rows(logits), ops.rms_norm(h, None, wf, 1e-6), ops.act_mul(gu, 1))
        torch.set_num_threads(1)
        for i in range(0, m, max(1, m // 64)):  # a spread of rows: each op alone on row i
            one = h[i:i + 1].clone()
            assert torch.equal(ops.rms_norm(h[i:i + 1].clone(), None, w, 1e-5), full[0][i:i + 1]), i
            assert torch.equal(ops.rms_norm(one, delta[i:i + 1].clone(), w, 1e-5), full[1][i:i + 1]), i
            assert torch.equal(one, summed[i:i + 1]), i
            assert torch.equal(ops.silu_mul(gu[i:i + 1].clone()), full[2][i:i + 1]), i
            assert torch.equal(ops.argmax_rows(logits[i:i + 1].clone()), full[3][i:i + 1]), i
            assert torch.equal(ops.rms_norm(h[i:i + 1].clone(), None, wf, 1e-6), full[4][i:i + 1]), i
            assert torch.equal(ops.act_mul(gu[i:i + 1].clone(), 1), full[5][i:i + 1]), i
            row = qkv[i:i + 1].clone()
            ops.norm_runs(row, 64, 6, 64, wh, 1e-6)
            assert torch.equal(row, heads[i:i + 1]), i
            cap = (logits[i:i + 1] * 20).contiguous()
            ops.softcap(cap, 30.0)
            assert torch.equal(cap, capped[i:i + 1]), i
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@EXAMPLES
@given(m=st.integers(1, 2048), seed=st.integers(0, 2**16), weights_in_dtype=st.booleans())
def test_every_row_of_an_moe_mlp_equals_that_row_alone(dtype, m, seed, weights_in_dtype):
    """The fused forward's MoE MLP (8 experts, 2 a row): a row's routing, its experts' linears at whatever number
    of rows each expert gets, and its sum over its experts are the row's own."""
    from conveyor.core.backends.cpu.linears import Linear

    g = torch.Generator().manual_seed(seed)
    hidden, inter, experts = 64, 32, 8

    def lin(n, k):
        return Linear((torch.randn(n, k, generator=g) / k ** 0.5).to(dtype), None, ops).native(ops)

    moe = ops.Moe(lin(experts, hidden), [lin(2 * inter, hidden) for _ in range(experts)],
                  [lin(hidden, inter) for _ in range(experts)], 2, True, weights_in_dtype)
    x = torch.randn(m, hidden, generator=g).to(dtype)
    before = _threads(2)
    try:
        full = moe(x, 0)
        torch.set_num_threads(1)
        for i in range(0, m, max(1, m // 64)):
            assert torch.equal(moe(x[i:i + 1].clone(), 0), full[i:i + 1]), i
    finally:
        torch.set_num_threads(before)


@pytest.mark.timeout(1200)  # (the suite's 600 s per test would end the worker before the child's own 900)
@pytest.mark.skipif(ops is None or not ops.amx_gemm_available() or os.environ.get("CONVEYOR_NO_AMX") == "1",
                    reason="no AMX here: the routes without tiles are the ones tested above")
def test_the_routes_of_cpus_without_amx_in_a_child_process():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", __file__],
                          env={**os.environ, "CONVEYOR_NO_AMX": "1"}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
