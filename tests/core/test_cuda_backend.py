"""The cuda backend's CPU-runnable parts, in Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
where there is no CUDA): the paged attention kernel against a dense reference and against itself alone, the
graphs' padded static inputs against an eager step, the memory budget and the backend choice. (Its engine runs:
tests/core/test_model_runner.py, route "cuda"; on a GPU: benchmarks/gpu_check.sh.)"""

from __future__ import annotations

import pytest
import torch
from pools import reference_attention
from transformers import LlamaConfig, LlamaForCausalLM

from conveyor.core import ConfigError
from conveyor.core.backends import available_backends, select_backend
from conveyor.core.backends.step import FLASH
from conveyor.core.kv_cache import KVCache
from conveyor.core.model_runner import ModelRunner
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.schedule_types import ScheduledRequest

pytestmark = pytest.mark.skipif("cuda" not in available_backends(torch.device("cpu")),
                                reason="Triton does not run here (not installed, or TRITON_INTERPRET unset)")

from conveyor.core.backends.cuda.graphs import StaticInputs  # noqa: E402
from conveyor.core.backends.cuda.triton_attention import block_shape, paged_attention, query_blocks  # noqa: E402


def _attention(q, kp, vp, reqs, tables, prefill, **variant):
    """reqs: (keys before, queries) per request; the step's rows are the requests' queries in order."""
    H, Hkv = q.shape[1], kp.shape[2]
    block_m, block_q = block_shape(H // Hkv, prefill)
    counts = [n for _, n in reqs]
    blocks = query_blocks(counts, block_q)
    width = max(len(t) for t in tables)
    q_start = [0]
    for n in counts:
        q_start.append(q_start[-1] + n)
    i32 = dict(dtype=torch.int32)
    out = torch.zeros_like(q)
    return paged_attention(out, q, kp, vp, torch.tensor([t + [0] * (width - len(t)) for t in tables], **i32),
                           torch.tensor([c + n for c, n in reqs], **i32), torch.tensor(q_start, **i32),
                           torch.tensor(blocks.seq, **i32), torch.tensor(blocks.first, **i32), q.shape[2] ** -0.5,
                           block_m, block_q, **variant)


def _pool_and_step(reqs, H, Hkv, D, bs, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-(c + n) // bs) for c, n in reqs) + 3
    kp = torch.randn(nb, bs, Hkv, D, generator=g).to(dtype)
    vp = torch.randn(nb, bs, Hkv, D, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for c, n in reqs:
        k = -(-(c + n) // bs)
        tables.append(perm[used:used + k])
        used += k
    q = torch.randn(sum(n for _, n in reqs), H, D, generator=g).to(dtype)
    return q, kp, vp, tables


# fresh prompts, a chunk after cached keys, decodes at block edges and inside blocks
REQUESTS = [(0, 7), (5, 1), (9, 3), (0, 1), (15, 1), (16, 1), (0, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (8, 1)], ids=["gqa3", "mha", "mqa8"])
def test_kernel_rows_equal_the_reference_and_themselves_alone(dtype, heads):
    H, Hkv = heads
    D, bs = 24, 4
    q, kp, vp, tables = _pool_and_step(REQUESTS, H, Hkv, D, bs, dtype, seed=1)
    got = _attention(q, kp, vp, REQUESTS, tables, prefill=True)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    row = 0
    for r, (c, n) in enumerate(REQUESTS):
        slots = torch.tensor([tables[r][p // bs] * bs + p % bs for p in range(c + n)])
        keys, values = kp.view(-1, Hkv, D)[slots], vp.view(-1, Hkv, D)[slots]
        alone = _attention(q[row:row + n], kp, vp, [(c, n)], [tables[r]], prefill=True)
        assert torch.equal(alone, got[row:row + n])  # a row's result does not depend on the other requests
        for i in range(n):
            want = reference_attention(q[row + i], keys[:c + i + 1], values[:c + i + 1], D ** -0.5)
            assert torch.allclose(got[row + i].double(), want, atol=tol, rtol=tol)
        row += n


@pytest.mark.parametrize("variant", ["window", "softcap", "sinks", "all"])
def test_kernel_windows_softcaps_and_sinks_equal_the_reference_and_themselves_alone(variant):
    """A layer's sliding window (shorter than most contexts: whole tiles before it skipped), softcap and sinks
    (float32; the GPU runs the same program in bf16 too)."""
    H, Hkv, D, bs = 6, 2, 24, 4
    reqs = [(0, 7), (40, 1), (9, 3), (0, 1), (70, 1), (0, 45)]
    q, kp, vp, tables = _pool_and_step(reqs, H, Hkv, D, bs, torch.float32, seed=3)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(4))
    v = {"window": dict(window=10), "softcap": dict(softcap=2.0), "sinks": dict(sinks=sinks),
         "all": dict(window=33, softcap=3.0, sinks=sinks)}[variant]
    got = _attention(q, kp, vp, reqs, tables, prefill=True, **v)
    row = 0
    for r, (c, n) in enumerate(reqs):
        slots = torch.tensor([tables[r][p // bs] * bs + p % bs for p in range(c + n)])
        keys, values = kp.view(-1, Hkv, D)[slots], vp.view(-1, Hkv, D)[slots]
        assert torch.equal(_attention(q[row:row + n], kp, vp, [(c, n)], [tables[r]], prefill=True, **v),
                           got[row:row + n])
        for i in range(n):
            want = reference_attention(q[row + i], keys[:c + i + 1], values[:c + i + 1], D ** -0.5,
                                       v.get("window"), v.get("softcap"), v.get("sinks"))
            assert torch.allclose(got[row + i].double(), want, atol=1e-5, rtol=1e-5), (r, i)
        row += n


def test_kernel_decode_and_prefill_block_shapes_agree():
    q, kp, vp, tables = _pool_and_step(REQUESTS, 6, 2, 32, 16, torch.float32, seed=2)
    a = _attention(q, kp, vp, REQUESTS, tables, prefill=True)
    b = _attention(q, kp, vp, REQUESTS, tables, prefill=False)
    assert torch.allclose(a, b, atol=1e-6)


def _tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def _entry(req_id, tokens, start, table):
    return ScheduledRequest(req_id=req_id, token_ids=tuple(tokens), start_pos=start, block_ids=tuple(table),
                            sample=True, sampling=SamplingParams(temperature=0), num_output_tokens=0)


@torch.inference_mode()
def test_a_graph_buckets_padded_static_inputs_give_the_eager_steps_logits():
    """What a replayed graph computes (the step copied into a bigger bucket's buffers: padding rows on the
    scratch slot, unused query blocks -1), run eagerly here: the same logits as the step alone."""
    model = _tiny_llama()
    backend = select_backend(model, "cuda")
    kv = KVCache(2, 2, 16, 33, 4, torch.float32, torch.device("cpu"), FLASH)  # 32 blocks + the scratch block
    runner = ModelRunner(backend, kv, eos_token_ids=())
    prompt = [(7 * i) % 128 for i in range(11)]
    runner.backend.forward(backend.prepare(runner.flatten([_entry("p", prompt, 0, [3, 4, 5])])))
    entries = [_entry("a", [5], 11, [3, 4, 5]), _entry("b", [9, 8, 7, 6, 5], 0, [10, 11]),
               _entry("c", prompt[:4], 0, [20])]
    rows = runner.flatten(entries)
    before = [t.clone() for t in kv.keys]
    eager = backend.forward(backend.prepare(rows))
    for layer, t in enumerate(before):  # store the same keys again from the same state
        kv.keys[layer].copy_(t)
    inputs = StaticInputs(16, 8, backend.max_blocks, backend.group, backend.scratch_slot, torch.device("cpu"))
    n = inputs.fill(rows)
    v = inputs.views
    from conveyor.core.backends.cuda.backend import TritonAttention

    attention = TritonAttention(kv, v["slots"].long(), v["tables"], v["seq_lens"], v["q_start"], v["qb_seq"],
                                v["qb_first"], inputs.block_m, inputs.block_q)
    padded = backend.lean(v["input_ids"].long(), v["positions"].long(), attention, v["logit_rows"].long())[:n]
    assert n == 3 and torch.allclose(padded, eager, atol=1e-5)
    scratch = backend.scratch_slot // 4
    assert kv.keys[0][scratch].abs().sum() > 0  # the padding rows wrote there, and nowhere else
    assert torch.equal(kv.keys[0][:scratch][~torch.isin(torch.arange(scratch), torch.tensor([3, 4, 5, 10, 11, 20]))],
                       before[0][:scratch][~torch.isin(torch.arange(scratch), torch.tensor([3, 4, 5, 10, 11, 20]))])
    with pytest.raises(ValueError, match="does not fit"):
        StaticInputs(4, 2, backend.max_blocks, backend.group, backend.scratch_slot, torch.device("cpu")).fill(rows)


def test_budget_backend_choice_and_errors(monkeypatch):
    model = _tiny_llama()
    backend = select_backend(model, "cuda")
    assert backend.kv_budget(123456, 0.9) == 123456 and backend.kv_budget(None, 0.9) == 2 << 30  # on the CPU
    assert backend.activation_bytes() > 2048 * 64 and backend.exact is False and "cuBLAS" in backend.inexact_reason()
    assert select_backend(model, "auto").name in ("cpu", "torch")  # auto never takes Triton's interpreter
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "cuda" not in available_backends(torch.device("cpu"))
    with pytest.raises(ConfigError) as cuda:  # the field and value travel with it; the CLI names its option
        select_backend(model, "cuda")
    assert cuda.value.named("--backend").startswith("--backend cuda: does not run on cpu")
    with pytest.raises(ConfigError) as metal:
        select_backend(model, "metal")
    assert metal.value.named("--backend").startswith("--backend: 'metal'")
