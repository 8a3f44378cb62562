"""The run loop: reader -> request builder -> engine -> journal -> final output. No Typer here.

Records stream in lazily (the engine's waiting queue is kept short: backpressure); finished rows go
to the run directory's journal, committed every `checkpoint_every` records or `checkpoint_seconds`;
when every record has a row, the output file is written from the journal in input order and
appears atomically. A stop request (signal, --max-runtime) commits what finished and returns 75.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.cli.config import DEVICE_DEFAULTS, RunConfig
from conveyor.cli.exit_codes import ExitCode, UsageError
from conveyor.cli.run_info import command_line, read_run_info, write_run_info
from conveyor.cli.stop_signals import StopController
from conveyor.core import SamplingParams
from conveyor.io.readers import InputError, RawRecord, fingerprint, fingerprints_content, open_reader
from conveyor.io.paths import check_run_paths
from conveyor.io.records_run import run_records
from conveyor.io.request_builder import BuildOptions, RequestBuilder
from conveyor.io.request_options import run_grammar
from conveyor.io.run_dir import STATE_FILES, Manifest, RunDir
from conveyor.io.shards import Shard, ShardError, ShardSet, clear_done, mark_done, merge, shard_dir
from conveyor.io.sink import CommitPolicy, JournalSink, RunTotals
from conveyor.io.writers import check_keep_fields, infer_output_format, write_output

TOOL_VERSION = "0.1.0"


@dataclass
class RunResult:
    exit_code: ExitCode
    totals: RunTotals
    engine_stats: Any = None
    message: str = ""
    profile: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        t = self.totals
        s = self.engine_stats
        return {
            "records": t.done,
            "ok": t.ok,
            "errors": t.errors,
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens,
            "load_s": round(t.load_s, 3),
            "elapsed_s": round(t.elapsed_s, 3),
            "output_tokens_per_s": round(t.output_tokens_per_s, 2),
            "preemptions": s.num_preemptions if s else 0,
            "prefix_cache_hit_rate": round(s.prefix_cache_hit_rate, 4) if s else 0.0,
            "resumed_from": t.resumed_from,
            "status": self.exit_code.name.lower(),
        }


def sampling_defaults(cfg: RunConfig) -> SamplingParams:
    try:
        grammar = run_grammar(cfg.json_schema_text(), cfg.choice, cfg.regex)
    except ValueError as e:
        raise UsageError(str(e) if str(e).startswith("--") else f"--json-schema {cfg.json_schema}: {e}") from None
    try:
        return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
                              max_tokens=cfg.max_tokens, min_tokens=cfg.min_tokens, stop=cfg.stop,
                              ignore_eos=cfg.ignore_eos, grammar=grammar, logprobs=cfg.logprobs,
                              prompt_logprobs=0 if cfg.prompt_logprobs else None)
    except ValueError as e:
        field_name = str(e).split(" ", 1)[0]
        raise UsageError(f"--{field_name.replace('_', '-')}: {e}") from None


def _with_resolved_device(cfg: RunConfig) -> RunConfig:
    """The device and backend checked (a usage error, before any model work, where they are not available),
    the device's engine sizes filled in where not given, and `--dtype auto` made concrete for the device before
    the manifest records it, so that a run resumed where auto means another dtype (another CPU, a GPU) is
    refused instead of mixing two arithmetics."""
    from conveyor.core.backends import available_backends
    from conveyor.core.model_loader import ModelLoadError, auto_dtype, resolve_device

    try:
        device = resolve_device(cfg.device)
    except ModelLoadError as e:
        raise UsageError(str(e)) from None
    if cfg.backend != "auto" and cfg.backend not in available_backends(device):
        raise UsageError(f"--backend {cfg.backend}: does not run on {device} here; backends that do: "
                         f"{', '.join(available_backends(device))} (or --backend auto)")
    if cfg.gpu_memory_utilization is not None and (device.type != "cuda" or cfg.kv_cache_memory is not None):
        sys.stderr.write(f"conveyor: --gpu-memory-utilization {cfg.gpu_memory_utilization} is not used: "
                         + (f"this run is on {device}, where " if device.type != "cuda" else "")
                         + f"--kv-cache-memory ({cfg.kv_cache_memory or '2GiB'}) sizes the KV cache\n")
    sizes = {k: v for k, v in DEVICE_DEFAULTS["cuda" if device.type == "cuda" else "cpu"].items()
             if getattr(cfg, k) is None}
    if cfg.dtype == "auto":
        sizes["dtype"] = auto_dtype(device)
    return dataclasses.replace(cfg, **sizes) if sizes else cfg


def check_summary_path(path: str | None) -> None:
    """--summary-json must name a file in a folder that exists: checked before the run, not after it."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"--summary-json {path}: is a folder; name a file")
    if not target.absolute().parent.is_dir():
        raise UsageError(f"--summary-json {path}: the folder {target.absolute().parent} does not exist; create it "
                         "or choose another path")


