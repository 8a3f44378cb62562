"""Run: one run of a RunSpec, from its run directory to its output file.

    run = Run(spec, command="conveyor run ...", say=print)
    try:
        run.open()                      # checks, run directory, the records left: usage errors here, before the model
        run.load_engine()
        result = run.execute(should_stop, on_progress)
    finally:
        run.close()

A Run owns the run directory (lock, manifest, drift), the resume-aware record stream (`pending.py`), the sink and
journal, the final write, and a shard's finish and merge. `conveyor run`, each shard of `--shard`, each Ray worker
(`merge_when_done=False`: the driver merges) and `conveyor validate` (`Run.validate`: no run directory, no engine)
build one from a spec; the CLI only turns options into the spec and handles signals, progress and exit codes.
Records stream in lazily; finished rows go to the journal, committed every `checkpoint_every` rows or
`checkpoint_seconds`; when every record has a row, the output is written from the journal in input order and
appears atomically. A stop (`should_stop`) commits what finished.
"""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from conveyor.core import (
    DEFAULT_KV_CACHE_MEMORY,
    ConfigError,
    EngineConfig,
    check_before_loading,
    check_model,
    load_engine,
    load_tokenizer,
    resolve_engine_config,
    resolve_reasoning,
)
from conveyor.io.errors import SpecError
from conveyor.io.records.pending import PendingRecords
from conveyor.io.records.readers import fingerprint, fingerprints_content, open_reader
from conveyor.io.records.request_builder import RequestBuilder, has_chat_template
from conveyor.io.records_run import run_records
from conveyor.io.rows.figures import run_figures
from conveyor.io.rows.rows import SAMPLE_INDEX, without_errors
from conveyor.io.rows.sink import BadRecordStop, CommitPolicy, JournalSink, RunTotals
from conveyor.io.rows.writers import STDOUT, check_keep_fields, infer_output_format, write_output
from conveyor.io.run_spec import RunSpec
from conveyor.io.state.journal import Journal
from conveyor.io.state.paths import check_output_path, check_run_paths
from conveyor.io.state.run_dir import STATE_FILES, Manifest, RunDir
from conveyor.io.state.run_info import read_run_info, write_run_info
from conveyor.io.state.shards import MergeResult, Shard, ShardError, ShardSet, clear_done, mark_done, merge, shard_dir
from conveyor.io.validation import ValidationSink

try:
    TOOL_VERSION = version("conveyor")
except PackageNotFoundError:  # run from a source tree that was never installed
    TOOL_VERSION = "unknown"

STOPPED, SOME_ERRORS, OK = "stopped", "some_errors", "ok"  # a run's outcome (the CLI's exit code)
__all__ = ["OK", "SOME_ERRORS", "STOPPED", "BadRecordStop", "Run", "RunResult", "ValidationReport",
           "draft_acceptance_rate", "merge_shards", "run_figures"]


def draft_acceptance_rate(draft_tokens: int, accepted: int) -> float | None:
    """Accepted draft tokens over those fed (None where none was: no rate, not a rate of 0)."""
    return round(accepted / draft_tokens, 4) if draft_tokens else None


