"""`conveyor validate`'s sink: every record built and checked as a run would (ids, grammars, lengths), none
generated. `Run.validate` feeds it through `run_records` without an engine.
"""

from __future__ import annotations

from collections import Counter

from conveyor.core import EngineConfig, Grammars
from conveyor.io.records.pooling_builder import BuiltPooling
from conveyor.io.records.readers.record import location
from conveyor.io.records.record_head import ErrorRow
from conveyor.io.rows.rows import duplicate_id_message
from conveyor.io.rows.sink import RecordSink
from conveyor.io.state.journal import Journal


class ValidationSink(RecordSink):
    """Counts records and errors, keeps the first `show_errors` messages and a histogram of prompt lengths, and
    checks ids through `ids` (a scratch journal on disk: an input of 100M ids does not fill memory)."""

    COMMIT_EVERY = 50_000  # id claims buffered in memory between writes of the scratch journal

    def __init__(self, tokenizer, show_errors: int, ids: Journal, engine: EngineConfig = EngineConfig()) -> None:
        self.tokenizer = tokenizer
        self.engine = engine  # its grammar limits apply here too
        self.show_errors = show_errors
        self.ids = ids
        self.records = 0
        self.lengths: Counter[int] = Counter()  # prompt length -> records (bounded by the model's context)
        self.errors: list[str] = []
        self.num_errors = 0
        self.grammars: Grammars | None = None  # made on the first record with a grammar
        # The first ok record's place and its prompt as the model gets it (decoded, special tokens shown).
        self.first_prompt: tuple[str, str] | None = None

    def admit(self, raw, built):
        self.records += 1
        if isinstance(built, ErrorRow):
            return self._error(built.error)
        prompts = [s.token_ids for s in built.request.sequences] if isinstance(built, BuiltPooling) else \
            [built.prompt_token_ids]
        if built.sampling.grammar is not None:
            self.grammars = self.grammars or Grammars(self.tokenizer, len(self.tokenizer),
                                                      self.engine.max_grammar_compile_s, self.engine.max_grammar_bytes)
            try:
                self.grammars.compiled(built.sampling.grammar)
            except ValueError as e:
                return self._error(f"{location(raw.index, raw.line)}: {e}")
        if built.id_given:
            if not self.ids.claim_id(built.id, built.index):
                return self._error(duplicate_id_message(location(raw.index, raw.line), built.id))
            if self.records % self.COMMIT_EVERY == 0:
                self.ids.commit()
        for tokens in prompts:
            self.lengths[len(tokens)] += 1
        if self.first_prompt is None:
            self.first_prompt = (location(raw.index, raw.line),
                                 self.tokenizer.decode(prompts[0], skip_special_tokens=False))
        return None  # built and checked; nothing to generate

    def _error(self, message: str) -> None:
        self.num_errors += 1
        if len(self.errors) < self.show_errors:
            self.errors.append(message)
        return None

    @property
    def num_ok(self) -> int:
        return self.records - self.num_errors

    def percentile(self, q: float) -> int:
        """The prompt length below which a fraction q of the ok prompts fall (as sorted(lengths)[int(q * n)]); a
        pooling record's several inputs count one each."""
        n = sum(self.lengths.values())
        rank = min(n - 1, int(q * n))
        for length in sorted(self.lengths):
            rank -= self.lengths[length]
            if rank < 0:
                return length
        raise ValueError("no lengths")
