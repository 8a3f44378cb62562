"""Where a run's records become rows: the sink `run_records` feeds (see `records_run.py`).

`RecordSink` is the interface: `admit` (a built record: the request to submit, or None when it became a row),
`finished` (the engine's output of a request: a completion, or its error, a refusal at admission included), `tick`
(time passes) and `close`.
`JournalSink` is the one every run uses: it owns the in-flight join (request id -> the record it answers),
claims ids through the journal (a repeated id is an error row), turns completions and bad records into rows
(`rows.py`), keeps the run's totals and commits by its `CommitPolicy`: each commit also keeps the tokens of the
requests still generating (partials), and a record admitted again continues from its partial, so a stop or a
kill -9 loses no more than the generation since the last commit.

A record with n > 1 is a request per sample (`BuiltRequest.to_generation_request`); its journal row is added once
every sample has finished (`rows.group_row`), and until then its partial holds the rows of the samples that
finished and the tokens of those still generating: each (record, sample) is written exactly once.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.core import GenerationRequest, InFlight, Task, TokenLogprobs
from conveyor.io.records.pooling_builder import BuiltPooling
from conveyor.io.records.readers import RawRecord
from conveyor.io.records.readers.record import location
from conveyor.io.records.record_head import BuiltRecord, ErrorRow
from conveyor.io.records.request_builder import BuiltRequest
from conveyor.io.records.seeds import sample_seed
from conveyor.io.rows.figures import LatencyFigures
from conveyor.io.rows.rows import (
    SAMPLE_INDEX,
    duplicate_id_message,
    error_row,
    group_row,
    ok_row,
    output_rows,
    pooled_row,
)
from conveyor.io.rows.sink_options import ON_ERROR, CommitPolicy
from conveyor.io.state.journal import Journal

DIGEST_KEY = "digest"  # a partial's: the digest of the record it is the state of (continued only for that record)

BUILT = (BuiltRequest, BuiltPooling)  # a record that became a request (generation's, or a pooling task's)


class BadRecordStop(Exception):
    """--on-error fail met a bad record."""


@dataclass
class RunTotals:
    """Counts for the summary and the progress display; this process's generation only for speed."""

    total: int | None = None  # records in the input (after --limit, in this shard), when cheaply known
    done: int = 0  # rows in the journal (committed or pending), all runs together: records
    samples: int = 0  # the output rows those hold (a record with n > 1 has n)
    ok: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    generated_tokens: int = 0  # sampled by this process (continued records' earlier tokens not included)
    load_s: float = 0.0
    first_admit: float | None = None
    last_active: float | None = None  # the last step or finished record
    resumed_from: int = 0  # rows already committed when this process started
    continued: int = 0  # records this process continued from an earlier one's partial (or its finished samples)
    tokens_carried_over: int = 0  # the tokens those partials held
    reuse: dict[str, int] | None = None  # over an input that changed: rows reused, records new and changed, rows removed
    retried_errors: int = 0  # --retry-errors: error rows of the run's own making dropped to compute their records again
    in_flight_saved: int = 0  # records still generating whose tokens the last commit kept (a stop's)
    keep_fields_seen: set[str] = dataclasses.field(default_factory=set)  # --keep-fields some record read here had
    latency: LatencyFigures = dataclasses.field(default_factory=LatencyFigures)  # this process's ok rows' timings
    # this process's ok output rows by finish reason; those whose request had a grammar, and of those the ones
    # max_tokens cut before their grammar was complete (ok rows whose output may not parse)
    finish_reasons: Counter[str] = dataclasses.field(default_factory=Counter)
    structured_outputs: int = 0
    structured_outputs_cut: int = 0

    @property
    def elapsed_s(self) -> float:
        if self.first_admit is None or self.last_active is None:
            return 0.0
        return max(self.last_active - self.first_admit, 0.0)

    @property
    def output_tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class RecordSink:
    def admit(self, raw: RawRecord, built: BuiltRecord | ErrorRow):
        """The GenerationRequest to submit for this record (a list of them for a record with n > 1), or None when
        it became a row here."""
        raise NotImplementedError

    def finished(self, out) -> None:
        """The engine's RequestOutput of a request `admit` returned: a completion, or (`out.error`) what kept it from
        one."""
        raise NotImplementedError

    def tick(self, now: float) -> None:
        """Called between steps."""

    def close(self, completed: bool) -> None:
        """The run ended: all records done (`completed`) or stopped early."""


