"""The output row: its columns and their Arrow types, and how a finished request or a bad record becomes one.

The one place that defines a row. `writers.py` writes these columns, the journal stores rows as built here,
and `conveyor merge` reads them back; nothing else spells a column name. Imports neither torch nor pyarrow at
module level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conveyor.io.records.readers.record import location

# Rows may carry the request kind ("chat" or "completion") under this key, for openai-batch output, and where
# the record was read ("line 12", "record 12") under the other, for a duplicate id found when shards merge.
# Neither is an output column.
KIND_KEY = "__conveyor_kind"
WHERE_KEY = "__conveyor_where"
# A record with n > 1 is one journal row (its record-level "id", "index", "status": "error" where a sample is an
# error row, and WHERE_KEY) holding its n sample rows, each with its "sample_index", under this key; `output_rows`
# gives them back as the output's rows.
SAMPLES_KEY = "__conveyor_samples"
OUTPUT_COLUMNS = ("id", "index", "status", "output", "finish_reason", "prompt_tokens", "completion_tokens",
                  "error", "seed", "queue_s", "ttft_s", "latency_s")
# Columns a run has where its records asked for them (the caller says which), between the fixed ones and the
# keep fields: per token {token, id, logprob, top: [{token, id, logprob}]}.
OPTIONAL_COLUMNS = ("logprobs", "prompt_logprobs", "prompt_logprob_sum", "sample_index", "reasoning",
                    "prompt_tokens_truncated",  # the prompt tokens truncation cut
                    "draft_tokens", "accepted_draft_tokens")  # --speculative: fed to the model, and accepted
SAMPLE_INDEX = "sample_index"  # 0 to n - 1; a run's files have it where some record has n > 1, or --n > 1


def base_schema():
    """The Arrow schema of the fixed output columns (keep fields are appended per file)."""
    import pyarrow as pa

    string, int64, float64 = pa.string(), pa.int64(), pa.float64()
    types = (string, int64, string, string, string, int64, int64, string, int64, float64, float64, float64)
    return pa.schema(list(zip(OUTPUT_COLUMNS, types)))


def optional_schema(name: str):
    """The Arrow type of an optional column."""
    import pyarrow as pa

    if name == "prompt_logprob_sum":
        return pa.float64()
    if name == "reasoning":  # the output's reasoning section (--reasoning-parser), null where it had none
        return pa.string()
    if name in (SAMPLE_INDEX, "prompt_tokens_truncated", "draft_tokens", "accepted_draft_tokens"):
        return pa.int64()
    alternative = pa.struct([("token", pa.string()), ("id", pa.int64()), ("logprob", pa.float64())])
    return pa.list_(pa.struct([("token", pa.string()), ("id", pa.int64()), ("logprob", pa.float64()),
                               ("top", pa.list_(alternative))]))


def error_row(e) -> dict[str, Any]:
    """The row of a record that could not run (`request_builder.ErrorRow`)."""
    row = {"id": e.id, "index": e.index, "status": "error", "output": None, "finish_reason": None,
           "prompt_tokens": e.prompt_tokens, "completion_tokens": 0, "error": e.error, "seed": e.seed,
           "queue_s": None, "ttft_s": None, "latency_s": None, KIND_KEY: None, **e.kept}
    if e.prompt_tokens_truncated is not None:
        row["prompt_tokens_truncated"] = e.prompt_tokens_truncated
    return row


def ok_row(b, out, token_text: Callable[[int], str] = str, where: str | None = None) -> dict[str, Any]:
    """The row of a completion: `b` the record's `request_builder.BuiltRequest`, `out` the engine's
    RequestOutput; `token_text` names tokens in its logprobs; `where` the record's place in the input."""
    row = {"id": b.id, "index": b.index, "status": "ok", "output": out.text, "finish_reason": out.finish_reason,
           "prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens, "error": out.note,
           "seed": b.sampling.seed, "queue_s": round(out.queue_s, 6), "ttft_s": round(out.ttft_s, 6),
           "latency_s": round(out.latency_s, 6), KIND_KEY: b.kind, **b.kept}
    if where is not None and b.id_given:
        row[WHERE_KEY] = where
    if b.prompt_tokens_truncated is not None:
        row["prompt_tokens_truncated"] = b.prompt_tokens_truncated
    if b.sampling.reasoning is not None:
        row["reasoning"] = out.reasoning
    if out.num_draft_tokens is not None:
        row["draft_tokens"] = out.num_draft_tokens
        row["accepted_draft_tokens"] = out.num_accepted_draft_tokens
    if out.logprobs is not None:
        row["logprobs"] = [_logprob_entry(lp, token_text) for lp in out.logprobs]
    if out.prompt_logprobs is not None:
        row["prompt_logprobs"] = [
            _logprob_entry(lp, token_text) if lp is not None
            else {"token": token_text(token), "id": token, "logprob": None, "top": []}
            for lp, token in zip(out.prompt_logprobs, b.prompt_token_ids)]
        row["prompt_logprob_sum"] = sum(lp.logprob for lp in out.prompt_logprobs if lp is not None)
    return row


def group_row(samples: list[dict], where: str | None) -> dict[str, Any]:
    """The journal row of a record with n > 1: its sample rows (in sample order, each with its sample_index) under
    SAMPLES_KEY; status "error" where one of them is an error row. `where`: the record's place, where it has an id."""
    first = samples[0]
    row = {"id": first["id"], "index": first["index"],
           "status": "ok" if all(s["status"] == "ok" for s in samples) else "error", SAMPLES_KEY: samples}
    if where is not None:
        row[WHERE_KEY] = where
    return row


def output_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A journal row as the output's rows: a record with n > 1 its sample rows, any other itself (sample 0)."""
    return row[SAMPLES_KEY] if SAMPLES_KEY in row else [row]


def without_errors(row: dict[str, Any]) -> dict[str, Any] | None:
    """A journal row without its error rows (--on-error skip): None where nothing is left."""
    if SAMPLES_KEY not in row:
        return None if row["status"] == "error" else row
    kept = [s for s in row[SAMPLES_KEY] if s["status"] != "error"]
    return {**row, "status": "ok", SAMPLES_KEY: kept} if kept else None


def duplicate_id_message(where: str, record_id: str) -> str:
    return f"{where}: duplicate id {record_id!r} (first seen earlier in the input); make ids unique or use --id-field"


def duplicate_id_row(row: dict[str, Any]) -> dict[str, Any]:
    """An ok `row` turned into the row its record gets when an earlier record holds its id: the row a single
    run gives it (shards find such ids only when they merge): one error row, for a record with n > 1 too."""
    if SAMPLES_KEY in row:
        row = {**row[SAMPLES_KEY][0], WHERE_KEY: row.get(WHERE_KEY)}
    out = {k: v for k, v in row.items() if k not in OPTIONAL_COLUMNS and k != WHERE_KEY}
    out.update(status="error", output=None, finish_reason=None, prompt_tokens=None, completion_tokens=0,
               queue_s=None, ttft_s=None, latency_s=None, **{KIND_KEY: None},
               error=duplicate_id_message(row.get(WHERE_KEY) or location(row["index"]), row["id"]))
    return out


def _logprob_entry(lp, token_text: Callable[[int], str]) -> dict[str, Any]:
    return {"token": token_text(lp.token_id), "id": lp.token_id, "logprob": lp.logprob,
            "top": [{"token": token_text(t), "id": t, "logprob": v} for t, v in lp.top]}
