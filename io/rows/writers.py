"""Output writers: Parquet, JSONL and OpenAI-batch files, streamed row by row in input order, with the columns
of `rows.py`.

The file appears by atomic rename after an fsync (`conveyor.io.state.atomic`); on any error the temp file is
removed and the error propagates unchanged (ENOSPC included). pyarrow is imported only when a schema is needed.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import sys
import time
from typing import IO, Any, Iterable, Iterator

from conveyor.core import Task
from conveyor.io.errors import SpecError
from conveyor.io.rows.openai_lines import pooling_line
from conveyor.io.rows.rows import (
    KIND_KEY,
    OPTIONAL_COLUMNS,
    OUTPUT_COLUMNS,
    SAMPLE_INDEX,
    base_schema,
    column_schema,
    optional_schema,
    output_columns,
    output_rows,
    unpack_vector,
)
from conveyor.io.state.atomic import atomic_file, make_temp
from conveyor.io.storage import is_remote, put

OUTPUT_FORMATS = ("parquet", "jsonl", "openai-batch")
STDOUT = "-"  # -o -: the finished output goes to stdout
OUTPUT_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}
_INT64 = (-2**63, 2**63)
UPLOAD_STAGING = "upload"  # the target name of a file staged for a store (`atomic.remove_leftovers` finds them)


def infer_output_format(path: str, output_format: str | None) -> str:
    """"parquet", "jsonl" or "openai-batch", from --output-format or else the path's extension (stdout: JSONL, or
    openai-batch; Parquet is not written to a stream)."""
    if output_format is not None:
        if output_format not in OUTPUT_FORMATS:
            raise SpecError(f"--output-format {output_format!r} is not one of {', '.join(OUTPUT_FORMATS)}")
        if path == STDOUT and output_format == "parquet":
            raise SpecError("-o -: Parquet is not written to stdout; use --output-format jsonl or openai-batch, "
                            "or name a .parquet file")
        return output_format
    if path == STDOUT:
        return "jsonl"
    fmt = OUTPUT_EXTENSIONS.get(os.path.splitext(path.lower())[1])
    if fmt is None:
        raise SpecError(f"cannot tell the output format of {path!r} from its extension; name it .parquet or "
                         f".jsonl, or pass --output-format ({', '.join(OUTPUT_FORMATS)})")
    return fmt


def check_keep_fields(keep_fields: tuple[str, ...]) -> None:
    """Keep fields become extra columns: they must not repeat or shadow an output column."""
    clash = sorted(set(keep_fields) & {*OUTPUT_COLUMNS, *OPTIONAL_COLUMNS, KIND_KEY})
    if clash:
        raise SpecError(f"--keep-fields {', '.join(clash)} would overwrite output columns; keep other fields")
    repeated = sorted({name for name in keep_fields if keep_fields.count(name) > 1})
    if repeated:
        raise SpecError(f"--keep-fields lists {', '.join(repeated)} more than once")


def write_output(rows: Iterable[dict], path: str, output_format: str, keep_fields: tuple[str, ...] = (),
                 model_name: str = "", row_group_size: int = 4096, optional: Iterable[str] = (),
                 task: Task = Task.GENERATE, vector_size: int | None = None, staging: str | None = None,
                 file_metadata: dict[str, str] | None = None) -> int:
    """Stream `rows` (output-row dicts, input order) to `path` atomically; returns the rows written.

    `optional`: which OPTIONAL_COLUMNS the file has (those some row of the run holds). Keys beyond the columns
    (such as `kind`) are ignored, except that openai-batch reads `kind` ("completion" -> a text_completion
    body; anything else -> chat). `task`: the run's (its rows' columns: `rows.output_columns`); an embedding
    run's Parquet column holds `vector_size` floats a row (None: a list whose length varies). A `path` in object
    storage is written to a temporary file in the local folder `staging` first, then put there in one upload.
    `file_metadata`: key-value pairs a Parquet file carries in its footer (a part file: the run that wrote it).
    """
    if output_format not in OUTPUT_FORMATS:
        raise SpecError(f"--output-format {output_format!r} is not one of {', '.join(OUTPUT_FORMATS)}")
    keep_fields = tuple(keep_fields)
    check_keep_fields(keep_fields)
    extra = tuple(c for c in OPTIONAL_COLUMNS if c in set(optional))
    columns = output_columns(task)
    if output_format != "openai-batch":  # a row per sample; openai-batch: a line per record, its n choices
        rows = _sample_rows(rows, SAMPLE_INDEX in extra)
    if output_format == "parquet":
        with _destination(path, "wb", staging) as f:
            return _write_parquet(rows, f, keep_fields, row_group_size, extra, columns, vector_size, file_metadata)
    with (_stdout() if path == STDOUT else _destination(path, "w", staging)) as f:
        if output_format == "jsonl":
            return _write_jsonl(rows, f, columns + extra + keep_fields)
        if Task(task).pools:
            return _write_lines(rows, f, lambda row, created: pooling_line(row, task, model_name, created))
        return _write_lines(rows, f, lambda row, created: _openai_record_line(row, model_name, created))


@contextlib.contextmanager
def _destination(path: str, mode: str, staging: str | None) -> Iterator[IO]:
    """A file that appears at `path` whole or not at all: renamed onto a local path (`atomic_file`), or uploaded to
    a store in one piece from a temporary file in `staging`."""
    if not is_remote(path):
        with atomic_file(path, mode) as f:
            yield f
        return
    if staging is None:
        raise ValueError(f"writing {path}: a file in a store is staged in a local folder, and none was given")
    fd, local = make_temp(staging, UPLOAD_STAGING)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8", "newline": "\n"})) as f:
            yield f
        put(local, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(local)


@contextlib.contextmanager
def _stdout() -> Iterator[IO[str]]:
    """stdout, for a run's finished output (written once every row is there: nothing half-done reaches it)."""
    yield sys.stdout
    sys.stdout.flush()