def _manifest(cfg: RunConfig, output_format: str) -> Manifest:
    return Manifest(input_fingerprint=fingerprint(cfg.input), input_path=cfg.input, model=cfg.model,
                    generation_config=cfg.generation_config(), tool_version=TOOL_VERSION,
                    created_at=time.time(), output_path=cfg.output, output_format=output_format)


class Pipeline:
    """One `conveyor run`: owns the run directory, journal, reader, builder and engine."""

    def __init__(self, cfg: RunConfig, on_progress: Callable[["Pipeline"], None] | None = None,
                 handle_signals: bool = True, merge_when_done: bool = True, command: str | None = None) -> None:
        self.cfg = cfg
        self.command = command or command_line()  # how to resume this run, for `conveyor status`
        self.on_progress = on_progress
        self.handle_signals = handle_signals  # False where the caller owns them (a Ray worker)
        self.merge_when_done = merge_when_done  # a shard: the last to finish writes the output
        self.totals = RunTotals()
        self.engine = None
        self.stopper = StopController(cfg.max_runtime)
        self.output_format = ""
        self.note: str | None = None  # said once the run directory is open (a run that started over)
        self.shard: Shard | None = None  # --shard: this run answers the records whose index is I mod N
        self.input_records = 0  # input records read so far, every shard's (after --limit)
        self.arithmetic: str | None = None  # the backend's arithmetic the rows so far were computed with
        self._token_texts: dict[int, str] = {}

    # -- setup (usage errors surface here, before any model work) -------------------------------

    def prepare(self) -> None:
        self.cfg = cfg = _with_resolved_device(self.cfg)
        try:
            self.output_format = infer_output_format(cfg.output, cfg.output_format)
        except ValueError as e:
            raise UsageError(str(e)) from None
        try:
            check_keep_fields(cfg.keep_fields)
        except ValueError as e:
            raise UsageError(str(e)) from None
        self.defaults = sampling_defaults(cfg)
        run_dir = Path(cfg.run_dir or RunDir.default_for(cfg.output))
        if cfg.shard is not None:
            try:
                self.shard = Shard.parse(cfg.shard)
            except ValueError as e:
                raise UsageError(str(e)) from None
            if cfg.input == "-":
                raise UsageError("--shard: every shard reads the whole input, so it must be a file or dataset, not "
                                 "stdin")
            self.base_run_dir = run_dir
            run_dir = shard_dir(run_dir, self.shard)
        check_run_paths(cfg.input, cfg.output, run_dir, STATE_FILES)
        check_summary_path(cfg.summary_json)
        self.reader = open_reader(cfg.input, cfg.input_format, cfg.split, cfg.max_record_bytes)
        self.run_dir = RunDir(run_dir)
        self.run_dir.acquire_lock()
        manifest = _manifest(cfg, self.output_format)
        if cfg.restart:
            self.run_dir.reset()
        self.journal, self.note = self.run_dir.open_journal(manifest)
        if self.shard is not None:
            clear_done(self.run_dir.path)  # said again when this shard has every row
        # Without a fingerprint of the input's content (stdin, a pipe, a hub dataset), a resumed run checks
        # its records one by one against the digests the journal keeps of the records it answered.
        self.reader.with_digests = not fingerprints_content(manifest.input_fingerprint)
        self.totals.resumed_from = self.journal.num_committed()
        self.totals.done = self.totals.resumed_from
        self.totals.errors = self.journal.num_errors()
        self.totals.ok = self.totals.done - self.totals.errors
        count = self.reader.count()
        if count is not None and cfg.limit is not None:
            count = min(count, cfg.limit)
        self.totals.total = count if count is None or self.shard is None else self.shard.num_records(count)
        self.records = self._pending_records()
        if self.reader.with_digests and self.totals.resumed_from:  # read the answered prefix now, before the
            first = next(self.records, None)  # model loads: a different input is refused at once
            self.records = itertools.chain([first] if first is not None else [], self.records)
        self.arithmetic = read_run_info(self.run_dir.path).get("arithmetic") if self.totals.resumed_from else None
        write_run_info(self.run_dir.path, self.totals.total, self.command, self.arithmetic)

    def load_engine(self) -> None:
        from conveyor.core import EngineConfig
        from conveyor.core.engine import Engine

        cfg = self.cfg
        start = time.monotonic()
        gpu = {} if cfg.gpu_memory_utilization is None else {"gpu_memory_utilization": cfg.gpu_memory_utilization}
        engine_config = EngineConfig(block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                                     max_num_batched_tokens=cfg.max_num_batched_tokens,
                                     num_kv_blocks=cfg.num_kv_blocks, kv_cache_memory=cfg.kv_cache_memory,
                                     max_waiting=max(2 * cfg.max_num_seqs, 64), device=cfg.device, dtype=cfg.dtype,
                                     backend=cfg.backend, **gpu)  # (None on a CPU: the engine's default, unused)
        self.engine = Engine.from_pretrained(cfg.model, engine_config)
        self._check_arithmetic(self.engine.backend.arithmetic())
        if cfg.profile:
            self.engine.enable_profiling()
        self.totals.load_s = time.monotonic() - start
        options = BuildOptions(sampling=self.defaults, seed=cfg.seed, system_prompt=cfg.system_prompt,
                               prompt_field=cfg.prompt_field, messages_field=cfg.messages_field,
                               id_field=cfg.id_field, keep_fields=cfg.keep_fields,
                               max_model_len=self.engine.max_model_len)
        self.builder = RequestBuilder(self.engine.tokenizer, options)

    def _check_arithmetic(self, now: str) -> None:
        """Say so where this run's rows so far were computed with other kernels or another device (a resume on
        another machine): the rest are right, but need not be bitwise an uninterrupted run's."""
        before = self.arithmetic
        if before is not None and before != now:
            sys.stderr.write(f"conveyor: the first {self.totals.resumed_from} rows of this run were computed with "
                             f"{before}; it resumes with {now}, so the rest need not equal an uninterrupted run's "
                             "bit for bit (rerun with --restart, or resume on the machine it started on, to keep "
                             "one arithmetic)\n")
        self.arithmetic = now
        write_run_info(self.run_dir.path, self.totals.total, self.command, now)

    # -- the loop ------------------------------------------------------------------------------

    def _token_text(self, token: int) -> str:
        """A token's own text, as logprobs name it (decoded alone, special tokens kept); cached."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.engine.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def _pending_records(self) -> Iterator[RawRecord]:
        """This run's records without a committed row, from the first gap on; stops at --limit."""
        shard = self.shard
        for raw in self._unanswered():
            self.input_records = raw.index + 1
            if shard is None or shard.owns(raw.index):
                yield raw

    def _unanswered(self) -> Iterator[RawRecord]:
        if self.reader.with_digests:
            yield from self._pending_records_checked()
            return
        start = self.journal.contiguous_prefix()
        self.input_records = start  # the records below the prefix all have rows
        committed = self.journal.committed_indices_from(start)
        next_committed = next(committed, None)
        for raw in self.reader.iter_from(start):
            if self.cfg.limit is not None and raw.index >= self.cfg.limit:
                return
            while next_committed is not None and next_committed < raw.index:
                next_committed = next(committed, None)
            if next_committed == raw.index:
                self.input_records = raw.index + 1
                continue
            yield raw

    def _pending_records_checked(self) -> Iterator[RawRecord]:
        """The same for an input without a fingerprint (stdin, a pipe, a hub dataset): read from its start,
        and every record the journal already answered must be the record it answered (by digest)."""
        committed = self.journal.committed_digests_from(0)
        answered = next(committed, None)
        for raw in self.reader.iter_from(0):
            if self.cfg.limit is not None and raw.index >= self.cfg.limit:
                return
            while answered is not None and answered[0] < raw.index:
                answered = next(committed, None)
            if answered is not None and answered[0] == raw.index:
                if answered[1] is not None and answered[1] != raw.digest:
                    raise InputError(self.cfg.input, raw.line, f"record {raw.index} is not the record this run "
                                     "answered at that position (an input without a file to fingerprint is checked "
                                     "record by record when a run resumes); feed the same input, or run with "
                                     "--restart to start over")
                answered = next(committed, None)
                self.input_records = raw.index + 1
                continue
            yield raw
        if answered is not None:
            raise InputError(self.cfg.input, None, f"the input ended before record {answered[0]}, which this run "
                             "already answered: it is not the input the run started with; feed the same input, or "
                             "run with --restart to start over")

    def run(self) -> RunResult:
        """Every pending record through the engine into the journal (`run_records`), then the output."""
        cfg = self.cfg
        self.sink = JournalSink(self.journal, CommitPolicy(cfg.checkpoint_every, cfg.checkpoint_seconds),
                                cfg.on_error, self._token_text, self.totals)
        progress = (lambda: self.on_progress(self)) if self.on_progress else None
        if self.handle_signals:
            self.stopper.install()
        try:
            state = run_records(self.records, self.builder, self.engine, self.sink, self.stopper.should_stop,
                                progress)
        finally:
            self.stopper.uninstall()
        if state == "stopped":
            return self._result(ExitCode.STOPPED, f"stopped ({self.stopper.reason}); run the same command again to "
                                "resume")
        if self.on_progress:
            self.on_progress(self)
        return self._finish()

    def _finish(self) -> RunResult:
        cfg = self.cfg
        code = ExitCode.SOME_ERRORS if self.totals.errors and cfg.on_error != "skip" else ExitCode.OK
        if self.shard is not None:
            return self._finish_shard(code)
        limit = cfg.limit
        skip_errors = cfg.on_error == "skip"

        def rows():
            for row in self.journal.iter_rows():
                if limit is not None and row["index"] >= limit:
                    break
                if skip_errors and row["status"] == "error":
                    continue
                yield row

        write_output(rows(), cfg.output, self.output_format, cfg.keep_fields, model_name=cfg.model,
                     optional=self.journal.columns())
        return self._result(code, "")

    def _finish_shard(self, code: ExitCode) -> RunResult:
        """Say this shard is done; the shard that finds every shard done writes the output."""
        mark_done(self.run_dir.path, self.shard, self.input_records, self.cfg.on_error)
        shards = ShardSet(self.base_run_dir, self.shard.count)
        waiting = [name for name, state in shards.status().items() if state != "done"]
        if not self.merge_when_done:
            self.merged = False
            return self._result(code, f"shard {self.shard} done")
        if waiting:
            self.merged = False
            return self._result(code, f"shard {self.shard} done; waiting for shard{'s' if len(waiting) > 1 else ''} "
                                f"{', '.join(waiting)}: the last to finish writes {self.cfg.output} (or run "
                                f"`conveyor merge -o {self.cfg.output}` once all are done)")
        try:
            merged = merge(self.base_run_dir, self.cfg.output, self.output_format)
        except ShardError as e:  # another shard's problem: this one's rows stand
            self.merged = False
            return self._result(code, f"shard {self.shard} done, but {self.cfg.output} cannot be written yet: {e}")
        self.merged = True
        code = ExitCode.SOME_ERRORS if merged.has_error_rows else ExitCode.OK
        return self._result(code, f"all {self.shard.count} shards done: merged {merged.rows} rows")

    def _result(self, code: ExitCode, message: str) -> RunResult:
        stats = self.engine.stats() if self.engine else None
        profile = self.engine.profile() if self.engine and self.cfg.profile else {}
        return RunResult(code, self.totals, stats, message, profile)

    def close(self) -> None:
        journal = getattr(self, "journal", None)
        if journal is not None:
            journal.close()
        run_dir = getattr(self, "run_dir", None)
        if run_dir is not None:
            run_dir.release_lock()
