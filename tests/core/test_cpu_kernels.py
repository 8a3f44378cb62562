"""The C++ element-wise and sampling kernels and the fused decoder forward, each against plain torch /
transformers. (Attention: test_paged_attention.py; linears: test_linear_kernels.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pools import pool_slot
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conveyor.core.backends.attention_probe import probe_attention
from conveyor.core.backends.cpu.backend import LAYOUTS, CpuAttention, kv_layout
from conveyor.core.backends.cpu.fused_decoder import FusedDecoder
from conveyor.core.backends.cpu.kernels import cpu_kernels
from conveyor.core.backends.transformers_forward import register
from conveyor.core.kv_cache import KVCache

ops = cpu_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ kernels here (no compiler, or a CPU without "
                                                    "AVX-512): the torch fallback is tested instead")


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


@pytest.mark.parametrize("layout, dtype", [("plain", torch.float32), ("plain", torch.bfloat16), ("pairs", torch.bfloat16)])
def test_rope_store_is_bit_identical_to_transformers_and_fills_the_pool(layout, dtype):
    g = torch.Generator().manual_seed(1)
    T, H, Hkv, D, bs = 7, 4, 2, 32, 4
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    angles = torch.rand(T, D // 2, generator=g) * 50
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q = qkv[:, :H * D].view(T, H, D).transpose(0, 1).unsqueeze(0)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D).transpose(0, 1).unsqueeze(0)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos.unsqueeze(0), sin.unsqueeze(0))
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D).clone()
    kv = KVCache(1, Hkv, D, num_blocks=8, block_size=bs, dtype=dtype, device=torch.device("cpu"),
                 layout=LAYOUTS[layout])
    kv.values[0].fill_(float("nan"))  # what an earlier owner might have left
    slots = [9, 10, 11, 12, 30, 2, 13]
    work = qkv.clone()
    ops.rope_store(work, cos, sin, torch.tensor(slots), kv.keys[0], kv.values[0], H)
    assert torch.equal(work[:, :H * D].view(T, H, D), want_q[0].transpose(0, 1))
    assert torch.equal(work[:, H * D:(H + Hkv) * D].view(T, Hkv, D), want_k[0].transpose(0, 1))
    for t, slot in enumerate(slots):
        stored_k, stored_v = pool_slot(kv, slot)
        assert torch.equal(stored_k, want_k[0][:, t]) and torch.equal(stored_v, v[t])
    if layout == "pairs":  # block 3 began in this step (slot 12): its unwritten slots hold zero V, not NaN
        assert torch.equal(pool_slot(kv, 14)[1], torch.zeros(Hkv, D, dtype=dtype))
        assert pool_slot(kv, 31)[1].isnan().all()  # block 7 did not begin here (slot 30): untouched


@pytest.mark.parametrize("layout, dtype", [("plain", torch.float32), ("plain", torch.bfloat16), ("pairs", torch.bfloat16)])
def test_store_kv_writes_what_rope_store_writes(layout, dtype):
    g = torch.Generator().manual_seed(4)
    T, Hkv, D, bs = 5, 2, 32, 4
    k, v = (torch.randn(T, Hkv, D, generator=g).to(dtype) for _ in range(2))
    kv = KVCache(1, Hkv, D, num_blocks=8, block_size=bs, dtype=dtype, device=torch.device("cpu"),
                 layout=LAYOUTS[layout])
    slots = [4, 5, 17, 30, 0]
    ops.store_kv(k, v, torch.tensor(slots), kv.keys[0], kv.values[0])
    for t, slot in enumerate(slots):
        stored_k, stored_v = pool_slot(kv, slot)
        assert torch.equal(stored_k, k[t]) and torch.equal(stored_v, v[t])
    with pytest.raises(RuntimeError, match="store_kv"):
        ops.store_kv(k[:, :1], v[:, :1], torch.tensor(slots), kv.keys[0], kv.values[0])


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


# -- the fused forward against transformers' own -----------------------------------------------------

def _llama(**kw):
    cfg = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.1)
    cfg.update(kw)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def _fused(model, kernels=ops):
    """FusedDecoder.build over `model` (its attention probed), the model left on eager attention for references."""
    register(model)
    try:
        return FusedDecoder.build(model, probe_attention(model, "test"), kernels)[0]
    finally:
        model.set_attn_implementation("eager")


def _fused_logits(model, prompts, block_size=16):
    """Prefill every prompt in one flat step, then one decode step each."""
    mc = model.config
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    dtype = next(model.parameters()).dtype
    layout = kv_layout(dtype, head_dim, block_size, mc.num_attention_heads // mc.num_key_value_heads)
    kv = KVCache(mc.num_hidden_layers, mc.num_key_value_heads, head_dim, num_blocks=64, block_size=block_size,
                 dtype=dtype, device=torch.device("cpu"), layout=LAYOUTS[layout])
    fused = _fused(model)
    assert fused is not None
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(prompts))]

    def slot(i, p):
        return tables[i][p // block_size] * block_size + p % block_size

    ids, pos, slots, rows, reqs = [], [], [], [], []
    for i, p in enumerate(prompts):
        ids += p
        pos += range(len(p))
        slots += [slot(i, j) for j in range(len(p))]
        reqs += [i] * len(p)
        rows.append(len(ids) - 1)
    batch = _batch(kv, slots, block_size, tables, reqs, [q + 1 for q in pos])
    prefill = fused(torch.tensor(ids), torch.tensor(pos), batch, torch.tensor(rows))
    nxt = [7 + i for i in range(len(prompts))]
    dslots = [slot(i, len(p)) for i, p in enumerate(prompts)]
    batch = _batch(kv, dslots, block_size, tables, range(len(prompts)), [len(p) + 1 for p in prompts])
    decode = fused(torch.tensor(nxt), torch.tensor([len(p) for p in prompts]), batch, torch.arange(len(prompts)))
    return prefill, decode, nxt


def _batch(kv, slots, block_size, tables, reqs, ctxs):
    """Every row through the paged kernel: row i of request reqs[i] sees its first ctxs[i] keys."""
    return CpuAttention(ops, kv, torch.tensor(slots), torch.tensor(tables), torch.tensor(list(reqs)),
                        torch.tensor(list(ctxs)))


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
    """bf16: conveyor's kernels (tiles or pair products, and bf16 attention products) and torch's round
    differently."""
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
    assert _fused(_llama(hidden_act="gelu")) is None
    assert _fused(_llama(), None) is None
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert _fused(gpt2) is None


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
