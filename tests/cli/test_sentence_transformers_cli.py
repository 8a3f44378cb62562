"""`conveyor run --task embed` over checkpoints in the layouts sentence-transformers writes (the installed version's
own `save`, and 5.x's written from its format): the vectors of its `encode`, a text over the checkpoint's length
cut where it cuts it, its default prompt prepended where it prepends it (a cross-encoder's: the scores of its
`predict`); a module conveyor does not compute refused with exit 2, naming its class and its path; a pooling
conveyor does not compute refused unless --pooling replaces it, and a setting that changes the tokens refused, in
`run` and in `validate`."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import read_rows, run_in_process, write_jsonl
from pooling_models import (
    bert_model,
    cased_bert_model,
    cross_encoder,
    saved_by_sentence_transformers,
    sentence_transformers,
    sentence_transformers_files,
)

TEXTS = ["hello world", "what is the capital of france?", "a",
         "paris is the capital city of france and the answer to the question " * 2]  # (over 16 tokens)
F32 = ["--dtype", "float32"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return bert_model(tmp_path_factory.mktemp("bert"))


def _embeddings(folder, tmp_path, *options, out="out.jsonl", texts=TEXTS):
    source = write_jsonl(tmp_path / "texts.jsonl", [{"prompt": t} for t in texts])
    result = run_in_process("run", source, "-o", tmp_path / out, "--model", folder, "--task", "embed", *F32, *options)
    return result, (torch.tensor([r["embedding"] for r in read_rows(tmp_path / out)]) if result.code == 0 else None)


def _encode(folder, texts=TEXTS):
    return sentence_transformers().SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)


@pytest.mark.parametrize("layout", ["saved by sentence-transformers", "5.x"])
def test_embed_gives_the_vectors_of_sentence_transformers_encode(bert, tmp_path, layout):
    folder = tmp_path / "st"
    if layout == "5.x":
        bert_model(folder)
        sentence_transformers_files(folder, "mean", max_seq_length=16)
    else:  # (16 tokens: kept as the tokenizer's model_max_length)
        saved_by_sentence_transformers(folder, bert, "mean", max_seq_length=16)
    cut, got = _embeddings(folder, tmp_path, "--truncate-prompt-tokens", "auto")
    assert cut.code == 0, cut.err
    torch.testing.assert_close(got, _encode(folder), rtol=1e-5, atol=1e-5)
    whole, _ = _embeddings(folder, tmp_path, out="whole.jsonl")
    assert whole.code == 3 and "at most 16" in read_rows(tmp_path / "whole.jsonl")[3]["error"]


def test_a_module_conveyor_does_not_compute_exits_2_naming_its_class_and_path(bert, tmp_path):
    from sentence_transformers.sentence_transformer.modules import Dense

    folder = saved_by_sentence_transformers(tmp_path / "dense", bert, "mean", Dense(64, 16))
    for pooling in ([], ["--pooling", "mean"]):
        result, _ = _embeddings(folder, tmp_path, *pooling)
        assert result.code == 2, result.err
        assert "module 2 (2_Dense) is class Dense (type sentence_transformers.base.modules.dense.Dense)" in result.err
    checked = run_in_process("validate", tmp_path / "texts.jsonl", "--model", folder, "--task", "embed")
    assert checked.code == 2 and "class Dense" in checked.err


def test_pooling_replaces_a_pooling_conveyor_does_not_compute(bert, tmp_path):
    folder = saved_by_sentence_transformers(tmp_path / "max", bert, "max")
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "max"
    refused, _ = _embeddings(folder, tmp_path)
    assert refused.code == 2 and "asks for max pooling" in refused.err and "--pooling" in refused.err
    result, got = _embeddings(folder, tmp_path, "--pooling", "mean", out="mean.jsonl")
    assert result.code == 0, result.err
    mean = saved_by_sentence_transformers(tmp_path / "mean", bert, "mean")
    torch.testing.assert_close(got, _encode(mean), rtol=1e-5, atol=1e-5)
    (tmp_path / "mean.yaml").write_text("pooling: mean\n")  # (validate takes --pooling from a config file)
    for config, code in (([], 2), (["--config", tmp_path / "mean.yaml"], 0)):
        checked = run_in_process("validate", tmp_path / "texts.jsonl", "--model", folder, "--task", "embed", *config)
        assert checked.code == code, checked.err


PROMPTS = {"query": "query: ", "document": "passage: "}
FITS = "paris is the capital city of france and the answer to the question"  # 15 tokens; 17 with "query: "


@pytest.mark.parametrize("default", ["query", None])
def test_embed_prepends_the_default_prompt_as_encode_does_within_the_length_limit(tmp_path, default):
    """encode joins the default prompt and the text as they are and tokenizes them as one: the prompt's tokens count
    within max_seq_length (16 here), and a cut keeps them. A prompts dict without a default changes nothing."""
    folder = saved_by_sentence_transformers(tmp_path / "st", cased_bert_model(tmp_path / "cased"), "mean",
                                            max_seq_length=16, prompts=PROMPTS, default_prompt_name=default)
    texts = ["hello world", "What is the capital of France?", FITS, FITS + " " + FITS]
    tokenizer = sentence_transformers().SentenceTransformer(str(folder), device="cpu").tokenizer
    assert len(tokenizer(FITS)["input_ids"]) <= 16 < len(tokenizer(PROMPTS["query"] + FITS)["input_ids"])
    cut, got = _embeddings(folder, tmp_path, "--truncate-prompt-tokens", "auto", texts=texts)
    assert cut.code == 0, cut.err
    torch.testing.assert_close(got, _encode(folder, texts), rtol=1e-5, atol=1e-5)
    whole, _ = _embeddings(folder, tmp_path, out="whole.jsonl", texts=texts)
    errors = [row["error"] for row in read_rows(tmp_path / "whole.jsonl")]
    if default is None:
        longest = len(tokenizer(texts[3])["input_ids"])
        assert errors[:3] == [None] * 3 and f"an input is {longest} tokens but the model takes at most 16" in errors[3]
        return
    assert errors[:2] == [None] * 2 and whole.code == 3
    assert "an input is 17 tokens (with the default prompt the model's sentence-transformers config prepends) but " \
           "the model takes at most 16" in errors[2]
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hello world"}]}])
    chatted = run_in_process("run", chat, "-o", tmp_path / "chat.out.jsonl", "--model", folder, "--task", "embed")
    assert chatted.code == 3
    assert "prepends a default prompt (\"query: \") to every text, and a chat has no text to prepend it to" in \
        read_rows(tmp_path / "chat.out.jsonl")[0]["error"]


def test_score_puts_a_cross_encoders_default_prompt_before_each_pairs_first_text(tmp_path):
    model = sentence_transformers().CrossEncoder(str(cross_encoder(tmp_path / "base")), device="cpu",
                                                 prompts={"rank": "rank the: "}, default_prompt_name="rank")
    model.save(str(tmp_path / "ce"))
    pairs = [("what is the capital of france?", "the capital of france is paris."), ("hello", "hello world")]
    source = write_jsonl(tmp_path / "pairs.jsonl", [{"text_1": a, "text_2": b} for a, b in pairs])
    result = run_in_process("run", source, "-o", tmp_path / "out.jsonl", "--model", tmp_path / "ce", "--task", "score",
                            *F32)
    assert result.code == 0, result.err
    got = torch.tensor([row["score"] for row in read_rows(tmp_path / "out.jsonl")])
    expected = sentence_transformers().CrossEncoder(str(tmp_path / "ce"), device="cpu").predict(pairs)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_a_setting_that_changes_the_tokens_exits_2_naming_the_file_and_the_key(bert, tmp_path):
    folder = saved_by_sentence_transformers(tmp_path / "st", bert, "mean")
    config = folder / "sentence_bert_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "processing_kwargs": {"text": {"max_length": 8}}}))
    result, _ = _embeddings(folder, tmp_path)
    expected = f"{config}: processing_kwargs {{\"text\": {{\"max_length\": 8}}}}: sentence-transformers passes these"
    assert result.code == 2 and expected in result.err
    checked = run_in_process("validate", tmp_path / "texts.jsonl", "--model", folder, "--task", "embed")
    assert checked.code == 2 and expected in checked.err
