"""A run's output written from its journal (and the temporary files a killed write left, removed): the whole output file in input order when every record has its row
(`write_whole`), or a folder's part files as their records all have rows (`PartRows`, given to `PartWriter`), and
what the summary says it wrote (`parts_written`). `check_input_unchanged` runs before either: rows are written only
over the input the run opened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from conveyor.core import Task
from conveyor.io.counts import counted
from conveyor.io.errors import InputChanged
from conveyor.io.records.readers import fingerprint, fingerprints_content
from conveyor.io.rows.parts import RUN_ID_KEY, PartWriter
from conveyor.io.rows.rows import SAMPLE_INDEX, output_rows, part_columns, vector_size, without_errors
from conveyor.io.rows.writers import UPLOAD_STAGING, write_output
from conveyor.io.run_spec import RunSpec
from conveyor.io.state.atomic import remove_leftovers
from conveyor.io.state.journal import Journal
from conveyor.io.state.paths import check_output_writable
from conveyor.io.storage import is_remote

_PART_COLUMNS_KEY = "part_columns"  # the journal's record of the optional columns of a part-file output


def _count(number: int, noun: str) -> str:
    """"1 row", "1,024 rows"."""
    return counted(number, noun, thousands=True)


def _model_name(spec: RunSpec) -> str:
    """The model the output names (an OpenAI result line's `model`)."""
    return (spec.build.served_model_names or (spec.model,))[0]


def write_whole(spec: RunSpec, journal: Journal, output_format: str, input_records: int, staging: str) -> None:
    """The output file, from the journal's rows of records [0, input_records) in input order; every record read has
    exactly one row, checked as they stream (not by the counters)."""
    skip_errors = spec.output.on_error == "skip"

    def rows():
        for row in journal.iter_rows_expecting(range(input_records)):
            if skip_errors:
                row = without_errors(row)
                if row is None:
                    continue
            yield row

    size = vector_size(journal.iter_rows()) if spec.task is Task.EMBED and output_format == "parquet" else None
    check_output_writable(spec.output.path)  # (its folder again: one removed while the run went is made anew)
    write_output(rows(), spec.output.path, output_format, spec.build.keep_fields, model_name=_model_name(spec),
                 optional=journal.columns() | ({SAMPLE_INDEX} if spec.build.n > 1 else set()), task=spec.task,
                 vector_size=size, staging=staging)


def parts_written(parts: PartWriter, input_records: int) -> str:
    """The parts finished (the last written) and what the summary says of them: those written here, and those an
    earlier process of the run wrote."""
    count, rows = parts.finish(input_records)
    now, rows_now = parts.written_here()
    folder = f"{parts.layout.folder}/"
    if now == count:
        return f"wrote {_count(count, 'part')} ({_count(rows, 'row')}) in {folder}"
    if now:
        return (f"wrote {_count(now, 'part')} ({_count(rows_now, 'row')}) in {folder}, beside the "
                f"{_count(count - now, 'part')} an earlier process of this run wrote ({_count(count, 'part')}, "
                f"{_count(rows, 'row')} in all)")
    return f"{folder} holds this run's {_count(count, 'part')} ({_count(rows, 'row')}), written earlier"


class PartRows:
    """The rows of one part file of a folder output, written as the output file would hold them, every part with
    the same columns (`columns`). `run_id` goes into each file's metadata (whose part it is)."""

    def __init__(self, spec: RunSpec, journal: Journal, output_format: str, staging: str, run_id: str,
                 say: Callable[[str], None]) -> None:
        self.spec, self.journal, self.output_format, self.staging = spec, journal, output_format, staging
        self.run_id, self.say = run_id, say

    def write(self, rows: Iterable[dict], path: str, first: int, stop: int) -> int:
        """Journal rows (input order) of the records [first, stop) into one part file at `path`; the rows written
        (an embedding's column is a fixed-size list where the part's vectors all have one size)."""
        spec = self.spec
        if not is_remote(path):  # (a folder removed while the run went is made anew)
            os.makedirs(os.path.dirname(path), exist_ok=True)
        if spec.output.on_error == "skip":
            rows = (row for row in map(without_errors, rows) if row is not None)
        size = None
        if spec.task is Task.EMBED and self.output_format == "parquet":
            size = vector_size(json.loads(text) for _, text in self.journal.row_texts_between(first, stop))
        return write_output(rows, path, self.output_format, spec.build.keep_fields, model_name=_model_name(spec),
                            optional=self.columns(first, stop), task=spec.task, vector_size=size,
                            staging=self.staging, file_metadata={RUN_ID_KEY: self.run_id})

    def columns(self, first: int, stop: int) -> tuple[str, ...]:
        """The optional columns of the part of records [first, stop): those the run's settings fill, fixed when its
        first part is written (the journal keeps them; every shard of a split run comes to the same), so that every
        part has the same columns; a part whose rows hold another (a record asked for it) has it too, and says so."""
        spec, journal = self.spec, self.journal
        stored = journal.meta_value(_PART_COLUMNS_KEY)
        if stored is not None:
            fixed = tuple(json.loads(stored))
        else:
            fixed = part_columns(spec.task, self._asked())
            journal.set_meta_value(_PART_COLUMNS_KEY, json.dumps(fixed))
        if set(part_columns(spec.task, journal.columns())) <= set(fixed):
            return fixed
        held = set()
        for _, text in journal.row_texts_between(first, stop):
            held.update(key for row in output_rows(json.loads(text)) for key in row)
        more = [c for c in part_columns(spec.task, held) if c not in fixed]
        if more:
            self.say(f"records {first} to {stop - 1} asked for {', '.join(more)}, which the run's settings do not "
                     "fill: their part has the column and other parts may not; read the folder with its columns "
                     "united (pyarrow's unify_schemas, DuckDB's union_by_name)")
        return part_columns(spec.task, {*fixed, *more})

    def _asked(self) -> set[str]:
        """The optional columns the run's settings fill."""
        spec, sampling = self.spec, self.spec.sampling
        asked = set()
        asked |= {"logprobs"} if sampling.logprobs is not None else set()
        asked |= {"prompt_logprobs", "prompt_logprob_sum"} if sampling.prompt_logprobs is not None else set()
        asked |= {SAMPLE_INDEX} if spec.build.n > 1 else set()
        asked |= {"reasoning"} if spec.reasoning_parser is not None else set()
        asked |= {"prompt_tokens_truncated"} if spec.build.truncate_prompt_tokens is not None else set()
        asked |= {"draft_tokens", "accepted_draft_tokens"} if spec.engine.speculative is not None else set()
        return asked


def remove_leftovers_of(run_dir: Path, output: str, folder: str | None, say: Callable[[str], None]) -> None:
    """The temporary files a process of the run left when it was killed mid-write: the output's (a file; a folder's
    part files: `PartWriter.open`) and those staged in the run directory for a store."""
    remove_leftovers(run_dir, lambda name: name == UPLOAD_STAGING)
    if folder is not None or output == "-" or is_remote(output):
        return
    directory, name = os.path.split(os.path.abspath(output))
    if remove_leftovers(directory, lambda target: target == name):
        say(f"removed the temporary file of {output} that an interrupted write left")


def check_input_unchanged(path: str, before: str, records_at_open: int | None, records_read: int,
                          parts: PartWriter | None) -> None:
    """Before any output is written: the input must be the one the run opened (its fingerprint `before` again, and
    as many records read as counted then). A file rewritten while the run read it may have given it records that
    are not there now (a line cut in half): InputChanged, no output, the state kept; the next run checks every row
    against the input as it is then, and computes those of records that changed. (An input without a fingerprint
    of its content, or stdin's copy in the run directory, is not checked.)"""
    if not fingerprints_content(before):
        return
    now = fingerprint(path)
    if now != before:
        why = f"its fingerprint was {before[:19]}... when the run opened and is {now[:19]}... now"
    elif records_at_open is not None and records_read != records_at_open:
        why = (f"it held {_count(records_at_open, 'record')} when the run opened, and the run read "
               f"{_count(records_read, 'record')} of it")
    else:
        return
    written = "no output was written" if parts is None else \
        f"its last parts were not written (those in {parts.layout.folder}/ are checked again with the rows)"
    raise InputChanged(f"the input {path} changed while this run read it ({why}), so its rows may answer records "
                       f"that are not in it: {written}; the run's rows are kept: run the same command again once the "
                       "input is settled, and every row is checked against the input as it is then (those of changed "
                       "records are computed again)")
