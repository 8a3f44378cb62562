"""`conveyor merge`: the shards' rows into one output file, in input order (io does the work)."""

from __future__ import annotations

import sys

from conveyor.io.counts import counted


def merge_shards(output: str, run_dir: str | None, output_format: str | None) -> int:
    from conveyor.cli.summary import exit_code
    from conveyor.io.split_run import merge_shards as merge

    result = merge(output, run_dir, output_format)
    errors = counted(result.errors, "error row") + (" left out" if result.skipped_errors else "")
    sys.stderr.write(f"conveyor: merged {counted(result.shards, 'shard')}: {counted(result.rows, 'row')} ({errors}) "
                     f"into {output}\n")
    return exit_code(result.outcome)
