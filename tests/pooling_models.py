"""Tiny random-weight models for the pooling tasks, saved as checkpoints a user would have: a BERT embedder with a
sentence-transformers pooling config (5.x's layout, written here from its format, or saved by the installed
sentence-transformers itself), a BERT whose tokenizer keeps case, a Qwen3-shaped decoder, a BERT sequence classifier,
an XLM-RoBERTa-shaped cross-encoder and a Llama reward model. The encoders share a small WordPiece vocabulary written
here."""

from __future__ import annotations

import json
import string
from pathlib import Path

WORDS = ("the a an of to and in is was for on with as by at from it this that be are what which who how why when "
         "where capital city country france paris brazil brasilia germany berlin question answer number one two "
         "three four five six seven eight nine ten good bad great blender loud stars review product app crashes "
         "upload feature bug hello world assistant helpful unhelpful you are query passage document").split()


def _vocab(folder: Path) -> Path:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase, *string.digits,
             *string.punctuation, *WORDS, *(f"##{c}" for c in string.ascii_lowercase)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    return folder / "vocab.txt"


def bert_tokenizer(folder: Path):
    from transformers import BertTokenizerFast

    tokenizer = BertTokenizerFast(vocab=str(_vocab(folder)), model_max_length=128)
    tokenizer.save_pretrained(folder)
    return tokenizer


def _encoder_config(cls, tokenizer, **extra):
    return cls(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=128, max_position_embeddings=136, pad_token_id=tokenizer.pad_token_id, **extra)


def sentence_transformers():
    """The installed sentence-transformers (6 or newer), imported when a test first needs it rather than while every
    worker collects the tests (7 s of a core), or that test skipped where it is not installed."""
    import pytest

    return pytest.importorskip("sentence_transformers", minversion="6",
                               reason="sentence-transformers 6 or newer is not installed (pip install 'conveyor[dev]')")


def sentence_transformers_files(folder: Path, pooling: str, normalize: bool = True, max_seq_length: int = 128,
                                do_lower_case: bool = False):
    """sentence-transformers 5.x's files around the model in `folder`: its module paths, its pooling_mode_* flags."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, **{m: m == modes[pooling] for m in modes.values()},
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                  "do_lower_case": do_lower_case}))


def bert_model(folder: Path) -> Path:
    """A BERT base model (no head, no pooler) and its tokenizer, without sentence-transformers files."""
    import torch
    from transformers import BertConfig, BertModel

    tokenizer = bert_tokenizer(folder)
    torch.manual_seed(1)
    BertModel(_encoder_config(BertConfig, tokenizer), add_pooling_layer=False).save_pretrained(folder)
    return folder


def cased_bert_model(folder: Path) -> Path:
    """A BERT base model whose WordPiece tokenizer keeps case and knows the vocabulary's words ("paris" is one,
    "Paris" none), without sentence-transformers files."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    tokenizer = BertTokenizerFast(vocab=str(_vocab(folder)), do_lower_case=False, model_max_length=128)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(6)
    BertModel(_encoder_config(BertConfig, tokenizer), add_pooling_layer=False).save_pretrained(folder)
    return folder


def bert_embedder(folder: Path, pooling: str = "mean") -> Path:
    sentence_transformers_files(bert_model(folder), pooling)
    return folder


def saved_by_sentence_transformers(folder: Path, base: Path, pooling_mode, *between, normalize: bool = True,
                                   max_seq_length: int | None = None, include_prompt: bool = True,
                                   prompts: dict | None = None, default_prompt_name: str | None = None) -> Path:
    """The model in `base` saved into `folder` by the installed sentence-transformers' own `save` (its current
    layout): its Transformer, Pooling by `pooling_mode` (a name or a tuple of names), the modules `between`, and
    Normalize where `normalize`; its `prompts` and `default_prompt_name` where given."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(base), max_seq_length=max_seq_length)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode, include_prompt=include_prompt)
    modules = [transformer, pooling, *between, *([Normalize()] if normalize else [])]
    SentenceTransformer(modules=modules, device="cpu", prompts=prompts, default_prompt_name=default_prompt_name
                        ).save(str(folder))
    return folder


def bert_classifier(folder: Path) -> Path:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = bert_tokenizer(folder)
    torch.manual_seed(2)
    config = _encoder_config(BertConfig, tokenizer, num_labels=3,
                             id2label={0: "bug", 1: "feature", 2: "question"},
                             label2id={"bug": 0, "feature": 1, "question": 2})
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def cross_encoder(folder: Path) -> Path:
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    tokenizer = bert_tokenizer(folder)
    torch.manual_seed(3)
    XLMRobertaForSequenceClassification(_encoder_config(XLMRobertaConfig, tokenizer, num_labels=1)
                                        ).save_pretrained(folder)
    return folder


def _decoder_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    from conveyor.core.model_loader import ensure_embedded

    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m-instruct"))
    tokenizer.save_pretrained(folder)
    return tokenizer


def qwen3_model(folder: Path) -> Path:
    """A Qwen3-shaped base model (no LM head) and its tokenizer (with a chat template), without sentence-transformers
    files."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = _decoder_tokenizer(folder)
    torch.manual_seed(4)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, architectures=["Qwen3Model"])
    Qwen3Model(config).save_pretrained(folder)
    return folder


def qwen3_embedder(folder: Path) -> Path:
    """A Qwen3-shaped decoder saved as an embedding checkpoint: a base model (no LM head), last-token pooling."""
    sentence_transformers_files(qwen3_model(folder), "last", max_seq_length=512)
    return folder


def llama_reward(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = _decoder_tokenizer(folder)
    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    return folder
