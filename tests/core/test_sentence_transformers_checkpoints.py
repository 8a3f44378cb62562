"""Embedding checkpoints in every layout sentence-transformers writes, against its own `encode` (float32, allclose):
the one the installed version saves itself (6.x: `sentence_transformers.base.modules...`, `"pooling_mode": "mean"`)
and 5.x's (`sentence_transformers.models.*`, `pooling_mode_*` flags), written here from its format; a module or a
pooling conveyor does not compute refused, naming it; --pooling in place of the checkpoint's mode; texts lowercased
where do_lower_case asks; a Transformer setting that changes the tokens refused before the weights load. And a
cross-encoder the installed version saves, against its `predict`. (The default prompt is joined to a text where
records become requests: tests/cli/test_sentence_transformers_cli.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from pooling_models import (
    bert_embedder,
    bert_model,
    cased_bert_model,
    cross_encoder,
    qwen3_model,
    saved_by_sentence_transformers,
    sentence_transformers,
    sentence_transformers_files,
)

from conveyor.core import EngineConfig, PoolingRequest, TokenSequence, load_engine, load_pooling_tokenizer
from conveyor.core.errors import UnsupportedModel

TEXTS = ["hello world", "what is the capital of france?", "the blender was loud, three stars", "a",
         "paris is the capital city of france and the answer to the question " * 2]
F32 = EngineConfig(device="cpu", dtype="float32")
CONVEYOR = {"mean": "mean", "cls": "cls", "lasttoken": "last"}  # sentence-transformers' mode -> --pooling


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny BERT base model, no sentence-transformers files."""
    return bert_model(tmp_path_factory.mktemp("bert"))


def _results(engine, sequences, normalize=True):
    requests = [PoolingRequest(str(i), (s,), normalize=normalize) for i, s in enumerate(sequences)]
    outs = {o.req_id: o for step in engine.stream(requests) for o in step}
    assert all(o.error is None for o in outs.values()), [o.error for o in outs.values()]
    return torch.tensor([outs[str(i)].results[0] for i in range(len(sequences))])


def _embed(folder, pooling=None, normalize=True, texts=TEXTS):
    engine = load_engine(str(folder), F32, "embed", pooling)
    sequences = [TokenSequence(tuple(engine.tokenizer(t)["input_ids"])) for t in texts]
    return engine, _results(engine, sequences, normalize)


def _encode(folder, texts=TEXTS):
    return sentence_transformers().SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)


@pytest.mark.parametrize("mode", ["mean", "cls", "lasttoken"])
@pytest.mark.parametrize("layout", ["saved by sentence-transformers", "5.x"])
def test_vectors_equal_sentence_transformers_encode_in_each_layout(bert, tmp_path, layout, mode):
    folder = tmp_path / "st"
    if layout == "5.x":
        bert_embedder(folder, CONVEYOR[mode])
        assert json.loads((folder / "modules.json").read_text())[1]["type"] == "sentence_transformers.models.Pooling"
    else:
        saved_by_sentence_transformers(folder, bert, mode)
        assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == mode
    engine, got = _embed(folder)
    assert engine.model.pooling == CONVEYOR[mode]
    torch.testing.assert_close(got, _encode(folder), rtol=1e-5, atol=1e-5)


def test_a_checkpoint_without_normalize_gives_its_raw_vectors_with_normalize_off(bert, tmp_path):
    """(conveyor normalizes by default, as OpenAI does; --no-normalize gives the vectors sentence-transformers does)"""
    folder = saved_by_sentence_transformers(tmp_path / "st", bert, "mean", normalize=False)
    _, got = _embed(folder, normalize=False)
    torch.testing.assert_close(got, _encode(folder), rtol=1e-5, atol=1e-5)
    assert all(abs(float(v.norm()) - 1) > 1e-3 for v in got)


def test_a_module_conveyor_does_not_compute_is_refused_naming_its_class_and_path(bert, tmp_path):
    from sentence_transformers.sentence_transformer.modules import Dense

    dense = saved_by_sentence_transformers(tmp_path / "dense", bert, "mean", Dense(64, 16))
    with pytest.raises(UnsupportedModel, match=r"module 2 \(2_Dense\) is class Dense \(type "
                                                r"sentence_transformers\.base\.modules\.dense\.Dense\), a "
                                                "sentence-transformers module conveyor does not compute"):
        _embed(dense)
    with pytest.raises(UnsupportedModel, match="class Dense"):
        _embed(dense, pooling="mean")  # --pooling replaces the pooling, not the modules after it

    custom = tmp_path / "custom"  # a class of the same name, from the checkpoint's own code
    shutil.copytree(saved_by_sentence_transformers(tmp_path / "plain", bert, "mean"), custom)
    modules = json.loads((custom / "modules.json").read_text())
    modules[0]["type"] = "custom_st.Transformer"
    (custom / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModel, match=r"module 0 \(the model folder\) is class Transformer \(type "
                                                r"custom_st\.Transformer\), a custom module"):
        _embed(custom)