@dataclass
class RunResult:
    status: str  # OK, SOME_ERRORS (finished, some rows are error rows) or STOPPED (early, on purpose)
    totals: RunTotals
    engine_stats: Any = None  # the engine's EngineStats, where it ran
    message: str = ""  # what to tell the user beside the summary
    profile: dict[str, float] = field(default_factory=dict)  # seconds per step phase, where asked for
    output_written: bool = False  # the output file was written (a shard writes it only when it merges)
    keep_fields_missing: tuple[str, ...] = ()  # --keep-fields that no record of the input had (a column of nulls)
    wall_s: float = 0.0  # from the run's start (before its checks and the model's load) to this result
    setup: dict[str, Any] = field(default_factory=dict)  # model, model_path, dtype, backend, max_num_seqs as run

    def figures_state(self) -> dict[str, Any]:
        """What the summary's latency and occupancy figures are made of (`run_figures`), as plain data: a Ray
        worker sends it to the driver, whose figures are then over every worker's rows."""
        s = self.engine_stats
        return {"latency": self.totals.latency.state(), "scheduled_rows": s.num_scheduled_rows if s else 0,
                "steps": s.num_forward_steps if s else 0, "max_num_seqs": self.setup.get("max_num_seqs")}

    def summary(self) -> dict[str, Any]:
        t = self.totals
        s = self.engine_stats
        return {
            "records": t.done,
            "samples": t.samples,  # output rows: a record with n > 1 has n
            "ok": t.ok,
            "errors": t.errors,
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens,
            "load_s": round(t.load_s, 3),
            "elapsed_s": round(t.elapsed_s, 3),
            "output_tokens_per_s": round(t.output_tokens_per_s, 2),
            "preemptions": s.num_preemptions if s else 0,
            "prefix_cache_hit_rate": round(s.prefix_cache_hit_rate, 4) if s else 0.0,
            "draft_tokens": s.num_draft_tokens if s else 0,  # --speculative: fed to the model ...
            "accepted_draft_tokens": s.num_accepted_draft_tokens if s else 0,  # ... and accepted
            "draft_acceptance_rate": draft_acceptance_rate(s.num_draft_tokens, s.num_accepted_draft_tokens) if s
            else None,
            "resumed_from": t.resumed_from,
            "continued": t.continued,  # records continued from an earlier process's partial ...
            "tokens_carried_over": t.tokens_carried_over,  # ... and the tokens those held
            "in_flight_saved": t.in_flight_saved if self.status == STOPPED else 0,  # partials kept at the stop
            "keep_fields_missing": list(self.keep_fields_missing),
            "wall_s": round(self.wall_s, 3),
            **{key: self.setup.get(key) for key in ("model", "model_path", "dtype", "backend")},
            **run_figures([self.figures_state()]),  # over the ok rows this process wrote
            "status": self.status,
        }