# Characters that JSON leaves raw but that line splitters (Python's str.splitlines, JavaScript) treat as line
# ends; escaped, so that one row is one line for every reader.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def json_line(value, **kw) -> str:
    """`value` as one line of JSON (UTF-8 kept), ending in a newline."""
    return json.dumps(value, ensure_ascii=False, **kw).translate(_LINE_BREAKS) + "\n"


def _sample_rows(rows: Iterable[dict], numbered: bool) -> Iterator[dict]:
    """Journal rows as output rows: a record with n > 1 its n sample rows (in sample order); `numbered`: every row
    has its sample_index (0 for a record's only row)."""
    for row in rows:
        for sample in output_rows(row):
            yield {**sample, SAMPLE_INDEX: 0} if numbered and SAMPLE_INDEX not in sample else sample


def _write_jsonl(rows: Iterable[dict], f: IO[str], columns: tuple[str, ...]) -> int:
    num_rows = 0
    for row in rows:
        out = {c: row.get(c) for c in columns}
        if out.get("embedding") is not None:
            out["embedding"] = unpack_vector(out["embedding"])
        f.write(json_line(out, default=str))
        num_rows += 1
    return num_rows


def _write_lines(rows: Iterable[dict], f: IO[str], line) -> int:
    """One OpenAI batch output line per record, `line(row, created)`."""
    created = int(time.time())
    num_rows = 0
    for row in rows:
        f.write(json_line(line(row, created)))
        num_rows += 1
    return num_rows


