"""`conveyor run`: options -> RunSpec -> io's Run (signals, progress) -> summary -> ExitCode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conveyor.cli import options as opt
from conveyor.cli.config import Invocation, build_config
from conveyor.cli.exit_codes import ExitCode, UsageError

EXAMPLES = """
Examples:

  conveyor run prompts.jsonl -o answers.parquet

  conveyor run prompts.jsonl -o answers.jsonl --temperature 0 --max-tokens 64

  conveyor run qa.parquet -o out.parquet --prompt-field q --keep-fields topic

  conveyor run batch.jsonl -o results.jsonl --output-format openai-batch

  conveyor run tickets.jsonl -o labels.parquet --choice bug,feature,question

  conveyor run big.jsonl -o out.parquet --max-runtime 50m --quiet   # cron

  conveyor run prompts.jsonl -o out.parquet --config configs/greedy-eval.yaml
"""


def run_command(
    input: opt.InputArg,
    output: opt.OutputOpt,
    config: opt.ConfigOpt = None,
    model: opt.ModelOpt = None,
    dtype: opt.DtypeOpt = None,
    device: opt.DeviceOpt = None,
    backend: opt.BackendOpt = None,
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
    json_schema: opt.JsonSchemaOpt = None,
    choice: opt.ChoiceOpt = None,
    regex: opt.RegexOpt = None,
    max_grammar_compile_s: opt.MaxGrammarCompileOpt = None,
    max_grammar_bytes: opt.MaxGrammarBytesOpt = None,
    logprobs: opt.LogprobsOpt = None,
    prompt_logprobs: opt.PromptLogprobsOpt = None,
    no_prompt_logprobs: opt.NoPromptLogprobsOpt = False,
    reasoning_parser: opt.ReasoningParserOpt = None,
    system_prompt: opt.SystemPromptOpt = None,
    chat_field: opt.ChatFieldOpt = None,
    chat_template: opt.ChatTemplateOpt = None,
    prompt_template: opt.PromptTemplateOpt = None,
    prompt_template_as: opt.PromptTemplateAsOpt = None,
    truncate_prompt_tokens: opt.TruncatePromptTokensOpt = None,
    served_model_name: opt.ServedModelNameOpt = None,
    prompt_field: opt.PromptFieldOpt = None,
    messages_field: opt.MessagesFieldOpt = None,
    id_field: opt.IdFieldOpt = None,
    keep_fields: opt.KeepFieldsOpt = None,
    input_format: opt.InputFormatOpt = None,
    output_format: opt.OutputFormatOpt = None,
    split: opt.SplitOpt = None,
    limit: opt.LimitOpt = None,
    max_record_bytes: opt.MaxRecordBytesOpt = None,
    on_error: opt.OnErrorOpt = None,
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
    shard: opt.ShardOpt = None,
    executor: opt.ExecutorOpt = None,
    num_workers: opt.NumWorkersOpt = None,
    profile: opt.ProfileOpt = None,
    no_profile: opt.NoProfileOpt = False,
) -> int:
    """Generate a completion for every record of INPUT into OUTPUT; resumable: rerun to continue."""
    flags = opt.negatives(dict(locals()))
    config_path = flags.pop("config")
    flags["restart"] = restart or None
    return execute(build_config(flags, config_path))


def execute(invocation: Invocation) -> int:
    from conveyor.cli.command_line import command_line
    from conveyor.cli.progress import make_progress
    from conveyor.cli.stop_signals import StopController
    from conveyor.io.run import STOPPED, BadRecordStop, Run

    spec, cli = invocation.spec, invocation.cli
    if cli.executor == "ray":
        from conveyor.cli.ray_executor import run_on_ray

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
        _quiet_libraries()
        progress = make_progress(cli.quiet, cli.log_every)
        run = Run(spec, command=command_line(), say=say)
        stopper.start_clock()
        run.open()
        if not cli.quiet:
            if run.totals.resumed_from or run.partials:
                say(f"resuming: {run.totals.resumed_from} records already done"
                    + (f", {len(run.partials)} to continue from where they stopped" if run.partials else ""))
            _note_loading(spec.model)
        run.load_engine()
        try:
            with progress:
                result = run.execute(stopper.should_stop, lambda: progress.update(run))
                progress.update(run, force=True)
        except BadRecordStop as e:
            sys.stderr.write(f"conveyor: {e}\nconveyor: stopped at the first bad record (--on-error fail); "
                             "fix the input, or use --on-error record, and run again\n")
            return int(ExitCode.SOME_ERRORS)
    finally:
        stopper.uninstall()
        if run is not None:
            run.close()
    summary = result.summary()
    message = f"stopped ({stopper.reason}); {result.message}" if result.status == STOPPED else result.message
    to_stdout = spec.output.path == "-"  # stdout carries the output: everything else goes to stderr
    if cli.quiet:  # warnings and errors only
        warn_missing_keep_fields(summary)
    else:
        _print_summary(summary, message, sys.stderr if to_stdout else sys.stdout)
    if result.profile:
        _print_profile(result.profile, sys.stderr if to_stdout else sys.stdout)
    if cli.summary_json:
        write_summary_json(cli.summary_json, summary)
    if result.output_written and not cli.quiet:
        say("wrote the output to stdout" if to_stdout else f"wrote {spec.output.path}")
    return int(ExitCode[result.status.upper()])


def say(note: str) -> None:
    """A note for the user, on stderr."""
    sys.stderr.write(f"conveyor: {note}\n")


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


def write_summary_json(path: str, summary: dict) -> None:
    try:
        Path(path).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    except OSError as e:  # the run's result stands; only its summary file is missing
        sys.stderr.write(f"conveyor: warning: could not write --summary-json {path} ({e.strerror or e}); the run's "
                         "exit code is unchanged\n")


def _note_loading(model: str) -> None:
    from conveyor.core import EMBEDDED_MODELS, is_embedded_cached

    first_use = model in EMBEDDED_MODELS and not is_embedded_cached(model)
    extra = " (first use: fetching and converting it once, about a minute)" if first_use else ""
    sys.stderr.write(f"conveyor: loading {model}{extra}\n")


def _quiet_libraries() -> None:
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # pragma: no cover - a broken transformers install shows itself at load time
        pass


def _print_summary(summary: dict, message: str, stream=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="conveyor run summary", show_header=False, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("records", summary["records"] if summary.get("samples", summary["records"]) == summary["records"]
         else f"{summary['records']} ({summary['samples']} samples)"),
        ("ok", summary["ok"]), ("errors", summary["errors"]),
        ("prompt tokens", summary["prompt_tokens"]), ("completion tokens", summary["completion_tokens"]),
        ("model load", f"{summary['load_s']:.1f} s"), ("generation", f"{summary['elapsed_s']:.1f} s"),
        ("output tokens/s", f"{summary['output_tokens_per_s']:.1f}"), ("preemptions", summary["preemptions"]),
        ("prefix-cache hit rate", f"{summary['prefix_cache_hit_rate']:.1%}"),
        *_figure_rows(summary),
    ]
    if summary["resumed_from"]:
        rows.append(("resumed from", summary["resumed_from"]))
    if summary.get("continued"):
        rows.append(("continued", f"{summary['continued']} records, {summary['tokens_carried_over']} tokens carried "
                                  "over"))
    if summary.get("in_flight_saved"):
        rows.append(("in flight, saved", f"{summary['in_flight_saved']} records (continued when the run resumes)"))
    for name, value in rows:
        table.add_row(name, str(value))
    stream = stream or sys.stdout
    console = Console(file=stream, width=max(60, Console().width if stream.isatty() else 80))
    console.print(table)
    if message:
        sys.stderr.write(f"conveyor: {message}\n")
    warn_missing_keep_fields(summary)


def _figure_rows(summary: dict) -> list[tuple[str, str]]:
    """The summary table's rows of wall time, model and the latency and occupancy figures (where it has them)."""
    rows = []
    if "wall_s" in summary:
        rows.append(("wall time", f"{summary['wall_s']:.1f} s"))
    if summary.get("model"):
        ran = ", ".join(str(summary[key]) for key in ("dtype", "backend") if summary.get(key))
        rows.append(("model", f"{summary['model']} ({ran})" if ran else summary["model"]))
    for key, name in (("ttft_s", "time to first token"), ("latency_s", "latency"), ("queue_s", "queue time"),
                      ("tpot_s", "time per output token")):
        figures = summary.get(key)
        if figures and any(v is not None for v in figures.values()):
            rows.append((f"{name} {'/'.join(figures)}", _seconds(list(figures.values()))))
    if summary.get("draft_tokens"):
        rows.append(("draft tokens accepted", f"{summary['accepted_draft_tokens']} of {summary['draft_tokens']} "
                                              f"({summary['draft_acceptance_rate']:.0%})"))
    if summary.get("steps"):
        rows.append(("mean running (occupancy)", f"{summary['mean_running']:.1f} ({summary['occupancy']:.0%})"))
        rows.append(("engine steps", summary["steps"]))
    return rows


def _seconds(values: list[float | None]) -> str:
    """'12.3 / 20.1 ms', or in seconds where one is 1 s or more."""
    scale, unit = (1, "s") if max(v or 0 for v in values) >= 1 else (1000, "ms")
    return " / ".join("-" if v is None else f"{v * scale:.{3 if unit == 's' else 1}f}" for v in values) + f" {unit}"


def warn_missing_keep_fields(summary: dict) -> None:
    """A --keep-fields field no record had: its column is all null (a typo, most likely)."""
    for name in summary.get("keep_fields_missing", ()):
        sys.stderr.write(f"conveyor: warning: keep field {name!r} was in no record (its column is all null); check "
                         "--keep-fields\n")


def _print_profile(profile: dict, out) -> None:
    total = profile.get("step_s", 0.0) or 1e-9
    out.write("step time breakdown:\n")
    for key, value in profile.items():
        if key.endswith("_s") and key != "step_s":
            out.write(f"  {key[:-2]:<12} {value:9.3f} s  {value / total:6.1%}\n")
    out.write(f"  {'total':<12} {total:9.3f} s over {int(profile.get('steps', 0))} steps\n")
