"""Model runner and engine on a tiny randomly initialised Llama (float32, CPU).

The reference is a second instance of the same weights running transformers' own "sdpa"
attention: the Engine switches the model it is given to "conveyor_paged", after which that model
can no longer run without the engine.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from routes import ROUTES, route_config
from transformers import LlamaConfig, LlamaForCausalLM

from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
from conveyor.core.backends import select_backend
from conveyor.core.backends.transformers_forward import ATTN_IMPLEMENTATION
from conveyor.core.engine import Engine
from conveyor.core.kv_cache import KVCache
from conveyor.core.model_runner import ModelRunner
from conveyor.core.schedule_types import ScheduledRequest, SchedulerOutput

VOCAB = 256
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
GREEDY_SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class CharTokenizer:
    """Stand-in tokenizer: token i decodes to one distinct character; no EOS."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x4E00 + int(i)) for i in ids)


def _tiny_config() -> LlamaConfig:
    # A large init range keeps the logits well apart, so greedy choices are not near-ties.
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def ref_model():
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_config()).eval()
    model.set_attn_implementation("sdpa")
    return model


@pytest.fixture(scope="module")
def model(ref_model):
    """Same weights as `ref_model`, for the engine to take over."""
    m = LlamaForCausalLM(_tiny_config()).eval()
    m.load_state_dict(ref_model.state_dict())
    return m


def _random_prompts(n: int, seed: int, max_len: int = 100, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (n,), generator=g).tolist()
    return [(prefix or []) + torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lengths]


PROMPTS = _random_prompts(24, seed=1)
SHARED = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
PREFIX_PROMPTS = _random_prompts(10, seed=3, max_len=30, prefix=SHARED)


@torch.inference_mode()
def _generate(model, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         pad_token_id=0)  # the tiny model has no EOS: always n tokens
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def references(ref_model):
    return {tuple(p): _generate(ref_model, p) for p in PROMPTS + PREFIX_PROMPTS}


@pytest.fixture(params=ROUTES)
def route(request):
    """The backend and forward the engine takes (tests/core/routes.py)."""
    return request.param


def _engine(model, config: EngineConfig, route: str = "cpu") -> Engine:
    """An engine on the tiny model along `route` (skips where it does not run here)."""
    return Engine(model, CharTokenizer(), route_config(route, config))


def _interpreted(route: str) -> bool:
    """Whether `route` runs in Triton's interpreter here (the cuda route without CUDA: ~15 s an engine run)."""
    return route == "cuda" and os.environ.get("TRITON_INTERPRET") == "1"


def _prompts(route: str) -> list[list[int]]:
    """PROMPTS, or in the interpreter the first 8 of them (~3x faster; still longer than 4 chunks of 16 and too
    many for a 32-block pool)."""
    return PROMPTS[:8] if _interpreted(route) else PROMPTS


def _greedy(route: str) -> SamplingParams:
    """GREEDY, or in the interpreter its first 8 tokens (greedy output is a prefix of the longer run's)."""
    return GREEDY_SHORT if _interpreted(route) else GREEDY


def _want(references, prompts: list[list[int]], route: str) -> list[list[int]]:
    return [references[tuple(p)][:_greedy(route).max_tokens] for p in prompts]


def _interpreted_once(route: str, chosen: bool) -> None:
    """In the interpreter one case of each test is enough."""
    if _interpreted(route) and not chosen:
        pytest.skip("the cuda route in Triton's interpreter: another case of this test covers it")


def _run(engine: Engine, prompts: list[list[int]], sampling=GREEDY) -> list[list[int]]:
    outs = {o.req_id: o for o in engine.generate(
        GenerationRequest(f"r{i}", p, sampling) for i, p in enumerate(prompts))}
    assert not engine.has_unfinished() and engine.stats().kv_usage == 0.0
    engine.scheduler.check_invariants()
    return [outs[f"r{i}"].output_token_ids for i in range(len(prompts))]


def test_reference_outputs_are_not_degenerate(references):
    outs = list(references.values())
    assert len({tuple(o) for o in outs}) > len(outs) // 2
    assert sum(len(set(o)) for o in outs) > 3 * len(outs)


# -- the model runner alone ------------------------------------------------------------------------

class _CapturingSampler:
    """Records the logits the runner hands to the sampler; answers greedily."""

    def __init__(self):
        self.logits: list[torch.Tensor] = []

    def sample(self, logits, entries, states=None):
        self.logits.append(logits.clone())
        return logits.argmax(-1).tolist(), {}, {}


