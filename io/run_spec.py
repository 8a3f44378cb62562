"""RunSpec: everything a run is asked to do. It nests core's own configuration (`SamplingParams`: the run's sampling
defaults; `EngineConfig`) with io's (`BuildOptions`: records to requests; where the input, the output and the run's
state are); every default is a field default of one of these dataclasses, written once, and each checks itself
(`core.fields.check_fields`). `generation_config` derives the settings that decide the rows (drift) from the fields.
Pure Python.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from conveyor.core import (
    DEFAULT_MODEL,
    REASONING_PARSERS,
    TASKS,
    EngineConfig,
    PoolingOptions,
    SamplingParams,
    Task,
    check_fields,
    option,
    option_meta,
)
from conveyor.io.records.build_options import BuildOptions
from conveyor.io.records.readers.record import DEFAULT_MAX_RECORD_BYTES
from conveyor.io.records.readers.record import FORMATS as INPUT_FORMATS
from conveyor.io.records.structured_output import run_grammar
from conveyor.io.rows.sink_options import ON_ERROR, CommitPolicy
from conveyor.io.rows.writers import OUTPUT_FORMATS

# What building a spec takes besides the dataclasses below: the request options and the run's grammar.
__all__ = ["DEFAULT_ROWS_PER_FILE", "BuildOptions", "InputOptions", "OutputOptions", "PoolingOptions", "RunSpec", "StateOptions", "run_grammar"]
DEFAULT_ROWS_PER_FILE = 10_000  # records a part file holds where -o names a folder and --rows-per-file is not given
CONFIG_VERSION = 2  # of generation_config: which settings a manifest records (io/state/run_dir.Manifest)


@dataclass(frozen=True)
class InputOptions:
    path: str  # a file, a datasets folder, a hub dataset name, or "-" (stdin)
    format: str | None = option(None, name="input_format", choices=INPUT_FORMATS)  # None: from the extension
    split: str | None = option(None)  # a datasets split
    limit: int | None = option(None, minimum=0)  # only the first N records
    max_record_bytes: int = option(DEFAULT_MAX_RECORD_BYTES, size=True, positive=True)  # bigger: an error row

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class OutputOptions:
    path: str  # the output file, or a folder of part files (a path ending in "/", an existing folder)
    format: str | None = option(None, name="output_format", choices=OUTPUT_FORMATS)  # None: from the extension
    on_error: str = option(ON_ERROR[0], choices=ON_ERROR)  # bad records: an error row, no row, or stop
    # part files of N records each in the folder -o names (io/rows/parts.py); None: one file, unless -o is a folder
    rows_per_file: int | None = option(None, positive=True)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class StateOptions:
    """The run directory and when it commits."""

    run_dir: str | None = option(None)  # None: <output>.conveyor beside the output
    restart: bool = option(False, config_file=False)  # start over: the finished rows are set aside (RunDir.reset)
    # compute again the records whose error row the run itself made (a step failure, a grammar over its budget)
    retry_errors: bool = option(False, config_file=False)
    shard: str | None = option(None)  # "I/N": answer the records whose index is I mod N (io/state/shards.py)
    # commit every N finished rows (None: by time only), and at least every so many seconds
    checkpoint_every: int | None = option(CommitPolicy.every_rows, positive=True)
    checkpoint_seconds: float = option(CommitPolicy.every_seconds, positive=True, flag=False)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class RunSpec:
    input: InputOptions
    output: OutputOptions
    model: str = option(DEFAULT_MODEL)  # an embedded name, a model folder, a .gguf file or a hub id
    sampling: SamplingParams = field(default_factory=SamplingParams)  # the run's defaults; records override them
    build: BuildOptions = field(default_factory=BuildOptions)
    engine: EngineConfig = field(default_factory=EngineConfig)
    state: StateOptions = field(default_factory=StateOptions)
    # what the run computes: generate, or a pooling task (core.pooling_params); auto: a batch line's url, else what
    # the checkpoint is (a classifier: classify; an embedding model: embed; else generate). `Run` resolves it.
    task: Task = option(Task.AUTO, choices=TASKS)
    pooling: PoolingOptions = field(default_factory=PoolingOptions)  # the pooling tasks' settings
    profile: bool = option(False)  # split the engine's step time into its phases
    # core.reasoning.REASONING_PARSERS: the output's reasoning in its own column
    reasoning_parser: str | None = option(None, choices=REASONING_PARSERS)

    def __post_init__(self) -> None:
        check_fields(self)
        object.__setattr__(self, "task", Task(self.task))

    def generation_config(self, version: int = CONFIG_VERSION) -> dict[str, Any]:
        """What decides the output rows: a change of any of these under a run directory is drift. Every field of
        the spec is in it but the row-neutral ones (ROW_NEUTRAL) and the model (the manifest's own); a field added
        later is left out while it has its default, so a run started before it existed is no drift. `version`: as
        a manifest of that config version recorded it (without the settings it did not record yet). (The engine's
        dtype as it runs: `Run` resolves "auto" before it records this.)"""
        out: dict[str, Any] = {}
        for where, key, value, default, switch in self._fields():
            if where in ROW_NEUTRAL or (version < 2 and key in RECORDED_SINCE_VERSION_2):
                continue
            for name, recorded in _recorded(key, value, switch).items():
                if name in RECORDED_SINCE_FIRST or recorded != _recorded(key, default, switch).get(name):
                    out[name] = recorded
        if self.build.prompt_template is not None:  # (recorded with its template, also at its default)
            out["prompt_template_as"] = self.build.prompt_template_as
        return {**{k: out.pop(k) for k in RECORDED_SINCE_FIRST}, **out}

    def _fields(self):
        """("part.name", key, value, default, whether its option is a switch) of every field of the spec and its parts (but the input's and output's
        paths and the parts themselves; the run directory's options are no part of it). The key is the field's name,
        or "part.name" for a field that is no option (SamplingParams' own seed is not the run's)."""
        parts = {"input", "output", "sampling", "build", "engine", "state", "pooling"}
        for group, part in (("engine", self.engine), ("sampling", self.sampling), ("build", self.build),
                            ("input", self.input), ("output", self.output), ("pooling", self.pooling),
                            ("spec", self)):
            for f in dataclasses.fields(part):
                if f.name == "path" or (group == "spec" and f.name in parts):
                    continue
                where, meta = f"{group}.{f.name}", option_meta(f)
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default
                yield where, f.name if meta is not None else where, getattr(part, f.name), default, \
                    meta is not None and meta.switch


# The fields that never change a row (the exactness contract: a row is the same in any batch, on any schedule,
# with or without speculation), and the model (compared on its own). Every other field of the spec's parts is part of
# the generation config, so a new field that changes rows cannot be left out of drift. (The run directory's options,
# StateOptions, are not walked: where and how often a run commits changes no row.)
ROW_NEUTRAL = frozenset({
    # how the engine sizes and orders its work (the schedule is neutral but priority: see _recorded)
    *(f"engine.{name}" for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                                    "kv_cache_memory", "gpu_memory_utilization", "enable_prefix_caching",
                                    "max_waiting", "lookahead", "speculative", "num_speculative_tokens")),
    # where it runs: a resume on other kernels or another device is said (the manifest's arithmetic), not refused
    "engine.device", "engine.backend", "engine.fused_forward", "engine.cpu_isa",
    # the input's identity is its fingerprint; the output is written from the journal, in any format
    "input.format", "input.split", "input.limit", "output.format",
    "output.rows_per_file",
    # what a bad record's row is: its error row is in the journal under each (skip leaves it out of the output
    # when it is written, fail stops the run), so a run stopped by fail resumes with record or skip
    "output.on_error",
    "spec.profile",
    "spec.model",  # the manifest's own field
})
# The settings that decide error rows but were not recorded before config version 2: a run directory of version 1
# resumes without comparing them.
RECORDED_SINCE_VERSION_2 = frozenset({"max_record_bytes", "max_grammar_compile_s", "max_grammar_bytes"})
# Recorded by every run directory since the first, even at their defaults (and first, in this order).
RECORDED_SINCE_FIRST = ("dtype", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos",
                        "min_tokens", "system_prompt", "prompt_field", "messages_field", "id_field", "keep_fields")


def _recorded(key: str, value: Any, switch: bool) -> dict[str, Any]:
    """How field `key`'s value is recorded: {name: JSON value} (the grammar under its option's name, a switch as
    true or false, a chat template by its digest, tuples as lists)."""
    if key == "sampling.grammar":
        if value is None:
            return {}
        return {value.kind: json.loads(value.spec) if value.kind == "choice" else value.spec}
    if switch:  # the option is true or false; the field a number (None: off)
        return {key: value is not None}
    if key == "schedule":  # the other schedules give the same rows; this one reads a record's priority field
        return {key: value} if value == "priority" else {}
    if key == "task":  # recorded as it ran (`Run` resolves auto); a generation run's manifest as before it existed
        return {key: Task(value).value} if Task(value).pools else {}
    if key == "chat_template" and value is not None:
        return {key: hashlib.sha256(value.encode()).hexdigest()[:16]}
    return {key: list(value) if isinstance(value, tuple) else value}
