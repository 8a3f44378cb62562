"""The probe of a model's own transformers forward (core/backends/attention_probe.py): each layer's window read off
the mask transformers builds, its scaling, softcap and sinks off what the attention is handed; and what conveyor
would not compute as the model defines it refused by name (the cases the config checks would not catch, so the
probe is called here on models built past them)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from families import WINDOW, build

from conveyor.core.backends.attention_probe import probe_attention
from conveyor.core.backends.transformers_forward import register
from conveyor.core.errors import UnsupportedModel


def _probe(model):
    register(model)
    return probe_attention(model, "tiny")


def test_each_layer_reads_as_its_model_defines_it():
    gemma3 = _probe(build("gemma3"))  # five of six layers slide, query_pre_attn_scalar scales
    assert [layer.window for layer in gemma3.layers] == [WINDOW] * 5 + [None]
    assert all(layer.scale == pytest.approx(256 ** -0.5) for layer in gemma3.layers)
    gemma2 = _probe(build("gemma2"))  # alternating windows, a softcap of 50
    assert [layer.window for layer in gemma2.layers] == [WINDOW, None] * 2
    assert {layer.softcap for layer in gemma2.layers} == {50.0}
    oss = _probe(build("gpt-oss"))
    assert all(layer.sinks for layer in oss.layers)
    qwen2 = _probe(build("qwen2-window"))  # use_sliding_window with max_window_layers 2: the layers from 2 on
    assert [layer.window for layer in qwen2.layers] == [None, None, WINDOW, WINDOW]
    mistral = _probe(build("mistral-window"))
    assert mistral.all_slide == WINDOW and gemma2.all_slide is None
    granite = _probe(build("granite"))
    assert {layer.scale for layer in granite.layers} == {0.0078125}
    assert _probe(build("gpt-neox")).head_dim == 16


def test_a_chunked_mask_is_refused():
    cfg = tf.Llama4TextConfig(vocab_size=64, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              attention_chunk_size=32, num_local_experts=2, max_position_embeddings=256)
    model = tf.Llama4ForCausalLM(cfg).eval()
    with pytest.raises(UnsupportedModel, match="Llama4ForCausalLM.*not causal or a sliding window.*chunked"):
        _probe(model)


def test_bidirectional_attention_is_refused():
    cfg = tf.BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64)
    with pytest.raises(UnsupportedModel, match="bidirectional|not causal"):
        _probe(tf.BertLMHeadModel(cfg).eval())


def test_keys_and_values_of_different_widths_are_refused():
    cfg = tf.DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                              q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                              n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1, n_group=1,
                              topk_group=1)
    with pytest.raises(UnsupportedModel, match="keys of 24 and values of 16"):
        _probe(tf.DeepseekV3ForCausalLM(cfg).eval())


def test_a_keyword_no_backend_implements_is_refused(monkeypatch):
    """A layer whose attention is handed a keyword conveyor's attention does not implement (one that would change
    the result) is refused naming it."""
    import conveyor.core.backends.transformers_forward as tfw

    real = tfw.paged_attention_forward

    def handed_more(*args, **kwargs):
        return real(*args, attention_temperature=torch.tensor(0.5), **kwargs)

    monkeypatch.setattr(tfw, "paged_attention_forward", handed_more)
    with pytest.raises(UnsupportedModel, match="attention_temperature"):
        _probe(build("llama"))


@pytest.mark.parametrize("causal", [True, False])
def test_is_causal_handed_over_is_read(monkeypatch, causal):
    """Some forwards hand the attention is_causal: True is what conveyor computes, False is bidirectional."""
    import conveyor.core.backends.transformers_forward as tfw

    real = tfw.paged_attention_forward

    def handed(*args, **kwargs):
        return real(*args, is_causal=causal, **kwargs)

    monkeypatch.setattr(tfw, "paged_attention_forward", handed)
    if causal:
        assert _probe(build("llama")).all_slide is None
    else:
        with pytest.raises(UnsupportedModel, match="bidirectional"):
            _probe(build("llama"))
