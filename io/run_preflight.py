"""What a run settles and checks before it opens its run directory: the engine config as it runs here, the task
`--task auto` resolves to, and every setting that can be refused without loading the model (the task's options,
the model for the task, the grammar, the reasoning parser, the chat options). Usage errors are SpecError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from conveyor.core import (
    DEFAULT_KV_CACHE_MEMORY,
    ConfigError,
    EngineConfig,
    ModelSource,
    Task,
    auto_task,
    check_before_loading,
    check_pooling_model,
    load_tokenizer,
    resolve_engine_config,
    resolve_reasoning,
)
from conveyor.io.errors import SpecError
from conveyor.io.records.readers import open_reader
from conveyor.io.run_checks import chat_option, check_chat_template, check_task_options, first_batch_task
from conveyor.io.run_spec import RunSpec

Say = Callable[[str], None]


def resolved_engine_config(given: EngineConfig, say: Say) -> EngineConfig:
    """The engine config as it runs here (device, sizes, dtype: the manifest records the dtype auto chose, so a
    resume where auto means another is refused instead of mixing two arithmetics)."""
    resolved, unused = resolve_engine_config(given)
    if "gpu_memory_utilization" in unused:
        say(f"--gpu-memory-utilization {given.gpu_memory_utilization} is not used: this run is on "
            f"{resolved.device}, where --kv-cache-memory ({given.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY}) sizes "
            "the KV cache")
    return resolved


def settled(spec: RunSpec, source: ModelSource, say: Say) -> RunSpec:
    """`spec` with --task auto resolved (recorded as resolved: a resume compares what ran): the task of the input's
    first batch line, else what the checkpoint (`source`, the spec's model) is for."""
    if spec.task is not Task.AUTO:
        return spec
    first = first_batch_task(spec, open_reader(spec.input.path, spec.input.format, spec.input.split,
                                               spec.input.max_record_bytes))
    spec = dataclasses.replace(spec, task=first or auto_task(source))
    if first is None and spec.task.pools:
        say(f"--task auto: {spec.model} is no generation model; this run does --task {spec.task}, what its "
            "checkpoint is for (give --task to choose)")
    return spec


def check_settings(spec: RunSpec, source: ModelSource, engine_config: EngineConfig) -> None:
    """Every setting refused before the model loads: an option the task does not use, a model that does not do the
    task, a grammar the engine cannot take, a reasoning parser for a model without think tags, a chat option for
    one without a chat template (its tokenizer read once for both)."""
    check_task_options(spec)
    if spec.task.pools:
        check_pooling_model(source, spec.task, spec.pooling.pooling)
    try:
        if not spec.task.pools:
            check_before_loading(source, engine_config, spec.sampling.grammar)
    except ConfigError as e:
        if e.field != "grammar":
            raise
        option = {"regex": "--regex", "choice": "--choice"}.get(spec.sampling.grammar.kind, "--json-schema")
        raise SpecError(f"{option}: {e}") from None
    tokenizer = load_tokenizer(source)[0] if spec.reasoning_parser is not None or chat_option(spec) else None
    if spec.reasoning_parser is not None:
        reasoning_of(spec, tokenizer)
    if tokenizer is not None:
        check_chat_template(spec, tokenizer)


def reasoning_of(spec: RunSpec, tokenizer):
    """The run's reasoning section (core.reasoning.Reasoning) for the model's tokenizer; SpecError naming
    --reasoning-parser where the model has none."""
    try:
        return resolve_reasoning(spec.reasoning_parser, tokenizer)
    except ConfigError as e:
        raise SpecError(e.named("--reasoning-parser")) from None
