"""`conveyor validate`'s run (`Run.validate`): every record parsed, templated, tokenized and checked as a run of
the spec would, none generated; no run directory, no engine (the sink is `validation.py`'s)."""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conveyor.core import ModelSource, Task, auto_task, check_model, load_pooling_tokenizer, load_tokenizer
from conveyor.io.records.pooling_builder import PoolingRequestBuilder
from conveyor.io.records.readers import open_reader
from conveyor.io.records.request_builder import RequestBuilder
from conveyor.io.records_run import run_records
from conveyor.io.run_checks import (
    check_chat_template,
    check_dimensions,
    check_named_fields,
    check_task_options,
    first_batch_task,
    no_chat_template_note,
)
from conveyor.io.run_spec import RunSpec
from conveyor.io.state.journal import Journal
from conveyor.io.validation import ValidationSink


@dataclass
class ValidationReport:
    sink: ValidationSink  # counts, the first errors and the prompt lengths
    max_model_len: int  # the model's context, in tokens


def validate_run(spec: RunSpec, show_errors: int, say: Callable[[str], None]) -> ValidationReport:
    """The records of `spec` built and checked; the first `show_errors` error messages kept."""
    reader = open_reader(spec.input.path, spec.input.format, spec.input.split, spec.input.max_record_bytes)
    check_named_fields(spec, reader)
    source = ModelSource.of(spec.model)
    if spec.task is Task.AUTO:  # as the run would resolve it
        spec = dataclasses.replace(spec, task=first_batch_task(spec, reader) or auto_task(source))
    check_task_options(spec)
    if not spec.task.pools:
        check_model(source)  # a model conveyor refuses, or whose weight files are not whole: refused here too
        tokenizer, limits = load_tokenizer(source)
        builder = RequestBuilder(tokenizer, spec.build, spec.sampling, limits, spec.model,
                                 priorities=spec.engine.schedule == "priority")
    else:
        tokenizer, limits, cross_encoder, size, prompt = load_pooling_tokenizer(source, spec.task, spec.pooling.pooling)
        check_dimensions(spec, size)
        builder = PoolingRequestBuilder(tokenizer, spec.build, spec.pooling, spec.task, limits, spec.model,
                                        cross_encoder, size, prompt)
    check_chat_template(spec, tokenizer)
    if not spec.task.pools:
        no_chat_template_note(spec, tokenizer, say)
    limit = spec.input.limit
    records = itertools.takewhile(lambda raw: limit is None or raw.index < limit, reader)
    with tempfile.TemporaryDirectory(prefix="conveyor-validate-") as scratch, \
            Journal(Path(scratch) / "ids.sqlite") as ids:
        sink = ValidationSink(tokenizer, show_errors, ids, spec.engine)
        run_records(records, builder, None, sink)
    return ValidationReport(sink, limits.max_model_len)
