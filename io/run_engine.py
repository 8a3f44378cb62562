"""A run's engine, as its task asks: the generation or the pooling engine (`load_run_engine`), the builder of its
records' requests (`record_builder`), and what the summary says of the model it ran (`run_setup`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from conveyor.core import EngineConfig, ModelSource, load_engine
from conveyor.core.engine_api import InferenceEngine
from conveyor.io.records.pooling_builder import PoolingRequestBuilder
from conveyor.io.records.record_head import RecordBuilder
from conveyor.io.records.request_builder import RequestBuilder
from conveyor.io.run_checks import check_dimensions, no_chat_template_note
from conveyor.io.run_preflight import reasoning_of
from conveyor.io.run_report import RunSetup
from conveyor.io.run_spec import RunSpec


def load_run_engine(spec: RunSpec, source: ModelSource, config: EngineConfig) -> InferenceEngine:
    """The engine of the run's task, of the model `source` (`spec.model`'s), on `config` (the engine config as it
    runs here)."""
    return load_engine(source, config, spec.task, spec.pooling.pooling)


def record_builder(spec: RunSpec, engine, say: Callable[[str], None]) -> RecordBuilder:
    """The builder of the run's requests for `engine`; SpecError where a setting does not fit the model loaded
    (--dimensions above its embedding size)."""
    if spec.task.pools:
        check_dimensions(spec, engine.vector_size)
        return PoolingRequestBuilder(engine.tokenizer, spec.build, spec.pooling, spec.task, engine.limits, spec.model,
                                     engine.cross_encoder, engine.vector_size, engine.prompt)
    sampling = spec.sampling
    if spec.reasoning_parser is not None:
        sampling = dataclasses.replace(sampling, reasoning=reasoning_of(spec, engine.tokenizer))
    builder = RequestBuilder(engine.tokenizer, spec.build, sampling, engine.limits, spec.model,
                             priorities=spec.engine.schedule == "priority")
    no_chat_template_note(spec, engine.tokenizer, say)
    return builder


def run_setup(spec: RunSpec, engine: InferenceEngine | None) -> RunSetup:
    """The model as given and where it loaded from (a .gguf file, an embedded model's cache folder, a folder, or a
    hub id), and the dtype, backend and max_num_seqs it ran with (auto resolved)."""
    model, task = spec.model, spec.task
    if engine is None:
        return RunSetup(model, task=task)
    info = engine.info()
    if model.endswith(".gguf"):
        path = str(Path(model).expanduser().resolve())
    else:
        path = info.model_path or model
        if Path(path).expanduser().exists():
            path = str(Path(path).expanduser().resolve())
    return RunSetup(model, path, info.dtype, info.backend, info.max_num_seqs, task, info.cpu_isa, info.batch_invariant)
