"""`conveyor merge`: the shards' rows into one output file, in input order (io does the work)."""

from __future__ import annotations

import sys

from conveyor.cli.exit_codes import ExitCode


def merge_shards(output: str, run_dir: str | None, output_format: str | None) -> int:
    from conveyor.io.split_run import merge_shards as merge

    result = merge(output, run_dir, output_format)
    errors = f"{result.errors} error rows left out" if result.skipped_errors else f"{result.errors} error rows"
    sys.stderr.write(f"conveyor: merged {result.shards} shards: {result.rows} rows ({errors}) into {output}\n")
    return int(ExitCode.SOME_ERRORS if result.has_error_rows else ExitCode.OK)
