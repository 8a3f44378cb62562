"""Writers: Parquet schema and keep-field types, JSONL, OpenAI batch output, atomic replacement."""

from __future__ import annotations

import errno
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conveyor.io.rows import writers
from conveyor.io.rows.writers import KIND_KEY, OUTPUT_COLUMNS, base_schema, infer_output_format, write_output
from conveyor.io.state import atomic


def ok_row(index, **extra):
    return {"id": f"r{index}", "index": index, "status": "ok", "output": f"answer {index} é", "finish_reason": "stop",
            "prompt_tokens": 10 + index, "completion_tokens": 3, "error": None, "seed": 2**62 + index,
            "queue_s": 0.5, "ttft_s": 1, "latency_s": 1.25, KIND_KEY: "chat", **extra}


def error_row(index, **extra):
    return {"id": str(index), "index": index, "status": "error", "output": None, "finish_reason": None,
            "prompt_tokens": None, "completion_tokens": 0, "error": f"line {index + 1}: field 'prompt' is empty",
            "seed": None, "queue_s": None, "ttft_s": None, "latency_s": None, KIND_KEY: None, **extra}


def test_base_schema_types():
    schema = base_schema()
    assert schema.names == list(OUTPUT_COLUMNS)
    assert [str(t) for t in schema.types] == ["string", "int64", "string", "string", "string", "int64", "int64",
                                              "string", "int64", "double", "double", "double"]


def test_parquet_round_trip(tmp_path):
    rows = [ok_row(0), error_row(1), ok_row(2)]
    path = tmp_path / "out.parquet"
    assert write_output(iter(rows), str(path), "parquet") == 3
    table = pq.read_table(path)
    assert table.schema == base_schema()
    got = table.to_pylist()
    assert got[1] == {k: v for k, v in error_row(1).items() if k != KIND_KEY}
    assert got[0]["output"] == "answer 0 é" and got[0]["seed"] == 2**62 and got[0]["ttft_s"] == 1.0
    assert os.listdir(tmp_path) == ["out.parquet"]


def test_parquet_row_groups_and_empty_output(tmp_path):
    path = tmp_path / "out.parquet"
    write_output((ok_row(i) for i in range(10)), str(path), "parquet", row_group_size=4)
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [4, 4, 2]
    assert write_output(iter([]), str(path), "parquet", keep_fields=("category",)) == 0
    table = pq.read_table(path)
    assert table.num_rows == 0 and table.schema == base_schema().append(pa.field("category", pa.string()))


def test_parquet_keep_field_types(tmp_path):
    rows = [ok_row(0, s="a", i=1, f=1, b=True, d={"k": [1]}, n=None, mixed="x"),
            error_row(1, s=None, i=None, f=2.5, b=False, d=None, n=None, mixed=3),
            # second row group: in a string column, str values stay as they are and others become JSON
            ok_row(2, s=7, i=3.0, f=4, b=None, d="plain", n=None, mixed=None),
            ok_row(3, s=["x"], i=-5, f=None, b=True, d=[1, 2], n="late", mixed=None)]
    keep = ("s", "i", "f", "b", "d", "n", "mixed")
    path = tmp_path / "out.parquet"
    write_output(iter(rows), str(path), "parquet", keep_fields=keep, row_group_size=2)
    table = pq.read_table(path)
    assert table.schema.names == list(OUTPUT_COLUMNS) + list(keep)
    assert [str(table.schema.field(k).type) for k in keep] == ["string", "int64", "double", "bool", "string",
                                                               "string", "string"]
    columns = {k: table.column(k).to_pylist() for k in keep}
    assert columns == {"s": ["a", None, "7", '["x"]'], "i": [1, None, 3, -5], "f": [1.0, 2.5, 4.0, None],
                       "b": [True, False, None, True], "d": ['{"k": [1]}', None, 'plain', "[1, 2]"],
                       "n": [None, None, None, "late"], "mixed": ["x", "3", None, None]}


def test_parquet_keep_field_that_breaks_its_type_fails_cleanly(tmp_path):
    path = tmp_path / "out.parquet"
    path.write_bytes(b"old output")
    rows = [ok_row(0, score=1), ok_row(1, score=2), ok_row(2, score=2.5)]
    with pytest.raises(ValueError) as e:
        write_output(iter(rows), str(path), "parquet", keep_fields=("score",), row_group_size=2)
    assert "keep field 'score': row 2 holds 2.5" in str(e.value) and "--output-format jsonl" in str(e.value)
    assert path.read_bytes() == b"old output"
    assert os.listdir(tmp_path) == ["out.parquet"]