@pytest.mark.parametrize("mode, include_prompt, refusal", [
    ("max", True, "asks for max pooling"),
    ("weightedmean", True, "asks for weightedmean pooling"),
    (("mean", "max"), True, r"joins 2 poolings \(mean, max\)"),
])
def test_a_pooling_conveyor_does_not_compute_is_refused_unless_pooling_replaces_it(bert, tmp_path, mode,
                                                                                     include_prompt, refusal):
    folder = saved_by_sentence_transformers(tmp_path / "st", bert, mode, include_prompt=include_prompt)
    with pytest.raises(UnsupportedModel, match=refusal + ".*give --pooling last, mean or cls"):
        _embed(folder)
    engine, got = _embed(folder, pooling="mean")
    assert engine.model.pooling == "mean"
    torch.testing.assert_close(got, _encode(saved_by_sentence_transformers(tmp_path / "mean", bert, "mean")),
                               rtol=1e-5, atol=1e-5)


def test_the_5x_flags_name_the_pooling_conveyor_does_not_compute(bert, tmp_path):
    folder = bert_embedder(tmp_path / "st", "mean")
    config = folder / "1_Pooling" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pooling_mode_mean_tokens": False,
                                  "pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(UnsupportedModel, match="asks for weightedmean pooling"):
        _embed(folder)
    assert _embed(folder, pooling="cls")[0].model.pooling == "cls"


def test_a_length_limit_kept_in_the_tokenizer_cuts_texts_where_sentence_transformers_does(bert, tmp_path):
    """6.x keeps max_seq_length as the tokenizer's model_max_length, not in sentence_bert_config.json."""
    folder = saved_by_sentence_transformers(tmp_path / "st", bert, "mean", max_seq_length=16)
    assert load_engine(str(folder), F32, "embed").limits.max_model_len == 16


def test_texts_rendered_through_a_chat_template_are_refused(tmp_path):
    """6.x renders every text through the chat template of a tokenizer that has one ("message" modality)."""
    folder = saved_by_sentence_transformers(tmp_path / "st", qwen3_model(tmp_path / "qwen3"), "lasttoken")
    config = folder / "sentence_bert_config.json"
    with pytest.raises(UnsupportedModel, match=r"sentence_bert_config\.json: modality_config has \"message\""):
        _embed(folder)
    settings = json.loads(config.read_text())
    del settings["modality_config"]["message"]  # plain texts, in sentence-transformers too
    config.write_text(json.dumps(settings))
    engine, got = _embed(folder)
    assert engine.model.pooling == "last"
    torch.testing.assert_close(got, _encode(folder), rtol=1e-5, atol=1e-5)


def test_include_prompt_false_pools_every_token_where_no_default_prompt_applies(bert, tmp_path):
    """sentence-transformers leaves out only a prompt it prepended: with none, every token is pooled. With a default
    prompt, conveyor (which pools every token) refuses, unless --pooling replaces the checkpoint's pooling."""
    folder = saved_by_sentence_transformers(tmp_path / "none", bert, "mean", include_prompt=False,
                                            prompts={"query": "query: "})
    torch.testing.assert_close(_embed(folder)[1], _encode(folder), rtol=1e-5, atol=1e-5)
    prompted = saved_by_sentence_transformers(tmp_path / "default", bert, "mean", include_prompt=False,
                                              prompts={"query": "query: "}, default_prompt_name="query")
    with pytest.raises(UnsupportedModel, match=r"leaves the prompt out of the pooled tokens \(include_prompt: false\), "
                                                r"and its config_sentence_transformers\.json prepends a default prompt "
                                                r"to every text.*give --pooling last, mean or cls"):
        _embed(prompted)
    assert _embed(prompted, pooling="mean")[0].model.pooling == "mean"


CASED = ["Hello World", "What is the Capital of FRANCE?", "paris", "The Blender was LOUD"]


@pytest.mark.parametrize("layout", ["saved by sentence-transformers", "5.x"])
def test_do_lower_case_lowercases_texts_as_sentence_transformers_does(tmp_path, layout):
    """5.x's do_lower_case (which the installed version still reads, as a Lowercase normalizer put first in the
    tokenizer) with a tokenizer that keeps case: "Hello" is no word of its vocabulary, "hello" is."""
    from transformers import AutoTokenizer

    folder = tmp_path / "st"
    if layout == "5.x":
        sentence_transformers_files(cased_bert_model(folder), "mean", do_lower_case=True)
    else:
        saved_by_sentence_transformers(folder, cased_bert_model(tmp_path / "cased"), "mean")
        config = folder / "sentence_bert_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "do_lower_case": True}))
    engine, got = _embed(folder, texts=CASED)
    torch.testing.assert_close(got, _encode(folder, CASED), rtol=1e-5, atol=1e-5)
    unk = engine.tokenizer.unk_token_id
    assert unk in AutoTokenizer.from_pretrained(folder)(CASED[0])["input_ids"]  # (as the checkpoint's files read)
    assert unk not in engine.tokenizer(CASED[0])["input_ids"]
    validating = load_pooling_tokenizer(str(folder), "embed")[0]  # (`conveyor validate` counts the same tokens)
    assert [validating(t)["input_ids"] for t in CASED] == [engine.tokenizer(t)["input_ids"] for t in CASED]