@dataclass
class ValidationReport:
    sink: ValidationSink  # counts, the first errors and the prompt lengths
    max_model_len: int  # the model's context, in tokens


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
        self.engine_config: EngineConfig = spec.engine  # as it runs here, once `open` resolved it
        self.partials: dict[int, dict] = {}  # the journal's partials, once `open` read them
        self.shard: Shard | None = None  # --shard: this run answers the records whose index is I mod N
        self.output_format = ""
        self.arithmetic: str | None = None  # the backend's arithmetic the rows so far were computed with
        self.journal: Journal | None = None
        self.run_dir: RunDir | None = None
        self._token_texts: dict[int, str] = {}

    @property
    def base_run_dir(self) -> Path:
        """The run directory the user named (a shard's own is a folder inside it)."""
        return Path(self.spec.state.run_dir or RunDir.default_for(self.spec.output.path))

    @property
    def input_records(self) -> int:
        """Input records read so far, every shard's (after --limit)."""
        return self.records.input_records

    # -- setup: every check that can fail does so here, before any model work --------------------------------

    def open(self) -> None:
        spec = self.spec
        self.engine_config = self._resolved_engine_config()
        self.output_format = self._check_output()
        try:
            check_before_loading(spec.model, self.engine_config, spec.sampling.grammar)
        except ConfigError as e:
            if e.field != "grammar":
                raise
            option = {"regex": "--regex", "choice": "--choice"}.get(spec.sampling.grammar.kind, "--json-schema")
            raise SpecError(f"{option}: {e}") from None
        # Refused before the model loads: a reasoning parser for a model without think tags, a chat option for one
        # without a chat template (its tokenizer read once for both).
        tokenizer = load_tokenizer(spec.model)[0] if spec.reasoning_parser is not None or self._chat_option() else None
        if spec.reasoning_parser is not None:
            self._reasoning(tokenizer)
        if tokenizer is not None:
            self._check_chat_template(tokenizer)
        run_dir = self.base_run_dir
        if spec.state.shard is not None:
            self.shard = Shard.parse(spec.state.shard)
            if spec.input.path == "-":
                raise SpecError("--shard: every shard reads the whole input, so it must be a file or dataset, not "
                                "stdin")
            run_dir = shard_dir(run_dir, self.shard)
        check_run_paths(spec.input.path, spec.output.path, run_dir, STATE_FILES)
        reader = open_reader(spec.input.path, spec.input.format, spec.input.split, spec.input.max_record_bytes)
        self.run_dir = RunDir(run_dir)
        self.run_dir.acquire_lock()
        manifest = self._manifest()
        if spec.state.restart:
            self.run_dir.reset()
        self.journal, note = self.run_dir.open_journal(manifest)
        if note:
            self.say(note)
        if self.shard is not None:
            clear_done(self.run_dir.path)  # said again when this shard has every row
        # Without a fingerprint of the input's content (stdin, a pipe, a hub dataset), a resumed run checks its
        # records one by one against the digests the journal keeps of the records it answered.
        reader.with_digests = not fingerprints_content(manifest.input_fingerprint)
        t = self.totals
        self.partials = self.journal.partials()  # records an earlier process left generating: they continue
        t.resumed_from = t.done = self.journal.num_committed()
        t.errors = self.journal.num_errors()
        t.ok = t.done - t.errors
        t.samples = self.journal.num_samples()
        count = reader.count()
        if count is not None and spec.input.limit is not None:
            count = min(count, spec.input.limit)
        t.total = count if count is None or self.shard is None else self.shard.num_records(count)
        self.records = PendingRecords(reader, self.journal, spec.input.path, spec.input.limit, self.shard)
        self._pending = iter(self.records)
        if reader.with_digests and t.resumed_from:  # read the answered prefix now, before the model loads: a
            first = next(self._pending, None)  # different input is refused at once
            self._pending = itertools.chain([first] if first is not None else [], self._pending)
        self.arithmetic = read_run_info(self.run_dir.path).get("arithmetic") if t.resumed_from else None
        write_run_info(self.run_dir.path, t.total, self.command, self.arithmetic)

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

    def _check_output(self) -> str:
        output = self.spec.output
        check_output_path(output.path)
        fmt = infer_output_format(output.path, output.format)
        check_keep_fields(self.spec.build.keep_fields)
        if output.path == STDOUT:
            if self.spec.state.shard is not None:
                raise SpecError("-o -: a shard does not write the output (the last one to finish does, maybe in "
                                "another process); name an output file")
            if self.spec.state.run_dir is None:
                raise SpecError("-o -: give --run-dir too: the run's state needs a folder, and stdout has no place "
                                "beside it for one")
        return fmt

    def _manifest(self) -> Manifest:
        spec = dataclasses.replace(self.spec, engine=self.engine_config)
        return Manifest(input_fingerprint=fingerprint(spec.input.path), input_path=spec.input.path, model=spec.model,
                        generation_config=spec.generation_config(), tool_version=TOOL_VERSION,
                        created_at=time.time(), output_path=spec.output.path, output_format=self.output_format)

    def load_engine(self) -> None:
        start = time.monotonic()
        self.engine = load_engine(self.spec.model, self.engine_config)
        self._check_arithmetic(self.engine.backend.arithmetic())
        if self.spec.profile:
            self.engine.enable_profiling()
        self.totals.load_s = time.monotonic() - start
        sampling = self.spec.sampling
        if self.spec.reasoning_parser is not None:
            sampling = dataclasses.replace(sampling, reasoning=self._reasoning(self.engine.tokenizer))
        self.builder = RequestBuilder(self.engine.tokenizer, self.spec.build, sampling, self.engine.limits,
                                      self.spec.model, priorities=self.spec.engine.schedule == "priority")
        self._no_chat_template_note(self.engine.tokenizer)

    def _chat_option(self) -> str | None:
        """The option that builds every prompt through a chat template (none given by --chat-template), if any."""
        b = self.spec.build
        if b.chat_template is not None:
            return None
        return "--chat-field" if b.chat_field is not None else \
            "--prompt-template-as chat" if b.prompt_template is not None and b.prompt_template_as == "chat" else None

    def _check_chat_template(self, tokenizer) -> None:
        """--chat-field and --prompt-template-as chat build every prompt through a chat template: a model without
        one (and no --chat-template) is a usage error before it loads."""
        option = self._chat_option()
        if option is not None and not has_chat_template(tokenizer):
            raise SpecError(f"{option}: every prompt goes through the model's chat template, and {self.spec.model} "
                            "has none; give one with --chat-template FILE, or build raw prompts (--prompt-field, "
                            "--prompt-template)")

    def _no_chat_template_note(self, tokenizer) -> None:
        """Said once at the start: chat records of a model without a chat template become error rows."""
        if self.spec.build.chat_template is None and not has_chat_template(tokenizer):
            self.say(f"note: {self.spec.model} has no chat template: chat records (a messages field, an OpenAI chat "
                     "body) become error rows saying so; give one with --chat-template FILE")

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
            self.say(f"the first {self.totals.resumed_from} rows of this run were computed with {before}; it resumes "
                     f"with {now}, so the rest need not equal an uninterrupted run's bit for bit (rerun with "
                     "--restart, or resume on the machine it started on, to keep one arithmetic)")
        self.arithmetic = now
        write_run_info(self.run_dir.path, self.totals.total, self.command, now)

    # -- the run ---------------------------------------------------------------------------------------------

    def execute(self, should_stop: Callable[[], bool] = lambda: False,
                on_progress: Callable[[], None] | None = None) -> RunResult:
        """Every pending record through the engine into the journal (`run_records`), then the output. Raises
        BadRecordStop at the first bad record under --on-error fail (what finished is committed)."""
        state = self.spec.state
        sink = JournalSink(self.journal, CommitPolicy(state.checkpoint_every, state.checkpoint_seconds),
                           self.spec.output.on_error, self._token_text, self.totals, self.engine.in_flight,
                           self.partials)
        records = self._noting_keep_fields(self._pending)
        if run_records(records, self.builder, self.engine, sink, should_stop, on_progress) == "stopped":
            return self._result(STOPPED, "run the same command again to resume")
        return self._finish()

    def _token_text(self, token: int) -> str:
        """A token's own text, as logprobs name it (decoded alone, special tokens kept); cached."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.engine.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def _finish(self) -> RunResult:
        spec = self.spec
        skip_errors = spec.output.on_error == "skip"
        status = SOME_ERRORS if self.totals.errors and not skip_errors else OK
        if self.shard is not None:
            return self._finish_shard(status)

        def rows():  # every record read has exactly one row, checked as they stream (not by the counters)
            for row in self.journal.iter_rows_expecting(range(self.input_records)):
                if skip_errors:
                    row = without_errors(row)
                    if row is None:
                        continue
                yield row

        write_output(rows(), spec.output.path, self.output_format, spec.build.keep_fields, model_name=spec.model,
                     optional=self.journal.columns() | ({SAMPLE_INDEX} if spec.build.n > 1 else set()))
        return self._result(status, "", output_written=True)

    def _finish_shard(self, status: str) -> RunResult:
        """Say this shard is done; the shard that finds every shard done writes the output."""
        mark_done(self.run_dir.path, self.shard, self.input_records, self.spec.output.on_error)
        if not self.merge_when_done:
            return self._result(status, f"shard {self.shard} done")
        output = self.spec.output.path
        waiting = [name for name, state in ShardSet(self.base_run_dir, self.shard.count).status().items()
                   if state != "done"]
        if waiting:
            return self._result(status, f"shard {self.shard} done; waiting for shard{'s' if len(waiting) > 1 else ''} "
                                f"{', '.join(waiting)}: the last to finish writes {output} (or run "
                                f"`conveyor merge {output}` once all are done)")
        try:
            merged = merge(self.base_run_dir, output, self.output_format)
        except ShardError as e:  # another shard's problem: this one's rows stand (a warning: said even when quiet)
            self.say(f"warning: shard {self.shard} done, but {output} cannot be written yet: {e}")
            return self._result(status, "")
        return self._result(SOME_ERRORS if merged.has_error_rows else OK,
                            f"all {self.shard.count} shards done: merged {merged.rows} rows", output_written=True)

    def _result(self, status: str, message: str, output_written: bool = False) -> RunResult:
        stats = self.engine.stats() if self.engine else None
        if stats is not None:
            self.totals.generated_tokens = stats.num_generated_tokens
        profile = self.engine.profile() if self.engine and self.spec.profile else {}
        missing = ()
        if status != STOPPED and self.shard is None and not self.totals.resumed_from:  # every record read here
            missing = tuple(f for f in self.spec.build.keep_fields if f not in self.totals.keep_fields_seen)
        return RunResult(status, self.totals, stats, message, profile, output_written, missing,
                         time.monotonic() - self.started, self._setup())

    def _setup(self) -> dict[str, Any]:
        """The model as given and where it loaded from, and the dtype, backend and max_num_seqs it ran with (auto
        resolved); None each where the model did not load."""
        engine = self.engine
        if engine is None:
            return {"model": self.spec.model, "model_path": None, "dtype": None, "backend": None, "max_num_seqs": None}
        model = self.spec.model
        if model.endswith(".gguf"):
            path = str(Path(model).expanduser().resolve())
        else:  # an embedded model's cache folder, a folder, or a hub id
            path = getattr(getattr(engine.model, "config", None), "name_or_path", None) or model
            if Path(path).expanduser().exists():
                path = str(Path(path).expanduser().resolve())
        return {"model": model, "model_path": path, "dtype": self.engine_config.dtype, "backend": engine.backend.name,
                "max_num_seqs": engine.config.max_num_seqs}

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
        if self.run_dir is not None:
            self.run_dir.release_lock()

    # -- without a run directory: validation, and a split run's driver ---------------------------------------

    def validate(self, show_errors: int) -> ValidationReport:
        """Every record parsed, templated, tokenized and checked as this run would, none generated."""
        spec = self.spec
        reader = open_reader(spec.input.path, spec.input.format, spec.input.split, spec.input.max_record_bytes)
        check_model(spec.model)  # a model conveyor refuses, or whose weight files are not whole: refused here too
        tokenizer, limits = load_tokenizer(spec.model)
        self._check_chat_template(tokenizer)
        self._no_chat_template_note(tokenizer)
        builder = RequestBuilder(tokenizer, spec.build, spec.sampling, limits, spec.model,
                                 priorities=spec.engine.schedule == "priority")
        limit = spec.input.limit
        records = itertools.takewhile(lambda raw: limit is None or raw.index < limit, reader)
        with tempfile.TemporaryDirectory(prefix="conveyor-validate-") as scratch, \
                Journal(Path(scratch) / "ids.sqlite") as ids:
            sink = ValidationSink(tokenizer, show_errors, ids, spec.engine)
            run_records(records, builder, None, sink)
        return ValidationReport(sink, limits.max_model_len)

    def open_split(self) -> Path:
        """The checks and the run directory of a run whose shards run elsewhere (`--executor ray`): its shards'
        run directories go inside the returned one, and `merge` writes the output from them."""
        spec = self.spec
        if spec.state.shard is not None:
            raise SpecError("--shard: not with --executor ray, which runs every shard itself")
        if spec.input.path == "-":
            raise SpecError("--executor ray: every worker reads the input, so it must be a file or dataset, not "
                            "stdin")
        if spec.output.path == STDOUT:
            raise SpecError("-o -: not with --executor ray, which writes the output from its shards; name a file")
        self.output_format = self._check_output()
        run_dir = self.base_run_dir
        check_run_paths(spec.input.path, spec.output.path, run_dir, STATE_FILES)
        if not Path(spec.input.path).exists():
            raise SpecError(f"{spec.input.path}: no such input file or directory")
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir

    def merge(self) -> MergeResult:
        """Write the output from this run's finished shards, in input order."""
        return merge(self.base_run_dir, self.spec.output.path, self.output_format)


def merge_shards(output: str, run_dir: str | None = None, output_format: str | None = None) -> MergeResult:
    """`conveyor merge`: `output` from the finished shards under `run_dir` (default: the output's)."""
    if output_format is not None:
        output_format = infer_output_format(output, output_format)
    return merge(Path(run_dir) if run_dir else RunDir.default_for(output), output, output_format)

