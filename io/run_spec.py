"""RunSpec: everything a run is asked to do. It nests core's own configuration (`SamplingParams`: the run's sampling
defaults; `EngineConfig`) with io's (`BuildOptions`: records to requests; where the input, the output and the run's
state are); every default is a field default of one of these dataclasses, written once. Pure Python.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from conveyor.core import DEFAULT_MODEL, EngineConfig, SamplingParams
from conveyor.io.records.readers.record import DEFAULT_MAX_RECORD_BYTES
from conveyor.io.records.readers.record import FORMATS as INPUT_FORMATS
from conveyor.io.records.request_builder import TEMPLATE_AS, BuildOptions
from conveyor.io.records.request_options import run_grammar
from conveyor.io.rows.sink import ON_ERROR, CommitPolicy
from conveyor.io.rows.writers import OUTPUT_FORMATS

# What building a spec takes besides the dataclasses below: the choices of its options and the run's grammar.
__all__ = ["INPUT_FORMATS", "ON_ERROR", "OUTPUT_FORMATS", "TEMPLATE_AS", "BuildOptions", "InputOptions",
           "OutputOptions", "RunSpec", "StateOptions", "run_grammar"]


@dataclass(frozen=True)
class InputOptions:
    path: str  # a file, a datasets folder, a hub dataset name, or "-" (stdin)
    format: str | None = None  # readers.FORMATS; None: from the extension
    split: str | None = None  # a datasets split
    limit: int | None = None  # only the first N records
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES  # a bigger record is an error row, never parsed


@dataclass(frozen=True)
class OutputOptions:
    path: str  # the output file
    format: str | None = None  # writers.OUTPUT_FORMATS; None: from the extension
    on_error: str = ON_ERROR[0]  # bad records: "record" (an error row), "skip" (no row) or "fail" (stop)


@dataclass(frozen=True)
class StateOptions:
    """The run directory and when it commits."""

    run_dir: str | None = None  # None: <output>.conveyor beside the output
    restart: bool = False  # discard the run directory's state and start over
    shard: str | None = None  # "I/N": answer the records whose index is I mod N (io/state/shards.py)
    checkpoint_every: int | None = CommitPolicy.every_rows  # commit every N finished rows (None: by time only)
    checkpoint_seconds: float = CommitPolicy.every_seconds  # and at least this often


@dataclass(frozen=True)
class RunSpec:
    input: InputOptions
    output: OutputOptions
    model: str = DEFAULT_MODEL  # an embedded name, a model folder, a .gguf file or a hub id
    sampling: SamplingParams = field(default_factory=SamplingParams)  # the run's defaults; records override them
    build: BuildOptions = field(default_factory=BuildOptions)
    engine: EngineConfig = field(default_factory=EngineConfig)
    state: StateOptions = field(default_factory=StateOptions)
    profile: bool = False  # split the engine's step time into its phases
    reasoning_parser: str | None = None  # core.reasoning.REASONING_PARSERS: the output's reasoning in its own column

    def generation_config(self) -> dict[str, Any]:
        """What decides the output rows: a change of any of these under a run directory is drift. (The engine's
        dtype as it runs: `Run` resolves "auto" before it records this.)"""
        s, b = self.sampling, self.build
        grammar = s.grammar
        out: dict[str, Any] = {
            "dtype": self.engine.dtype, "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "top_k": s.top_k, "min_p": s.min_p, "seed": b.seed, "stop": list(s.stop), "ignore_eos": s.ignore_eos,
            "min_tokens": s.min_tokens, "system_prompt": b.system_prompt, "prompt_field": b.prompt_field,
            "messages_field": b.messages_field, "id_field": b.id_field, "keep_fields": list(b.keep_fields)}
        # The settings added later are left out while unset: a run started before they existed is no drift.
        later = {"regex": grammar.spec if grammar is not None and grammar.kind == "regex" else None,
                 "logprobs": s.logprobs, "prompt_logprobs": s.prompt_logprobs is not None,
                 "choice": json.loads(grammar.spec) if grammar is not None and grammar.kind == "choice" else [],
                 "json_schema": grammar.spec if grammar is not None and grammar.kind == "json_schema" else None,
                 "reasoning_parser": self.reasoning_parser, "chat_field": b.chat_field,
                 "prompt_template": b.prompt_template,
                 "prompt_template_as": b.prompt_template_as if b.prompt_template is not None else None,
                 "truncate_prompt_tokens": b.truncate_prompt_tokens,
                 "served_model_names": list(b.served_model_names),
                 "n": b.n if b.n != 1 else None,
                 "chat_template": hashlib.sha256(b.chat_template.encode()).hexdigest()[:16]
                 if b.chat_template is not None else None,
                 # (the other schedules give the same rows; this one reads a record's priority field)
                 "schedule": self.engine.schedule if self.engine.schedule == "priority" else None}
        out.update({k: v for k, v in later.items() if not (v is None or v is False or v == [])})
        return out
