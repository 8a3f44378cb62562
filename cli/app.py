"""The Typer app: registers the commands; `main()` is the single place exceptions become exit codes."""

from __future__ import annotations

import os
import sys
import traceback

import typer

from conveyor.cli.exit_codes import ExitCode, code_for
from conveyor.cli.run import EXAMPLES, run_command
from conveyor.cli.run_info import set_command_line

app = typer.Typer(
    name="conveyor",
    help="Offline LLM batch inference over large datasets: prompts in, completions out, resumable.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("run", epilog=EXAMPLES)(run_command)


@app.command("validate")
def validate_command(
    input: str = typer.Argument(..., help="Prompts file to check, as for `conveyor run`."),
    config: str = typer.Option(None, "--config", "-c", help="YAML file of options, as for `conveyor run`."),
    model: str = typer.Option(None, help="Model whose tokenizer and context length to check against."),
    max_tokens: int = typer.Option(None, help="Most tokens to generate per record. \\[default: 256]"),
    system_prompt: str = typer.Option(None, help="System message for chat records that have none."),
    prompt_field: str = typer.Option(None, help="Field holding a raw prompt. \\[default: prompt]"),
    messages_field: str = typer.Option(None, help="Field holding chat messages. \\[default: messages]"),
    id_field: str = typer.Option(None, help="Field holding the record id. \\[default: id]"),
    input_format: str = typer.Option(None, help="jsonl, json, parquet, csv or datasets."),
    split: str = typer.Option(None, help="Split of a hub dataset."),
    limit: int = typer.Option(None, help="Only the first N records."),
    max_record_bytes: str = typer.Option(None, help="A record bigger than this (e.g. 4MiB) is an error. \\[default: 4MiB]"),
    show_errors: int = typer.Option(10, help="How many error messages to print."),
) -> int:
    """Parse, template and tokenize every record without running the model; exit 0 or 3."""
    from conveyor.cli.validate import validate

    return validate(dict(input=input, output="-", model=model, max_tokens=max_tokens, system_prompt=system_prompt,
                         prompt_field=prompt_field, messages_field=messages_field, id_field=id_field,
                         input_format=input_format, split=split, limit=limit, max_record_bytes=max_record_bytes),
                    config, show_errors)


@app.command("status")
def status_command(
    output: str = typer.Argument(..., help="The output file of a run (its run directory is <output>.conveyor)."),
    run_dir: str = typer.Option(None, help="The run directory, if not the default."),
) -> int:
    """Show a run's progress: done / total, errors, last checkpoint, whether it is running, how to resume."""
    from conveyor.cli.status import show_status

    return show_status(output, run_dir)


@app.command("merge")
def merge_command(
    output: str = typer.Option(..., "--output", "-o", help="The output file the shards were run for."),
    run_dir: str = typer.Option(None, help="The run directory the shards used (default: <output>.conveyor)."),
    output_format: str = typer.Option(None, help="parquet, jsonl or openai-batch (default: the shards')."),
) -> int:
    """Write OUTPUT from the shards of `conveyor run ... --shard I/N`, in input order; refuses while a shard is
    missing, unfinished or run with other settings."""
    from conveyor.cli.merge import merge_shards

    return merge_shards(output, run_dir, output_format)


@app.command("models")
def models_command() -> int:
    """List the embedded models and whether each is cached."""
    from conveyor.core.model_loader import EMBEDDED_MODELS, cache_dir, is_embedded_cached

    for name, spec in EMBEDDED_MODELS.items():
        state = "cached" if is_embedded_cached(name) else "not cached (fetched from PyPI on first use)"
        typer.echo(f"{name}\t{state}\t{spec.description}")
    typer.echo(f"cache: {cache_dir() / 'models'}")
    return 0


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
        text += "; fix the cause (free disk space, permissions) and run the same command again to resume"
    return text.splitlines()[0]


def main(argv: list[str] | None = None) -> None:
    """Run the app and exit with DESIGN.md's codes; usage errors are one line, no traceback."""
    debug = os.environ.get("CONVEYOR_DEBUG") == "1"
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:
        args.remove("--debug")
        debug = True
    set_command_line(args)
    command = typer.main.get_command(app)
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
        hint = " (run with --debug for the traceback)" if code == ExitCode.FATAL and not debug else ""
        sys.stderr.write(f"conveyor: error: {_one_line(e)}{hint}\n")
    sys.exit(int(code or 0))


def _one_line_text(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())
