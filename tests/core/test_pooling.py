"""The pooling engine against transformers' own forward plus the same pooling (float32, allclose), on tiny random
checkpoints: a BERT embedder pooled by mean and by [CLS], a Qwen3-shaped decoder by its last token, a BERT sequence
classifier, an XLM-RoBERTa-shaped cross-encoder, a Llama reward model; on the packed route and one sequence at a
time; a sequence's result the same bits alone or packed with any others, in both dtypes; Matryoshka dimensions."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from conveyor.core import EngineConfig, PoolingRequest, TokenSequence, load_engine
from conveyor.core.backends.cpu.kernels import cpu_kernels, native_bf16
from conveyor.core.errors import UnsupportedModel

TEXTS = ["hello world", "what is the capital of france?", "the blender was loud, three stars",
         "a", "paris is the capital city of france and the answer to the question " * 3, "good product"]
PAIRS = [("what is the capital of france?", "the capital of france is paris."),
         ("what is the capital of france?", "the capital of brazil is brasilia."),
         ("hello", "hello world, hello world, hello world")]
F32 = EngineConfig(device="cpu", dtype="float32")
KERNELS = pytest.mark.skipif(cpu_kernels() is None, reason="the packed route needs conveyor's C++ kernels")


def _engine(folder, task, config=F32, pooling=None):
    return load_engine(str(folder), config, task, pooling)


def _results(engine, sequences, **request) -> list[torch.Tensor]:
    requests = [PoolingRequest(str(i), (s,), **request) for i, s in enumerate(sequences)]
    outs = {o.req_id: o for step in engine.stream(requests) for o in step}
    assert all(o.error is None for o in outs.values()), [o.error for o in outs.values()]
    return [torch.tensor(outs[str(i)].results[0]) for i in range(len(sequences))]


def _sequences(tokenizer, texts):
    return [TokenSequence(tuple(tokenizer(t)["input_ids"])) for t in texts]


@torch.inference_mode()
def _reference_hidden(folder, text):
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]


@pytest.mark.parametrize("name, pooling", [("bert-mean", "mean"), ("bert-cls", "cls"), ("qwen3", "last")])
@pytest.mark.parametrize("route", ["packed", "alone"])
def test_embeddings_equal_transformers_forward_with_the_same_pooling(pooling_models, monkeypatch, name, pooling,
                                                                     route):
    if route == "packed" and cpu_kernels() is None:
        pytest.skip("the packed route needs conveyor's C++ kernels")
    if route == "alone":  # the model's own forward, one sequence at a time
        monkeypatch.setattr("conveyor.core.backends.cpu.packed_pooling.cpu_kernels", lambda: None)
    folder = pooling_models(name)
    engine = _engine(folder, "embed")
    assert engine.model.pooling == pooling  # read from the checkpoint's sentence-transformers config
    assert ("packed" in engine.arithmetic()) == (route == "packed")
    got = _results(engine, _sequences(engine.tokenizer, TEXTS))
    for text, vector in zip(TEXTS, got):
        hidden = _reference_hidden(folder, text)
        pooled = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling]
        torch.testing.assert_close(vector, torch.nn.functional.normalize(pooled, dim=0), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_classifier_cross_encoder_and_reward_equal_transformers(pooling_models):
    folder = pooling_models("classifier")
    engine = _engine(folder, "classify")
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = engine.tokenizer
    for text, probs in zip(TEXTS, _results(engine, _sequences(tokenizer, TEXTS))):
        logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
        torch.testing.assert_close(probs, torch.softmax(logits, 0), rtol=1e-5, atol=1e-6)
    assert engine.labels == ("bug", "feature", "question")

    folder = pooling_models("cross-encoder")
    engine = _engine(folder, "score")
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    encoded = [engine.tokenizer(a, b) for a, b in PAIRS]  # (this tokenizer types the second text 1, as BERT's)
    pairs = [TokenSequence(tuple(e["input_ids"]), tuple(e["token_type_ids"])) for e in encoded]
    for (a, b), score in zip(PAIRS, _results(engine, pairs)):
        logit = model(**engine.tokenizer(a, b, return_tensors="pt")).logits[0]
        torch.testing.assert_close(score, torch.sigmoid(logit), rtol=1e-5, atol=1e-6)

    folder = pooling_models("reward")
    engine = _engine(folder, "reward")
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    for text, reward in zip(TEXTS, _results(engine, _sequences(engine.tokenizer, TEXTS))):
        logits = model(**engine.tokenizer(text, return_tensors="pt")).logits[0]
        torch.testing.assert_close(reward, logits, rtol=1e-5, atol=1e-5)


def test_an_embedding_model_scores_pairs_by_the_cosine_of_their_embeddings(pooling_models):
    engine = _engine(pooling_models("bert-mean"), "score")
    assert not engine.cross_encoder
    a, b, c = _sequences(engine.tokenizer, TEXTS[:3])
    out = next(o for step in engine.stream([PoolingRequest("0", (a, b, c), pairs=((0, 1), (0, 2)))]) for o in step)
    va, vb, vc = _results(engine, [a, b, c])
    torch.testing.assert_close(torch.tensor(out.results).flatten(), torch.stack([va @ vb, va @ vc]))


DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not native_bf16(), reason="this CPU has no native bf16 (AMX or AVX512-BF16)"))]


@KERNELS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, task", [("bert-mean", "embed"), ("qwen3", "embed"), ("classifier", "classify"),
                                        ("reward", "reward")])
def test_a_result_does_not_depend_on_the_sequences_packed_with_it(pooling_models, name, task, dtype):
    """Alone, packed in steps of every size, in another order: the same bits."""
    folder = pooling_models(name)
    alone = _engine(folder, task, EngineConfig(device="cpu", dtype=dtype, max_num_seqs=1))
    sequences = _sequences(alone.tokenizer, TEXTS)
    want = _results(alone, sequences)
    for budget, order in ((2048, 1), (40, -1), (17, 1)):
        packed = _engine(folder, task, EngineConfig(device="cpu", dtype=dtype, max_num_batched_tokens=budget))
        got = _results(packed, sequences[::order])[::order]
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"budget {budget}: the packing changed bits"
        assert packed.stats().num_forward_steps < len(TEXTS) or budget < 40


def test_dimensions_cut_then_normalize(pooling_models):
    engine = _engine(pooling_models("bert-cls"), "embed")
    sequences = _sequences(engine.tokenizer, TEXTS[:2])
    raw = _results(engine, sequences, normalize=False)
    cut = _results(engine, sequences, dimensions=16)
    for r, c in zip(raw, cut):
        assert c.shape == (16,)
        torch.testing.assert_close(c, torch.nn.functional.normalize(r[:16], dim=0))
        assert abs(float(r.norm()) - 1.0) > 1e-3  # (raw: not normalized)


def test_a_task_the_checkpoint_cannot_do_is_refused_before_its_weights_load(pooling_models):
    with pytest.raises(UnsupportedModel, match="sequence-classification head"):
        _engine(pooling_models("bert-mean"), "classify")
    with pytest.raises(UnsupportedModel, match="a sequence classifier"):
        _engine(pooling_models("classifier"), "embed")
    with pytest.raises(UnsupportedModel, match="3 labels"):
        _engine(pooling_models("classifier"), "score")


def test_a_sentence_transformers_module_conveyor_does_not_compute_refuses_the_model(pooling_models, tmp_path):
    import json
    import shutil

    folder = tmp_path / "dense"
    shutil.copytree(pooling_models("bert-mean"), folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModel, match="Dense"):
        _engine(folder, "embed")


@pytest.mark.parametrize(("architectures", "pooling_config", "task"), [
    (["BertModel"], False, "embed"),  # a base model without a head: what it can do is embed
    (["Qwen3Model"], False, "embed"),
    (["LlamaForCausalLM"], True, "embed"),  # a sentence-transformers pooling config says embed
    (["XLMRobertaForSequenceClassification"], False, "classify"),
    (["LlamaForCausalLM"], False, "generate"),
    (["GPT2LMHeadModel"], False, "generate"),  # ends in "Model", but has its LM head
    (["GPT2DoubleHeadsModel"], False, "generate"),
    ([], False, "generate"),
])
def test_task_auto_follows_the_checkpoints_architecture(architectures, pooling_config, task):
    from types import SimpleNamespace

    from conveyor.core.pooling_config import default_task

    assert default_task(SimpleNamespace(architectures=architectures), pooling_config) == task


def test_load_engine_refuses_a_pooling_method_for_generation_and_an_unresolved_task():
    with pytest.raises(ValueError, match="pooling 'mean'"):
        load_engine("no-such-folder", EngineConfig(device="cpu"), "generate", "mean")
    with pytest.raises(ValueError, match="task auto"):
        load_engine("no-such-folder", EngineConfig(device="cpu"), "auto")
