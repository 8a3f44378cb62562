"""`conveyor merge`: the shards' rows into one output file, in input order (io/shards.py does the work)."""

from __future__ import annotations

import sys
from pathlib import Path

from conveyor.cli.exit_codes import ExitCode


def merge_shards(output: str, run_dir: str | None, output_format: str | None) -> int:
    from conveyor.io.run_dir import RunDir
    from conveyor.io.shards import merge
    from conveyor.io.writers import infer_output_format

    if output_format is not None:
        output_format = infer_output_format(output, output_format)
    result = merge(Path(run_dir) if run_dir else RunDir.default_for(output), output, output_format)
    errors = f"{result.errors} error rows left out" if result.skipped_errors else f"{result.errors} error rows"
    sys.stderr.write(f"conveyor: merged {result.shards} shards: {result.rows} rows ({errors}) into {output}\n")
    return int(ExitCode.SOME_ERRORS if result.has_error_rows else ExitCode.OK)
