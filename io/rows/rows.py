"""The output row: its columns and their Arrow types, and how a finished request or a bad record becomes one.

The one place that defines a row. `writers.py` writes these columns, the journal stores rows as built here,
and `conveyor merge` reads them back; nothing else spells a column name. Imports neither torch nor pyarrow at
module level.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable, Iterable
from typing import Any

from conveyor.core import Task
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
OPTIONAL_COLUMNS = ("logprobs", "prompt_logprobs", "prompt_logprob_sum", "sample_index", "input_index", "reasoning",
                    "prompt_tokens_truncated",  # the prompt tokens truncation cut
                    "draft_tokens", "accepted_draft_tokens")  # --speculative: fed to the model, and accepted
_POOLING_OPTIONAL = ("input_index", "prompt_tokens_truncated")  # what a pooling task's rows may hold of them
SAMPLE_INDEX = "sample_index"  # 0 to n - 1; a run's files have it where some record has n > 1, or --n > 1

# The pooling tasks' rows: their own columns instead of a completion's. A record with several inputs (a list of
# texts, documents to score) is a group row (SAMPLES_KEY) of one row per input, numbered by INPUT_INDEX.
POOLING_COLUMNS = ("id", "index", "status", "prompt_tokens", "error", "queue_s", "latency_s")
TASK_VALUES = {Task.EMBED: ("embedding",), Task.CLASSIFY: ("label", "probs"), Task.SCORE: ("score",),
               Task.RERANK: ("score",), Task.REWARD: ("reward",)}
INPUT_INDEX = "input_index"  # 0 to k - 1: which input of its record a row answers (where a record had several)
# Beside a pooling row, for its OpenAI batch result line: how its embeddings are encoded, a rerank line's
# document and the number of best results it asked for. Not output columns.
ENCODING_KEY = "__conveyor_encoding"
DOCUMENT_KEY = "__conveyor_document"
TOP_N_KEY = "__conveyor_top_n"


def output_columns(task: str) -> tuple[str, ...]:
    """The fixed columns of a run's output: a completion's, or a pooling task's (its values after the status)."""
    if task in TASK_VALUES:
        return (*POOLING_COLUMNS[:3], *TASK_VALUES[task], *POOLING_COLUMNS[3:])
    return OUTPUT_COLUMNS


def pack_vector(values) -> str:
    """A float32 vector as the journal keeps it: its little-endian bytes in base64 (exact, and a quarter of its
    JSON's size); OpenAI's `encoding_format: base64` is the same text."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def unpack_vector(text: str) -> list[float]:
    data = base64.b64decode(text)
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def part_columns(task: Task, asked: Iterable[str]) -> tuple[str, ...]:
    """The optional columns of a `task` run's part files among `asked` (those its settings fill, and those its rows
    hold when the first part is written), in the columns' order: fixed then, so that the parts of one folder read as
    one table."""
    allowed = _POOLING_OPTIONAL if Task(task).pools else tuple(c for c in OPTIONAL_COLUMNS if c != INPUT_INDEX)
    asked = set(asked)
    return tuple(c for c in allowed if c in asked)


def vector_size(rows) -> int | None:
    """The length of every embedding in `rows` (journal rows), where they all have one; None where none has one or
    their lengths differ (a record's own `dimensions`)."""
    sizes = {len(base64.b64decode(r["embedding"])) // 4 for row in rows for r in output_rows(row)
             if r.get("embedding") is not None}
    return sizes.pop() if len(sizes) == 1 else None


def pooled_row(b, out, task: Task, labels: tuple[str, ...], where: str | None = None) -> dict[str, Any]:
    """The row of a finished pooling request: `b` the record's `pooling_builder.BuiltPooling`, `out` the engine's
    PoolingOutput, `labels` a classifier's. One row per input where the record had several (a group row)."""
    base = {"id": b.id, "index": b.index, "status": "ok", "prompt_tokens": out.num_prompt_tokens, "error": None,
            "queue_s": round(out.queue_s, 6), "latency_s": round(out.latency_s, 6), KIND_KEY: b.kind, **b.kept}
    if b.prompt_tokens_truncated is not None:
        base["prompt_tokens_truncated"] = b.prompt_tokens_truncated
    if b.batch_line and task is Task.EMBED:
        base[ENCODING_KEY] = b.encoding_format
    values = [_task_values(task, v, labels) for v in out.results]
    if not b.multiple:
        row = {**base, **values[0]}
    else:
        rows = [{**base, **v, INPUT_INDEX: i, "prompt_tokens": out.num_prompt_tokens if i == 0 else 0}
                for i, v in enumerate(values)]
        for row, document in zip(rows, b.documents):
            row[DOCUMENT_KEY] = document
        row = {"id": b.id, "index": b.index, "status": "ok", SAMPLES_KEY: rows}
        if b.top_n is not None:
            row[TOP_N_KEY] = b.top_n
    if where is not None and b.id_given:
        row[WHERE_KEY] = where
    return row


def _task_values(task: Task, values: tuple[float, ...], labels: tuple[str, ...]) -> dict[str, Any]:
    if task is Task.EMBED:
        return {"embedding": pack_vector(values)}
    if task is Task.CLASSIFY:
        best = max(range(len(values)), key=values.__getitem__)
        return {"label": labels[best] if best < len(labels) else str(best), "probs": list(values)}
    return {TASK_VALUES[task][0]: values[0]}


def base_schema():
    """The Arrow schema of the fixed output columns (keep fields are appended per file)."""
    import pyarrow as pa

    string, int64, float64 = pa.string(), pa.int64(), pa.float64()
    types = (string, int64, string, string, string, int64, int64, string, int64, float64, float64, float64)
    return pa.schema(list(zip(OUTPUT_COLUMNS, types)))


def column_schema(name: str, vector_size: int | None = None):
    """The Arrow type of a pooling task's column (an embedding: `vector_size` floats, or a list where they vary)."""
    import pyarrow as pa

    if name == "embedding":
        return pa.list_(pa.float32(), vector_size) if vector_size else pa.list_(pa.float32())
    if name == "probs":
        return pa.list_(pa.float32())
    if name in ("score", "reward", "queue_s", "latency_s"):
        return pa.float64()
    if name in ("index", "prompt_tokens"):
        return pa.int64()
    return pa.string()


def optional_schema(name: str):
    """The Arrow type of an optional column."""
    import pyarrow as pa

    if name == "prompt_logprob_sum":
        return pa.float64()
    if name == "reasoning":  # the output's reasoning section (--reasoning-parser), null where it had none
        return pa.string()
    if name in (SAMPLE_INDEX, INPUT_INDEX, "prompt_tokens_truncated", "draft_tokens", "accepted_draft_tokens"):
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
