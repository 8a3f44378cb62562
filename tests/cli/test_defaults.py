"""Every default is written once: the `[default: ...]` that --help shows for each option, and the value a run gets
when neither a flag nor the config file sets it, are the fields' defaults in core and io."""

from __future__ import annotations

import re

import pytest
import typer

from conveyor.cli.app import app
from conveyor.cli.config import build_config
from conveyor.core import (
    DEFAULT_KV_CACHE_MEMORY,
    DEFAULT_MODEL,
    DEVICE_DEFAULTS,
    MIN_WAITING,
    EngineConfig,
    SamplingParams,
)
from conveyor.io.records.build_options import BuildOptions
from conveyor.io.records.readers.record import DEFAULT_MAX_RECORD_BYTES
from conveyor.io.run_spec import InputOptions, OutputOptions, PoolingOptions, RunSpec, StateOptions

CPU, GPU = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]
# option -> its default as the source holds it
SOURCES = {
    "--model": DEFAULT_MODEL,
    "--dtype": EngineConfig().dtype,
    "--device": EngineConfig().device,
    "--backend": EngineConfig().backend,
    "--cpu-isa": EngineConfig().cpu_isa,
    "--block-size": EngineConfig().block_size,
    "--max-num-seqs": f"{CPU['max_num_seqs']}; on a GPU {GPU['max_num_seqs']}",
    "--max-num-batched-tokens": f"{CPU['max_num_batched_tokens']}; on a GPU {GPU['max_num_batched_tokens']}",
    "--kv-cache-memory": f"{DEFAULT_KV_CACHE_MEMORY} on the CPU; on a GPU what --gpu-memory-utilization leaves",
    "--gpu-memory-utilization": GPU["gpu_memory_utilization"],
    "--max-tokens": SamplingParams().max_tokens,
    "--temperature": SamplingParams().temperature,
    "--top-p": SamplingParams().top_p,
    "--top-k": SamplingParams().top_k,
    "--min-p": SamplingParams().min_p,
    "--min-tokens": SamplingParams().min_tokens,
    "--repetition-penalty": SamplingParams().repetition_penalty,
    "--seed": BuildOptions().seed,
    "--n": BuildOptions().n,
    "--prompt-field": BuildOptions().prompt_field,
    "--messages-field": BuildOptions().messages_field,
    "--id-field": BuildOptions().id_field,
    "--prompt-template-as": BuildOptions().prompt_template_as,
    "--max-record-bytes": f"{DEFAULT_MAX_RECORD_BYTES >> 20}MiB",
    "--on-error": OutputOptions("x").on_error,
    "--executor": "local",
    "--max-grammar-compile-s": EngineConfig().max_grammar_compile_s,
    "--max-grammar-bytes": f"{EngineConfig().max_grammar_bytes >> 10}KiB",
    "--schedule": EngineConfig().schedule,
    "--lookahead": f"max(2 x --max-num-seqs, {MIN_WAITING})",
    "--speculative": "off" if EngineConfig().speculative is None else EngineConfig().speculative,
    "--num-speculative-tokens": EngineConfig(speculative="ngram").speculative_tokens,
    "--task": RunSpec(InputOptions("x"), OutputOptions("y")).task,
    "--pooling": "the checkpoint's sentence-transformers config, else last for decoders, cls for encoders"
    if PoolingOptions().pooling is None else PoolingOptions().pooling,
    "--dimensions": "all" if PoolingOptions().dimensions is None else PoolingOptions().dimensions,
}
SHOWN = re.compile(r"\\?\[default: ([^\]]*)\]")


def _shown_defaults(command: str) -> dict[str, str]:
    click_command = typer.main.get_command(app).commands[command]
    out = {}
    for param in click_command.params:
        found = SHOWN.search(getattr(param, "help", None) or "")
        if found:
            out[max(param.opts, key=len)] = found.group(1)
    return out


@pytest.mark.parametrize("command", ["run", "validate"])
def test_help_shows_each_default_from_its_source(command):
    shown = _shown_defaults(command)
    assert shown, "no option shows a default"
    unknown = set(shown) - set(SOURCES) - {"--num-workers"}  # (its default is the cluster's GPUs: not a value)
    assert not unknown, f"defaults shown with no source to check them against: {unknown}"
    for option, text in shown.items():
        if option in SOURCES:
            assert text == str(SOURCES[option]), (option, text, SOURCES[option])


def test_help_renders_the_defaults():
    from cli_helpers import run_in_process

    text = " ".join(run_in_process("run", "--help").out.replace("│", " ").split())  # (rich's table, unwrapped)
    for option in ("--max-tokens", "--block-size", "--model"):
        assert f"[default: {SOURCES[option]}]" in text, option


def test_an_option_neither_given_nor_in_the_config_takes_its_fields_default(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("temperature: 0\n")
    invocation = build_config({"input": "in.jsonl", "output": "out.jsonl", "max_tokens": 7}, str(config))
    spec = invocation.spec
    assert spec.sampling == SamplingParams(max_tokens=7, temperature=0.0)
    assert spec.engine == EngineConfig() and spec.build == BuildOptions() and spec.state == StateOptions()
    assert spec.model == DEFAULT_MODEL and spec.output == OutputOptions("out.jsonl")
    assert spec.input.max_record_bytes == DEFAULT_MAX_RECORD_BYTES
