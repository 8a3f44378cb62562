"""The OpenAI / vLLM batch result lines of the pooling tasks, one per record, in vLLM's run-batch shape:
`{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}`, the body that of
`/v1/embeddings` (a list of embedding objects, floats or base64 as the request's encoding_format asked),
`/v1/score` (score objects), `/v1/rerank` (results ranked by relevance, `top_n` of them) or `/v1/classify`
(label and probabilities). A record that is an error row is an error line naming why.
"""

from __future__ import annotations

from typing import Any

from conveyor.core import Task
from conveyor.io.rows.rows import DOCUMENT_KEY, ENCODING_KEY, INPUT_INDEX, TOP_N_KEY, output_rows, unpack_vector


def pooling_line(row: dict, task: Task, model_name: str, created: int) -> dict:
    """The result line of a pooling record's journal row."""
    task = Task(task)
    index = row["index"]
    line: dict[str, Any] = {"id": f"batch_req_{index}", "custom_id": row["id"]}
    parts = output_rows(row)
    bad = next((p for p in parts if p["status"] != "ok"), None)
    if bad is not None:
        return {**line, "response": None, "error": {"code": "invalid_request", "message": bad.get("error")}}
    tokens = sum(p.get("prompt_tokens") or 0 for p in parts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    ordered = sorted(parts, key=lambda p: p.get(INPUT_INDEX) or 0)
    if task is Task.EMBED:
        body = {"id": f"embd-{index}", "object": "list", "created": created, "model": model_name,
                "data": [{"index": k, "object": "embedding", "embedding": _embedding(p)} for k, p in enumerate(ordered)],
                "usage": usage}
    elif task is Task.SCORE:
        body = {"id": f"score-{index}", "object": "list", "created": created, "model": model_name,
                "data": [{"index": k, "object": "score", "score": p["score"]} for k, p in enumerate(ordered)],
                "usage": usage}
    elif task is Task.RERANK:
        results = [{"index": k, "document": {"text": p.get(DOCUMENT_KEY)}, "relevance_score": p["score"]}
                   for k, p in enumerate(ordered)]
        results.sort(key=lambda r: -r["relevance_score"])
        top_n = row.get(TOP_N_KEY)
        body = {"id": f"rerank-{index}", "model": model_name, "usage": usage,
                "results": results[:top_n] if top_n else results}
    elif task is Task.REWARD:
        body = {"id": f"reward-{index}", "object": "list", "created": created, "model": model_name,
                "data": [{"index": k, "object": "reward", "reward": p["reward"]} for k, p in enumerate(ordered)],
                "usage": usage}
    else:
        body = {"id": f"classify-{index}", "object": "list", "created": created, "model": model_name,
                "data": [{"index": k, "label": p["label"], "probs": p["probs"], "num_classes": len(p["probs"])}
                         for k, p in enumerate(ordered)], "usage": usage}
    return {**line, "response": {"status_code": 200, "request_id": f"req_{index}", "body": body}, "error": None}


def _embedding(part: dict):
    """The embedding as the request asked: base64 of its float32 bytes (as the journal holds it), else floats."""
    return part["embedding"] if part.get(ENCODING_KEY) == "base64" else unpack_vector(part["embedding"])