class JournalSink(RecordSink):
    """`engine_in_flight` (the engine's `in_flight`), where given, is read at every commit: the tokens of the
    requests still generating are committed with the finished rows as partials, and `partials` (the journal's,
    from an earlier process) continue the records they belong to when those are admitted again."""

    def __init__(self, journal: Journal, policy: CommitPolicy = CommitPolicy(), on_error: str = ON_ERROR[0],
                 token_text: Callable[[int], str] = str, totals: RunTotals | None = None,
                 engine_in_flight: Callable[[], dict[str, InFlight]] | None = None,
                 partials: dict[int, dict] | None = None, task: Task = Task.GENERATE, labels: tuple[str, ...] = (),
                 after_commit: Callable[[], None] | None = None) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
        self.journal = journal
        self.policy = policy
        self.on_error = on_error
        self.token_text = token_text
        self.totals = totals if totals is not None else RunTotals()
        self.engine_in_flight = engine_in_flight
        self.partials = dict(partials or {})  # index -> a partial not yet continued
        self.task = Task(task)  # a pooling task's rows are its own (rows.pooled_row); `labels`: a classifier's
        self.labels = labels
        self.after_commit = after_commit  # (a part-file output writes the parts whose records all have rows)
        self.in_flight: dict[str, tuple[BuiltRequest, str, int]] = {}  # request id -> (record, where read, sample)
        self.samples: dict[int, dict[int, dict]] = {}  # index of a record with n > 1 -> its finished samples' rows
        self.sample_digests: dict[int, str | None] = {}  # (and the digest of its record, kept with its partial)
        self._last_commit = time.monotonic()

    def admit(self, raw: RawRecord, built: BuiltRecord | ErrorRow):
        where = location(raw.index, raw.line)
        if isinstance(built, BUILT) and built.id_given and not self.journal.claim_id(built.id, built.index):
            self._bad(built.error_row(duplicate_id_message(where, built.id)), "duplicate", where)
            return None
        if isinstance(built, BUILT):
            if self.totals.first_admit is None:
                self.totals.first_admit = time.monotonic()
            partial = self.partials.pop(built.index, None)
            if isinstance(partial, dict) and partial.get(DIGEST_KEY) != built.digest:
                partial = None  # the state of another record at this index (the input changed): computed anew
            if isinstance(built, BuiltPooling):  # (nothing of it is ever half-done: it runs whole)
                self.in_flight[str(built.index)] = (built, where, 0)
                return built.to_generation_request()
            if built.n > 1:
                return self._admit_samples(built, where, partial)
            self.in_flight[str(built.index)] = (built, where, 0)
            request = self._continued(built.to_generation_request(), partial)
            self.totals.continued += bool(request.output_token_ids)
            return request
        self._bad(built, "input", where)
        return None

    def _admit_samples(self, built: BuiltRequest, where: str, partial: dict | None) -> list[GenerationRequest] | None:
        """A record with n > 1: a request per sample, but for the samples its partial holds finished (their rows
        are kept); a sample it holds tokens of continues from them."""
        saved = partial.get("samples") if isinstance(partial, dict) else None
        saved = saved if isinstance(saved, dict) else {}
        done: dict[int, dict] = {}
        requests = []
        for k in range(built.n):
            state = saved.get(str(k))
            row = state.get("row") if isinstance(state, dict) else None
            if isinstance(row, dict) and row.get("index") == built.index and row.get(SAMPLE_INDEX) == k and \
                    row.get("status") in ("ok", "error"):
                done[k] = row
                continue
            request = self._continued(built.to_generation_request(k), state)
            self.in_flight[request.req_id] = (built, where, k)
            requests.append(request)
        self.totals.continued += bool(done) or any(r.output_token_ids for r in requests)
        self.samples[built.index] = done
        self.sample_digests[built.index] = built.digest
        if not requests:  # (every sample had finished: the row was due at the next commit)
            self._sample_done(built, where, None, None)
            return None
        return requests

    def _continued(self, request: GenerationRequest, partial: dict | None) -> GenerationRequest:
        """`request`, continuing from its partial where it has one that fits it (one that does not, from a
        journal edited by hand, is dropped: the request starts over)."""
        state = partial_state(partial, request.sampling)
        if state is None:
            return request
        self.totals.tokens_carried_over += len(state.output_token_ids)
        return dataclasses.replace(request, output_token_ids=state.output_token_ids,
                                   output_logprobs=state.output_logprobs)

    def _failed(self, built: BuiltRequest, where: str, sample: int, e: ErrorRow) -> None:
        """A request that could not run (refused, or its grammar) or broke a step: the record's error row, or its
        sample's."""
        if built.n == 1:
            self._bad(e, "run", where)
            return
        if self.on_error == "fail":
            self.journal.commit()
            raise BadRecordStop(e.error)
        self._sample_done(built, where, sample, error_row(e))

    def _sample_done(self, built: BuiltRequest, where: str, sample: int | None, row: dict | None) -> None:
        """Sample `sample` of a record with n > 1 ended as `row`; the record's row once all n have."""
        done = self.samples[built.index]
        if row is not None:
            row[SAMPLE_INDEX] = sample
            row["seed"] = sample_seed(built.sampling.seed, sample) if sample else built.sampling.seed
            done[sample] = row
        if len(done) == built.n:
            del self.samples[built.index]
            self.sample_digests.pop(built.index, None)
            row = group_row([done[k] for k in range(built.n)], where if built.id_given else None)
            self._add(row, built.digest, built.sampling.grammar is not None, "run" if row["status"] == "error" else None,
                      where, id_given=built.id_given)

    def _bad(self, e: ErrorRow, origin: str, where: str) -> None:
        """The error row of a record read at `where`; `origin` what made it ("input": the record, "duplicate": its
        id, "run": the run, which --retry-errors computes again)."""
        if self.on_error == "fail":
            self.journal.commit()
            raise BadRecordStop(e.error)
        self._add(error_row(e), e.digest, origin=origin, place=where, id_given=e.id_given)

    def finished(self, out) -> None:
        built, where, k = self.in_flight.pop(out.req_id)
        if out.error is not None:  # it could not run (refused, or its grammar), or its own data broke a step
            self._failed(built, where, k, built.error_row(f"{where}: {out.error}", out.num_prompt_tokens))
            return
        if isinstance(built, BuiltPooling):
            self._add(pooled_row(built, out, self.task, self.labels, where), built.digest, place=where,
                      id_given=built.id_given)
            self.totals.last_active = time.monotonic()
            return
        row = ok_row(built, out, self.token_text, where)
        if built.n == 1:
            self._add(row, built.digest, built.sampling.grammar is not None, place=where, id_given=built.id_given)
        else:
            self._sample_done(built, where, k, row)
        self.totals.last_active = time.monotonic()

    def _add(self, row: dict[str, Any], digest: str | None, structured: bool = False, origin: str | None = None,
             place: str | None = None, *, id_given: bool) -> None:
        """`row` into the journal and the totals (`structured`: its request had a grammar; `origin`, `place` and
        `id_given` as Journal.add takes them)."""
        self.journal.add(row, digest, origin, place, claim_id=id_given)
        t = self.totals
        t.done += 1
        if row["status"] == "ok":
            t.ok += 1
        else:
            t.errors += 1
        for sample in output_rows(row):
            t.samples += 1
            if sample["status"] == "ok":
                t.prompt_tokens += sample["prompt_tokens"]
                t.completion_tokens += sample.get("completion_tokens") or 0
                t.latency.add_row(sample)
                if sample.get("finish_reason") is not None:  # (a pooling row has none)
                    t.finish_reasons[sample["finish_reason"]] += 1
                if structured:
                    t.structured_outputs += 1
                    # an ok row's error column holds its note: here, that its grammar did not complete
                    t.structured_outputs_cut += sample["finish_reason"] == "length" and sample["error"] is not None

    def tick(self, now: float) -> None:
        """Between steps: commit by the policy (rows, and partials, every `every_seconds` whatever finished)."""
        self.totals.last_active = now
        pending = self.journal.pending
        if (pending and self.policy.every_rows and pending >= self.policy.every_rows) or \
                now - self._last_commit >= self.policy.every_seconds:
            self.commit(now)

    def commit(self, now: float | None = None) -> None:
        """Commit the finished rows and, with them, the tokens of the requests still generating."""
        if self.engine_in_flight is not None:
            partials: dict[int, dict] = {}
            for req_id, state in self.engine_in_flight().items():
                entry = self.in_flight.get(req_id)
                if entry is None:
                    continue
                built, _, k = entry
                if built.n == 1:
                    partials[built.index] = {**partial_json(state), DIGEST_KEY: built.digest}
                else:  # a record with n > 1: {"samples": {k: tokens, or the row of a finished sample}}
                    partials.setdefault(built.index, {"samples": {}, DIGEST_KEY: built.digest})["samples"][str(k)] = \
                        partial_json(state)
            for index, done in self.samples.items():
                for k, row in done.items():
                    partials.setdefault(index, {"samples": {}, DIGEST_KEY: self.sample_digests.get(index)})["samples"][
                        str(k)] = {"row": row}
            self.journal.set_partials(partials)
            self.totals.in_flight_saved = len(partials)
        self.journal.commit()
        if self.after_commit is not None:
            self.after_commit()
        self._last_commit = time.monotonic() if now is None else now

    def close(self, completed: bool) -> None:
        self.commit()


def partial_json(state: InFlight) -> dict:
    """A request's InFlight as the journal keeps it: its tokens, and its logprobs where it asks for them."""
    logprobs = None if state.output_logprobs is None else [
        [lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in state.output_logprobs]
    return {"tokens": list(state.output_token_ids), "logprobs": logprobs}


def partial_state(partial: dict | None, sampling) -> InFlight | None:
    """The InFlight a journal's partial holds, where it fits a request of `sampling` (None otherwise)."""
    if not isinstance(partial, dict):
        return None
    tokens, logprobs = partial.get("tokens"), partial.get("logprobs")
    if not isinstance(tokens, list) or not tokens or len(tokens) >= sampling.max_tokens or \
            not all(type(t) is int for t in tokens):
        return None
    if (logprobs is None) != (sampling.logprobs is None):
        return None
    try:
        decoded = None if logprobs is None else tuple(
            TokenLogprobs(int(t), float(v), tuple((int(a), float(b)) for a, b in top)) for t, v, top in logprobs)
    except (TypeError, ValueError):
        return None
    if decoded is not None and len(decoded) != len(tokens):
        return None
    return InFlight(tuple(tokens), decoded)