def _entry(req_id, tokens, start, table, sample=True):
    return ScheduledRequest(req_id=req_id, token_ids=tuple(tokens), start_pos=start, block_ids=tuple(table),
                            sample=sample, sampling=GREEDY, num_output_tokens=0)


@torch.inference_mode()
def _last_logits(ref_model, tokens):
    return ref_model(torch.tensor([tokens])).logits[0, -1]


def test_runner_logits_match_the_model_across_prefills_chunks_decodes_and_shared_blocks(model, ref_model, route):
    config = route_config(route, EngineConfig())
    backend = select_backend(model, config.backend, config.fused_forward)
    mc = model.config
    head_dim = mc.hidden_size // mc.num_attention_heads
    kv = KVCache(mc.num_hidden_layers, mc.num_key_value_heads, head_dim, num_blocks=24, block_size=4,
                 dtype=torch.float32, device=torch.device("cpu"), layout=backend.kv_layout(head_dim, 4, 2))
    runner = ModelRunner(backend, kv, eos_token_ids=())
    capture = _CapturingSampler()
    runner.sampler = capture
    g = torch.Generator().manual_seed(7)
    a, b, c, d = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (10, 14, 9, 7))
    ta, tb, tc = [5, 2, 7], [1, 6, 23, 0], [13, 14, 15]  # scattered block tables, block_size 4
    # step 1: a prefilled whole, b's first chunk (nothing sampled for b)
    runner.execute(SchedulerOutput([_entry("a", a, 0, ta), _entry("b", b[:6], 0, tb, sample=False)],
                                   len(a) + 6))
    assert torch.allclose(capture.logits[-1][0], _last_logits(ref_model, a), atol=1e-4)
    # step 2: a decodes one token, b finishes its prefill from position 6, c prefills from 0
    x = 42
    runner.execute(SchedulerOutput([_entry("a", [x], len(a), ta), _entry("b", b[6:], 6, tb),
                                    _entry("c", c, 0, tc)], 1 + len(b) - 6 + len(c)))
    got = capture.logits[-1]
    assert got.shape[0] == 3
    for row, tokens in zip(got, [a + [x], b, c]):
        assert torch.allclose(row, _last_logits(ref_model, tokens), atol=1e-4)
    # step 3: d shares a's first two blocks (8 tokens) and feeds only its own tail, beside two decodes
    d = a[:8] + d
    td = ta[:2] + [20, 21]
    runner.execute(SchedulerOutput([_entry("a", [x + 1], len(a) + 1, ta), _entry("d", d[8:], 8, td),
                                    _entry("c", [x], len(c), tc)], 1 + len(d) - 8 + 1))
    got = capture.logits[-1]
    for row, tokens in zip(got, [a + [x, x + 1], d, c + [x]]):
        assert torch.allclose(row, _last_logits(ref_model, tokens), atol=1e-4)


def test_bf16_pools_are_bf16_pairs_where_the_cpu_has_bf16_products_and_every_row_takes_the_kernel():
    """bf16 on CPUs with AMX or AVX512-BF16: the engine's pool is in the pair layout and every row, prompts
    from position 0 included, goes through the kernel's bf16 products; logits stay close to transformers'
    own bf16 forward."""
    from conveyor.core.backends.cpu.kernels import cpu_kernels

    ops = cpu_kernels()
    if not (ops and ops.kv_pairs(True, 64, 16, 2)):
        pytest.skip("no AMX or AVX512-BF16 here: bf16 pools stay plain")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    ref = LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    ref.set_attn_implementation("sdpa")
    model = LlamaForCausalLM(copy.deepcopy(cfg)).eval().to(torch.bfloat16)  # its own config: the engine changes it
    model.load_state_dict(ref.state_dict())
    engine = Engine(model, CharTokenizer(), EngineConfig(num_kv_blocks=32))
    assert engine.kv_cache.layout.name == "pairs" and engine.backend.fused is not None
    assert Engine(model, CharTokenizer(), EngineConfig(num_kv_blocks=32, block_size=8)).kv_cache.layout.name == "plain"
    runner = engine.runner
    step = engine.backend.prepare(runner.flatten([_entry("a", [1, 2, 3], 0, [4])]))
    assert step.attention.token_ctx.tolist() == [1, 2, 3]
    capture = _CapturingSampler()
    runner.sampler = capture
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (70, 21))
    runner.execute(SchedulerOutput([_entry("a", a, 0, [5, 2, 7, 9, 11]), _entry("b", b, 0, [1, 6])], len(a) + len(b)))
    for got, tokens in zip(capture.logits[-1], [a, b]):
        want = _last_logits(ref, tokens).float()
        assert (got.float() - want).norm() / want.norm() < 0.03
        assert got.argmax() == want.argmax()


