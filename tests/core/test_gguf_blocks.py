"""GGUF files whose linears are of each kept block type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), written
inside the test (tests/gguf_files.py): conveyor keeps them in their blocks on the cpu backend, its de-quantized
weights equal transformers' own GGUF load bit for bit (q/k rows in transformers' order), and greedy float32 output
equals transformers' model of the file token for token, with a cached prefix, chunked prompts and preemption; a
record's output does not depend on its batch."""

from __future__ import annotations

import pytest
import torch
from families import CharTokenizer, prompts, reference
from gguf_files import VOCAB, write
from routes import route_config

from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
from conveyor.core.engine import Engine
from conveyor.core.quant.gguf_blocks import KEPT
from conveyor.core.quant.gguf_load import load_gguf_quantized
from conveyor.core.quant.weights import QuantLinear

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
CROWDED = EngineConfig(num_kv_blocks=14, max_num_batched_tokens=32, max_num_seqs=8)


def _prompts():
    return {k: [3 + t % (VOCAB - 3) for t in p] for k, p in prompts().items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = {}

    def get(kind):
        if kind not in out:
            folder = tmp_path_factory.mktemp(kind)
            write(folder / "m.gguf", kind)
            out[kind] = folder
        return out[kind]

    return get


def _ours(folder, dtype=torch.float32):
    from transformers import AutoConfig

    return load_gguf_quantized(folder / "m.gguf", AutoConfig.from_pretrained(str(folder), gguf_file="m.gguf"), dtype,
                               str(folder))


def _transformers(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="m.gguf", dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", KEPT)
def test_kept_blocks_equal_transformers_gguf_load_and_its_greedy_output(kind, files):
    folder = files(kind)
    ours, theirs = _ours(folder), _transformers(folder)
    quantized = {n: m for n, m in ours.named_modules() if isinstance(m, QuantLinear)}
    assert len(quantized) == 15  # 7 linears in each of 2 layers, and the lm_head
    for name, module in quantized.items():
        assert torch.equal(module.quant.dense(), theirs.get_submodule(name).weight), name
    want = {k: reference(theirs, p, MAX_TOKENS) for k, p in _prompts().items()}
    engine = Engine(ours, CharTokenizer(), route_config("cpu", CROWDED))
    outs = {o.req_id: o.output_token_ids for o in engine.generate(GenerationRequest(k, p, GREEDY)
                                                                  for k, p in _prompts().items())}
    assert engine.stats().num_preemptions > 0 and engine.stats().num_cached_prompt_tokens > 0
    assert outs == want, kind
    assert engine.backend.describe() == "cpu (fused llama forward)"


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_a_record_does_not_depend_on_its_batch(kind, files):
    sampling = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    folder = files(kind)
    crowd_engine = Engine(_ours(folder, torch.bfloat16), CharTokenizer(), route_config("cpu", CROWDED))
    crowd = {o.req_id: o for o in crowd_engine.generate(GenerationRequest(k, p, sampling)
                                                        for k, p in _prompts().items())}
    alone = Engine(_ours(folder, torch.bfloat16), CharTokenizer(), route_config("cpu", EngineConfig(num_kv_blocks=64)))
    for k, p in _prompts().items():
        (out,) = alone.generate([GenerationRequest(k, p, sampling)])
        assert out.output_token_ids == crowd[k].output_token_ids and out.logprobs == crowd[k].logprobs, k
