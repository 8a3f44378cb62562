"""OpenAI batch request lines: `{"custom_id", "method", "url", "body"}`, with the body of a
`/v1/chat/completions` or `/v1/completions` request. What tells a batch line from a plain record, the checks of
the line and its body (url, method, stream, model, the fields a body may hold), and the model names a body may
give. A line that cannot be used raises Reject naming the field at fault. Pure Python.
"""

from __future__ import annotations

import json

from conveyor.core import Task
from conveyor.io.records import request_options
from conveyor.io.records.readers.record import describe
from conveyor.io.records.reject import Reject

OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
# The pooling endpoints (OpenAI's and vLLM's), and the task each asks for.
POOLING_URLS = {"/v1/embeddings": Task.EMBED, "/embeddings": Task.EMBED, "/v1/score": Task.SCORE,
                "/score": Task.SCORE, "/v1/rerank": Task.RERANK, "/rerank": Task.RERANK, "/v2/rerank": Task.RERANK,
                "/v1/classify": Task.CLASSIFY, "/classify": Task.CLASSIFY}
# What an OpenAI batch body may hold: the request itself, its generation settings (OpenAI's and vLLM's names)
# and fields that do not change the output ("model": the run's --model answers; "user", "metadata", "store").
_BODY_FIELDS = frozenset({"messages", "prompt", "stream", *request_options.REQUEST_METADATA,
                          *request_options.APPLIED, *request_options.AT_DEFAULT})


def is_batch_line(record: dict) -> bool:
    """An OpenAI batch request line: it has a body object, an OpenAI url, or a custom_id with a body (a plain
    record's "url" or "body" of other kinds, a web page's address or an email's text, is data)."""
    url = record.get("url")
    return (isinstance(record.get("body"), dict) or (isinstance(url, str) and url.startswith("/v1/"))
            or ("custom_id" in record and "body" in record))


def error_id(record: dict, index: int) -> str:
    """The id of the error row of a record whose id is bad: a batch line's custom_id as given ("" too: result
    lines are matched by it), else the record's index."""
    custom_id = record.get("custom_id") if "body" in record else None
    return custom_id if isinstance(custom_id, str) else str(index)


def served_names(model: str | None) -> tuple[str, ...]:
    """The model names an OpenAI body may give by default: the run's --model as given, and its last part (a
    folder's or a hub id's name; a .gguf file's name, with and without the extension)."""
    if not model:
        return ()
    name = model.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    return tuple(dict.fromkeys(n for n in (model, name, name.removesuffix(".gguf")) if n))


def url_task(record: dict) -> Task | None:
    """The task a batch line's url asks for, None where it names no endpoint conveyor knows."""
    url = record.get("url")
    if url in OPENAI_URLS:
        return Task.GENERATE
    return POOLING_URLS.get(url) if isinstance(url, str) else None


def wrong_task(url: str, task: Task) -> Reject:
    """The error of a line whose url asks for another task than the run's."""
    asked = POOLING_URLS.get(url, Task.GENERATE)
    fix = f"run these lines on their own with --task {asked}" if asked.pools else \
        "run these lines on their own with a model of that kind"
    return Reject(f"url {url} asks for {f'--task {asked}' if asked.pools else 'generation'}, but this run "
                  f"does {f'--task {task}' if Task(task).pools else 'generation'}; {fix}")


def line_body(record: dict, served_model_names: tuple[str, ...], task: str) -> tuple[dict, str]:
    """(the body, the url) of batch line `record`, checked as every endpoint's are: its custom_id, method, url (one
    of the run's task) and body.model."""
    if record.get("custom_id") is None:
        raise Reject("the line is an OpenAI batch request (it has 'url' or 'body') but no 'custom_id'; give every "
                     "line a unique custom_id (its result line carries it)")
    if "body" not in record:
        raise Reject("the line has no 'body'; give the OpenAI request body (an object with messages or prompt)")
    body = record["body"]
    if not isinstance(body, dict):
        raise Reject(f"field 'body' must be an object (an OpenAI request body), got {describe(body)}")
    method = record.get("method")
    if method is not None and method != "POST":
        raise Reject(f"method {method!r} is not supported; batch lines are POST requests (\"method\": \"POST\")")
    url = record.get("url")
    urls = tuple(u for u, t in POOLING_URLS.items() if t == task) if Task(task).pools else OPENAI_URLS
    if url is None:
        raise Reject(f"the line has no 'url'; give the endpoint it calls: {' or '.join(urls)}")
    if url_task(record) is None:
        raise Reject(f"url {url!r} is not supported; use {' or '.join(urls)}")
    if url_task(record) != task:
        raise wrong_task(url, task)
    if body.get("stream") not in (None, False):
        raise Reject("body.stream is not supported in a batch; remove it")
    model = body.get("model")
    if model is not None and served_model_names and model not in served_model_names:
        raise Reject(f"body.model {json.dumps(model, ensure_ascii=False)} is not the model this run serves "
                     f"({', '.join(served_model_names)}); to answer it with this run's model, add "
                     f"--served-model-name {model if isinstance(model, str) else 'NAME'}, or fix body.model")
    return body, url


def batch_body(record: dict, served_model_names: tuple[str, ...], priorities: bool) -> dict:
    """The body of generation batch line `record`, checked: the line's custom_id, method and url, and the body's
    fields. `served_model_names`: the names body.model may give ((): any); `priorities` (--schedule priority):
    body.priority orders the requests, else it must be 0."""
    body, url = line_body(record, served_model_names, Task.GENERATE)
    takes, other = ("messages", "prompt") if url == OPENAI_URLS[0] else ("prompt", "messages")
    if other in body and takes not in body:
        raise Reject(f"url {url} takes body.{takes}, not body.{other}; use {OPENAI_URLS[url == OPENAI_URLS[0]]} "
                     f"for a {other}, or send body.{takes}")
    unknown = [key for key in body if key not in _BODY_FIELDS]
    if unknown:
        at_default = request_options.AT_DEFAULT.keys()
        raise Reject(f"body.{unknown[0]} is not supported by conveyor; remove it (supported: "
                     f"{', '.join(sorted(_BODY_FIELDS - at_default))}; at their defaults only: "
                     f"{', '.join(sorted(at_default))})")
    at_default = [name for name in request_options.AT_DEFAULT if not (name == "priority" and priorities)]
    try:
        request_options.check_at_default(body, "body.", at_default)
    except Reject as e:
        hint = " (or order the requests by it with --schedule priority)" if str(e).startswith("body.priority ") \
            else ""
        raise Reject(f"{e}{hint}") from None
    return body
