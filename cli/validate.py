"""`conveyor validate`: parse, template and tokenize every record without running the model (io's
`Run.validate`), and report what was found."""

from __future__ import annotations

import sys

from conveyor.cli.config import build_config
from conveyor.cli.exit_codes import ExitCode


def validate(flags: dict, config_path: str | None, show_errors: int) -> int:
    from conveyor.cli.run import _quiet_libraries
    from conveyor.io.run import Run

    spec = build_config(flags, config_path).spec
    _quiet_libraries()
    report = Run(spec).validate(show_errors)
    sink = report.sink
    out = sys.stdout
    lengths = sink.lengths
    ok = sink.num_ok
    out.write(f"{spec.input.path}: {sink.records} records, {ok} ok, {sink.num_errors} errors\n")
    if ok:
        out.write(f"prompt tokens: min {min(lengths)}, median {sink.percentile(0.5)}, p95 {sink.percentile(0.95)}, "
                  f"max {max(lengths)}, total {sum(n * c for n, c in lengths.items())} (model context "
                  f"{report.max_model_len})\n")
    for message in sink.errors:
        out.write(f"  error: {message}\n")
    if sink.num_errors > len(sink.errors):
        out.write(f"  ... and {sink.num_errors - len(sink.errors)} more\n")
    return int(ExitCode.SOME_ERRORS if sink.num_errors else ExitCode.OK)
