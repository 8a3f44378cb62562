"""Every common decoder family against transformers' own forward, on tiny random-weight models built from each
family's config (tests/core/families.py): greedy float32 output equals transformers' full-recompute forward
token for token on every route, on prompts longer than the family's sliding window, with a shared prefix served
from the cache, prompts chunked and requests preempted; the cpu backend takes each family's fused forward where
it has one, and there a record's output does not depend on its batch, in float32 and bf16."""

from __future__ import annotations

import pytest
import torch
from families import CONFIGS, FUSED, build, prompts, reference
from routes import route_config

from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
from conveyor.core.backends.cpu.kernels import cpu_identity, cpu_kernels
from conveyor.core.engine import Engine

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# A pool too small for every request at once (preemption), a token budget that chunks the long prompts.
CROWDED = EngineConfig(num_kv_blocks=14, max_num_batched_tokens=32, max_num_seqs=8)


class CharTokenizer:
    """Stand-in tokenizer: token i decodes to one distinct character; no EOS."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x4E00 + int(i)) for i in ids)


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(name):
        if name not in cache:
            model = build(name)
            cache[name] = {k: reference(model, p, MAX_TOKENS) for k, p in prompts().items()}
        return cache[name]

    return get


def _run(model, config, sampling=GREEDY, which=None):
    engine = Engine(model, CharTokenizer(), config)
    todo = prompts() if which is None else {k: prompts()[k] for k in which}
    outs = {o.req_id: o for o in engine.generate(GenerationRequest(k, p, sampling) for k, p in todo.items())}
    assert set(outs) == set(todo) and engine.block_manager.num_free_blocks == engine.num_kv_blocks
    return outs, engine


@pytest.mark.parametrize("name, route", [(name, route) for name in sorted(CONFIGS) for route in
                                         ("cpu", "cpu-transformers", "torch")
                                         if route != "cpu-transformers" or name in FUSED])  # (else the same as cpu)
def test_greedy_float32_equals_transformers(name, route, references):
    config = route_config(route, CROWDED)
    outs, engine = _run(build(name), config)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_cached_prompt_tokens > 0
    assert max(len(p) for p in prompts().values()) > CROWDED.max_num_batched_tokens
    want = references(name)
    wrong = {k: (outs[k].output_token_ids, want[k]) for k in want if outs[k].output_token_ids != want[k]}
    assert not wrong, f"{name} on {engine.backend.describe()}: {len(wrong)}/8 differ: {wrong}"
    if route == "cpu":  # the fused forward where the family has one, and only there the exact claim
        fused = FUSED.get(name)
        assert engine.backend.describe() == (f"cpu (fused {fused} forward)" if fused else "cpu (transformers forward)")
        assert engine.backend.exact == (fused is not None)


CUDA_PROMPTS = ("p4", "p5", "p6", "p7")


@pytest.mark.parametrize("name", ["gemma3", "qwen3-moe", "phi3-partial-window", "olmo2"])
def test_greedy_float32_equals_transformers_on_the_cuda_route(name, references):
    """The Triton attention and the lean forward (in Triton's interpreter here, which takes seconds a family:
    benchmarks/gpu_check.sh runs every family on a GPU): windows, sandwich norms, the final softcap, two rotaries
    and q/k norms (Gemma 3), MoE, partial rotary, norms after the sublayers; Mistral's all-sliding layers in the
    test of blocks going back; attention softcaps and sinks at the kernel (tests/core/test_cuda_backend.py)."""
    config = route_config("cuda", CROWDED)
    # Half the prompts and the first half of their tokens (the interpreter's seconds; greedy output is a prefix of
    # the longer run's): two sharing the cached prefix, every one longer than the window and the token budget, so
    # chunked.
    n = MAX_TOKENS // 2
    outs, engine = _run(build(name), config, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                        which=CUDA_PROMPTS)
    want = references(name)
    wrong = {k for k in CUDA_PROMPTS if outs[k].output_token_ids != want[k][:n]}
    assert not wrong, f"{name} on {engine.backend.describe()}: {sorted(wrong)} differ"
    if name in FUSED:
        assert "lean" in engine.backend.describe()


def _native_bf16() -> bool:
    ops = cpu_kernels()
    return ops is not None and bool(ops.amx_gemm_available() or ops.pair_gemm_available()) and \
        ("avx512_bf16" in cpu_identity()[1] or "amx_bf16" in cpu_identity()[1])


@pytest.mark.skipif(cpu_kernels() is None, reason="no exact backend here (conveyor's C++ kernels do not run)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])  # (bf16 widened or not)
@pytest.mark.parametrize("name", sorted(FUSED))
def test_a_record_does_not_depend_on_its_batch_on_the_fused_route(name, dtype):
    """Seeded sampling with logprobs: each record alone (one at a time, a pool to spare) equals the same record among
    the others with chunked prompts, a cached prefix and preemption, bit for bit."""
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    crowd, engine = _run(build(name, dtype), route_config("cpu", CROWDED), sampling)
    assert engine.backend.exact and engine.stats().num_preemptions > 0
    alone = Engine(build(name, dtype), CharTokenizer(), route_config("cpu", EngineConfig(num_kv_blocks=64)))
    for k, p in prompts().items():
        (out,) = alone.generate([GenerationRequest(k, p, sampling)])
        assert out.output_token_ids == crowd[k].output_token_ids, (name, k)
        assert out.logprobs == crowd[k].logprobs, (name, k)


@pytest.mark.skipif(not _native_bf16(), reason="this CPU has no native bf16 (AMX or AVX512-BF16)")
@pytest.mark.parametrize("name", sorted(FUSED))
def test_the_fused_forward_in_bfloat16_stays_as_close_to_transformers_as_its_own_forward(name):
    """bf16 rounds differently in conveyor's kernels than in torch's: every prompt token's logprob (prompt logprobs
    of the whole prompt) stays as close to transformers' eager bf16 forward on the fused route as it does on the
    model's own transformers forward under conveyor's attention, and on average within 0.1."""
    model = build(name, torch.bfloat16)
    model.set_attn_implementation("eager")
    sampling = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    errors = {}
    for route in ("cpu", "cpu-transformers"):
        outs, _ = _run(build(name, torch.bfloat16), route_config(route, EngineConfig(num_kv_blocks=64)), sampling)
        total = []
        with torch.inference_mode():
            for k, p in prompts().items():
                want = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)[:-1]
                want = want.gather(1, torch.tensor(p[1:])[:, None]).squeeze(1)
                got = torch.tensor([lp.logprob for lp in outs[k].prompt_logprobs[1:]])
                total.append((got - want).abs().mean().item())
        errors[route] = sum(total) / len(total)
    assert errors["cpu"] < 0.1 and errors["cpu"] <= 1.5 * errors["cpu-transformers"] + 0.005, errors


@pytest.mark.parametrize("route", ["cpu", "cuda"])
def test_blocks_out_of_every_window_go_back_to_the_pool(route):
    """Mistral with a window of 16 on every layer: a 73-token prompt and 60 tokens (36 in Triton's interpreter) need
    9 (7) blocks of 16 in all, but the pool holds no more than the window's, the step's chunk and the backend's read
    alignment (4 on the cpu, 5 on the cuda route: 32-key tiles) at any time between steps; the output is
    transformers' all the same."""
    model = build("mistral-window")
    prompt = prompts()["p7"]
    n = 60 if route == "cpu" else 36
    want = reference(model, prompt, n)
    engine = Engine(model, CharTokenizer(), route_config(route, EngineConfig(num_kv_blocks=64,
                                                                             max_num_batched_tokens=32)))
    sampling = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    peak, outs = 0, []
    for finished in engine.stream([GenerationRequest("a", prompt, sampling)]):
        bm = engine.block_manager
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
        outs += finished
    assert -(-(len(prompt) + n) // 16) == (9 if route == "cpu" else 7) and peak <= (4 if route == "cpu" else 5)
    assert outs[0].output_token_ids == want
