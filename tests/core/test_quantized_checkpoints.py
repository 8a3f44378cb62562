"""Quantized checkpoints (compressed-tensors W8A8 / W4A16 / W8A16, GPTQ, AWQ), each written inside the test from a
tiny random Llama by the format's own definition (tests/core/quant_checkpoints.py, no download):

- conveyor reads every format into the weights the format defines, bit for bit;
- greedy float32 output equals the format's plain torch forward (transformers' forward over `QuantLinear`, which
  de-quantizes, and for W8A8 quantizes each row of x) token for token, with a shared prefix from the cache, chunked
  prompts and preemption, on the fused CPU route (the quantized kernels) and the torch route. (W8A8 rounds each
  activation to an int8 step, so a last-bit difference in the float work around it, attention and norms computed
  in another order than transformers', can move a logit by a step: there a record may part from the reference only
  at a near-tie, where the reference's own second choice is within NEAR_TIE of its first, and takes that second.)
- on the fused route a record's output does not depend on its batch, in float32 and bf16;
- the quantized kernels: weight-only equals the dense route over the de-quantized weights bit for bit, and W8A8
  equals its torch definition bit for bit, for every row count, a row alone as in any batch;
- the CUDA backend's Triton kernels (in Triton's interpreter): greedy output against the format's forward, the
  weight-only kernel against the de-quantized weights, W8A8 against its torch definition bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from families import CharTokenizer, build, prompts, reference
from quant_checkpoints import FORMATS, write
from routes import route_config

from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
from conveyor.core.backends.cpu.kernels import cpu_kernels
from conveyor.core.checkpoint_format import read_scheme
from conveyor.core.engine import Engine
from conveyor.core.model_loader import load_config
from conveyor.core.quant.load import load_quantized
from conveyor.core.quant.weights import QuantLinear, QuantWeight

MAX_TOKENS = 10
NEAR_TIE = 0.1  # logits apart (W8A8 only; the tiny models' logits are about 5 in size)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
CROWDED = EngineConfig(num_kv_blocks=14, max_num_batched_tokens=32, max_num_seqs=8)
kernels = pytest.mark.skipif(cpu_kernels() is None, reason="conveyor's C++ kernels do not run here")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """fmt -> (folder, {linear: the weight the format defines})."""
    out = {}

    def get(fmt):
        if fmt not in out:
            folder = tmp_path_factory.mktemp(fmt)
            out[fmt] = folder, write(build("llama"), folder, fmt)
        return out[fmt]

    return get


def _load(folder, dtype="float32"):
    """The model as `load_model` loads it (these folders have no tokenizer: the CharTokenizer stands in)."""
    cfg = load_config(str(folder))
    return load_quantized(folder, cfg, read_scheme(cfg), getattr(torch, dtype), torch.device("cpu"), str(folder))


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_reads_into_the_weights_it_defines(fmt, folders):
    folder, want = folders(fmt)
    model = _load(folder)
    for name, weight in want.items():
        module = model.get_submodule(name)
        assert isinstance(module, QuantLinear), (name, type(module))
        assert torch.equal(module.quant.dense(), weight), name
    assert not isinstance(model.lm_head, QuantLinear)  # ignored, as the config says


@pytest.mark.parametrize("fmt, route", [(fmt, "cpu") for fmt in FORMATS] +
                         [(fmt, "torch") for fmt in ("ct-w8a8", "gptq-4-asym-desc", "awq")])
def test_greedy_float32_equals_the_formats_torch_forward(fmt, route, folders):
    model = _load(folders(fmt)[0])
    want = {k: reference(model, p, MAX_TOKENS) for k, p in prompts().items()}
    engine = Engine(model, CharTokenizer(), route_config(route, CROWDED))
    outs = {o.req_id: o for o in engine.generate(GenerationRequest(k, p, GREEDY) for k, p in prompts().items())}
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_cached_prompt_tokens > 0
    wrong = {k: (outs[k].output_token_ids, want[k]) for k in want if outs[k].output_token_ids != want[k]}
    if "w8a8" in fmt:
        wrong = {k: v for k, v in wrong.items() if not _parts_at_a_near_tie(model, prompts()[k], *v)}
    assert not wrong, f"{fmt} on {engine.backend.describe()}: {wrong}"
    if route == "cpu":
        assert engine.backend.describe() == "cpu (fused llama forward)" and engine.backend.exact


def test_a_tensor_the_model_has_no_place_for_is_refused_not_dropped(folders, tmp_path):
    """GPTQ writes a bias of zeros beside every linear (read, and nothing to add); one that is not zero, where the
    architecture has no bias, is refused rather than left out."""
    import shutil

    from safetensors.torch import load_file, save_file

    from conveyor.core.errors import UnsupportedModel

    folder = shutil.copytree(folders("gptq-4")[0], tmp_path / "biased")
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.bias"] = torch.ones_like(state["model.layers.0.self_attn.q_proj.bias"])
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match="q_proj has a bias in the checkpoint"):
        _load(folder)


@torch.inference_mode()
def _parts_at_a_near_tie(model, prompt, got, want) -> bool:
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        logits = model(torch.tensor([prompt + want[:i]])).logits[0, -1]
    finally:
        model.set_attn_implementation(before)
    top = logits.topk(2)
    return int(top.indices[1]) == got[i] and float(top.values[0] - top.values[1]) < NEAR_TIE


@kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["ct-w8a8", "ct-w4a16", "gptq-4-asym-desc", "awq"])
def test_a_record_does_not_depend_on_its_batch(fmt, dtype, folders):
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    folder = folders(fmt)[0]
    crowd_engine = Engine(_load(folder, dtype), CharTokenizer(), route_config("cpu", CROWDED))
    crowd = {o.req_id: o for o in crowd_engine.generate(GenerationRequest(k, p, sampling)
                                                        for k, p in prompts().items())}
    assert crowd_engine.stats().num_preemptions > 0
    alone = Engine(_load(folder, dtype), CharTokenizer(), route_config("cpu", EngineConfig(num_kv_blocks=64)))
    for k, p in prompts().items():
        (out,) = alone.generate([GenerationRequest(k, p, sampling)])
        assert out.output_token_ids == crowd[k].output_token_ids and out.logprobs == crowd[k].logprobs, k


def _random_wq(g, n, k, bits, group, offsets):
    groups = -(-k // group)
    return QuantWeight("wq", torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8),
                       torch.rand(n, groups, generator=g) * 0.01, bits, group,
                       torch.randint(0, 2 ** bits, (n, groups), generator=g).float(),
                       torch.randn(n, groups, generator=g) * 0.01 if offsets else None)


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("bits, group, offsets", [(4, 32, False), (8, 128, False), (4, 16, True), (8, 48, True)])
def test_weight_only_kernel_is_the_dense_route_over_the_dequantized_weights(bits, group, offsets, dtype):
    from conveyor.core.backends.cpu.linears import Linear, pack_panels

    ops = cpu_kernels()
    g = torch.Generator().manual_seed(bits * group)
    n, k = 70, 200
    q = _random_wq(g, n, k, bits, group, offsets)
    bias = torch.randn(n, generator=g).to(dtype)
    linear = Linear(q, bias, ops)
    dense = pack_panels(q.dequantize())
    x = torch.randn(2048, k, generator=g).to(dtype)
    for m in (1, 2, 5, 6, 7, 14, 15, 33, 2048):
        y = linear(x[:m])
        assert torch.equal(y, ops.panel_gemm(x[:m].float(), dense, n, bias.float(), 0).to(dtype)), m
        assert torch.equal(y[-1:], linear(x[m - 1:m])), m  # a row alone as in the batch


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("x_scale", [0.0, 0.02], ids=["dynamic", "static"])
def test_w8a8_kernel_is_its_torch_definition(x_scale, dtype):
    from conveyor.core.backends.cpu.linears import Linear

    ops = cpu_kernels()
    g = torch.Generator().manual_seed(3)
    n, k = 45, 257
    q = QuantWeight("w8a8", torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
                    torch.rand(n, generator=g) * 0.01, x_scale=x_scale)
    bias = torch.randn(n, generator=g).to(dtype)
    linear, plain = Linear(q, bias, ops), QuantLinear(q, bias, dtype)
    x = torch.randn(2048, k, generator=g).to(dtype) * 3
    x[3] = 0  # a row of zeros
    for m in (1, 4, 6, 7, 15, 100, 2048):
        y = linear(x[:m])
        assert torch.equal(y, plain(x[:m])), m
        assert torch.equal(y[-1:], linear(x[m - 1:m])), m


def test_w8a8_torch_definition_quantizes_each_row_by_its_largest_magnitude():
    """QuantLinear's W8A8 forward, against the definition written out here: s = max |x| / 127.5 per row,
    q = clamp(round half even(x / s), -128, 127), y = (sum q w) * s * s_w."""
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (8, 16), generator=g, dtype=torch.int8)
    sw = torch.rand(8, generator=g)
    x = torch.randn(3, 16, generator=g)
    s = x.abs().max(dim=1).values / 127.5
    q = torch.clamp(torch.round(x / s[:, None]), -128, 127)
    want = ((q.double() @ w.double().t()).float() * s[:, None]) * sw
    assert torch.equal(QuantLinear(QuantWeight("w8a8", w, sw), None, torch.float32)(x), want)


CUDA_PROMPTS = ("p5",)


def test_greedy_float32_on_the_cuda_route_with_the_triton_kernels(folders):
    """The CUDA backend's lean forward over quantized weights (4-bit, zero points, act-order: the Triton kernels; in
    Triton's interpreter here, benchmarks/gpu_check.sh runs it on a GPU) against the format's torch forward, on a
    prompt longer than the token budget (chunked). (Every kind of weight against QuantLinear: the test below.)"""
    model = _load(folders("gptq-4-asym-desc")[0])
    want = {k: reference(model, prompts()[k], 4) for k in CUDA_PROMPTS}
    engine = Engine(model, CharTokenizer(), route_config("cuda", CROWDED))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {o.req_id: o.output_token_ids for o in engine.generate(GenerationRequest(k, prompts()[k], greedy)
                                                                  for k in CUDA_PROMPTS)}
    assert outs == want, engine.backend.describe()
    assert "lean" in engine.backend.describe() and engine.backend.lean.quantized  # the Triton kernels ran


@pytest.mark.parametrize("bits, group, offsets", [(4, 32, False), (8, 64, True), (4, 16, True)])
def test_triton_weight_only_kernel_computes_the_dequantized_weights(bits, group, offsets):
    from conveyor.core.backends.cuda.triton_quant import TritonQuantLinear

    g = torch.Generator().manual_seed(bits + group)
    q = _random_wq(g, 40, 100, bits, group, offsets)
    bias = torch.randn(40, generator=g)
    x = torch.randn(19, 100, generator=g)
    want = x.double() @ q.dequantize().double().t() + bias.double()
    assert torch.allclose(TritonQuantLinear(q, bias)(x).double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("x_scale", [0.0, 0.02], ids=["dynamic", "static"])
def test_triton_w8a8_kernel_is_its_torch_definition_bit_for_bit(x_scale):
    from conveyor.core.backends.cuda.triton_quant import TritonQuantLinear

    g = torch.Generator().manual_seed(9)
    q = QuantWeight("w8a8", torch.randint(-128, 128, (45, 100), generator=g, dtype=torch.int8),
                    torch.rand(45, generator=g) * 0.01, x_scale=x_scale)
    bias = torch.randn(45, generator=g)
    x = torch.randn(7, 100, generator=g) * 3
    assert torch.equal(TritonQuantLinear(q, bias)(x), QuantLinear(q, bias, torch.float32)(x))


def test_8_bit_asymmetric_zero_points_are_read_from_their_packing_along_n():
    """pack-quantized packs the zero points of asymmetric weights along N (8 bits: four a word) as it packs 4-bit
    ones; they were read as if unpacked."""
    from quant_checkpoints import _asym, _pack_along

    from conveyor.core.quant.formats import ModuleScheme, Scheme
    from conveyor.core.quant.tensors import read_linear

    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    q, z, s = _asym(w, 8, 32)
    tensors = {"m.weight_packed": _pack_along(q, 8, 1), "m.weight_scale": s, "m.weight_zero_point": _pack_along(z, 8, 0),
               "m.weight_shape": torch.tensor([40, 64], dtype=torch.int32)}
    scheme = ModuleScheme("wq", 8, 32, symmetric=False)
    weight = read_linear(Scheme("compressed-tensors", "pack-quantized", ((("Linear",), scheme),)), scheme, "m",
                         tensors.get, (40, 64))
    assert torch.equal(weight.dense(), (q.float() - z.float().repeat_interleave(32, 1)) * s.repeat_interleave(32, 1))