def _openai_record_line(row: dict, model_name: str, created: int) -> dict:
    """A record's line: a record with n > 1 has its n choices in it ("index": k), as OpenAI answers n; usage counts
    the prompt once and every choice's tokens. An error of one sample makes the line an error naming it."""
    samples = output_rows(row)
    lines = [_openai_line(sample, model_name, created) for sample in samples]
    if len(lines) == 1:
        return lines[0]
    for k, line in enumerate(lines):
        if line["response"] is None:
            return {**line, "error": {**line["error"], "message": f"sample {k}: {line['error']['message']}"}}
    body = lines[0]["response"]["body"]
    body["choices"] = [{**line["response"]["body"]["choices"][0], "index": k} for k, line in enumerate(lines)]
    prompt_tokens = body["usage"]["prompt_tokens"]
    completion_tokens = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in lines)
    body["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens}
    return lines[0]


def _openai_line(row: dict, model_name: str, created: int) -> dict:
    """One line of an OpenAI Batch API output file."""
    index = row["index"]
    line: dict[str, Any] = {"id": f"batch_req_{index}", "custom_id": row["id"]}
    if row["status"] != "ok":
        return {**line, "response": None, "error": {"code": "invalid_request", "message": row.get("error")}}
    prompt_tokens = row.get("prompt_tokens") or 0
    completion_tokens = row.get("completion_tokens") or 0
    finish_reason = row.get("finish_reason")
    logprobs = row.get("logprobs")
    if row.get(KIND_KEY) == "completion":
        body_id, kind = f"cmpl-{index}", "text_completion"
        choice = {"index": 0, "text": row.get("output"), "logprobs": _completion_logprobs(logprobs),
                  "finish_reason": finish_reason}
        if "reasoning" in row:  # (vLLM's name; a completion has no message to hold it)
            choice["reasoning_content"] = row["reasoning"]
    else:
        body_id, kind = f"chatcmpl-{index}", "chat.completion"
        choice = {"index": 0, "message": {"role": "assistant", "content": row.get("output"), "refusal": None},
                  "logprobs": _chat_logprobs(logprobs), "finish_reason": finish_reason}
        if "reasoning" in row:  # --reasoning-parser: as vLLM's OpenAI server gives it
            choice["message"]["reasoning_content"] = row["reasoning"]
    body = {"id": body_id, "object": kind, "created": created, "model": model_name, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    return {**line, "response": {"status_code": 200, "request_id": f"req_{index}", "body": body}, "error": None}


def _chat_logprobs(entries: list[dict] | None) -> dict | None:
    """OpenAI chat's choices[].logprobs: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    if entries is None:
        return None

    def one(e: dict) -> dict:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode("utf-8"))}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e["top"]]} for e in entries], "refusal": None}


def _completion_logprobs(entries: list[dict] | None) -> dict | None:
    """OpenAI completions' choices[].logprobs: parallel lists of tokens, their logprobs and offsets."""
    if entries is None:
        return None
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for e in entries], "text_offset": offsets}


def _write_parquet(rows: Iterable[dict], f: IO[bytes], keep_fields: tuple[str, ...], row_group_size: int,
                   extra: tuple[str, ...] = (), fixed: tuple[str, ...] = OUTPUT_COLUMNS,
                   vector_size: int | None = None, file_metadata: dict[str, str] | None = None) -> int:
    import pyarrow.parquet as pq

    writer = None
    columns: list[_KeepColumn] = []
    num_rows = 0
    try:
        for chunk in _chunks(rows, row_group_size):
            if writer is None:
                columns = [_KeepColumn.from_first_chunk(name, [row.get(name) for row in chunk])
                           for name in keep_fields]
                writer = pq.ParquetWriter(f, _with_metadata(_schema(columns, extra, fixed, vector_size), file_metadata))
            writer.write_table(_table(chunk, columns, writer.schema, extra, fixed), row_group_size=row_group_size)
            num_rows += len(chunk)
        if writer is None:  # no rows: still a valid file with the full schema
            columns = [_KeepColumn(name, "str") for name in keep_fields]
            writer = pq.ParquetWriter(f, _with_metadata(_schema(columns, extra, fixed, vector_size), file_metadata))
    except BaseException:
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
        raise
    writer.close()
    return num_rows


def _with_metadata(schema, metadata: dict[str, str] | None):
    return schema if not metadata else schema.with_metadata({**(schema.metadata or {}), **metadata})


