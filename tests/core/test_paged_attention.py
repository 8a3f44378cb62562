"""The C++ paged attention kernel, in both pool layouts: against a dense float64 reference, row by row
against itself alone, across threads, and reading q in place from a wider tensor."""

from __future__ import annotations

import pytest
import torch
from pools import filled_pool, reference_attention

from conveyor.core.backends.cpu.kernels import cpu_identity, cpu_kernels, kernel_arch

ops = cpu_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ kernels here (no compiler, or a CPU without "
                                                    "AVX-512): the torch fallback is tested instead")

# (layout, dtype): the plain layout's FMA path in float32, bf16 and float16 (over float32 copies of its K/V), and
# the bf16 products of the pair layout where this CPU has them (AMX tiles, or AVX512-BF16 vectors).
ROUTES = [("plain", torch.float32), ("plain", torch.bfloat16), ("plain", torch.float16),
          pytest.param("pairs", torch.bfloat16, marks=pytest.mark.skipif(
              ops is None or not ops.kv_pairs(True, 64, 16, 3), reason="no bf16 products on this CPU"))]


def _pool(contexts, heads, head_dim, block_size, layout, dtype, g):
    """A pool of random K/V with each request's blocks scattered over it (block 0 is never used)."""
    Hkv = heads[1]
    num_blocks = sum(-(-c // block_size) for c in contexts) + 3
    keys = torch.randn(num_blocks * block_size, Hkv, head_dim, generator=g).to(dtype)
    values = torch.randn(num_blocks * block_size, Hkv, head_dim, generator=g).to(dtype)
    kv = filled_pool(keys, values, block_size, layout)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    max_blocks = max(-(-c // block_size) for c in contexts)
    tables, start = [], 0
    for c in contexts:
        n = -(-c // block_size)
        tables.append(perm[start:start + n].tolist() + [0] * (max_blocks - n))
        start += n
    return kv, keys, values, torch.tensor(tables)


def _attend(q, kv, tables, reqs, ctxs, **variant):
    return ops.paged_attention(q, kv.keys[0], kv.values[0], tables, torch.as_tensor(reqs), torch.as_tensor(ctxs),
                               kv.block_size, q.shape[-1] ** -0.5, **variant)


def _check_reference(out, q, keys, values, tables, reqs, ctxs, block_size, dtype, **variant):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (r, c) in enumerate(zip(reqs, ctxs)):
        slots = [tables[r][p // block_size].item() * block_size + p % block_size for p in range(c)]
        want = reference_attention(q[i].float(), keys[slots].float(), values[slots].float(), q.shape[-1] ** -0.5,
                                   variant.get("window") or None, variant.get("softcap") or None,
                                   variant.get("sinks"))
        assert torch.allclose(out[i].double(), want, atol=tol, rtol=tol), (i, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim, block_size, heads", [(64, 16, (9, 3)), (128, 16, (4, 4)), (32, 16, (8, 2)),
                                                         (16, 4, (4, 2)), (64, 8, (6, 3)),
                                                         (64, 16, (20, 2))])  # a group of 10: two passes
def test_plain_pool_matches_a_dense_reference(dtype, head_dim, block_size, heads):
    g = torch.Generator().manual_seed(head_dim + block_size)
    contexts = [1, 5, 16, 17, 33, 200, 64]
    kv, keys, values, tables = _pool(contexts, heads, head_dim, block_size, "plain", dtype, g)
    q = torch.randn(len(contexts), heads[0], head_dim, generator=g).to(dtype)
    out = _attend(q, kv, tables, range(len(contexts)), contexts)
    _check_reference(out, q, keys, values, tables, range(len(contexts)), contexts, block_size, dtype)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_float16_is_float32_over_the_same_values_rounded_once(head_dim):
    """float16 attends over float32 copies of its keys and values: every output is float32's over the same (widened)
    q, keys and values, rounded to float16 once, bit for bit, for decodes and prompt chunks alike."""
    g = torch.Generator().manual_seed(head_dim)
    contexts, rows = _LARGE_STEP
    kv, keys, values, tables = _pool(contexts, (9, 3), head_dim, 16, "plain", torch.float16, g)
    wide = filled_pool(keys.float(), values.float(), 16, "plain")
    q = torch.randn(len(rows), 9, head_dim, generator=g).half()
    reqs, ctxs = [r for r, _ in rows], [c for _, c in rows]
    assert torch.equal(_attend(q, kv, tables, reqs, ctxs), _attend(q.float(), wide, tables, reqs, ctxs).half())


@pytest.mark.parametrize("layout, dtype", ROUTES)
@pytest.mark.parametrize("heads", [(9, 3), (8, 8), (8, 2), (16, 1), (4, 1)])
def test_every_row_equals_itself_alone_and_the_reference(layout, dtype, heads):
    """The exactness contract of attention: a query row's output is the same bits whether it is a decode, a
    row of a fresh prompt or of a later chunk, whatever rows share its step: rows taken together (runs of a
    prompt chunk, cut by the run length, by another request and by a gap in positions) each equal that row
    computed alone, and the dense reference."""
    g = torch.Generator().manual_seed(sum(heads))
    H, D, bs = heads[0], 64, 16
    if layout == "pairs" and not ops.kv_pairs(True, D, bs, H // heads[1]):
        pytest.skip("no product path for this group size")
    kv, keys, values, tables = _pool([320, 304], heads, D, bs, layout, dtype, g)
    reqs = [1] + [0] * 70 + [1] * 5 + [0] * 3
    ctxs = [3] + list(range(1, 71)) + list(range(40, 45)) + [100, 101, 300]
    q = torch.randn(len(reqs), H, D, generator=g).to(dtype)
    out = _attend(q, kv, tables, reqs, ctxs)
    for i, (r, c) in enumerate(zip(reqs, ctxs)):
        assert torch.equal(out[i], _attend(q[i:i + 1], kv, tables, [r], [c])[0]), (i, r, c)
    _check_reference(out, q, keys, values, tables, reqs, ctxs, bs, dtype)


# What a model's layer may ask beyond plain causal attention: a sliding window (shorter than most contexts
# below, and one of a single key), a softcap (Gemma 2's 50), sinks (gpt-oss), and all three at once.
VARIANTS = {"window": dict(window=24), "window-1": dict(window=1), "softcap": dict(softcap=5.0),
            "sinks": "sinks", "all": "all"}


def _variant(name, heads, g):
    v = VARIANTS[name]
    sinks = (torch.randn(heads, generator=g) * 2).float()
    if v == "sinks":
        return dict(sinks=sinks)
    if v == "all":
        return dict(window=40, softcap=3.0, sinks=sinks)
    return dict(v)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout, dtype", ROUTES)
@pytest.mark.parametrize("heads, head_dim, block_size", [((9, 3), 64, 16), ((4, 2), 16, 4), ((8, 2), 128, 16),
                                                         ((6, 3), 64, 8)])
def test_windows_softcaps_and_sinks_match_the_reference_and_each_row_alone(variant, layout, dtype, heads, head_dim,
                                                                          block_size):
    """Each attention variant on every route: a dense float64 reference, and each row of a step (decodes, a
    fresh prompt, a later chunk, runs cut by another request) the same bits as that row alone. A window row
    reads only the blocks from its window on (the pool's other blocks hold NaN)."""
    if layout == "pairs" and not ops.kv_pairs(True, head_dim, block_size, heads[0] // heads[1]):
        pytest.skip("no product path for this shape")
    g = torch.Generator().manual_seed(len(variant) + head_dim)
    H = heads[0]
    v = _variant(variant, H, g)
    contexts = [300, 7, 150, 90]
    kv, keys, values, tables = _pool(contexts, heads, head_dim, block_size, layout, dtype, g)
    reqs = [0, 1, 2] + [3] * 40 + [0] * 20
    ctxs = [300, 7, 150] + list(range(51, 91)) + list(range(1, 21))
    q = torch.randn(len(reqs), H, head_dim, generator=g).to(dtype)
    out = _attend(q, kv, tables, reqs, ctxs, **v)
    for i, (r, c) in enumerate(zip(reqs, ctxs)):
        assert torch.equal(out[i], _attend(q[i:i + 1], kv, tables, [r], [c], **v)[0]), (i, r, c)
    _check_reference(out, q, keys, values, tables, reqs, ctxs, block_size, dtype, **v)
    if v.get("window"):  # the decode row (300 keys) reads its blocks from its window on (16-aligned): NaN in every
        # block before changes nothing
        first = (300 - v["window"]) // 16 * 16 // block_size
        assert first > 0
        for b in tables[0][:first].tolist():
            for t in (kv.keys[0], kv.values[0]):
                t.view(kv.num_blocks, -1)[b] = float("nan")
        assert torch.equal(_attend(q[:1], kv, tables, [0], [300], **v), out[:1])


def test_bf16_pools_take_the_pair_layout_wherever_the_cpu_has_bf16_products():
    """The pair layout (and its bf16 products) wherever the CPU has AMX tiles or AVX512-BF16 (and the build
    targets this CPU, not a named older one), for bf16, head_dim 64, block size 16 only."""
    if ops.amx_gemm_available() or (kernel_arch() == "native" and "avx512_bf16" in cpu_identity()[1]):
        assert ops.kv_pairs(True, 64, 16, 3) and ops.kv_pairs(True, 64, 16, 16)
    for bf16, d, bs, group in ((False, 64, 16, 3), (True, 128, 16, 3), (True, 64, 8, 3), (True, 64, 16, 17)):
        assert not ops.kv_pairs(bf16, d, bs, group)


@pytest.mark.skipif(ops is None or not ops.kv_pairs(True, 64, 16, 3), reason="no bf16 products on this CPU")
def test_a_pair_pool_refuses_a_shape_without_products():
    g = torch.Generator().manual_seed(2)
    kv, _, _, tables = _pool([40], (34, 2), 64, 16, "pairs", torch.bfloat16, g)  # a group of 17: no products
    with pytest.raises(RuntimeError, match="pair-layout pool"):
        _attend(torch.randn(1, 34, 64).bfloat16(), kv, tables, [0], [40])


# A step: (context of each request, its rows as (request, keys the row sees)).
_SMALL_STEP = ([300, 7, 150, 90],  # three decodes, then a 40-token prompt chunk of request 3
               [(0, 300), (1, 7), (2, 150)] + [(3, c) for c in range(51, 91)])
_LARGE_STEP = ([40 + 13 * i for i in range(24)] + [200, 64, 333],  # 24 decodes, three prompt chunks
               [(i, 40 + 13 * i) for i in range(24)] + [(24, c) for c in range(101, 201)]
               + [(25, c) for c in range(1, 65)] + [(26, c) for c in range(300, 334)])


@pytest.mark.parametrize("step", [_SMALL_STEP, _LARGE_STEP], ids=["small", "large"])
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("layout, dtype", ROUTES)
def test_splitting_work_across_threads_changes_no_result(threads, step, layout, dtype):
    """Rows of a step are cut into chunks that threads take as they go (decodes first, then prompt
    chunks' rows): every row's output equals the single-threaded one bit for bit."""
    g = torch.Generator().manual_seed(7)
    contexts, rows = step
    kv, _, _, tables = _pool(contexts, (9, 3), 64, 16, layout, dtype, g)
    q = torch.randn(len(rows), 9, 64, generator=g).to(dtype)
    reqs, ctxs = [r for r, _ in rows], [c for _, c in rows]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(q, kv, tables, reqs, ctxs)
        torch.set_num_threads(threads)
        many = _attend(q, kv, tables, reqs, ctxs)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@pytest.mark.parametrize("layout, dtype", ROUTES)
def test_q_is_read_in_place_from_a_wider_tensor(layout, dtype):
    """q as the fused forward passes it: the first H * D columns of each qkv row, not a contiguous
    tensor. The result equals that of a contiguous copy, and a q strided within a row is copied."""
    g = torch.Generator().manual_seed(11)
    H, Hkv, D = 9, 3, 64
    contexts, rows = _SMALL_STEP
    kv, _, _, tables = _pool(contexts, (H, Hkv), D, 16, layout, dtype, g)
    reqs, ctxs = [r for r, _ in rows], [c for _, c in rows]
    qkv = torch.randn(len(rows), (H + 2 * Hkv) * D, generator=g).to(dtype)
    q = qkv[:, :H * D].view(len(rows), H, D)
    assert not q.is_contiguous()
    assert torch.equal(_attend(q, kv, tables, reqs, ctxs), _attend(q.contiguous(), kv, tables, reqs, ctxs))
    heads_apart = torch.randn(len(rows), D, H, generator=g).to(dtype).transpose(1, 2)  # stride(1) = 1
    assert torch.equal(_attend(heads_apart, kv, tables, reqs, ctxs),
                       _attend(heads_apart.contiguous(), kv, tables, reqs, ctxs))