# -- the engine against model.generate ---------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(block_size=16, num_kv_blocks=256),
    dict(block_size=4, num_kv_blocks=1024),
    dict(block_size=16, num_kv_blocks=256, max_num_seqs=3),
], ids=["block16", "block4", "max_num_seqs=3"])
def test_engine_greedy_equals_generate(model, references, kw, route):
    _interpreted_once(route, False)  # the tests below run every prompt through it
    engine = _engine(model, EngineConfig(**kw), route)
    outs = _run(engine, PROMPTS)
    assert outs == [references[tuple(p)] for p in PROMPTS]
    assert engine.stats().num_preemptions == 0


@pytest.mark.parametrize("block_size, num_kv_blocks", [(4, 32), (16, 9)])
def test_engine_greedy_equals_generate_with_a_pool_that_forces_preemption(model, references, block_size,
                                                                        num_kv_blocks, route):
    _interpreted_once(route, block_size == 4)
    engine = _engine(model, EngineConfig(block_size=block_size, num_kv_blocks=num_kv_blocks), route)
    prompts = _prompts(route)
    outs = _run(engine, prompts, _greedy(route))
    assert engine.stats().num_preemptions > 0
    assert outs == _want(references, prompts, route)


@pytest.mark.parametrize("budget", [16, 5])
def test_engine_greedy_equals_generate_with_chunked_prefill(model, references, budget, route):
    _interpreted_once(route, budget == 16)
    prompts = _prompts(route)
    assert max(map(len, prompts)) > 4 * budget
    engine = _engine(model, EngineConfig(block_size=4, num_kv_blocks=512, max_num_batched_tokens=budget),
                     route)
    outs = _run(engine, prompts, _greedy(route))
    assert outs == _want(references, prompts, route)


def test_engine_greedy_equals_generate_with_prefix_sharing(model, references, route):
    _interpreted_once(route, False)  # the next test shares prefixes too
    engine = _engine(model, EngineConfig(block_size=4, num_kv_blocks=512, max_num_seqs=2), route)
    outs = _run(engine, PREFIX_PROMPTS)
    stats = engine.stats()
    assert stats.num_cached_prompt_tokens >= 8 * 40 and stats.prefix_cache_hit_rate > 0.5
    assert outs == [references[tuple(p)] for p in PREFIX_PROMPTS]


def test_engine_greedy_equals_generate_with_prefix_sharing_and_preemption(model, references, route):
    prompts = PREFIX_PROMPTS[:6] + PROMPTS[:4] if _interpreted(route) else PREFIX_PROMPTS + PROMPTS[:6]
    engine = _engine(model, EngineConfig(block_size=4, num_kv_blocks=40, max_num_batched_tokens=24),
                     route)
    outs = _run(engine, prompts, _greedy(route))
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_cached_prompt_tokens > 0
    assert outs == _want(references, prompts, route)


def test_seeded_sampling_is_the_same_alone_batched_chunked_and_preempted(model):
    target = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1234, max_tokens=MAX_TOKENS)
    alone = _run(Engine(model, CharTokenizer(), EngineConfig(block_size=4, num_kv_blocks=64)),
                 [PROMPTS[3]], target)[0]
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS) for i in range(10)]
    engine = Engine(model, CharTokenizer(), EngineConfig(block_size=4, num_kv_blocks=40,
                                                         max_num_batched_tokens=24))
    requests = [GenerationRequest(f"o{i}", p, s) for i, (p, s) in enumerate(zip(PROMPTS[5:15], others))]
    requests.insert(6, GenerationRequest("target", PROMPTS[3], target))
    outs = {o.req_id: o for o in engine.generate(requests)}
    assert engine.stats().num_preemptions > 0
    assert outs["target"].output_token_ids == alone
    other_seed = _run(Engine(model, CharTokenizer(), EngineConfig(block_size=4, num_kv_blocks=64)),
                      [PROMPTS[3]], SamplingParams(temperature=0.8, top_p=0.95, seed=99, max_tokens=MAX_TOKENS))
    assert other_seed[0] != alone


# -- stop conditions, limits -----------------------------------------------------------------------

def _first_new_token(tokens: list[int]) -> int:
    """An index k > 0 whose token did not appear before it."""
    return next(k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k])


def test_stop_string_cuts_the_text_and_stops(model, references):
    prompt = PROMPTS[0]
    ref = references[tuple(prompt)]
    k = _first_new_token(ref)
    tok = CharTokenizer()
    engine = Engine(model, tok, EngineConfig(block_size=4, num_kv_blocks=64))
    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[tok.decode([ref[k]])])
    [out] = engine.generate([GenerationRequest("s", prompt, sampling)])
    assert out.finish_reason == "stop"
    assert out.output_token_ids == ref[:k + 1]
    assert out.text == tok.decode(ref[:k])