def _chunks(rows: Iterable[dict], size: int) -> Iterator[list[dict]]:
    chunk: list[dict] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _schema(columns: list[_KeepColumn], extra: tuple[str, ...] = (), fixed: tuple[str, ...] = OUTPUT_COLUMNS,
            vector_size: int | None = None):
    import pyarrow as pa

    schema = base_schema() if fixed == OUTPUT_COLUMNS else \
        pa.schema([pa.field(name, column_schema(name, vector_size)) for name in fixed])
    for name in extra:
        schema = schema.append(pa.field(name, optional_schema(name)))
    for column in columns:
        schema = schema.append(pa.field(column.name, column.arrow_type()))
    return schema


def _table(chunk: list[dict], columns: list[_KeepColumn], schema, extra: tuple[str, ...] = (),
           fixed: tuple[str, ...] = OUTPUT_COLUMNS):
    import pyarrow as pa

    arrays = [_vectors(chunk, schema.field(name).type, name) if name == "embedding" else
              pa.array([row.get(name) for row in chunk], type=schema.field(name).type) for name in fixed + extra]
    arrays += [pa.array(column.convert(chunk), type=column.arrow_type()) for column in columns]
    return pa.Table.from_arrays(arrays, schema=schema)


def _vectors(chunk: list[dict], arrow_type, name: str):
    """The embeddings of a row group as one Arrow array, decoded from the rows' packed floats at once (null for an
    error row); ValueError naming the row where one's length is not the column's."""
    import numpy as np
    import pyarrow as pa

    packed = [row.get(name) for row in chunk]
    vectors = [np.frombuffer(base64.b64decode(p), dtype="<f4") if p is not None else None for p in packed]
    size = arrow_type.list_size if isinstance(arrow_type, pa.FixedSizeListType) else None
    if size is None:
        return pa.array([None if v is None else v for v in vectors], type=arrow_type)
    for row, v in zip(chunk, vectors):
        if v is not None and len(v) != size:
            raise ValueError(f"row {row.get('index')}: an embedding of {len(v)} floats in a column of {size}")
    flat = np.concatenate([v if v is not None else np.zeros(size, dtype="<f4") for v in vectors]) if vectors \
        else np.zeros(0, dtype="<f4")
    mask = pa.array([v is None for v in vectors], type=pa.bool_())
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, type=pa.float32()), size, mask=mask)


class _KeepColumn:
    """A keep field's Parquet type, fixed by the first row group's non-null values:

    all bool -> bool; all int (in int64) -> int64; ints and floats -> float64; all str -> string;
    anything else (objects, lists, mixed kinds, or no non-null value) -> string. In a string column,
    str values are stored as they are and every other value as its JSON text. A later value that does
    not fit a bool/int64/float64 column raises ValueError naming the field and the row.
    """

    def __init__(self, name: str, kind: str) -> None:
        self.name = name
        self.kind = kind  # "bool" | "int" | "float" | "str"

    @classmethod
    def from_first_chunk(cls, name: str, values: list) -> _KeepColumn:
        kinds = {_kind_of(v) for v in values if v is not None}
        if kinds == {"bool"}:
            return cls(name, "bool")
        if kinds == {"int"}:
            return cls(name, "int")
        if kinds and kinds <= {"int", "float"}:
            return cls(name, "float")
        return cls(name, "str")

    def arrow_type(self):
        import pyarrow as pa

        return {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "str": pa.string()}[self.kind]

    def convert(self, chunk: list[dict]) -> list:
        out = []
        for row in chunk:
            value = row.get(self.name)
            if value is None or self.kind == _kind_of(value):
                out.append(value)
            elif self.kind == "str":
                out.append(json.dumps(value, ensure_ascii=False, default=str))
            elif self.kind == "float" and _kind_of(value) == "int":
                out.append(float(value))
            elif self.kind == "int" and isinstance(value, float) and value.is_integer():
                out.append(int(value))
            else:
                raise ValueError(f"keep field {self.name!r}: row {row.get('index')} holds {value!r}, but the "
                                 f"column's Parquet type ({self.arrow_type()}) was fixed from the first row group; "
                                 "make the field's type consistent or write JSONL (--output-format jsonl)")
        return out


def _kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if _INT64[0] <= value < _INT64[1] else "other"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return "other"
