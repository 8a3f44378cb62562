"""The output row: its columns and their Arrow types, and how a finished request or a bad record becomes one.

The one place that defines a row. `writers.py` writes these columns, the journal stores rows as built here,
and `conveyor merge` reads them back; nothing else spells a column name. Imports neither torch nor pyarrow at
module level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Rows may carry the request kind ("chat" or "completion") under this key, for openai-batch output, and where
# the record was read ("line 12", "record 12") under the other, for a duplicate id found when shards merge.
# Neither is an output column.
KIND_KEY = "__conveyor_kind"
WHERE_KEY = "__conveyor_where"
OUTPUT_COLUMNS = ("id", "index", "status", "output", "finish_reason", "prompt_tokens", "completion_tokens",
                  "error", "seed", "queue_s", "ttft_s", "latency_s")
# Columns a run has where its records asked for them (the caller says which), between the fixed ones and the
# keep fields: per token {token, id, logprob, top: [{token, id, logprob}]}.
OPTIONAL_COLUMNS = ("logprobs", "prompt_logprobs", "prompt_logprob_sum")


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
    alternative = pa.struct([("token", pa.string()), ("id", pa.int64()), ("logprob", pa.float64())])
    return pa.list_(pa.struct([("token", pa.string()), ("id", pa.int64()), ("logprob", pa.float64()),
                               ("top", pa.list_(alternative))]))


def error_row(e) -> dict[str, Any]:
    """The row of a record that could not run (`request_builder.ErrorRow`)."""
    return {"id": e.id, "index": e.index, "status": "error", "output": None, "finish_reason": None,
            "prompt_tokens": e.prompt_tokens, "completion_tokens": 0, "error": e.error, "seed": e.seed,
            "queue_s": None, "ttft_s": None, "latency_s": None, KIND_KEY: None, **e.kept}


def ok_row(b, out, token_text: Callable[[int], str] = str, where: str | None = None) -> dict[str, Any]:
    """The row of a completion: `b` the record's `request_builder.BuiltRequest`, `out` the engine's
    RequestOutput; `token_text` names tokens in its logprobs; `where` the record's place in the input."""
    row = {"id": b.id, "index": b.index, "status": "ok", "output": out.text, "finish_reason": out.finish_reason,
           "prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens, "error": out.note,
           "seed": b.sampling.seed, "queue_s": round(out.queue_s, 6), "ttft_s": round(out.ttft_s, 6),
           "latency_s": round(out.latency_s, 6), KIND_KEY: b.kind, **b.kept}
    if where is not None and b.id_given:
        row[WHERE_KEY] = where
    if out.logprobs is not None:
        row["logprobs"] = [_logprob_entry(lp, token_text) for lp in out.logprobs]
    if out.prompt_logprobs is not None:
        row["prompt_logprobs"] = [
            _logprob_entry(lp, token_text) if lp is not None
            else {"token": token_text(token), "id": token, "logprob": None, "top": []}
            for lp, token in zip(out.prompt_logprobs, b.prompt_token_ids)]
        row["prompt_logprob_sum"] = sum(lp.logprob for lp in out.prompt_logprobs if lp is not None)
    return row


def duplicate_id_message(where: str, record_id: str) -> str:
    return f"{where}: duplicate id {record_id!r} (first seen earlier in the input); make ids unique or use --id-field"


def duplicate_id_row(row: dict[str, Any]) -> dict[str, Any]:
    """An ok `row` turned into the row its record gets when an earlier record holds its id: the row a single
    run gives it (shards find such ids only when they merge)."""
    out = {k: v for k, v in row.items() if k not in OPTIONAL_COLUMNS and k != WHERE_KEY}
    out.update(status="error", output=None, finish_reason=None, prompt_tokens=None, completion_tokens=0,
               queue_s=None, ttft_s=None, latency_s=None, **{KIND_KEY: None},
               error=duplicate_id_message(row.get(WHERE_KEY) or f"record {row['index']}", row["id"]))
    return out


def _logprob_entry(lp, token_text: Callable[[int], str]) -> dict[str, Any]:
    return {"token": token_text(lp.token_id), "id": lp.token_id, "logprob": lp.logprob,
            "top": [{"token": token_text(t), "id": t, "logprob": v} for t, v in lp.top]}
