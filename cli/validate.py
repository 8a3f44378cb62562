"""`conveyor validate`: parse, template and tokenize every record without running the model.

The records go through `run_records` without an engine, into a sink that counts them, checks ids and compiles
grammars: the same building and checks as a run, no generation.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from collections import Counter
from pathlib import Path

from conveyor.cli.config import build_config
from conveyor.cli.exit_codes import ExitCode
from conveyor.io.journal import Journal
from conveyor.io.request_builder import BuiltRequest
from conveyor.io.sink import RecordSink, record_location
from conveyor.io.rows import duplicate_id_message


class ValidationSink(RecordSink):
    """Counts records and errors, keeps the first `show_errors` messages and a histogram of prompt lengths, and
    checks ids through `ids` (a scratch journal on disk: an input of 100M ids does not fill memory)."""

    COMMIT_EVERY = 50_000  # id claims buffered in memory between writes of the scratch journal

    def __init__(self, tokenizer, show_errors: int, ids: Journal) -> None:
        self.tokenizer = tokenizer
        self.show_errors = show_errors
        self.ids = ids
        self.records = 0
        self.lengths: Counter[int] = Counter()  # prompt length -> records (bounded by the model's context)
        self.errors: list[str] = []
        self.num_errors = 0
        self.grammars = None  # made on the first record with a grammar

    def admit(self, raw, built):
        self.records += 1
        if not isinstance(built, BuiltRequest):
            return self._error(built.error)
        if built.sampling.grammar is not None:
            from conveyor.core.grammar import Grammars

            self.grammars = self.grammars or Grammars(self.tokenizer, len(self.tokenizer))
            try:
                self.grammars.compiled(built.sampling.grammar)
            except ValueError as e:
                return self._error(f"{record_location(raw)}: {e}")
        if built.id_given:
            if not self.ids.claim_id(built.id, built.index):
                return self._error(duplicate_id_message(record_location(raw), built.id))
            if self.records % self.COMMIT_EVERY == 0:
                self.ids.commit()
        self.lengths[len(built.prompt_token_ids)] += 1
        return None  # built and checked; nothing to generate

    def _error(self, message: str) -> None:
        self.num_errors += 1
        if len(self.errors) < self.show_errors:
            self.errors.append(message)
        return None

    def percentile(self, q: float) -> int:
        """The prompt length below which a fraction q of the ok records fall (as sorted(lengths)[int(q * n)])."""
        n = sum(self.lengths.values())
        rank = min(n - 1, int(q * n))
        for length in sorted(self.lengths):
            rank -= self.lengths[length]
            if rank < 0:
                return length
        raise ValueError("no lengths")


def validate(flags: dict, config_path: str | None, show_errors: int) -> int:
    from conveyor.cli.pipeline import sampling_defaults
    from conveyor.cli.run import _quiet_libraries
    from conveyor.core.model_loader import load_tokenizer
    from conveyor.io.readers import open_reader
    from conveyor.io.records_run import run_records
    from conveyor.io.request_builder import BuildOptions, RequestBuilder

    cfg = build_config(flags, config_path)
    reader = open_reader(cfg.input, cfg.input_format, cfg.split, cfg.max_record_bytes)
    _quiet_libraries()
    tokenizer, max_model_len = load_tokenizer(cfg.model)
    builder = RequestBuilder(tokenizer, BuildOptions(
        sampling=sampling_defaults(cfg), seed=cfg.seed, system_prompt=cfg.system_prompt,
        prompt_field=cfg.prompt_field, messages_field=cfg.messages_field, id_field=cfg.id_field,
        max_model_len=max_model_len))
    records = itertools.takewhile(lambda raw: cfg.limit is None or raw.index < cfg.limit, reader)
    with tempfile.TemporaryDirectory(prefix="conveyor-validate-") as scratch, \
            Journal(Path(scratch) / "ids.sqlite") as ids:
        sink = ValidationSink(tokenizer, show_errors, ids)
        run_records(records, builder, None, sink)
    out = sys.stdout
    lengths = sink.lengths
    ok = sum(lengths.values())
    out.write(f"{cfg.input}: {sink.records} records, {ok} ok, {sink.num_errors} errors\n")
    if ok:
        out.write(f"prompt tokens: min {min(lengths)}, median {sink.percentile(0.5)}, p95 {sink.percentile(0.95)}, "
                  f"max {max(lengths)}, total {sum(n * c for n, c in lengths.items())} (model context "
                  f"{max_model_len})\n")
    for message in sink.errors:
        out.write(f"  error: {message}\n")
    if sink.num_errors > len(sink.errors):
        out.write(f"  ... and {sink.num_errors - len(sink.errors)} more\n")
    return int(ExitCode.SOME_ERRORS if sink.num_errors else ExitCode.OK)
