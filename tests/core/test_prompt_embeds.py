"""Embeddings given for prompt positions (an image's features in place of its placeholder tokens): a tiny random
LLaVA (CLIP tower, Llama text model) built here, its image features computed once by its own vision tower and
projector, and the engine on its text model with those features at the image's positions gives transformers' own
greedy `generate` (float32, token for token), also with a chunked prefill that cuts through the image, under forced
preemption, and with the image's blocks served from the prefix cache to a second record with the same image (and not
to one with another image). Given embeddings that do not fit the prompt or the model are refused, naming the
request."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from routes import ROUTES, route_config

from conveyor.core import EngineConfig, GenerationRequest, SamplingParams
from conveyor.core.engine import Engine
from conveyor.core.outputs import PromptEmbeds

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def llava():
    from PIL import Image
    from transformers import (
        AutoTokenizer,
        CLIPVisionConfig,
        LlamaConfig,
        LlamaForCausalLM,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from conveyor.core.model_loader import ensure_embedded

    tok = AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m-instruct"))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tok.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=56, patch_size=14, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_id, vision_feature_layer=-1,
                         vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}),
        tokenizer=tok, patch_size=14, num_additional_image_tokens=1, vision_feature_select_strategy="default")
    lm = LlamaForCausalLM(text).eval()  # the same text model and head, as the engine loads a causal LM
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.lm_head.load_state_dict(model.lm_head.state_dict())
    images = [Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))
              for seed, (h, w) in enumerate([(40, 70), (64, 48)])]
    return model, processor, lm, tok, image_id, images


def _record(llava, prefix: str, image: int, question: str):
    """(the prompt's token ids, its PromptEmbeds, transformers' greedy tokens) of `prefix`, an image, `question`."""
    model, processor, _, tok, image_id, images = llava
    inputs = processor(images=[images[image]], text=f"{prefix}<image>{question}", return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    with torch.inference_mode():
        expected = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)[0, len(ids):].tolist()
        features = model.model.get_image_features(pixel_values=inputs["pixel_values"], vision_feature_layer=-1,
                                                  vision_feature_select_strategy="default",
                                                  return_dict=True).pooler_output[0]
    positions = tuple(i for i, t in enumerate(ids) if t == image_id)
    assert len(positions) == features.shape[0] == 16
    digest = int.from_bytes(hashlib.sha256(images[image].tobytes()).digest()[:7], "big")
    keys = tuple(-(digest * 64 + k) - 1 for k in range(len(positions)))  # negative: never a token id
    if tok.eos_token_id in expected:
        expected = expected[:expected.index(tok.eos_token_id) + 1]
    return ids, PromptEmbeds(positions, features.float(), keys), expected


@pytest.fixture(scope="module")
def records(llava):
    return {"a": _record(llava, "Look at this picture, please: ", 0, " What is in it?"),
            "b": _record(llava, "Here: ", 1, " Describe the colours you see in the picture."),
            "c": _record(llava, "Look at this picture, please: ", 0, " Is it dark?")}


def _run(llava, records, names, **config):
    _, _, lm, tok, _, _ = llava
    engine = Engine(lm, tok, EngineConfig(dtype="float32", **config))
    requests = [GenerationRequest(n, records[n][0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                  prompt_embeds=records[n][1]) for n in names]
    outs = {o.req_id: o for o in engine.generate(requests)}
    for n in names:
        assert outs[n].output_token_ids == records[n][2], n
    return outs, engine


def test_the_given_embeddings_decide_the_output(llava, records):
    """Without the image's features (its placeholder tokens' own embeddings) the output is another: the test can
    fail."""
    _, _, lm, tok, _, _ = llava
    ids, _, expected = records["a"]
    engine = Engine(lm, tok, EngineConfig(dtype="float32"))
    [out] = engine.generate([GenerationRequest("a", ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))])
    assert out.output_token_ids != expected


@pytest.mark.parametrize("route", ROUTES)
def test_greedy_equals_transformers_generate_with_the_image(llava, records, route):
    """On every route here (tests/core/routes.py): the cpu backend's fused forward, the model's own transformers
    forward given `inputs_embeds` over the paged pool, the torch backend, the cuda backend's lean forward."""
    config = route_config(route, EngineConfig(dtype="float32"))
    _run(llava, records, ["a", "b", "c"], backend=config.backend, fused_forward=config.fused_forward)


def test_a_chunked_prefill_through_the_image(llava, records):
    outs, engine = _run(llava, records, ["a", "b", "c"], max_num_batched_tokens=8, enable_prefix_caching=False)
    assert engine.stats().num_steps > 10


def test_under_forced_preemption(llava, records):
    need = max(-(-(len(r[0]) + MAX_TOKENS) // 16) for r in records.values())
    outs, engine = _run(llava, records, ["a", "b", "c"], num_kv_blocks=need + 1, enable_prefix_caching=False)
    assert engine.stats().num_preemptions > 0


def test_the_prefix_cache_serves_an_image_only_to_the_same_image(llava, records):
    _, _, lm, tok, _, _ = llava
    engine = Engine(lm, tok, EngineConfig(dtype="float32"))
    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    ids, embeds, _ = records["a"]
    list(engine.generate([GenerationRequest("a", ids, sampling, prompt_embeds=embeds)]))
    ids_c, embeds_c, expected_c = records["c"]
    [same] = engine.generate([GenerationRequest("c", ids_c, sampling, prompt_embeds=embeds_c)])
    assert same.num_cached_tokens >= 16 and same.output_token_ids == expected_c  # its text and image blocks
    other = PromptEmbeds(embeds_c.positions, records["b"][1].values, records["b"][1].keys)  # another image there
    [changed] = engine.generate([GenerationRequest("c2", ids_c, sampling, prompt_embeds=other)])
    first_image_block = embeds_c.positions[0] // 16
    assert changed.num_cached_tokens == first_image_block * 16


def test_given_embeddings_that_do_not_fit_the_prompt_or_the_model_are_refused(llava, records):
    _, _, lm, tok, _, _ = llava
    engine = Engine(lm, tok, EngineConfig(dtype="float32"))
    ids, embeds, _ = records["a"]
    sampling = SamplingParams(temperature=0, max_tokens=2)
    bad = {"past the prompt": PromptEmbeds(tuple(p + len(ids) for p in embeds.positions), embeds.values, embeds.keys),
           "not ascending": PromptEmbeds(embeds.positions[::-1], embeds.values, embeds.keys),
           "another hidden size": PromptEmbeds(embeds.positions, embeds.values[:, :32], embeds.keys),
           "too few keys": PromptEmbeds(embeds.positions, embeds.values, embeds.keys[:-1])}
    for why, given in bad.items():
        with pytest.raises(ValueError, match="request 'x'") as refused:
            engine.add_request(GenerationRequest("x", ids, sampling, prompt_embeds=given))
        assert ("positions" if why in ("past the prompt", "not ascending") else "rows of 64") in str(refused.value)