def test_stop_token_id_and_min_tokens(model, references):
    prompt = PROMPTS[1]
    ref = references[tuple(prompt)]
    k = _first_new_token(ref)
    engine = Engine(model, CharTokenizer(), EngineConfig(block_size=4, num_kv_blocks=64))
    [out] = engine.generate([GenerationRequest(
        "s", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[ref[k]]))])
    assert out.finish_reason == "stop" and out.output_token_ids == ref[:k + 1]
    # min_tokens bans the stop id until then, so it is not produced early
    [out] = engine.generate([GenerationRequest(
        "m", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[ref[k]],
                                    min_tokens=k + 3))])
    assert out.output_token_ids[:k] == ref[:k]
    assert ref[k] not in out.output_token_ids[:k + 2] and len(out.output_token_ids) >= k + 3


def test_max_tokens_gives_length(model, references):
    engine = Engine(model, CharTokenizer(), EngineConfig(block_size=4, num_kv_blocks=64))
    [out] = engine.generate([GenerationRequest("l", PROMPTS[2], SamplingParams(temperature=0, max_tokens=5))])
    assert out.finish_reason == "length" and out.output_token_ids == references[tuple(PROMPTS[2])][:5]
    assert out.num_prompt_tokens == len(PROMPTS[2]) and out.text == CharTokenizer().decode(out.output_token_ids)


def test_engine_rejects_requests_it_can_never_run(model):
    engine = Engine(model, CharTokenizer(), EngineConfig(block_size=4, num_kv_blocks=64))
    with pytest.raises(ValueError, match="'long'.*512"):
        engine.add_request(GenerationRequest("long", [1] * 500, SamplingParams(max_tokens=13)))
    with pytest.raises(ValueError, match="'oov'.*vocabulary"):
        engine.add_request(GenerationRequest("oov", [1, VOCAB], SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match="'pool'"):
        engine.add_request(GenerationRequest("pool", [1] * 250, SamplingParams(max_tokens=10)))
    assert not engine.has_unfinished()


def test_generate_pulls_requests_lazily(model):
    engine = Engine(model, CharTokenizer(), EngineConfig(block_size=4, num_kv_blocks=128, max_waiting=2))
    seen_waiting = []

    def requests():
        for i in range(8):
            seen_waiting.append(engine.num_waiting)
            yield GenerationRequest(f"r{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=3))

    outs = list(engine.generate(requests()))
    assert sorted(o.req_id for o in outs) == [f"r{i}" for i in range(8)]
    assert max(seen_waiting) <= 1  # never more than max_waiting queued
    assert engine.stats().num_generated_tokens == 24


def test_the_engine_owns_the_attention_implementation_of_its_model(model, references):
    engine = Engine(model, CharTokenizer(), EngineConfig(block_size=4, num_kv_blocks=64, fused_forward=False))
    with pytest.raises(RuntimeError, match="metadata"):  # plain forward passes no longer work
        _generate(model, PROMPTS[0], 2)
    model.set_attn_implementation("sdpa")  # switching back would silently give wrong tokens
    engine.add_request(GenerationRequest("x", PROMPTS[0], GREEDY))
    with pytest.raises(RuntimeError, match="attention"):
        engine.step()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    assert _run(engine, [PROMPTS[0]]) == [references[tuple(PROMPTS[0])]]


def test_last_step_describes_the_step_that_ran(model):
    """Two prompts (5 and 9 tokens) prefilled together, then decoded: rows, decode rows, their keys."""
    engine = Engine(model, CharTokenizer(), EngineConfig(block_size=4, num_kv_blocks=64, enable_prefix_caching=False))
    assert engine.last_step is None
    sampling = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request(GenerationRequest("a", list(range(1, 6)), sampling))
    engine.add_request(GenerationRequest("b", list(range(10, 19)), sampling))
    engine.step()
    first = engine.last_step
    assert (first.num_requests, first.num_tokens, first.num_decode_rows, first.decode_keys, first.num_sampled) == \
        (2, 14, 0, 0, 2)
    engine.step()
    second = engine.last_step
    # each request feeds its first output token: at position 5 (a) and 9 (b), seeing 6 and 10 keys
    assert (second.num_requests, second.num_tokens, second.num_decode_rows, second.decode_keys,
            second.num_sampled) == (2, 2, 2, 16, 2)
    assert first.seconds > 0 and second.seconds > 0
    while engine.has_unfinished():
        engine.step()
    assert engine.num_generated_tokens == 6
