"""The C++ CPU kernels and the fused Llama forward, each against plain torch / transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conveyor.core.attention import PagedBatch
from conveyor.core.cpu_kernels import cpu_identity, cpu_kernels, kernel_arch
from conveyor.core.fused_llama import (AMX_MAX_M, EXACT_M_ONEDNN, SMALL_M, FusedLlama, _Linear, pack_amx, pack_panels,
                                      row_bucket)
from conveyor.core.kv_cache import KVCache

ops = cpu_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ kernels here (no compiler, or a CPU without "
                                                    "AVX-512): the torch fallback is tested instead")


def _reference_attention(q, keys, values, scale):
    """q [H, D] against keys/values [L, Hkv, D] (GQA), in float64."""
    H, Hkv = q.shape[0], keys.shape[1]
    k = keys.double().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.double().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)
    w = torch.softmax((k @ q.double().unsqueeze(-1)).squeeze(-1) * scale, dim=-1)  # [H, L]
    return (w.unsqueeze(1) @ v).squeeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, block_size, heads", [(64, 16, (9, 3)), (128, 16, (4, 4)), (32, 16, (8, 2)),
                                                         (16, 4, (4, 2)), (64, 8, (6, 3)),
                                                         (64, 16, (20, 2))])  # a group of 10: two passes
def test_paged_attention_matches_a_dense_reference(dtype, head_dim, block_size, heads):
    g = torch.Generator().manual_seed(head_dim + block_size)
    H, Hkv = heads
    contexts = [1, 5, 16, 17, 33, 200, 64]
    num_blocks = sum(-(-c // block_size) for c in contexts) + 3
    k_cache = torch.randn(num_blocks, Hkv, head_dim, block_size, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, Hkv, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # scattered tables; block 0 is padding
    tables, start = [], 0
    max_blocks = max(-(-c // block_size) for c in contexts)
    for c in contexts:
        n = -(-c // block_size)
        tables.append(perm[start:start + n].tolist() + [0] * (max_blocks - n))
        start += n
    q = torch.randn(len(contexts), H, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    out = ops.paged_attention(q, k_cache, v_cache, torch.tensor(tables), torch.arange(len(contexts)),
                              torch.tensor(contexts), block_size, scale)
    for i, c in enumerate(contexts):
        slots = [tables[i][p // block_size] * block_size + p % block_size for p in range(c)]
        keys = k_cache.permute(0, 3, 1, 2).reshape(-1, Hkv, head_dim)[slots]
        want = _reference_attention(q[i], keys, v_cache[slots], scale)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out[i].double(), want, atol=tol, rtol=tol), (i, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (8, 8), (8, 2), (20, 2), (4, 1)])
def test_paged_attention_prompt_rows_taken_together_equal_each_row_alone(dtype, heads):
    """A prompt chunk's rows (one request, consecutive positions) share their K/V reads in the
    kernel; each row's output must equal that row computed on its own, bit for bit (bf16 on a CPU with
    AMX or AVX512-BF16: runs are bf16 products with bf16 probabilities, single rows take the FMA path,
    so only close), and the dense reference. Covers runs cut by the run length, by another request and
    by a gap in positions."""
    g = torch.Generator().manual_seed(sum(heads))
    H, Hkv = heads
    D, bs = 64, 16
    products = ops.paged_attention_bf16_prompts(dtype == torch.bfloat16, D, bs, H // Hkv)  # runs of 2+ rows
    num_blocks = 40
    k_cache = torch.randn(num_blocks, Hkv, D, bs, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * bs, Hkv, D, generator=g).to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.tensor([perm[:20], perm[20:39] + [0]])
    rows_req = [1] + [0] * 23 + [1] * 5 + [0] * 3
    rows_ctx = [3] + list(range(1, 24)) + list(range(40, 45)) + [100, 101, 300]
    q = torch.randn(len(rows_req), H, D, generator=g).to(dtype)
    args = (k_cache, v_cache, tables)
    out = ops.paged_attention(q, *args, torch.tensor(rows_req), torch.tensor(rows_ctx), bs, D ** -0.5)
    for i, (r, c) in enumerate(zip(rows_req, rows_ctx)):
        alone = ops.paged_attention(q[i:i + 1], *args, torch.tensor([r]), torch.tensor([c]), bs, D ** -0.5)
        if products:
            assert torch.allclose(out[i].float(), alone[0].float(), atol=2e-2, rtol=2e-2), (i, r, c)
        else:
            assert torch.equal(out[i], alone[0]), (i, r, c)
        slots = [tables[r][p // bs].item() * bs + p % bs for p in range(c)]
        keys = k_cache.permute(0, 3, 1, 2).reshape(-1, Hkv, D)[slots]
        want = _reference_attention(q[i], keys, v_cache[slots], D ** -0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out[i].double(), want, atol=tol, rtol=tol), (i, c)


def test_bf16_prompt_products_cover_bf16_with_head_dim_64_and_block_16_only():
    """Prompt runs take bf16 products (AMX tiles, or AVX512-BF16 vectors) wherever the CPU has either
    (and the build targets this CPU, not a named older one)."""
    if ops.amx_gemm_available() or (kernel_arch() == "native" and "avx512_bf16" in cpu_identity()[1]):
        assert ops.bf16_products_available()
    assert ops.paged_attention_bf16_prompts(True, 64, 16, 3) == ops.bf16_products_available()
    assert ops.paged_attention_bf16_prompts(True, 64, 16, 16) == ops.bf16_products_available()
    for bf16, d, bs, group in ((False, 64, 16, 3), (True, 128, 16, 3), (True, 64, 8, 3), (True, 64, 16, 17)):
        assert not ops.paged_attention_bf16_prompts(bf16, d, bs, group)


# A step: (context of each request, its rows as (request, keys the row sees)).
_SMALL_STEP = ([300, 7, 150, 90],  # three decodes, then a 40-token prompt chunk of request 3
               [(0, 300), (1, 7), (2, 150)] + [(3, c) for c in range(51, 91)])
_LARGE_STEP = ([40 + 13 * i for i in range(24)] + [200, 64, 333],  # 24 decodes, three prompt chunks
               [(i, 40 + 13 * i) for i in range(24)] + [(24, c) for c in range(101, 201)]
               + [(25, c) for c in range(1, 65)] + [(26, c) for c in range(300, 334)])


def _step_args(step, dtype, g):
    """Everything but q for `ops.paged_attention` on a step (9 query heads, 3 KV heads, head_dim 64,
    block size 16): caches of random K/V, each request's blocks in turn, the rows' requests and keys."""
    Hkv, D, bs = 3, 64, 16
    contexts, rows = step
    num_blocks = sum(-(-c // bs) for c in contexts) + 1
    k_cache = torch.randn(num_blocks, Hkv, D, bs, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * bs, Hkv, D, generator=g).to(dtype)
    max_blocks = max(-(-c // bs) for c in contexts)
    tables, nxt = [], 1
    for c in contexts:
        n = -(-c // bs)
        tables.append(list(range(nxt, nxt + n)) + [0] * (max_blocks - n))
        nxt += n
    return (k_cache, v_cache, torch.tensor(tables), torch.tensor([r for r, _ in rows]),
            torch.tensor([c for _, c in rows]), bs, D ** -0.5)


@pytest.mark.parametrize("step", [_SMALL_STEP, _LARGE_STEP], ids=["small", "large"])
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_splits_work_across_threads_without_changing_results(threads, step, dtype):
    """Rows of a step are cut into chunks that threads take as they go (decodes first, then prompt
    chunks' rows): every row's output equals the single-threaded one bit for bit."""
    g = torch.Generator().manual_seed(7)
    args = _step_args(step, dtype, g)
    q = torch.randn(len(step[1]), 9, 64, generator=g).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.paged_attention(q, *args)
        torch.set_num_threads(threads)
        many = ops.paged_attention(q, *args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_reads_query_rows_in_place_from_a_wider_tensor(dtype):
    """q as the fused forward passes it: the first H * D columns of each qkv row, not a contiguous
    tensor. The result equals that of a contiguous copy, and a q strided within a row is copied."""
    g = torch.Generator().manual_seed(11)
    H, Hkv, D = 9, 3, 64
    rows = _SMALL_STEP[1]
    args = _step_args(_SMALL_STEP, dtype, g)
    qkv = torch.randn(len(rows), (H + 2 * Hkv) * D, generator=g).to(dtype)
    q = qkv[:, :H * D].view(len(rows), H, D)
    assert not q.is_contiguous()
    want = ops.paged_attention(q.contiguous(), *args)
    assert torch.equal(ops.paged_attention(q, *args), want)
    heads_apart = torch.randn(len(rows), D, H, generator=g).to(dtype).transpose(1, 2)  # stride(1) = 1
    assert torch.equal(ops.paged_attention(heads_apart, *args), ops.paged_attention(heads_apart.contiguous(), *args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=g)
    norm = norm.to(dtype)
    h = torch.randn(7, 96, generator=g).to(dtype)
    delta = torch.randn(7, 96, generator=g).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(ops.rms_norm(h, None, norm.weight, 1e-5).float(), norm(h).float(), atol=tol, rtol=tol)
    summed = h + delta
    y = ops.rms_norm(h, delta, norm.weight, 1e-5)
    assert torch.equal(h, summed)  # the residual add happened in place, rounded like torch's
    assert torch.allclose(y.float(), norm(summed).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_is_bit_identical_to_transformers_and_fills_the_pool(dtype):
    g = torch.Generator().manual_seed(1)
    T, H, Hkv, D, bs = 6, 4, 2, 32, 4
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    angles = torch.rand(T, D // 2, generator=g) * 50
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q = qkv[:, :H * D].view(T, H, D).transpose(0, 1).unsqueeze(0)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D).transpose(0, 1).unsqueeze(0)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos.unsqueeze(0), sin.unsqueeze(0))
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D).clone()
    kv = KVCache(1, Hkv, D, num_blocks=8, block_size=bs, dtype=dtype, device=torch.device("cpu"))
    slots = torch.tensor([9, 10, 11, 12, 30, 2])
    work = qkv.clone()
    ops.rope_store(work, cos, sin, slots, kv.keys[0], kv.values[0], H)
    assert torch.equal(work[:, :H * D].view(T, H, D), want_q[0].transpose(0, 1))
    assert torch.equal(work[:, H * D:(H + Hkv) * D].view(T, Hkv, D), want_k[0].transpose(0, 1))
    stored_k = kv.keys[0].permute(0, 3, 1, 2).reshape(-1, Hkv, D)[slots]
    assert torch.equal(stored_k, want_k[0].transpose(0, 1))
    assert torch.equal(kv.values[0][slots], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_and_argmax_match_torch(dtype):
    g = torch.Generator().manual_seed(2)
    gu = (torch.randn(5, 2 * 53, generator=g) * 4).to(dtype)  # 53: a vector tail too
    gu[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])  # saturated and zero gates
    got, want = ops.silu_mul(gu), F.silu(gu[:, :53]) * gu[:, 53:]
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the exp may differ in the last bit of a float
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    logits = torch.randn(9, 1000, generator=g).to(dtype)
    logits[3, 10] = logits[3, 700] = 50.0  # a tie: the first index wins, as in torch
    logits[4] = float("-inf")
    logits[4, 999] = 0.0
    logits[5, 3] = 60.0
    logits[5, 500] = float("nan")  # a NaN after the maximum still wins, as in torch
    assert torch.equal(ops.argmax_rows(logits), torch.argmax(logits.float(), dim=-1))
    assert ops.argmax_rows(logits)[3].item() == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 48, 50, 1000])
def test_argmax_rows_returns_the_first_maximum_like_torch(dtype, width):
    """16 lanes each keep their own maximum; ties within and across lanes, rows narrower than a
    vector, tails past the last vector, all -inf rows and NaN anywhere must still match torch."""
    g = torch.Generator().manual_seed(width)
    rows = [torch.randn(width, generator=g), torch.randint(-2, 3, (width,), generator=g).float(),
            torch.full((width,), float("-inf")), torch.zeros(width)]
    top = torch.randn(width, generator=g)
    top[width // 2:] = top.max() + 1  # the maximum repeated from the middle to the end
    rows.append(top)
    for at in {0, width // 3, width - 1}:
        nan = torch.randn(width, generator=g)
        nan[at] = float("nan")
        rows.append(nan)
    if width > 16:
        lanes = torch.randn(width, generator=g)
        lanes[[5, width - 1]] = 9.0  # equal maxima: an early lane and the tail
        rows.append(lanes)
    if width >= 32:
        lanes = torch.randn(width, generator=g)
        lanes[[16 + 1, 5]] = 9.0  # equal maxima in lanes 1 (second vector) and 5 (first): index 5 wins
        rows.append(lanes)
    logits = torch.stack(rows).to(dtype)
    assert torch.equal(ops.argmax_rows(logits), torch.argmax(logits.float(), dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(96, 64), (100, 48), (7, 33)])
def test_small_gemm_matches_linear_and_does_not_depend_on_the_batch(dtype, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(130, k, generator=g).to(dtype)
    panels = pack_panels(w)
    assert panels.shape == (-(-n // 32), k, 32)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for m in (1, 3, 8, 9, 16, 20, 64, 130):  # one to 17 passes of 8 rows over each panel
        for b in (None, bias):
            got = ops.small_gemm(x[:m], panels, n, b)
            want = F.linear(x[:m].double(), w.double(), None if b is None else b.double())
            assert torch.allclose(got.double(), want, atol=tol * k ** 0.5, rtol=tol), (m, b is None)
    assert ops.small_gemm(x[:0], panels, n, bias).shape == (0, n)
    full = ops.small_gemm(x, panels, n, bias)
    for i in (0, 7, 8, 19, 129):  # each row alone equals that row computed among 129 others
        assert torch.equal(ops.small_gemm(x[i:i + 1], panels, n, bias)[0], full[i])


def test_amx_packing_puts_each_weight_where_the_tile_layout_wants_it():
    n, k = 40, 64  # two panels, the second half zero padding
    w = torch.arange(n * k, dtype=torch.float32).view(n, k).to(torch.bfloat16)
    packed = pack_amx(w)
    assert packed.shape == (2, 2, 2, 16, 16, 2)  # panels, K slices, column tiles, k pairs, columns, pair
    for col in (0, 15, 16, 31, 32, 39):
        for kk in (0, 1, 30, 31, 32, 63):
            p, j, c = col // 32, col % 32 // 16, col % 16
            assert packed[p, kk // 32, j, kk % 32 // 2, c, kk % 2] == w[col, kk]
    assert packed[1, :, :, :, 8:].abs().sum() == 0 and packed[1, :, 1].abs().sum() == 0
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_amx(torch.zeros(32, 48, dtype=torch.bfloat16))


amx = pytest.mark.skipif(ops is None or not ops.amx_gemm_available(), reason="this CPU has no AMX tiles")


@amx
@pytest.mark.parametrize("n, k", [(96, 64), (100, 32), (7, 96), (576, 1536)])
def test_amx_gemm_matches_linear_and_does_not_depend_on_the_batch(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    x = torch.randn(530, k, generator=g).to(torch.bfloat16)
    packed = pack_amx(w)
    for m in (1, 15, 16, 17, 32, 33, 48, 100, 256, 257, 530):  # row tiles, their tails, several row chunks
        for b in (None, bias):
            got = ops.amx_gemm(x[:m], packed, n, b)
            assert got.shape == (m, n) and got.dtype == torch.bfloat16
            want = F.linear(x[:m].double(), w.double(), None if b is None else b.double())
            assert torch.allclose(got.double(), want, atol=2e-2, rtol=1e-2), (m, b is None)
    assert ops.amx_gemm(x[:0], packed, n, bias).shape == (0, n)
    full = ops.amx_gemm(x, packed, n, bias)
    for i in (0, 15, 16, 31, 300, 529):  # each row alone equals that row computed among 529 others
        assert torch.equal(ops.amx_gemm(x[i:i + 1], packed, n, bias)[0], full[i])
    assert torch.equal(ops.amx_gemm(x[:40].t().contiguous().t(), packed, n, bias), full[:40])  # strided x
    with pytest.raises(RuntimeError, match="do not match"):
        ops.amx_gemm(x[:4, :32], packed, n, bias) if k != 32 else ops.amx_gemm(x[:4].repeat(1, 2), packed, n, bias)


@amx
def test_bf16_linear_takes_the_amx_kernel_up_to_its_row_limit_then_onednn():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    lin = _Linear(w, None, ops)
    assert lin.amx is not None and lin.panels is None
    for m in (1, AMX_MAX_M):
        x = torch.randn(m, 96, generator=g).to(torch.bfloat16)
        assert torch.equal(lin(x), ops.amx_gemm(x, lin.amx, 64, None))
    x = torch.randn(AMX_MAX_M + 1, 96, generator=g).to(torch.bfloat16)
    want = F.linear(x.double(), w.double())
    assert torch.allclose(lin(x).double(), want, atol=0.25, rtol=3e-2)
    assert _Linear(torch.zeros(64, 48, dtype=torch.bfloat16), None, ops).amx is None  # K not a multiple of 32


def test_row_buckets_cover_every_row_count_with_few_shapes():
    buckets = {row_bucket(m) for m in range(1, 2049)}
    for m in range(1, 4097):
        b = row_bucket(m)
        assert b >= m and b - m < 64
        if m <= EXACT_M_ONEDNN:
            assert b == m  # decode-sized calls run exactly
        assert row_bucket(b) == b  # a bucket is its own bucket
    assert len(buckets - set(range(1, EXACT_M_ONEDNN + 1))) <= 64  # shapes oneDNN builds above the exact range


class _WithoutAmx:
    """The kernels as a CPU without AMX tiles sees them."""

    def __getattr__(self, name):
        return getattr(ops, name)

    def amx_gemm_available(self):
        return False


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_pads_rows_to_a_bucket_and_returns_only_the_real_rows(bias, amx):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16) if bias else None
    lin = _Linear(w, b, ops if amx else _WithoutAmx())
    if not amx:
        assert lin.amx is None and lin.panels is not None  # panels up to SMALL_M_BF16 rows, oneDNN above
    for m in (1, 8, 9, 64, 65, 100, 513, 1030):  # AMX kernel (or panels, exact oneDNN), padded oneDNN
        x = torch.randn(m, 64, generator=g).to(torch.bfloat16)
        got = lin(x)
        assert got.shape == (m, 96) and got.is_contiguous()
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert torch.allclose(got.double(), want, atol=3e-2 * 8, rtol=3e-2), m


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_float32_linear_takes_panels_up_to_small_m_then_prepacked_onednn(bias):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    lin = _Linear(w, b, ops)
    assert lin.panels is not None and lin.packed is not None
    x = torch.randn(SMALL_M, 64, generator=g)
    assert torch.equal(lin(x), ops.small_gemm(x, lin.panels, 96, b))  # decode steps: the panel kernel
    for m in (SMALL_M + 1, 200, 600):  # larger steps: oneDNN, rows padded to a bucket, only the real ones back
        x = torch.randn(m, 64, generator=g)
        got = lin(x)
        assert got.shape == (m, 96) and got.is_contiguous()
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4), m


# -- the fused forward against transformers' own -----------------------------------------------------

def _llama(**kw):
    cfg = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.1)
    cfg.update(kw)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def _fused_logits(model, prompts, block_size=16):
    """Prefill every prompt in one flat step (fresh chunks), then one decode step each (paged rows)."""
    mc = model.config
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    kv = KVCache(mc.num_hidden_layers, mc.num_key_value_heads, head_dim, num_blocks=64, block_size=block_size,
                 dtype=next(model.parameters()).dtype, device=torch.device("cpu"))
    fused = FusedLlama.build(model, ops)
    assert fused is not None
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(prompts))]

    def slot(i, p):
        return tables[i][p // block_size] * block_size + p % block_size

    ids, pos, slots, rows, chunks = [], [], [], [], []
    for i, p in enumerate(prompts):
        chunks.append((len(ids), len(ids) + len(p)))
        ids += p
        pos += range(len(p))
        slots += [slot(i, j) for j in range(len(p))]
        rows.append(len(ids) - 1)
    batch = _batch(kv, slots, block_size, chunks)
    prefill = fused(torch.tensor(ids), torch.tensor(pos), batch, torch.tensor(rows))
    nxt = [7 + i for i in range(len(prompts))]
    dslots = [slot(i, len(p)) for i, p in enumerate(prompts)]
    batch = _batch(kv, dslots, block_size, [])
    batch.tables = torch.tensor(tables)
    batch.token_req = torch.arange(len(prompts))
    batch.token_ctx = torch.tensor([len(p) + 1 for p in prompts])
    batch.has_paged_rows = True
    decode = fused(torch.tensor(nxt), torch.tensor([len(p) for p in prompts]), batch, torch.arange(len(prompts)))
    return prefill, decode, nxt


def _batch(kv, slots, block_size, chunks):
    s = torch.tensor(slots)
    return PagedBatch(keys=kv.keys, values=kv.values, slot_mapping=s, slot_block=s // block_size,
                      slot_offset=s % block_size, block_size=block_size, fresh_chunks=chunks, paged_rows=None,
                      has_paged_rows=False, tables=None, token_req=None, token_ctx=None, gathered=[],
                      kernel=ops.paged_attention)


@pytest.mark.parametrize("make", [
    lambda: _llama(),  # head_dim 64: the kernel's vector path
    lambda: _llama(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, attention_bias=True),  # head_dim 16
    lambda: _qwen2(),
], ids=["llama-d64", "llama-d16-bias", "qwen2"])
def test_fused_forward_matches_transformers(make):
    model = make()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 40, 17)]
    with torch.inference_mode():
        want_prefill = [model(torch.tensor([p])).logits[0, -1] for p in prompts]
        prefill, decode, nxt = _fused_logits(model, prompts)
        want_decode = [model(torch.tensor([p + [t]])).logits[0, -1] for p, t in zip(prompts, nxt)]
    for got, want in zip(prefill, want_prefill):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    for got, want in zip(decode, want_decode):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    # the module weights became views into the fused ones: nothing stored twice, the model still works
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()


def test_fused_forward_in_bfloat16_stays_close_to_transformers():
    """bf16: prepacked oneDNN matmuls and the kernel's float accumulation round differently."""
    model = _llama().to(torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 40, 17)]
    with torch.inference_mode():
        want = [model(torch.tensor([p])).logits[0, -1].float() for p in prompts]
        prefill, decode, nxt = _fused_logits(model, prompts)
        want += [model(torch.tensor([p + [t]])).logits[0, -1].float() for p, t in zip(prompts, nxt)]
    for got, ref in zip(list(prefill) + list(decode), want):
        assert (got.float() - ref).norm() / ref.norm() < 0.03
        assert got.argmax() == ref.argmax()


