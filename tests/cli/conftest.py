"""Fixtures for the CLI tests: a tiny random Llama folder built once per session, and torch kept to
one thread while these modules run (several torch threads on a shared 2-core runner spin against
each other and make every step 10-20x slower; child processes get OMP_NUM_THREADS=1 likewise)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_child_outlives_its_test():
    from cli_helpers import Child

    yield
    Child.kill_all()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama (hidden 64) with the embedded SmolLM2 tokenizer and its chat template."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from conveyor.core.model_loader import ensure_embedded

    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m-instruct"))
    assert tokenizer.chat_template, "the embedded tokenizer lost its chat template"
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
