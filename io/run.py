"""Run: one run of a RunSpec, from its run directory to its output file.

    run = Run(spec, command="conveyor run ...", say=print)   # settled: engine config, output, --task auto
    try:
        run.open()                      # checks, run directory, the records left: usage errors here, before the model
        run.load_engine()
        result = run.execute(should_stop, on_progress)   # on_progress reads run.progress()
    finally:
        run.close()

A Run owns the run directory (lock, manifest, drift), the resume-aware record stream (`pending.py`), the sink and
journal and the final write. `open` is four steps: `_preflight` (every check that needs no state), `_open_state`
(the lock, leftovers, the manifest, stdin's copy), `_open_journal` (carried over to the input as it is:
`run_rebase.Carry`; --retry-errors; the part files) and `_open_pending` (the counts and the records left). Its
report (`RunResult`, `RunSummary`) is `run_report.py`'s, its progress `run_progress.py`'s, its output
`run_output.py`'s, its settled spec and checks `run_preflight.py`'s. `conveyor run`, each shard of `--shard` and
each Ray worker (`merge_when_done=False`: the driver merges) build one from a spec; a shard's finish and the split
run's driver are `split_run.py`'s. Records stream in lazily; finished rows go to the journal, committed every
`checkpoint_every` rows or `checkpoint_seconds`; when every record has a row, the output is written from the journal
in input order and appears atomically. A stop (`should_stop`) commits what finished.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from conveyor.core import ModelSource, model_fingerprint
from conveyor.core.engine_api import InferenceEngine
from conveyor.io.counts import counted
from conveyor.io.errors import SpecError
from conveyor.io.records.pending import PendingRecords, noting_keep_fields
from conveyor.io.records.readers import RawRecord, Reader, fingerprint, fingerprints_content, open_reader
from conveyor.io.records.readers.spool import spool
from conveyor.io.records.record_head import RecordBuilder
from conveyor.io.records_run import run_records
from conveyor.io.rows.parts import STALE_KEY, PartLayout, PartOwner, PartWriter
from conveyor.io.rows.sink import BadRecordStop, JournalSink, RunTotals
from conveyor.io.rows.sink_options import CommitPolicy
from conveyor.io.run_checks import (
    check_named_fields,
    check_output,
    output_folder,
)
from conveyor.io.run_engine import load_run_engine, record_builder, run_setup
from conveyor.io.run_output import PartRows, check_input_unchanged, parts_written, remove_leftovers_of, write_whole
from conveyor.io.run_preflight import check_settings, resolved_engine_config, settled
from conveyor.io.run_progress import RunProgress, run_progress
from conveyor.io.run_rebase import Carry, piped
from conveyor.io.run_report import Outcome, RunResult
from conveyor.io.run_spec import CONFIG_VERSION, DEFAULT_ROWS_PER_FILE, RunSpec
from conveyor.io.split_run import base_run_dir, finish_shard
from conveyor.io.state.journal import Journal
from conveyor.io.state.manifest import SPOOL_FILE, STATE_FILES, Manifest
from conveyor.io.state.paths import check_output_writable, check_run_paths
from conveyor.io.state.run_dir import RunDir
from conveyor.io.state.run_id import run_id
from conveyor.io.state.run_info import read_run_info, write_run_info
from conveyor.io.state.shards import Shard, clear_done, mark_done, shard_dir
from conveyor.io.storage import is_remote

try:
    TOOL_VERSION = version("conveyor")
except PackageNotFoundError:  # run from a source tree that was never installed
    TOOL_VERSION = "unknown"

__all__ = ["BadRecordStop", "Run"]

_RESUME = "run the same command again to resume"


def _count(number: int, noun: str) -> str:
    """"1 row", "1,024 rows"."""
    return counted(number, noun, thousands=True)


class Run:
    """One run of `spec`, settled here once (the engine config as it runs on this machine, the output checked,
    --task auto resolved, the model told apart). `command` is how to resume it (`conveyor status` shows it); `say`
    gets the notes a user should read (a run that starts over, a resume with other kernels, an option that does
    nothing here)."""

    def __init__(self, spec: RunSpec, command: str | None = None, merge_when_done: bool = True,
                 say: Callable[[str], None] = lambda note: None) -> None:
        self.command = command
        self.merge_when_done = merge_when_done  # a shard: the last to finish writes the output
        self.say = say
        self.started = time.monotonic()  # the summary's wall_s counts from here
        self.totals = RunTotals()
        self.engine_config = resolved_engine_config(spec.engine, say)  # as it runs here
        self.output_format = check_output(spec)  # (before --task auto reads the model: a bad output is said first)
        self.folder = output_folder(spec)  # a part-file output's folder, else None
        self.source = ModelSource.of(spec.model)  # the model, told apart once for every core entry point
        self.spec = settled(spec, self.source, say)
        self.engine: InferenceEngine | None = None  # once loaded
        self.builder: RecordBuilder | None = None  # the engine's record builder, once loaded
        self.has_pending = True  # whether a record still needs a row (read by `open`); without one no model is loaded
        self.partials: dict[int, dict] = {}  # the journal's partials, once `open` read them
        self.shard: Shard | None = None  # --shard: this run answers the records whose index is I mod N
        self.arithmetic: str | None = None  # the backend's arithmetic the rows so far were computed with
        self.journal: Journal | None = None
        self.run_dir: RunDir | None = None
        self.parts: PartWriter | None = None  # a part-file output's parts (`open`)
        self.records: PendingRecords | None = None  # the records without a row, as they stream (`open`)
        self.input_selection: dict[str, str] = {}  # how the input is read (the reader's `selection`: `open`)
        self._pending: Iterator[RawRecord] = iter(())  # the records left, the first read already (`open`)
        self._token_texts: dict[int, str] = {}
        self._spool: Path | None = None  # stdin or a pipe, copied into the run directory (`open`)
        self._model_fingerprint: str | None = None  # the content of the model's files (`open`)
        self._input_fingerprint = ""  # the input's, as the run opened (`open`): compared again at its end
        self._records_at_open: int | None = None  # the input's records (after --limit) as counted by `open`

    @property
    def input_records(self) -> int:
        """Input records read so far, every shard's (after --limit)."""
        return self.records.input_records

    # -- open: every check that can fail does so here, before any model work ---------------------------------

    def open(self) -> None:
        reader = self._preflight()
        reader, manifest, stored = self._open_state(reader)
        self._open_journal(reader, manifest, stored)
        self._open_pending(reader)

    def _preflight(self) -> Reader:
        """Every check that needs no state (the output was checked as the run was made): the settings, the paths, the
        input's fields; the run directory (a shard's own is a folder inside the run's). (The input's reader.)"""
        spec, folder = self.spec, self.folder
        check_settings(spec, self.source, self.engine_config)
        path = base_run_dir(spec)
        if spec.state.shard is not None:
            self.shard = Shard.parse(spec.state.shard)
            if spec.input.path == "-":
                raise SpecError("--shard: every shard reads the whole input, so it must be a file or dataset, not "
                                "stdin")
            path = shard_dir(path, self.shard)
        check_run_paths(spec.input.path, spec.output.path, path, STATE_FILES, folder=folder is not None)
        reader = open_reader(spec.input.path, spec.input.format, spec.input.split, spec.input.max_record_bytes)
        check_named_fields(spec, reader)
        check_output_writable(folder if folder is not None else spec.output.path, folder=folder is not None)
        self.run_dir = RunDir(path)
        return reader

    def _open_state(self, reader: Reader) -> tuple[Reader, Manifest, Manifest | None]:
        """The run directory locked and cleared of what a killed write left; this run's manifest and the stored one
        (after --restart, or taken back from one set aside); stdin or a pipe copied into it, read like a file from
        there (a run started before copies were made goes on without). (The reader, giving digests; the manifests.)"""
        spec = self.spec
        self.run_dir.acquire_lock()
        remove_leftovers_of(self.run_dir.path, self.spec.output.path, self.folder, self.say)
        self._model_fingerprint = model_fingerprint(self.source)
        self.input_selection = reader.selection
        fresh = self._manifest(None, fingerprint(spec.input.path))  # (a file's hash: read once)
        restarted = self.run_dir.restart(fresh) if spec.state.restart else None
        stored, taken_back = self.run_dir.stored_manifest(fresh)
        for note in (restarted, taken_back):
            if note:
                self.say(note)
        manifest = fresh if stored is None else self._manifest(stored, fresh.input_fingerprint)
        if piped(manifest.input_fingerprint) and (stored is None or fingerprints_content(stored.input_fingerprint)):
            self._spool = self.run_dir.path / SPOOL_FILE
            manifest = dataclasses.replace(manifest, input_fingerprint=spool(spec.input.path, self._spool))
            reader = open_reader(str(self._spool), reader.format, None, spec.input.max_record_bytes)
        # Every row keeps the digest of the record it answers, and is reused only for that record (`Carry`). stdin in
        # a run started before it was copied can be read once only: its records are checked one by one as they
        # stream (PendingRecords).
        reader.with_digests = True
        self._input_fingerprint = manifest.input_fingerprint
        return reader, manifest, stored

    def _open_journal(self, reader: Reader, manifest: Manifest, stored: Manifest | None) -> None:
        """The journal, carried over to the input as it is now where it changed (or where a resume's rows answer
        other records); --retry-errors; a part-file output's parts checked and those ready written."""
        spec, t = self.spec, self.totals
        carry = Carry(spec, self.shard, t, self.run_dir.path, self.say)
        self.journal, note = self.run_dir.open_journal(
            manifest, stored, lambda journal, drift: carry.carry_over(journal, drift, stored, manifest, reader))
        if note:
            self.say(note)
        if self.shard is not None:
            clear_done(self.run_dir.path)  # said again when this shard has every row
        if spec.state.retry_errors:
            self.journal.set_meta_value(STALE_KEY, "1")
            t.retried_errors = self.journal.forget_run_errors()
            self.say(f"--retry-errors: {_count(t.retried_errors, 'record')} whose error row the run made "
                     f"{'is' if t.retried_errors == 1 else 'are'} computed again" if t.retried_errors else
                     "--retry-errors: no error row of the run's own making to retry")
        if t.reuse is None and not piped(self._input_fingerprint) and self.journal.num_committed():
            carry.check_rows(self.journal, reader)
        if self.folder is not None:
            self._open_parts(self.folder, rows_changed=bool(t.reuse) or bool(t.retried_errors))
        self.partials = self.journal.partials()  # records an earlier process left generating: they continue

    def _open_pending(self, reader: Reader) -> None:
        """The counts so far, and the records left; the first is read now, before the model loads: without one the
        model is not needed (the output is written from the journal), and for an input checked by digests a
        different one is refused at once."""
        spec, t = self.spec, self.totals
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
                                      checked=piped(self._input_fingerprint))
        pending = iter(self.records)
        first = next(pending, None)
        self.has_pending = first is not None
        self._pending = itertools.chain([first] if first is not None else [], pending)
        self.arithmetic = read_run_info(self.run_dir.path).get("arithmetic") if t.resumed_from else None
        write_run_info(self.run_dir.path, t.total, self.command, self.arithmetic)

    def _open_parts(self, folder: str, rows_changed: bool) -> None:
        """The part files of a folder output: checked against the journal, and those whose records all have rows
        written (a process killed after a commit left them)."""
        spec = self.spec
        if not is_remote(folder):
            Path(folder).mkdir(parents=True, exist_ok=True)
        layout = PartLayout(folder, spec.output.rows_per_file or DEFAULT_ROWS_PER_FILE,
                            "parquet" if self.output_format == "parquet" else "jsonl", self.shard)
        base = base_run_dir(spec).resolve()
        owner = PartOwner(run_id(base), str(base))
        rows = PartRows(spec, self.journal, self.output_format, str(self.run_dir.path), owner.run_id, self.say)
        self.parts = PartWriter(self.journal, layout, owner, rows.write, self.say, spec.input.limit)
        self.parts.open(restart=spec.state.restart, rows_changed=rows_changed)
        self.parts.write_ready()

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

    # -- the engine ------------------------------------------------------------------------------------------

    def load_engine(self) -> None:
        """The run's engine (the generation or the pooling engine of its task) and the builder of its requests."""
        start = time.monotonic()
        self.engine = engine = load_run_engine(self.spec, self.source, self.engine_config)
        self._check_arithmetic(engine.arithmetic())
        if self.spec.profile:
            engine.enable_profiling()
        self.totals.load_s = time.monotonic() - start
        self.builder = record_builder(self.spec, engine, self.say)

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
                    return self._result(Outcome.STOPPED, _RESUME)
                raise RuntimeError("Run.execute: records are pending and no engine was loaded (call load_engine)")
            return self._finish()
        spec = self.spec
        sink = JournalSink(self.journal, CommitPolicy(spec.state.checkpoint_every, spec.state.checkpoint_seconds),
                           spec.output.on_error, self._token_text, self.totals, self.engine.in_flight, self.partials,
                           spec.task, self.engine.labels,
                           after_commit=self.parts.write_ready if self.parts is not None else None)
        records = noting_keep_fields(self._pending, spec.build.keep_fields, self.totals.keep_fields_seen)
        if run_records(records, self.builder, self.engine, sink, should_stop, on_progress) == "stopped":
            return self._result(Outcome.STOPPED, _RESUME)
        return self._finish()

    def progress(self) -> RunProgress:
        """Where the run is now: records done of the total, the token rate, the engine's queue, the ETA."""
        return run_progress(self.totals, self.engine.stats() if self.engine else None, self.spec.build.n,
                            self.spec.sampling.max_tokens, pooling=self.spec.task.pools)

    def _token_text(self, token: int) -> str:
        """A token's own text, as logprobs name it (decoded alone, special tokens kept); cached."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.engine.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def _finish(self) -> RunResult:
        """The output, once every record has its row: the last parts of a folder, a shard's share (`finish_shard`),
        or the whole file; checked first against the input as the run opened it (stdin's copy is the run's own)."""
        spec = self.spec
        if self._spool is None:
            check_input_unchanged(spec.input.path, self._input_fingerprint, self._records_at_open,
                                  self.input_records, self.parts)
        outcome = Outcome.of(self.totals.errors, spec.output.on_error == "skip")
        if self.parts is not None:
            where = parts_written(self.parts, self.input_records)
            if self.shard is not None:
                mark_done(self.run_dir.path, self.shard, self.input_records, spec.output.on_error)
                where = f"shard {self.shard}: {where}"
            return self._result(outcome, "", output_written=True, written=where)
        if self.shard is not None:
            return self._result(*finish_shard(spec, self.shard, self.run_dir.path, self.output_format,
                                              self.input_records, outcome, self.merge_when_done, self.say))
        write_whole(spec, self.journal, self.output_format, self.input_records, str(self.run_dir.path))
        return self._result(outcome, "", output_written=True)

    def _result(self, outcome: Outcome, message: str, output_written: bool = False, written: str = "") -> RunResult:
        stats = self.engine.stats() if self.engine else None
        if stats is not None:
            self.totals.generated_tokens = stats.num_generated_tokens
        profile = self.engine.profile() if self.engine and self.spec.profile else {}
        missing = ()
        if outcome is not Outcome.STOPPED and self.shard is None and not self.totals.resumed_from:
            # every record was read here: a keep field none had is said
            missing = tuple(f for f in self.spec.build.keep_fields if f not in self.totals.keep_fields_seen)
        return RunResult(outcome, self.totals, run_setup(self.spec, self.engine), stats, message, profile, output_written, missing,
                         time.monotonic() - self.started, written)

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
        if self._spool is not None:
            self._spool.unlink(missing_ok=True)
        if self.run_dir is not None:
            self.run_dir.release_lock()