def test_settings_that_change_nothing_encode_computes_load(bert, tmp_path):
    """Where the files were kept, a per-task length only encode_query passes, another modality's processing."""
    folder = saved_by_sentence_transformers(tmp_path / "st", bert, "mean")
    config = folder / "sentence_bert_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_args": {"trust_remote_code": True},
                                  "cache_dir": None, "query_length": 4, "unpad_inputs": False,
                                  "processing_kwargs": {"image": {"do_resize": False}}}))
    torch.testing.assert_close(_embed(folder)[1], _encode(folder), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("file, settings, refusal", [
    ("sentence_bert_config.json", {"processing_kwargs": {"text": {"max_length": 8}}},
     r"processing_kwargs \{\"text\": \{\"max_length\": 8\}\}: sentence-transformers passes these to the tokenizer"),
    ("sentence_bert_config.json", {"tokenizer_args": {"model_max_length": 8}},
     r"tokenizer_args has model_max_length, which sentence-transformers passes on loading the tokenizer"),
    ("sentence_bert_config.json", {"config_kwargs": {"layer_norm_eps": 0.5}},
     r"config_kwargs has layer_norm_eps, which sentence-transformers passes on loading the model's config"),
    ("sentence_bert_config.json", {"tokenizer_name_or_path": "other/tokenizer"},
     r"tokenizer_name_or_path \"other/tokenizer\": sentence-transformers reads the tokenizer from there"),
    ("sentence_bert_config.json", {"transformer_task": "fill-mask"}, r"transformer_task \"fill-mask\""),
    ("sentence_bert_config.json", {"lowercase": True}, r"key \"lowercase\" is not a setting conveyor knows"),
    ("config_sentence_transformers.json", {"prompts": {"query": "query: "}, "default_prompt_name": "passage"},
     r"default_prompt_name \"passage\" names none of its prompts \(\"query\"\)"),
    ("config_sentence_transformers.json", {"prompts": {"query": 3}, "default_prompt_name": "query"},
     r"prompts\[\"query\"\], the default prompt, is 3, not a text"),
])
def test_a_setting_that_changes_the_tokens_is_refused_before_the_weights_load(bert, tmp_path, file, settings,
                                                                               refusal):
    folder = saved_by_sentence_transformers(tmp_path / "st", bert, "mean")
    path = folder / file
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    (folder / "model.safetensors").unlink()  # (refused before its weights are looked for)
    with pytest.raises(UnsupportedModel, match=f"{path.name}: {refusal}"):
        load_engine(str(folder), F32, "embed")


@pytest.mark.parametrize("activation", ["Sigmoid", "Identity"])
def test_a_cross_encoder_saved_by_sentence_transformers_scores_as_its_predict(tmp_path, activation):
    """6.x keeps the activation in config_sentence_transformers.json, no longer in config.json."""
    model = sentence_transformers().CrossEncoder(str(cross_encoder(tmp_path / "base")), device="cpu",
                                                 activation_fn=getattr(torch.nn, activation)())
    model.save(str(tmp_path / "ce"))
    engine = load_engine(str(tmp_path / "ce"), F32, "score")
    pairs = [("what is the capital of france?", "the capital of france is paris."), ("hello", "hello world")]
    encoded = [engine.tokenizer(a, b) for a, b in pairs]
    got = _results(engine, [TokenSequence(tuple(e["input_ids"]), tuple(e["token_type_ids"])) for e in encoded])
    torch.testing.assert_close(got.flatten(), torch.tensor(model.predict(pairs)), rtol=1e-5, atol=1e-6)


def test_an_embedders_similarity_other_than_cosine_refuses_score_and_an_activation_is_a_cross_encoders(bert,
                                                                                                    tmp_path):
    from conveyor.core import check_pooling_model

    folder = tmp_path / "dot"
    shutil.copytree(bert_embedder(tmp_path / "base"), folder)
    settings = folder / "config_sentence_transformers.json"
    settings.write_text(json.dumps({"similarity_fn_name": "dot", "activation_fn": "torch.nn.modules.Tanh"}))
    check_pooling_model(str(folder), "embed")  # (an embedder: neither is read for its vectors)
    with pytest.raises(UnsupportedModel, match="names the similarity dot, and conveyor scores an embedder's pairs by "
                                               "cosine"):
        check_pooling_model(str(folder), "score")
    settings.write_text(json.dumps({"similarity_fn_name": "cosine"}))
    check_pooling_model(str(folder), "score")
