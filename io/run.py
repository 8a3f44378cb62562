"""Run: one run of a RunSpec, from its run directory to its output file.

    run = Run(spec, command="conveyor run ...", say=print)
    try:
        run.open()                      # checks, run directory, the records left: usage errors here, before the model
        run.load_engine()
        result = run.execute(should_stop, on_progress)   # on_progress reads run.progress()
    finally:
        run.close()

A Run owns the run directory (lock, manifest, drift), the resume-aware record stream (`pending.py`), the sink and
journal and the final write; its report (`RunResult`, `RunSummary`) is `run_report.py`'s, its progress
`run_progress.py`'s. `conveyor run`, each shard of `--shard`, each Ray worker (`merge_when_done=False`: the driver
merges) and `conveyor validate` (`Run.validate`, `validate_run.py`: no run directory, no engine) build one from a
spec; a shard's finish and the split run's driver are `split_run.py`'s. The CLI only turns options into the spec
and handles signals, progress and exit codes. Records stream in lazily; finished rows go to the journal, committed
every `checkpoint_every` rows or `checkpoint_seconds`; when every record has a row, the output is written from the
journal in input order and appears atomically. A stop (`should_stop`) commits what finished.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from conveyor.core import (
    DEFAULT_KV_CACHE_MEMORY,
    ConfigError,
    EngineConfig,
    auto_task,
    check_before_loading,
    check_pooling_model,
    load_engine,
    load_pooling_engine,
    load_tokenizer,
    model_fingerprint,
    resolve_engine_config,
    resolve_reasoning,
)
from conveyor.io.counts import counted
from conveyor.io.errors import InputChanged, SpecError
from conveyor.io.records.pending import PendingRecords
from conveyor.io.records.pooling_builder import PoolingRequestBuilder
from conveyor.io.records.readers import fingerprint, fingerprints_content, open_reader
from conveyor.io.records.readers.spool import spool
from conveyor.io.records.request_builder import RequestBuilder
from conveyor.io.records_run import run_records
from conveyor.io.rows.parts import RUN_ID_KEY, STALE_KEY, PartLayout, PartOwner, PartWriter
from conveyor.io.rows.rows import SAMPLE_INDEX, output_rows, part_columns, vector_size, without_errors
from conveyor.io.rows.sink import BadRecordStop, JournalSink, RunTotals
from conveyor.io.rows.sink_options import CommitPolicy
from conveyor.io.rows.writers import UPLOAD_STAGING, write_output
from conveyor.io.run_checks import (
    chat_option,
    check_chat_template,
    check_dimensions,
    check_named_fields,
    check_output,
    check_task_options,
    first_batch_task,
    no_chat_template_note,
    output_folder,
)
from conveyor.io.run_progress import RunProgress, run_progress
from conveyor.io.run_rebase import input_entries, input_kept_fields, rows_of_other_records
from conveyor.io.run_report import Outcome, RunResult, RunSetup
from conveyor.io.run_spec import CONFIG_VERSION, DEFAULT_ROWS_PER_FILE, RunSpec
from conveyor.io.split_run import base_run_dir, finish_shard
from conveyor.io.state.atomic import remove_leftovers
from conveyor.io.state.journal import Journal
from conveyor.io.state.journal_rebase import rebase as rebase_journal
from conveyor.io.state.journal_rebase import refresh_kept_fields
from conveyor.io.state.paths import check_output_writable, check_run_paths
from conveyor.io.state.run_dir import SPOOL_FILE, STATE_FILES, DriftError, Manifest, RunDir, settings_key
from conveyor.io.state.run_id import run_id
from conveyor.io.state.run_info import read_run_info, write_run_info
from conveyor.io.state.shards import Shard, clear_done, mark_done, shard_dir
from conveyor.io.storage import is_remote
from conveyor.io.validate_run import ValidationReport, validate_run

try:
    TOOL_VERSION = version("conveyor")
except PackageNotFoundError:  # run from a source tree that was never installed
    TOOL_VERSION = "unknown"

__all__ = ["BadRecordStop", "Run"]


def _piped(input_fingerprint: str) -> bool:
    """Whether the input is stdin or a pipe (`fingerprint` names them so): read once, so copied before a run."""
    return input_fingerprint == "stdin" or input_fingerprint.startswith("stream:")


_PART_COLUMNS_KEY = "part_columns"  # the journal's record of the optional columns of a part-file output


def _count(number: int, noun: str) -> str:
    """"1 row", "1,024 rows"."""
    return counted(number, noun, thousands=True)


def _without_keep_fields(manifest: Manifest) -> Manifest:
    """`manifest` without --keep-fields, an output-only setting (the rows keep the fields; a change reads them again)."""
    return dataclasses.replace(manifest, generation_config={k: v for k, v in manifest.generation_config.items()
                                                            if k != "keep_fields"})


class Run:
    """One run of `spec`. `command` is how to resume it (`conveyor status` shows it); `say` gets the notes a user
    should read (a run that starts over, a resume with other kernels, an option that does nothing here)."""

    def __init__(self, spec: RunSpec, command: str | None = None, merge_when_done: bool = True,
                 say: Callable[[str], None] = lambda note: None) -> None:
        self.spec = spec
        self.command = command
        self.merge_when_done = merge_when_done  # a shard: the last to finish writes the output
        self.say = say
        self.started = time.monotonic()  # the summary's wall_s counts from here
        self.totals = RunTotals()
        self.engine = None  # core's Engine, once loaded
        self.has_pending = True  # whether a record still needs a row (read by `open`); without one no model is loaded
        self.engine_config: EngineConfig = spec.engine  # as it runs here, once `open` resolved it
        self.partials: dict[int, dict] = {}  # the journal's partials, once `open` read them
        self.shard: Shard | None = None  # --shard: this run answers the records whose index is I mod N
        self.output_format = ""
        self.arithmetic: str | None = None  # the backend's arithmetic the rows so far were computed with
        self.journal: Journal | None = None
        self.run_dir: RunDir | None = None
        self._token_texts: dict[int, str] = {}
        self._spool: Path | None = None  # stdin or a pipe, copied into the run directory (`open`)
        self._model_fingerprint: str | None = None  # the content of the model's files (`open`)
        self._input_fingerprint = ""  # the input's, as the run opened (`open`): compared again at its end
        self.input_selection: dict[str, str] = {}  # how the input is read (the reader's `selection`: `open`)
        self._records_at_open: int | None = None  # the input's records (after --limit) as counted by `open`
        self.parts: PartWriter | None = None  # a part-file output's parts (`open`)

    @property
    def input_records(self) -> int:
        """Input records read so far, every shard's (after --limit)."""
        return self.records.input_records

    # -- setup: every check that can fail does so here, before any model work --------------------------------

    def open(self) -> None:
        spec = self.spec
        self.engine_config = self._resolved_engine_config()
        self.output_format = check_output(spec)
        folder = output_folder(spec)
        if spec.task == "auto":  # recorded as resolved: a resume compares what ran
            first = first_batch_task(spec, open_reader(spec.input.path, spec.input.format, spec.input.split,
                                                       spec.input.max_record_bytes))
            self.spec = spec = dataclasses.replace(spec, task=first or auto_task(spec.model))
            if first is None and spec.task != "generate":
                self.say(f"--task auto: {spec.model} is no generation model; this run does --task {spec.task}, "
                         "what its checkpoint is for (give --task to choose)")
        check_task_options(spec)
        if spec.task != "generate":
            check_pooling_model(spec.model, spec.task, spec.pooling.pooling)
        try:
            if spec.task == "generate":
                check_before_loading(spec.model, self.engine_config, spec.sampling.grammar)
        except ConfigError as e:
            if e.field != "grammar":
                raise
            option = {"regex": "--regex", "choice": "--choice"}.get(spec.sampling.grammar.kind, "--json-schema")
            raise SpecError(f"{option}: {e}") from None
        # Refused before the model loads: a reasoning parser for a model without think tags, a chat option for one
        # without a chat template (its tokenizer read once for both).
        tokenizer = load_tokenizer(spec.model)[0] if spec.reasoning_parser is not None or chat_option(spec) else None
        if spec.reasoning_parser is not None:
            self._reasoning(tokenizer)
        if tokenizer is not None:
            check_chat_template(spec, tokenizer)
        run_dir = base_run_dir(spec)  # (a shard's own is a folder inside it)
        if spec.state.shard is not None:
            self.shard = Shard.parse(spec.state.shard)
            if spec.input.path == "-":
                raise SpecError("--shard: every shard reads the whole input, so it must be a file or dataset, not "
                                "stdin")
            run_dir = shard_dir(run_dir, self.shard)
        check_run_paths(spec.input.path, spec.output.path, run_dir, STATE_FILES, folder=folder is not None)
        reader = open_reader(spec.input.path, spec.input.format, spec.input.split, spec.input.max_record_bytes)
        check_named_fields(spec, reader)
        check_output_writable(folder if folder is not None else spec.output.path, folder=folder is not None)
        self.run_dir = RunDir(run_dir)
        self.run_dir.acquire_lock()
        self._remove_leftovers(folder)
        self._model_fingerprint = model_fingerprint(spec.model)
        self.input_selection = reader.selection
        fresh = self._manifest(None, fingerprint(spec.input.path))  # (a file's hash: read once)
        if spec.state.restart:
            rows, aside = self.run_dir.reset(set_aside=True, keep_key=settings_key(fresh))
            if rows and aside is not None:
                self.say(f"--restart: the {_count(rows, 'finished row')} of the earlier run (other settings) are set "
                         f"aside in {aside}; a later run with its settings takes them back")
            elif rows:
                self.say(f"--restart: the {_count(rows, 'finished row')} of the earlier run are dropped; every record "
                         "is computed again")
        stored = self.run_dir.load_manifest()
        if stored is None:
            taken = self.run_dir.take_back(fresh)
            if taken:
                stored = self.run_dir.load_manifest()
                self.say(f"took back the {_count(taken, 'row')} of an earlier run with these settings, which --restart "
                         "had set aside")
        manifest = fresh if stored is None else self._manifest(stored, fresh.input_fingerprint)
        if _piped(manifest.input_fingerprint) and (stored is None or fingerprints_content(stored.input_fingerprint)):
            # stdin or a pipe, read once: copied to the run directory first, it is read like a file (and a rerun
            # over one that changed reuses what it can). A run started before copies were made goes on without.
            self._spool = self.run_dir.path / SPOOL_FILE
            manifest = dataclasses.replace(manifest, input_fingerprint=spool(spec.input.path, self._spool))
            reader = open_reader(str(self._spool), reader.format, None, spec.input.max_record_bytes)
        # Every row keeps the digest of the record it answers, and is reused only for that record: a rerun over an
        # input that changed reuses the rows whose records are still there (journal_rebase.py), and every resume
        # checks the rows against the records read now (`_check_rows`). stdin in a run started before it was copied
        # can be read once only: its records are checked one by one as they stream (PendingRecords).
        reader.with_digests = True
        read_once = _piped(manifest.input_fingerprint)
        self._input_fingerprint = manifest.input_fingerprint

        def carry_over(journal: Journal, drift: DriftError) -> bool:
            return self._carry_over(journal, drift, stored, manifest, reader)

        self.journal, note = self.run_dir.open_journal(manifest, stored, carry_over)
        if note:
            self.say(note)
        if self.shard is not None:
            clear_done(self.run_dir.path)  # said again when this shard has every row
        t = self.totals
        if spec.state.retry_errors:
            self.journal.set_meta_value(STALE_KEY, "1")
            t.retried_errors = self.journal.forget_run_errors()
            self.say(f"--retry-errors: {_count(t.retried_errors, 'record')} whose error row the run made "
                     f"{'is' if t.retried_errors == 1 else 'are'} computed again" if t.retried_errors else
                     "--retry-errors: no error row of the run's own making to retry")
        if t.reuse is None and not read_once and self.journal.num_committed():
            self._check_rows(reader)
        if folder is not None:
            self._open_parts(folder, rows_changed=bool(t.reuse) or bool(t.retried_errors))
        self.partials = self.journal.partials()  # records an earlier process left generating: they continue
        t.resumed_from = t.done = self.journal.num_committed()
        t.errors = self.journal.num_errors()
        t.ok = t.done - t.errors
        t.samples = self.journal.num_samples()
        count = reader.count()
        if count is not None and spec.input.limit is not None:
            count = min(count, spec.input.limit)
        t.total = count if count is None or self.shard is None else self.shard.num_records(count)
        self._records_at_open = count
        self.records = PendingRecords(reader, self.journal, spec.input.path, spec.input.limit, self.shard,
                                      checked=read_once)
        self._pending = iter(self.records)
        # The first pending record is read now, before the model loads: without one the model is not needed (the
        # output is written from the journal), and for an input checked by digests a different one is refused at once.
        first = next(self._pending, None)
        self.has_pending = first is not None
        self._pending = itertools.chain([first] if first is not None else [], self._pending)
        self.arithmetic = read_run_info(self.run_dir.path).get("arithmetic") if t.resumed_from else None
        write_run_info(self.run_dir.path, t.total, self.command, self.arithmetic)

    def _remove_leftovers(self, folder: str | None) -> None:
        """The temporary files a process of this run left when it was killed mid-write: the output's (a file; a
        folder's part files: `PartWriter.open`) and those staged in the run directory for a store."""
        remove_leftovers(self.run_dir.path, lambda name: name == UPLOAD_STAGING)
        output = self.spec.output.path
        if folder is not None or output == "-" or is_remote(output):
            return
        directory, name = os.path.split(os.path.abspath(output))
        if remove_leftovers(directory, lambda target: target == name):
            self.say(f"removed the temporary file of {output} that an interrupted write left")

    def _open_parts(self, folder: str, rows_changed: bool) -> None:
        """The part files of a folder output: checked against the journal, and those whose records all have rows
        written (a process killed after a commit left them)."""
        spec = self.spec
        if not is_remote(folder):
            Path(folder).mkdir(parents=True, exist_ok=True)
        layout = PartLayout(folder, spec.output.rows_per_file or DEFAULT_ROWS_PER_FILE,
                            "parquet" if self.output_format == "parquet" else "jsonl", self.shard)
        base = base_run_dir(spec).resolve()
        self.parts = PartWriter(self.journal, layout, PartOwner(run_id(base), str(base)), self._write_rows, self.say,
                                spec.input.limit)
        self.parts.open(restart=spec.state.restart, rows_changed=rows_changed)
        self.parts.write_ready()

    def _carry_over(self, journal: Journal, drift: DriftError, stored: Manifest, manifest: Manifest, reader) -> bool:
        """The journal of a run whose input or output-only settings changed, carried over: rows of the records still
        there, unchanged, kept (`_rebase`), and their kept fields read again where --keep-fields changed. False where
        something else changed (drift: the model, a setting that decides rows)."""
        old_keep = tuple(stored.generation_config.get("keep_fields", ()))
        if "model" in drift.changed or "generation_config" in _without_keep_fields(manifest).changes_since(
                _without_keep_fields(stored))[0]:
            return False
        spec = self.spec
        if "input" in drift.changed:
            if _piped(stored.input_fingerprint) or _piped(manifest.input_fingerprint):  # (read once: not matched)
                return False
            why = "the input changed since the last run" if drift.detail.startswith("the input file changed") \
                else drift.detail.split(";")[0]
            if not self._rebase(journal, reader, why):
                raise DriftError(self.run_dir.path, drift.changed, f"{drift.detail}, and its rows were written by an "
                                 "earlier release, which kept no digest of the records they answer, so none can be "
                                 "reused")
        if old_keep != spec.build.keep_fields:
            refresh_kept_fields(journal, input_kept_fields(reader, spec.build.keep_fields, shard=self.shard),
                                old_keep)
            self.say(f"--keep-fields changed ({', '.join(old_keep) or 'none'} -> "
                     f"{', '.join(spec.build.keep_fields) or 'none'}): the rows are kept, their kept fields read again "
                     "from the input")
        return True

    def _check_rows(self, reader) -> None:
        """A resume over an input whose fingerprint did not change: its rows are still checked against the records
        read now (a file rewritten while a run read it and restored, a selection an earlier release did not record),
        and where some answer other records, the journal is carried over to the input as it is (`_rebase`)."""
        other = rows_of_other_records(self.journal, reader, self.spec.input.limit)
        if not other:
            return
        why = (f"{_count(other, 'row')} of this run answer{'s' if other == 1 else ''} records that are not the ones "
               "read now at their place (the input was changed, or read another way, after they were computed), and "
               "a row is reused only for its own record")
        if not self._rebase(self.journal, reader, why):
            raise DriftError(self.run_dir.path, ("input",), f"{_count(other, 'row')} of this run answer records that "
                             "are not in the input as it is now, and its rows were written by an earlier release, "
                             "which kept no digest of the records they answer, so none can be reused")

    def _rebase(self, journal: Journal, reader, why: str) -> bool:
        """The journal carried over to the input as it is now (the records this run answers: within --limit, this
        shard's); the counts said and kept for the summary. False where its rows cannot be matched."""
        spec = self.spec
        journal.set_meta_value(STALE_KEY, "1")  # (its parts are checked against the rows: a kill in between too)
        reuse = rebase_journal(journal, input_entries(reader, spec.build.id_field, spec.input.limit, self.shard))
        if reuse is None:
            return False
        self.totals.reuse = reuse.to_json()
        self.say(f"{why}: {reuse.describe()}")
        if reuse.moved_without_id:
            one = reuse.moved_without_id == 1
            self.say(f"{_count(reuse.moved_without_id, 'record')} without an id {'is' if one else 'are'} at another "
                     "index than before (a record was inserted or removed ahead): a seed follows its record's index, "
                     f"so {'it is' if one else 'they are'} computed again; "
                     "give records an id (--id-field) to reuse their rows wherever they move")
        return True

    def _resolved_engine_config(self) -> EngineConfig:
        """The engine config as it runs here (device, sizes, dtype: the manifest records the dtype auto chose, so a
        resume where auto means another is refused instead of mixing two arithmetics)."""
        given = self.spec.engine
        resolved, unused = resolve_engine_config(given)
        if "gpu_memory_utilization" in unused:
            self.say(f"--gpu-memory-utilization {given.gpu_memory_utilization} is not used: this run is on "
                     f"{resolved.device}, where --kv-cache-memory ({given.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY}) "
                     "sizes the KV cache")
        return resolved

    def _manifest(self, stored: Manifest | None, input_fingerprint: str) -> Manifest:
        """This run's manifest; its generation config as the stored manifest's version recorded it (a run directory
        started before a setting was recorded resumes: the setting is left out of the comparison)."""
        spec = dataclasses.replace(self.spec, engine=self.engine_config)
        version = CONFIG_VERSION if stored is None else min(stored.config_version, CONFIG_VERSION)
        return Manifest(input_fingerprint=input_fingerprint, input_path=spec.input.path, model=spec.model,
                        generation_config=spec.generation_config(version), tool_version=TOOL_VERSION,
                        created_at=time.time(), output_path=spec.output.path, output_format=self.output_format,
                        config_version=version, model_fingerprint=self._model_fingerprint,
                        input_selection=self.input_selection)

    def load_engine(self) -> None:
        start = time.monotonic()
        spec = self.spec
        if spec.task != "generate":
            self._load_pooling()
            self.totals.load_s = time.monotonic() - start
            return
        self.engine = load_engine(self.spec.model, self.engine_config)
        self._check_arithmetic(self.engine.arithmetic())
        if self.spec.profile:
            self.engine.enable_profiling()
        self.totals.load_s = time.monotonic() - start
        sampling = self.spec.sampling
        if self.spec.reasoning_parser is not None:
            sampling = dataclasses.replace(sampling, reasoning=self._reasoning(self.engine.tokenizer))
        self.builder = RequestBuilder(self.engine.tokenizer, self.spec.build, sampling, self.engine.limits,
                                      self.spec.model, priorities=self.spec.engine.schedule == "priority")
        no_chat_template_note(self.spec, self.engine.tokenizer, self.say)

    def _load_pooling(self) -> None:
        """The pooling engine of the run's task, and the builder of its requests."""
        spec = self.spec
        self.engine = engine = load_pooling_engine(spec.model, spec.task, self.engine_config, spec.pooling.pooling)
        self._check_arithmetic(engine.arithmetic())
        if spec.profile:
            engine.enable_profiling()
        check_dimensions(spec, engine.vector_size)
        self.builder = PoolingRequestBuilder(engine.tokenizer, spec.build, spec.pooling, spec.task, engine.limits,
                                             spec.model, engine.cross_encoder, engine.vector_size, engine.prompt)

    def _reasoning(self, tokenizer):
        """The run's reasoning section (core.reasoning.Reasoning) for the model's tokenizer; SpecError naming
        --reasoning-parser where the model has none."""
        try:
            return resolve_reasoning(self.spec.reasoning_parser, tokenizer)
        except ConfigError as e:
            raise SpecError(e.named("--reasoning-parser")) from None

    def _check_arithmetic(self, now: str) -> None:
        """Say so where this run's rows so far were computed with other kernels or another device (a resume on
        another machine): the rest are right, but need not be bitwise an uninterrupted run's."""
        before = self.arithmetic
        if before is not None and before != now:
            self.say(f"the first {_count(self.totals.resumed_from, 'row')} of this run were computed with {before}; it "
                     f"resumes with {now}, so the rest need not equal an uninterrupted run's bit for bit (rerun with "
                     "--restart, or resume on the machine it started on, to keep one arithmetic)")
        self.arithmetic = now
        write_run_info(self.run_dir.path, self.totals.total, self.command, now)

    # -- the run ---------------------------------------------------------------------------------------------

    def execute(self, should_stop: Callable[[], bool] = lambda: False,
                on_progress: Callable[[], None] | None = None) -> RunResult:
        """Every pending record through the engine into the journal (`run_records`), then the output. Raises
        BadRecordStop at the first bad record under --on-error fail (what finished is committed)."""
        if self.engine is None:  # every record already had a row (`has_pending` false): only the output is written
            if self.has_pending:
                if should_stop():  # asked to stop before the model loaded (the caller skipped the load)
                    return self._result(Outcome.STOPPED, "run the same command again to resume")
                raise RuntimeError("Run.execute: records are pending and no engine was loaded (call load_engine)")
            return self._finish()
        state = self.spec.state
        sink = JournalSink(self.journal, CommitPolicy(state.checkpoint_every, state.checkpoint_seconds),
                           self.spec.output.on_error, self._token_text, self.totals, self.engine.in_flight,
                           self.partials, self.spec.task, self.engine.labels,
                           after_commit=self.parts.write_ready if self.parts is not None else None)
        records = self._noting_keep_fields(self._pending)
        if run_records(records, self.builder, self.engine, sink, should_stop, on_progress) == "stopped":
            return self._result(Outcome.STOPPED, "run the same command again to resume")
        return self._finish()

    def progress(self) -> RunProgress:
        """Where the run is now: records done of the total, the token rate, the engine's queue, the ETA."""
        return run_progress(self.totals, self.engine.stats() if self.engine else None, self.spec.build.n,
                            self.spec.sampling.max_tokens, pooling=self.spec.task != "generate")

    def _token_text(self, token: int) -> str:
        """A token's own text, as logprobs name it (decoded alone, special tokens kept); cached."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.engine.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def _finish(self) -> RunResult:
        spec = self.spec
        self._check_input_unchanged()
        skip_errors = spec.output.on_error == "skip"
        outcome = Outcome.SOME_ERRORS if self.totals.errors and not skip_errors else Outcome.OK
        if self.parts is not None:
            count, rows = self.parts.finish(self.input_records)
            now, rows_now = self.parts.written_here()
            folder = f"{self.parts.layout.folder}/"
            if now == count:
                where = f"wrote {_count(count, 'part')} ({_count(rows, 'row')}) in {folder}"
            elif now:
                where = (f"wrote {_count(now, 'part')} ({_count(rows_now, 'row')}) in {folder}, beside the "
                         f"{_count(count - now, 'part')} an earlier process of this run wrote ({_count(count, 'part')},"
                         f" {_count(rows, 'row')} in all)")
            else:
                where = f"{folder} holds this run's {_count(count, 'part')} ({_count(rows, 'row')}), written earlier"
            if self.shard is not None:
                mark_done(self.run_dir.path, self.shard, self.input_records, spec.output.on_error)
                where = f"shard {self.shard}: {where}"
            return self._result(outcome, "", output_written=True, written=where)
        if self.shard is not None:
            return self._result(*finish_shard(spec, self.shard, self.run_dir.path, self.output_format,
                                              self.input_records, outcome, self.merge_when_done, self.say))

        def rows():  # every record read has exactly one row, checked as they stream (not by the counters)
            for row in self.journal.iter_rows_expecting(range(self.input_records)):
                if skip_errors:
                    row = without_errors(row)
                    if row is None:
                        continue
                yield row

        size = vector_size(self.journal.iter_rows()) if spec.task == "embed" and self.output_format == "parquet" \
            else None
        check_output_writable(spec.output.path)  # (its folder again: one removed while the run went is made anew)
        write_output(rows(), spec.output.path, self.output_format, spec.build.keep_fields,
                     model_name=(spec.build.served_model_names or (spec.model,))[0],
                     optional=self.journal.columns() | ({SAMPLE_INDEX} if spec.build.n > 1 else set()),
                     task=spec.task, vector_size=size, staging=str(self.run_dir.path))
        return self._result(outcome, "", output_written=True)

    def _check_input_unchanged(self) -> None:
        """Before any output is written: the input must be the one the run opened (its fingerprint again, and as many
        records read as counted then). A file rewritten while the run read it may have given it records that are
        not there now (a line cut in half): InputChanged, no output, the state kept; the next run checks every row
        against the input as it is then, and computes those of records that changed."""
        path, before = self.spec.input.path, self._input_fingerprint
        if self._spool is not None or not fingerprints_content(before):
            return  # (a copy of stdin in the run directory, or an input without a fingerprint of its content)
        now = fingerprint(path)
        if now != before:
            why = f"its fingerprint was {before[:19]}... when the run opened and is {now[:19]}... now"
        elif self._records_at_open is not None and self.input_records != self._records_at_open:
            why = (f"it held {_count(self._records_at_open, 'record')} when the run opened, and the run read "
                   f"{_count(self.input_records, 'record')} of it")
        else:
            return
        written = "no output was written" if self.parts is None else \
            f"its last parts were not written (those in {self.parts.layout.folder}/ are checked again with the rows)"
        raise InputChanged(f"the input {path} changed while this run read it ({why}), so its rows may answer records "
                           f"that are not in it: {written}; the run's rows are kept: run the same command again once "
                           "the input is settled, and every row is checked against the input as it is then (those of "
                           "changed records are computed again)")

    def _write_rows(self, rows, path: str, first: int, stop: int) -> int:
        """Journal rows (input order) of the records [first, stop) into one part file at `path`, as the output file
        would hold them; the rows written. Every part has the same columns (`_part_columns`)
        (an embedding's column is a fixed-size list where the part's vectors all have one size)."""
        spec = self.spec
        if not is_remote(path):  # (a folder removed while the run went is made anew)
            os.makedirs(os.path.dirname(path), exist_ok=True)
        if spec.output.on_error == "skip":
            rows = (row for row in map(without_errors, rows) if row is not None)
        size = None
        if spec.task == "embed" and self.output_format == "parquet":
            size = vector_size(json.loads(text) for _, text in self.journal.row_texts_between(first, stop))
        return write_output(rows, path, self.output_format, spec.build.keep_fields,
                            model_name=(spec.build.served_model_names or (spec.model,))[0],
                            optional=self._part_columns(first, stop), task=spec.task, vector_size=size,
                            staging=str(self.run_dir.path), file_metadata={RUN_ID_KEY: self.parts.owner.run_id})

    def _part_columns(self, first: int, stop: int) -> tuple[str, ...]:
        """The optional columns of the part of records [first, stop): those the run's settings fill, fixed when its
        first part is written (the journal keeps them; every shard of a split run comes to the same), so that every
        part has the same columns; a part whose rows hold another (a record asked for it) has it too, and says so."""
        spec, journal = self.spec, self.journal
        stored = journal.meta_value(_PART_COLUMNS_KEY)
        if stored is not None:
            fixed = tuple(json.loads(stored))
        else:
            asked = set()
            sampling = spec.sampling
            asked |= {"logprobs"} if sampling.logprobs is not None else set()
            asked |= {"prompt_logprobs", "prompt_logprob_sum"} if sampling.prompt_logprobs is not None else set()
            asked |= {SAMPLE_INDEX} if spec.build.n > 1 else set()
            asked |= {"reasoning"} if spec.reasoning_parser is not None else set()
            asked |= {"prompt_tokens_truncated"} if spec.build.truncate_prompt_tokens is not None else set()
            asked |= {"draft_tokens", "accepted_draft_tokens"} if spec.engine.speculative is not None else set()
            fixed = part_columns(spec.task, asked)
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

    def _result(self, outcome: Outcome, message: str, output_written: bool = False, written: str = "") -> RunResult:
        stats = self.engine.stats() if self.engine else None
        if stats is not None:
            self.totals.generated_tokens = stats.num_generated_tokens
        profile = self.engine.profile() if self.engine and self.spec.profile else {}
        missing = ()
        if outcome is not Outcome.STOPPED and self.shard is None and not self.totals.resumed_from:
            # every record was read here: a keep field none had is said
            missing = tuple(f for f in self.spec.build.keep_fields if f not in self.totals.keep_fields_seen)
        return RunResult(outcome, self.totals, self._setup(), stats, message, profile, output_written, missing,
                         time.monotonic() - self.started, written)

    def _setup(self) -> RunSetup:
        """The model as given and where it loaded from (a .gguf file, an embedded model's cache folder, a folder, or
        a hub id), and the dtype, backend and max_num_seqs it ran with (auto resolved)."""
        model, task = self.spec.model, self.spec.task
        if self.engine is None:
            return RunSetup(model, task=task)
        info = self.engine.info()
        if model.endswith(".gguf"):
            path = str(Path(model).expanduser().resolve())
        else:
            path = info.model_path or model
            if Path(path).expanduser().exists():
                path = str(Path(path).expanduser().resolve())
        return RunSetup(model, path, info.dtype, info.backend, info.max_num_seqs, task, info.cpu_isa,
                        info.batch_invariant)

    def _noting_keep_fields(self, records):
        """`records`, noting which --keep-fields they have (one no record has is said in the summary)."""
        wanted, seen = self.spec.build.keep_fields, self.totals.keep_fields_seen
        for raw in records:
            if raw.record is not None and len(seen) < len(wanted):
                seen.update(name for name in wanted if name in raw.record)
            yield raw

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
        if self._spool is not None:
            self._spool.unlink(missing_ok=True)
        if self.run_dir is not None:
            self.run_dir.release_lock()

    # -- without a run directory ------------------------------------------------------------------------------

    def validate(self, show_errors: int) -> ValidationReport:
        """Every record parsed, templated, tokenized and checked as this run would, none generated
        (`validate_run`)."""
        return validate_run(self.spec, show_errors, self.say)