def _qwen2():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                        initializer_range=0.1)).eval()


def test_fused_forward_declines_what_it_does_not_cover():
    assert FusedLlama.build(_llama(hidden_act="gelu"), ops) is None
    assert FusedLlama.build(_llama(), None) is None
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert FusedLlama.build(gpt2, ops) is None


def _sample(logits, rows, temps, u, top_k=None, top_p=None, min_p=None):
    n = len(rows)
    return ops.sample_rows(logits, torch.as_tensor(rows), torch.as_tensor(temps, dtype=torch.float32),
                           torch.as_tensor(u, dtype=torch.float64),
                           torch.as_tensor(top_k if top_k is not None else [0] * n),
                           torch.as_tensor(top_p if top_p is not None else [1.0] * n, dtype=torch.float32),
                           torch.as_tensor(min_p if min_p is not None else [0.0] * n, dtype=torch.float32))


def _inverse_cdf_reference(x, temp, u, top_k=0, top_p=1.0, min_p=0.0):
    """(column, distance of u x kept mass from the nearest CDF boundary, relative to it), in float64:
    no truncation: columns in id order; else columns by probability (ties by id), the kept prefix."""
    p = torch.softmax(x.double() / temp, -1)
    order = torch.arange(x.numel())
    if top_k > 0 or top_p < 1.0 or min_p > 0.0:
        order = torch.tensor(sorted(range(x.numel()), key=lambda j: (-p[j].item(), j)))
        sp = p[order]
        keep = torch.ones(x.numel(), dtype=torch.bool)
        if top_k > 0:
            keep &= torch.arange(x.numel()) < top_k
        keep &= torch.cumsum(sp, -1) - sp < top_p
        keep &= sp >= min_p * sp[0]
        keep[0] = True
        order = order[:int(keep.long().cumprod(0).sum())]
    cdf = torch.cumsum(p[order], -1)
    target = u * cdf[-1].item()
    pos = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True).item())
    return int(order[min(pos, len(order) - 1)]), (cdf - target).abs().min().item() / cdf[-1].item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 50, 1000, 4099])
