"""`conveyor validate`: parse, template and tokenize every record without running the model (io's
`validate_run`), and report what was found."""

from __future__ import annotations

import sys

from conveyor.cli.config import build_config
from conveyor.cli.exit_codes import ExitCode
from conveyor.io.counts import counted


def validate(flags: dict, config_path: str | None, show_errors: int) -> int:
    from conveyor.cli.notes import quiet_libraries, say
    from conveyor.io.validate_run import validate_run

    spec = build_config(flags, config_path).spec
    quiet_libraries()
    report = validate_run(spec, show_errors, say)
    sink = report.sink
    out = sys.stdout
    lengths = sink.lengths
    ok = sink.num_ok
    out.write(f"{spec.input.path}: {counted(sink.records, 'record')}, {ok} ok, {counted(sink.num_errors, 'error')}\n")
    if ok:
        out.write(f"prompt tokens: min {min(lengths)}, median {sink.percentile(0.5)}, p95 {sink.percentile(0.95)}, "
                  f"max {max(lengths)}, total {sum(n * c for n, c in lengths.items())} (model context "
                  f"{report.max_model_len})\n")
    if sink.first_prompt is not None:
        where, text = sink.first_prompt
        out.write(f"first prompt ({where}), as the model gets it:\n{prompt_block(text)}\n")
    for message in sink.errors:
        out.write(f"  error: {message}\n")
    if sink.num_errors > len(sink.errors):
        out.write(f"  ... and {sink.num_errors - len(sink.errors)} more\n")
    return int(ExitCode.SOME_ERRORS if sink.num_errors else ExitCode.OK)


def prompt_block(text: str, max_lines: int = 24, max_chars: int = 2000) -> str:
    """A prompt, each line indented behind "| ", cut to its first `max_lines` lines and `max_chars` characters."""
    shown = text[:max_chars]
    lines = shown.split("\n")[:max_lines]
    block = "\n".join("  | " + line for line in lines)
    hidden = len(text) - len("\n".join(lines))
    return block + (f"\n  ... ({hidden} more characters)" if hidden > 0 else "")
