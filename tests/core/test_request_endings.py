"""Every way a request ends reaches the caller the same way: through `Scheduler.finish_request`, as a RequestOutput
in the engine's output stream. A completion, a refusal at admission (too big for the KV pool, an empty prompt, an id
already in the engine), a grammar that does not compile, and an output that cannot be decoded; on a tiny random
Llama with the embedded SmolLM2 tokenizer (xgrammar needs a real one)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conveyor.core import EngineConfig, GenerationRequest, Grammar, SamplingParams
from conveyor.core.engine import Engine
from conveyor.core.model_loader import ensure_embedded
from conveyor.core.request import FINISHED, FinishReason

UNDECODABLE_TOKENS = 5  # the output length the test's tokenizer cannot decode


@pytest.fixture(scope="module")
def tiny():
    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m-instruct"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tokenizer


def _engine(tiny) -> tuple[Engine, list]:
    """An engine with a 64-token KV pool whose tokenizer cannot decode an output of UNDECODABLE_TOKENS tokens, and
    the list its scheduler's `finish_request` calls are recorded in."""
    model, tokenizer = tiny
    decode = tokenizer.decode

    def fragile_decode(ids, **kwargs):
        if len(ids) == UNDECODABLE_TOKENS:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return decode(ids, **kwargs)

    tokenizer.decode = fragile_decode
    engine = Engine(model, tokenizer, EngineConfig(num_kv_blocks=16, block_size=4, max_waiting=8))
    finishes = []
    finish = engine.scheduler.finish_request

    def recorded(request, reason, error=None):
        finish(request, reason, error)
        finishes.append((request, reason, error))

    engine.scheduler.finish_request = recorded
    return engine, finishes


def test_each_ending_is_a_finished_request_output_through_the_schedulers_finish(tiny):
    engine, finishes = _engine(tiny)
    try:
        plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        requests = [
            GenerationRequest("too-big", [1, 2, 3], SamplingParams(max_tokens=100)),  # 103 tokens; the pool holds 64
            GenerationRequest("ok", [1, 2, 3], plain),
            GenerationRequest("ok", [4, 5, 6], plain),  # its id is running
            GenerationRequest("empty", [], plain),
            GenerationRequest("bad-grammar", [1, 2, 3], SamplingParams(max_tokens=3, grammar=Grammar("regex", "(["))),
            GenerationRequest("undecodable", [7, 8], SamplingParams(temperature=0, max_tokens=UNDECODABLE_TOKENS,
                                                                    ignore_eos=True)),
        ]
        stream = engine.stream(requests)
        first = next(stream)  # the first step's outputs: those refused as they were pulled come first, in order
        assert [(o.req_id, o.finish_reason) for o in first[:3]] == [("too-big", "error"), ("ok", "error"),
                                                                    ("empty", "error")]
        outs = [*first, *(o for step in stream for o in step)]
    finally:
        del tiny[1].decode  # the tokenizer's own again

    by_id = {}
    for out in outs:
        by_id.setdefault(out.req_id, []).append(out)
    assert sorted(by_id) == ["bad-grammar", "empty", "ok", "too-big", "undecodable"]
    assert len(by_id["ok"]) == 2 and all(len(v) == 1 for k, v in by_id.items() if k != "ok")
    refused_twin, ok = sorted(by_id["ok"], key=lambda o: o.finish_reason)
    assert (ok.finish_reason, ok.error, ok.num_output_tokens) == ("length", None, 3)
    assert refused_twin.finish_reason == "error" and refused_twin.error == "request id 'ok' is already in the engine"
    [too_big], [empty], [bad], [undecodable] = (by_id[k] for k in ("too-big", "empty", "bad-grammar", "undecodable"))
    assert too_big.error.startswith("request 'too-big' needs up to 103 tokens of KV cache but the pool holds 64")
    assert empty.error == "request 'empty': the prompt has no tokens" and empty.num_prompt_tokens == 0
    assert bad.error.startswith("invalid regex")
    assert undecodable.error.startswith("the request failed while it ran (decoding its output failed: "
                                        "UnicodeDecodeError")
    assert undecodable.num_output_tokens == UNDECODABLE_TOKENS
    for out in (too_big, empty, bad, undecodable, refused_twin):
        assert (out.finish_reason, out.text, out.note) == ("error", "", None)

    # One finish per output, in the order they came out, each saying what its output says.
    assert [(r.req_id, reason.value, error) for r, reason, error in finishes] == \
        [(o.req_id, o.finish_reason, o.error) for o in outs]
    assert all(r.status in FINISHED and r.finish_reason is reason for r, reason, _ in finishes)
    assert [reason for _, reason, _ in finishes].count(FinishReason.ERROR) == 5
    assert not engine.has_unfinished() and not engine.scheduler.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
