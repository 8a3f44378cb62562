"""The Typer app: registers the commands; `main()` is the single place exceptions become exit codes."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Annotated

import typer

from conveyor.cli import options as opt
from conveyor.cli.command_line import set_command_line
from conveyor.cli.config import choices_text, default_text
from conveyor.cli.exit_codes import ExitCode, code_for, explained, message_for
from conveyor.cli.repeated_options import merge_repeated_options
from conveyor.cli.run import EXAMPLES, run_command

app = typer.Typer(
    name="conveyor",
    help="Offline LLM batch inference over large datasets: prompts in, completions out, resumable.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("run", epilog=EXAMPLES)(run_command)


def _show_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"conveyor {version('conveyor')}")
        except PackageNotFoundError:  # a source tree never installed
            typer.echo("conveyor (version unknown: not installed)")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="Print conveyor's version and exit.",
                                       callback=_show_version, is_eager=True)) -> None:
    """Offline LLM batch inference over large datasets: prompts in, completions out, resumable."""


# `conveyor validate`'s options: those of `conveyor run` that shape a record, and its own.
VALIDATE_OPTIONS = (
    opt.param("input", opt.InputArg, opt.REQUIRED), *opt.RECORD_OPTIONS, opt.param("max_tokens", opt.MaxTokensOpt),
    opt.param("task", opt.TaskOpt), opt.param("dimensions", opt.DimensionsOpt),
    opt.param("schedule", opt.ScheduleOpt),
    opt.param("show_errors", Annotated[int, typer.Option(help="How many error messages to print.")], 10),
)


@app.command("validate")
@opt.takes(*VALIDATE_OPTIONS)
def validate_command(**flags) -> int:
    """Parse, template and tokenize every record as `conveyor run` would (the model's tokenizer and context
    length, no generation); exit 0 or 3."""
    from conveyor.cli.validate import validate

    config_path, show = flags.pop("config"), flags.pop("show_errors")
    return validate({**flags, "output": "-"}, config_path, show)


@app.command("status")
def status_command(
    output: str = typer.Argument(..., help="The output of a run (its run directory is <output>.conveyor), or the "
                                 "run directory itself."),
    run_dir: str = typer.Option(None, help="The run directory, if not the default (an output in object storage: the "
                                           "--run-dir its run was given)."),
) -> int:
    """Show a run's progress: done / total, errors, tokens held in flight, last checkpoint, whether it is running,
    how to resume. Exit 0: finished (the output is written); 75: not finished, resumable; 2: no run there."""
    from conveyor.cli.status import show_status

    return show_status(output, run_dir)


@app.command("merge")
def merge_command(
    output_arg: str = typer.Argument(None, metavar="OUTPUT", help="The output file the shards were run for (as "
                                     "`conveyor status` takes it)."),
    output_opt: str = typer.Option(None, "--output", "-o", help="The same, as an option."),
    run_dir: str = typer.Option(None, help="The run directory the shards used (default: <output>.conveyor)."),
    output_format: str = typer.Option(None, help="parquet, jsonl or openai-batch (default: the shards')."),
) -> int:
    """Write OUTPUT from the shards of `conveyor run ... --shard I/N`, in input order; refuses while a shard is
    missing, unfinished or run with other settings."""
    from conveyor.cli.exit_codes import UsageError
    from conveyor.cli.merge import merge_shards

    if (output_arg is None) == (output_opt is None):
        raise UsageError("conveyor merge: name the output file once, as OUTPUT or with -o")
    return merge_shards(output_arg or output_opt, run_dir, output_format)


@app.command("models")
def models_command(check: str | None = typer.Option(
        None, "--check", metavar="MODEL",
        help="Read only MODEL's config (a folder, a .gguf file, a hub id), its weight files' headers and its tokenizer, "
             "and say what `conveyor run` does with it: the task, and for generation the route on each backend, the "
             "attention, the context and the chat template; for a pooling task the pooling, normalization, vector "
             "size or labels, length limit and route; or why run would refuse it (exit 2 if it would)."),
        task: str | None = typer.Option(
            None, "--task", help=f"With --check: the task to check MODEL for, as `conveyor run --task` takes it: "
            f"{choices_text('task')}. {default_text('task', 'auto: what run does with MODEL where its input does not choose')}")
        ) -> int:
    """List the embedded models and whether each is cached; or, with --check, what conveyor makes of a model."""
    from conveyor.cli.models import models

    return models(check, task)


def _one_line(exc: BaseException) -> str:
    text = message_for(exc).strip() or type(exc).__name__
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
        text += "; fix the cause (free disk space, permissions) and run the same command again to resume"
    return text.splitlines()[0]


def main(argv: list[str] | None = None) -> None:
    """Run the app and exit with the exit codes' table (exit_codes.py); usage errors are one line, no traceback."""
    debug = os.environ.get("CONVEYOR_DEBUG") == "1"
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:
        args.remove("--debug")
        debug = True
    set_command_line(args)
    command = typer.main.get_command(app)
    _untyped_switches(command)
    args, warnings = merge_repeated_options(command, args)
    for warning in warnings:
        sys.stderr.write(f"conveyor: warning: {warning}\n")
    try:
        code = command.main(args=args, prog_name="conveyor", standalone_mode=False)
    except typer.Exit as e:
        code = e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        sys.stderr.write("conveyor: interrupted\n")
        code = ExitCode.INTERRUPTED
    except typer.TyperException as e:  # the command line itself is wrong: bad option, missing argument
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError":  # `conveyor` alone: the help was shown
            code = ExitCode.OK
        else:
            name = getattr(ctx, "info_name", None)
            where = f"conveyor {name}" if name and name != "conveyor" else "conveyor"
            sys.stderr.write(f"{where}: error: {_one_line_text(e.format_message())} (see {where} --help)\n")
            code = ExitCode.USAGE
    except Exception as e:  # noqa: BLE001 - the one boundary
        if debug:
            traceback.print_exc()
        code = code_for(e)
        hint = " (run with --debug for the traceback)" if code == ExitCode.FATAL and not debug and not explained(e) \
            else ""
        sys.stderr.write(f"conveyor: error: {_one_line(e)}{hint}\n")
    if argv is None:  # the process itself (not a caller's in-process run): a grammar may still be compiling
        _exit_now_if_compiling(int(code or 0))
    sys.exit(int(code or 0))


def _untyped_switches(command) -> None:
    """--help shows a switch (--quiet, --restart, --help) as its name alone: it takes no value, so no `<bool>`."""
    for cmd in (command, *command.commands.values()):
        for param in (*cmd.params, cmd.get_help_option(typer.Context(cmd))):
            if param is not None and getattr(param, "is_flag", False):
                param.metavar = ""


def _exit_now_if_compiling(code: int) -> None:
    """End the process with `code` at once where a grammar still compiles on a worker thread (a stop or a given-up
    grammar left it): the interpreter's finalizers would abort under it. Every file is written and closed by now."""
    from conveyor.core import compiling

    if compiling():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _one_line_text(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())
