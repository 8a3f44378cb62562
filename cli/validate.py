"""`conveyor validate`: parse, template and tokenize every record without running the model."""

from __future__ import annotations

import sys

from conveyor.cli.config import build_config
from conveyor.cli.exit_codes import ExitCode


def validate(flags: dict, config_path: str | None, show_errors: int) -> int:
    from conveyor.cli.pipeline import sampling_defaults, record_location
    from conveyor.cli.run import _quiet_libraries
    from conveyor.core.model_loader import load_tokenizer
    from conveyor.io.readers import open_reader
    from conveyor.io.request_builder import BuildOptions, BuiltRequest, RequestBuilder

    cfg = build_config(flags, config_path)
    reader = open_reader(cfg.input, cfg.input_format, cfg.split, cfg.max_record_bytes)
    _quiet_libraries()
    tokenizer, max_model_len = load_tokenizer(cfg.model)
    builder = RequestBuilder(tokenizer, BuildOptions(
        sampling=sampling_defaults(cfg), seed=cfg.seed, system_prompt=cfg.system_prompt,
        prompt_field=cfg.prompt_field, messages_field=cfg.messages_field, id_field=cfg.id_field,
        max_model_len=max_model_len))
    lengths: list[int] = []
    errors: list[str] = []
    num_errors = 0
    seen: dict[str, int] = {}
    grammars = None  # made on the first record with a grammar
    records = 0
    for raw in reader:
        if cfg.limit is not None and raw.index >= cfg.limit:
            break
        records += 1
        built = builder.build(raw)
        if isinstance(built, BuiltRequest) and built.sampling.grammar is not None:
            from conveyor.core.grammar import Grammars

            grammars = grammars or Grammars(tokenizer, len(tokenizer))
            try:
                grammars.compiled(built.sampling.grammar)
            except ValueError as e:
                num_errors += 1
                if len(errors) < show_errors:
                    errors.append(f"{record_location(raw)}: {e}")
                continue
        if isinstance(built, BuiltRequest):
            if built.id_given and seen.setdefault(built.id, built.index) != built.index:
                num_errors += 1
                if len(errors) < show_errors:
                    errors.append(f"{record_location(raw)}: duplicate id {built.id!r}")
                continue
            lengths.append(len(built.prompt_token_ids))
        else:
            num_errors += 1
            if len(errors) < show_errors:
                errors.append(built.error)
    out = sys.stdout
    out.write(f"{cfg.input}: {records} records, {len(lengths)} ok, {num_errors} errors\n")
    if lengths:
        lengths.sort()
        pct = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]  # noqa: E731
        out.write(f"prompt tokens: min {lengths[0]}, median {pct(0.5)}, p95 {pct(0.95)}, max {lengths[-1]}, "
                  f"total {sum(lengths)} (model context {max_model_len})\n")
    for message in errors:
        out.write(f"  error: {message}\n")
    if num_errors > len(errors):
        out.write(f"  ... and {num_errors - len(errors)} more\n")
    return int(ExitCode.SOME_ERRORS if num_errors else ExitCode.OK)