def test_jsonl(tmp_path):
    path = tmp_path / "out.jsonl"
    rows = [ok_row(0, category="math", extra="dropped"), error_row(1, category=None)]
    assert write_output(iter(rows), str(path), "jsonl", keep_fields=("category",)) == 2
    raw = path.read_text(encoding="utf-8")
    assert "é" in raw  # not escaped
    lines = [json.loads(line) for line in raw.splitlines()]
    assert [list(obj) for obj in lines] == [list(OUTPUT_COLUMNS) + ["category"]] * 2
    assert lines[0]["category"] == "math" and lines[0]["seed"] == 2**62
    assert lines[1] == {**{k: v for k, v in error_row(1).items() if k != KIND_KEY}, "category": None}


@pytest.mark.parametrize("fmt", ["jsonl", "openai-batch"])
def test_a_row_is_one_line_for_every_line_splitter(tmp_path, fmt):
    """U+0085, U+2028 and U+2029 are legal raw in JSON strings but end lines for str.splitlines and JavaScript:
    they are written escaped."""
    path = tmp_path / "out.jsonl"
    text = "a\x85b\u2028c\u2029d"
    write_output(iter([ok_row(0, output=text), ok_row(1)]), str(path), fmt)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2 and text in json.dumps(json.loads(lines[0]), ensure_ascii=False)


def test_openai_batch(tmp_path):
    path = tmp_path / "out.jsonl"
    rows = [ok_row(0), error_row(1), {**ok_row(2), KIND_KEY: "completion", "finish_reason": "length"}]
    write_output(iter(rows), str(path), "openai-batch", model_name="smollm2")
    chat, error, completion = [json.loads(line) for line in path.read_text().splitlines()]
    created = chat["response"]["body"]["created"]
    assert chat == {"id": "batch_req_0", "custom_id": "r0", "response": {
        "status_code": 200, "request_id": "req_0", "body": {
            "id": "chatcmpl-0", "object": "chat.completion", "created": created, "model": "smollm2",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "answer 0 é", "refusal": None},
                         "logprobs": None,
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}}, "error": None}
    assert error == {"id": "batch_req_1", "custom_id": "1", "response": None,
                     "error": {"code": "invalid_request", "message": "line 2: field 'prompt' is empty"}}
    body = completion["response"]["body"]
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "answer 2 é", "logprobs": None, "finish_reason": "length"}]


def test_infer_output_format():
    assert infer_output_format("a/out.parquet", None) == "parquet"
    assert infer_output_format("out.JSONL", None) == "jsonl"
    assert infer_output_format("out.json", None) == "jsonl"
    assert infer_output_format("out.txt", "openai-batch") == "openai-batch"
    with pytest.raises(ValueError, match="--output-format"):
        infer_output_format("out.txt", None)
    with pytest.raises(ValueError, match="--output-format 'csv' is not one of"):
        infer_output_format("out.parquet", "csv")


def test_keep_fields_must_not_shadow_output_columns(tmp_path):
    with pytest.raises(ValueError, match="--keep-fields id, output would overwrite"):
        write_output(iter([]), str(tmp_path / "o.jsonl"), "jsonl", keep_fields=("output", "id"))
    assert os.listdir(tmp_path) == []


FORMATS = [("parquet", "out.parquet"), ("jsonl", "out.jsonl"), ("openai-batch", "out.jsonl")]


@pytest.mark.parametrize("fmt, name", FORMATS)
def test_failure_midway_leaves_no_file(tmp_path, fmt, name):
    def rows():
        for i in range(5):
            if i == 3:
                raise RuntimeError("journal unreadable")
            yield ok_row(i)

    with pytest.raises(RuntimeError, match="journal unreadable"):
        write_output(rows(), str(tmp_path / name), fmt, row_group_size=2)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt, name", FORMATS)
def test_disk_full_propagates_and_leaves_no_file(tmp_path, monkeypatch, fmt, name):
    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writers.os, "fsync", no_space)
    with pytest.raises(OSError) as e:
        write_output(iter([ok_row(0)]), str(tmp_path / name), fmt)
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_replaces_an_existing_file_atomically(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        replaced.append((os.path.basename(src), os.path.basename(dst)))
        assert path.read_text() == "old\n"  # the target is untouched until the rename
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", spy)
    write_output(iter([ok_row(0)]), str(path), "jsonl")
    assert len(replaced) == 1 and replaced[0][1] == "out.jsonl"
    assert replaced[0][0].startswith(".out.jsonl.tmp-") and replaced[0][0] != f".out.jsonl.tmp-{os.getpid()}"
    assert json.loads(path.read_text())["id"] == "r0"