def test_sample_rows_is_the_inverse_cdf_of_the_tempered_softmax(dtype, vocab):
    """Each sampled row's token is where u x total falls in its CDF (columns in id order), as a float64
    softmax gives, away from a boundary; a row sampled alone gives the same token as in the batch."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(12, vocab, generator=g) * 3).to(dtype)
    rows = torch.tensor([0, 3, 4, 7, 9, 11, 3])
    temps = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.7, 1.3, 1.0], dtype=torch.float32)
    u = torch.rand(7, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2 ** -53
    got = _sample(logits, rows, temps, u)
    checked = 0
    for k in range(7):
        want, margin = _inverse_cdf_reference(logits[rows[k]].float(), temps[k].item(), u[k].item())
        if margin > 1e-5:
            assert got[k].item() == want, (k, got[k].item(), want)
            checked += 1
        alone = _sample(logits[rows[k]:rows[k] + 1].clone(), [0], temps[k:k + 1], u[k:k + 1])
        assert alone.item() == got[k].item()
    assert checked >= 5


def test_sample_rows_follows_the_distribution():
    row = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0] * 3])  # 24 columns: a vector and a tail
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tokens = _sample(row.repeat(n, 1), torch.arange(n), torch.full((n,), 0.8), u)
    freq = torch.bincount(tokens, minlength=24).float() / n
    assert torch.allclose(freq, torch.softmax(row[0] / 0.8, -1), atol=0.01)


def test_sample_rows_never_draws_banned_or_nan_columns():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 40, generator=g)
    logits[:, ::2] = float("-inf")  # banned: every even column
    logits[1, 1] = float("nan")
    logits[2, :39] = float("-inf")  # only the last column is left
    u = torch.tensor([0.0, 1.0 - 2 ** -53, 0.5, 0.999])
    for trial in range(50):
        if trial:
            u = torch.rand(4, generator=g, dtype=torch.float64)
        got = _sample(logits, torch.arange(4), torch.ones(4), u).tolist()
        got += _sample(logits, torch.arange(4), torch.ones(4), u, top_k=[3] * 4, top_p=[0.5] * 4).tolist()
        for r, col in zip([0, 1, 2, 3] * 2, got):
            assert not torch.isnan(logits[r, col]) and logits[r, col].item() > float("-inf"), (r, col)
        assert got[2] == got[6] == 39


def test_sample_rows_takes_the_first_maximum_where_no_weights_exist():
    logits = torch.tensor([[float("-inf")] * 20,
                           [0.0, float("inf"), 1.0, float("inf")] + [0.0] * 16,
                           [float("nan")] * 5 + [float("-inf")] * 15])
    for top_p in (1.0, 0.5):
        got = _sample(logits, torch.arange(3), torch.ones(3), torch.full((3,), 0.5), top_p=[top_p] * 3)
        assert got.tolist() == [0, 1, 0]


def test_sample_rows_refuses_bad_arguments():
    logits = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        _sample(logits, [2], [1.0], [0.0])
    with pytest.raises(RuntimeError, match="one entry per sampled row"):
        _sample(logits, [0, 1], [1.0], [0.0, 0.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5, 33, 2000])
@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_k=4), dict(top_p=0.3), dict(top_p=0.95),
                                    dict(min_p=0.2), dict(top_k=10, top_p=0.8, min_p=0.05)])
def test_sample_rows_truncates_like_the_sorted_reference(dtype, vocab, params):
    """top-k / top-p / min-p: columns by probability (ties by id), the kept prefix, its inverse CDF."""
    g = torch.Generator().manual_seed(vocab)
    n = 24
    logits = (torch.randn(n, vocab, generator=g) * 2).to(dtype)
    temps = [0.5 + 0.1 * i for i in range(n)]
    u = torch.rand(n, generator=g, dtype=torch.float64)
    args = {k: [v] * n for k, v in params.items()}
    got = _sample(logits, list(range(n)), temps, u, **args).tolist()
    checked = 0
    for r in range(n):
        want, margin = _inverse_cdf_reference(logits[r].float(), temps[r], u[r].item(), **params)
        if margin > 1e-5:
            assert got[r] == want, (r, got[r], want)
            checked += 1
    assert checked >= n // 2
