"""Shared setup for every test: where no CUDA device exists, Triton runs its kernels in its interpreter on
the CPU (TRITON_INTERPRET=1, read when a kernel is defined), so the cuda backend's kernels are tested here
too (set before any test module imports Triton); conveyor's modules compiled to bytecode once, before the
workers start; and a tiny random Llama folder built once per session."""

from __future__ import annotations

import compileall
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Compile conveyor's modules once (in the main process: the workers and every child process they start then
    load bytecode). Where PYTHONDONTWRITEBYTECODE is set, as on some CI images, no import writes it, and each of
    the suite's child Pythons that import conveyor (runs killed and resumed, scripts, Ray workers: about 60)
    compiled ~150 modules again: half a second of a core each."""
    if not hasattr(config, "workerinput"):
        for package in ("cli", "core", "io"):
            compileall.compile_dir(ROOT / package, quiet=1)


def _has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidiactl")


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _no_grammar_compiles_outlive_their_test():
    """A compile a test left running (a grammar given up) ends before the next test: a process whose finalizers run
    under one aborts, and it would take a core from the tests after it."""
    yield
    import threading

    for thread in threading.enumerate():
        if thread.name == "conveyor-grammar":
            thread.join(timeout=300)


def _tiny_llama(folder, adapt_tokenizer=None):
    """A 2-layer random Llama (hidden 64) saved in `folder` with the embedded SmolLM2 tokenizer, which
    `adapt_tokenizer` may change first."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from conveyor.core.model_loader import ensure_embedded

    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m-instruct"))
    assert tokenizer.chat_template, "the embedded tokenizer lost its chat template"
    if adapt_tokenizer is not None:
        adapt_tokenizer(tokenizer)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama (hidden 64) with the embedded SmolLM2 tokenizer and its chat template."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny-model"))


THINK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<think>' + message['reasoning_content'] + '</think>' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="session")
def think_model(tmp_path_factory):
    """`tiny_model` with a reasoning model's tokenizer: <think> and </think> added as tokens, and a chat template
    that writes them (qwen3's way: the output may open the reasoning)."""

    def with_think_tags(tokenizer):
        tokenizer.add_tokens(["<think>", "</think>"])
        tokenizer.chat_template = THINK_TEMPLATE

    return _tiny_llama(tmp_path_factory.mktemp("think-model"), with_think_tags)


@pytest.fixture(scope="session")
def pooling_models(tmp_path_factory):
    """The tiny pooling checkpoints of `pooling_models.py`, each built on first use: name -> its folder."""
    import pooling_models as built

    makers = {"bert-mean": lambda f: built.bert_embedder(f, "mean"), "bert-cls": lambda f: built.bert_embedder(f, "cls"),
              "qwen3": built.qwen3_embedder, "classifier": built.bert_classifier, "cross-encoder": built.cross_encoder,
              "reward": built.llama_reward}
    folders = {}

    def get(name):
        if name not in folders:
            folders[name] = makers[name](tmp_path_factory.mktemp(name))
        return folders[name]

    return get
