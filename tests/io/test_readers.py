"""Readers: every input format, bad records with their line numbers, iter_from, count, fingerprint."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import sys
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conveyor.io.errors import InputError
from conveyor.io.records.readers import fingerprint, json_array, jsonl, open_reader
from conveyor.io.records.readers.record import StrictDecoder, location

ROWS = [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two", "n": 2}, {"id": "c", "prompt": "thé"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def records(reader, start=0):
    return [r.record for r in reader.iter_from(start)]


# -- JSONL ---------------------------------------------------------------------------------------

def test_jsonl_round_trip(tmp_path):
    reader = open_reader(write_jsonl(tmp_path / "in.jsonl", ROWS))
    got = list(reader)
    assert reader.format == "jsonl"
    assert [r.record for r in got] == ROWS
    assert [(r.index, r.line, r.error) for r in got] == [(0, 1, None), (1, 2, None), (2, 3, None)]
    assert reader.count() == 3
    assert list(reader) == got  # iterating again reopens the file


def test_jsonl_bom_crlf_and_blank_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n   \t\r\n{"prompt": "b"}\r\n\n{"prompt": "c"}')
    got = list(open_reader(str(path)))
    assert [(r.index, r.line, r.record) for r in got] == [
        (0, 1, {"prompt": "a"}), (1, 4, {"prompt": "b"}), (2, 6, {"prompt": "c"})]
    assert open_reader(str(path)).count() == 3


@pytest.mark.parametrize("line, expected", [
    (b'{"prompt": "a",}', "line 2: invalid JSON (Expecting property name enclosed in double quotes at column 16)"),
    (b'{"prompt" "a"}', "line 2: invalid JSON (Expecting ':' delimiter at column 11)"),
    (b'{"prompt": "caf\xe9"}', "line 2: not valid UTF-8 (invalid continuation byte at byte 16)"),
    (b"[" * 100_000 + b"]" * 100_000, "line 2: JSON nested too deeply"),
    (b'{"temperature": NaN}', "line 2: non-finite number (NaN)"),
    (b'{"temperature": -Infinity}', "line 2: non-finite number (-Infinity)"),
    (b'{"temperature": 1e999}', "line 2: non-finite number (1e999)"),
    (b'{"prompt": "a", "prompt": "b"}', 'line 2: the key "prompt" appears twice in one object'),
    (b'{"messages": [{"role": "user", "content": "a", "role": "system"}]}',
     'line 2: the key "role" appears twice in one object'),
    (b'["prompt", "a"]', "line 2: expected a JSON object, got a list"),
    (b'"just text"', "line 2: expected a JSON object, got a string"),
    (b"null", "line 2: expected a JSON object, got null"),
    (b"42", "line 2: expected a JSON object, got a number"),
])
def test_jsonl_bad_line_becomes_error_record(tmp_path, line, expected):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n' + line + b'\n{"prompt": "after"}\n')
    got = list(open_reader(str(path)))
    assert [r.index for r in got] == [0, 1, 2]
    bad = got[1]
    assert bad.record is None and bad.line == 2
    assert bad.error.startswith(expected)
    assert got[2].record == {"prompt": "after"}  # the run goes on


def test_jsonl_iter_from_skips_without_parsing(tmp_path, monkeypatch):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"i": 0}\n\nnot json\n{"i": 2}\n\n{"i": 3}\n{"i": 4}\n')
    calls = []
    real = StrictDecoder.line_record

    def spy(self, raw, index, line, digest=None):
        calls.append(index)
        return real(self, raw, index, line, digest)

    monkeypatch.setattr(StrictDecoder, "line_record", spy)
    got = list(open_reader(str(path)).iter_from(3))
    assert [(r.index, r.line, r.record) for r in got] == [(3, 6, {"i": 3}), (4, 7, {"i": 4})]
    assert calls == [3, 4]
    assert list(open_reader(str(path)).iter_from(99)) == []


def test_keyed_records_are_the_iterated_ones_and_a_jsonl_line_is_parsed_only_when_asked(tmp_path, monkeypatch):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"i": 0}\r\n\nnot json\n' + b'{"big": "' + b"x" * 300 + b'"}\n{"i": 3}\n')
    reader = open_reader(str(path), max_record_bytes=100)
    reader.with_digests = True
    whole = list(reader.iter_from(0))
    calls = []
    real = StrictDecoder.line_record

    def spy(self, raw, index, line, digest=None):
        calls.append(index)
        return real(self, raw, index, line, digest)

    monkeypatch.setattr(StrictDecoder, "line_record", spy)
    keyed = list(reader.keyed_from(1))
    assert calls == []  # digests without parsing
    assert [(i, line, d) for i, line, d, _ in keyed] == [(r.index, r.line, r.digest) for r in whole[1:]]
    assert [record() for *_, record in keyed] == whole[1:] and calls == [1, 3]  # (2 is over the size limit)
    table = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"]}), table)
    parquet = open_reader(str(table))
    parquet.with_digests = True
    assert [record() for *_, record in parquet.keyed_from(0)] == list(parquet.iter_from(0))


def test_jsonl_count_matches_iteration_across_chunk_boundaries(tmp_path, monkeypatch):
    rng = random.Random(7)
    pieces = ["", " ", "\t", "\r", "  \r"]
    for trial in range(40):
        lines = [rng.choice(pieces) if rng.random() < 0.3 else json.dumps({"p": "x" * rng.randint(0, 9)})
                 for _ in range(rng.randint(0, 25))]
        data = "\n".join(lines) + rng.choice(["", "\n", "\r\n"])
        if rng.random() < 0.3:
            data = "\ufeff" + data
        path = tmp_path / f"in{trial}.jsonl"
        path.write_text(data, encoding="utf-8")
        expected = len(list(open_reader(str(path))))
        for chunk in (1, 3, 7, 1 << 20):
            monkeypatch.setattr(jsonl, "CHUNK", chunk)
            assert open_reader(str(path)).count() == expected, (data, chunk)


def test_jsonl_gz(tmp_path):
    path = tmp_path / "in.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    reader = open_reader(str(path))
    assert records(reader) == ROWS
    assert reader.count() == 3
    assert records(reader, 2) == ROWS[2:]
    # A gzip stream is recognised by its bytes when --input-format jsonl names an odd file.
    odd = tmp_path / "in.data"
    odd.write_bytes(path.read_bytes())
    assert records(open_reader(str(odd), "jsonl")) == ROWS


def test_truncated_gzip_is_an_input_error(tmp_path):
    path = tmp_path / "in.jsonl.gz"
    data = gzip.compress(b"".join(json.dumps({"p": i}).encode() + b"\n" for i in range(2000)))
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError) as e:
        list(open_reader(str(path)))
    assert e.value.path == str(path) and "could not read the file" in str(e.value)


def _compress(data: bytes, kind: str) -> bytes:
    if kind == "zstd":
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as f:
            f.write(data)
        return sink.getvalue().to_pybytes()
    import bz2
    import lzma

    return {"gzip": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[kind](data)


@pytest.mark.parametrize("kind, suffix", [("gzip", ".gz"), ("bz2", ".bz2"), ("xz", ".xz"), ("zstd", ".zst")])
def test_compressed_jsonl_json_and_csv_read_as_their_plain_files(tmp_path, kind, suffix):
    plain = [{"id": r["id"], "prompt": r["prompt"]} for r in ROWS]
    texts = {"jsonl": "\n".join(json.dumps(r) for r in plain) + "\n", "json": json.dumps(plain),
             "csv": "id,prompt\n" + "".join(f"{r['id']},{r['prompt']}\n" for r in plain)}
    for fmt, text in texts.items():
        path = tmp_path / f"in.{fmt}{suffix}"
        path.write_bytes(_compress(text.encode(), kind))
        reader = open_reader(str(path))
        assert reader.format == fmt and records(reader) == plain, fmt
        assert reader.count() == len(plain) and records(reader, 2) == plain[2:]
        odd = tmp_path / f"odd-{fmt}.data"  # the bytes say the compression; --input-format the format
        odd.write_bytes(path.read_bytes())
        assert records(open_reader(str(odd), fmt)) == plain
    truncated = tmp_path / f"cut.csv{suffix}"
    data = _compress(("prompt\n" + "".join(f"record {i}\n" for i in range(20000))).encode(), kind)
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError) as e:
        list(open_reader(str(truncated)))
    assert e.value.path == str(truncated) and "could not read the file" in str(e.value)


def test_a_compressed_parquet_file_is_an_input_error(tmp_path):
    plain = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a"]}), plain)
    packed = tmp_path / "in.parquet.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    with pytest.raises(InputError, match="a gzip-compressed Parquet file; decompress it first"):
        open_reader(str(packed))


def test_stdin_jsonl(monkeypatch):
    fake = io.TextIOWrapper(io.BytesIO(b'{"prompt": "a"}\n\n{"prompt": "b"}\n'))
    monkeypatch.setattr(sys, "stdin", fake)
    reader = open_reader("-")
    assert reader.count() is None
    assert [(r.index, r.line, r.record) for r in reader] == [(0, 1, {"prompt": "a"}), (1, 3, {"prompt": "b"})]
    assert fingerprint("-") == "stdin"


def test_named_pipe_is_read_once_and_never_peeked(tmp_path):
    fifo = tmp_path / "in.pipe"
    os.mkfifo(fifo)
    data = b'{"prompt": "a"}\n{"prompt": "b"}\n'
    writer = threading.Thread(target=fifo.write_bytes, args=(data,))
    writer.start()
    reader = open_reader(str(fifo), "jsonl")  # opening must not consume the pipe's first bytes
    assert reader.count() is None and fingerprint(str(fifo)) == f"stream:{fifo}"
    assert records(reader) == [{"prompt": "a"}, {"prompt": "b"}]
    writer.join(timeout=5)


def test_stdin_json_array(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'[{"prompt": "a"}, {"prompt": "b"}]')))
    reader = open_reader("-", "json")
    assert reader.count() is None
    assert records(reader) == [{"prompt": "a"}, {"prompt": "b"}]


# -- JSON array ----------------------------------------------------------------------------------

def test_json_array_round_trip_and_bad_elements(tmp_path):
    path = tmp_path / "in.json"
    path.write_text('\ufeff[\n  {"a": 1},\n  [2],\n  {"b": NaN},\n  "s", {"c": "é"},\n  {"d": 1, "d": 2}\n]\n',
                    encoding="utf-8")
    reader = open_reader(str(path))
    got = list(reader)
    assert reader.format == "json" and reader.count() == 6
    assert [r.index for r in got] == [0, 1, 2, 3, 4, 5]
    assert all(r.line is None for r in got)
    assert [r.record for r in got] == [{"a": 1}, None, None, None, {"c": "é"}, None]
    assert got[1].error.startswith("record 1 (line 3): expected a JSON object, got a list")
    assert got[2].error.startswith("record 2 (line 4): non-finite number (NaN)")
    assert got[3].error.startswith("record 3 (line 5): expected a JSON object, got a string")
    assert got[5].error.startswith('record 5 (line 6): the key "d" appears twice in one object')
    assert records(reader, 4) == [{"c": "é"}, None]


def test_json_array_not_utf8_is_an_input_error(tmp_path):
    path = tmp_path / "in.json"
    path.write_bytes(b'[{"prompt": "caf\xe9"}]')
    with pytest.raises(InputError, match="not valid UTF-8"):
        list(open_reader(str(path)))


def test_json_array_elements_cut_by_small_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(json_array, "CHUNK", 5)
    rows = [{"id": i, "text": "x" * (i * 7), "n": 12345.5 + i, "nested": {"k": [1, 2, {"z": None}]}} for i in range(30)]
    path = tmp_path / "in.json"
    path.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    assert records(open_reader(str(path))) == rows
    assert open_reader(str(path)).count() == 30
    path.write_text("[]", encoding="utf-8")
    assert records(open_reader(str(path))) == []


@pytest.mark.parametrize("text, line, message", [
    ('{"a": 1}', None, "expected a JSON array of objects, but it starts with '{'"),
    ("", None, "the file is empty"),
    ('[\n{"a": 1},\n', 3, "the array ends early (missing ']')"),
    ('[\n{"a": 1},\n{"b": [1, 2}\n', 3, "the array ends early (missing ']')"),
    ('[\n{"a": 1},,\n{"b": 2}]', 2, "an element is missing before this ','"),
    ('[{"a": 1}] [', 1, "extra data after the array"),
])
def test_json_array_fatal_errors(tmp_path, text, line, message):
    path = tmp_path / "in.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InputError) as e:
        list(open_reader(str(path)))
    assert e.value.line == line and message in e.value.message


# -- Parquet -------------------------------------------------------------------------------------

def test_parquet_round_trip_and_row_group_skipping(tmp_path, monkeypatch):
    rows = [{"id": f"r{i}", "prompt": f"p{i}", "score": i / 2} for i in range(10)]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)  # groups: 3, 3, 3, 1
    reader = open_reader(str(path))
    assert reader.format == "parquet" and reader.count() == 10
    got = list(reader)
    assert [r.record for r in got] == rows and [r.index for r in got] == list(range(10))
    assert all(r.line is None for r in got)

    asked = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        asked.append(kwargs.get("row_groups"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    tail = list(reader.iter_from(7))
    assert [(r.index, r.record) for r in tail] == [(i, rows[i]) for i in range(7, 10)]
    assert asked == [[2, 3]]  # groups 0 and 1 are never read
    assert list(reader.iter_from(10)) == []


def test_unreadable_parquet_is_an_input_error(tmp_path):
    path = tmp_path / "in.parquet"
    path.write_text('{"prompt": "not parquet"}\n')
    with pytest.raises(InputError) as e:
        open_reader(str(path))
    assert "not a readable Parquet file" in str(e.value) and str(path) in str(e.value)


def test_a_parquet_column_named_twice_is_an_input_error(tmp_path):
    top = pa.Table.from_arrays([pa.array(["a"]), pa.array(["hello"]), pa.array(["world"])],
                               names=["id", "prompt", "prompt"])  # as a dict a row would keep one prompt
    pq.write_table(top, tmp_path / "top.parquet")
    with pytest.raises(InputError, match="column 'prompt' appears twice in the schema; rename one"):
        open_reader(str(tmp_path / "top.parquet"))
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("content", pa.string())])
    nested = pa.Table.from_arrays([pa.array([[("user", "x", "y")]], type=pa.list_(message))], names=["messages"])
    pq.write_table(nested, tmp_path / "nested.parquet")
    with pytest.raises(InputError, match="column 'messages.content' appears twice"):
        open_reader(str(tmp_path / "nested.parquet"))


# -- CSV -----------------------------------------------------------------------------------------

def test_csv_rows_lines_and_errors(tmp_path):
    path = tmp_path / "in.csv"
    path.write_bytes(b'\xef\xbb\xbfid,prompt,label\r\n'
                     b'1,"two\r\nlines",x\r\n'
                     b'\r\n'
                     b'2,"a, b",y,extra\r\n'
                     b'3,short\r\n'
                     b'4,caf\xe9,z\r\n'
                     b'5,last,w')
    reader = open_reader(str(path))
    got = list(reader)
    assert reader.format == "csv" and reader.count() == 5
    assert [(r.index, r.line) for r in got] == [(0, 2), (1, 5), (2, 6), (3, 7), (4, 8)]
    assert got[0].record == {"id": "1", "prompt": "two\r\nlines", "label": "x"}
    assert got[1].error.startswith("line 5: the row has 4 fields but the header has 3")
    assert got[2].record == {"id": "3", "prompt": "short", "label": None}
    assert got[3].error.startswith("line 7: not valid UTF-8")
    assert got[4].record == {"id": "5", "prompt": "last", "label": "w"}
    assert [r.index for r in reader.iter_from(3)] == [3, 4]


def test_tsv_rows_are_split_on_tabs_and_commas_stay_in_their_cells(tmp_path):
    text = 'id\tprompt\n1\tWhat is 2, then 3?\n2\t"a\ttab"\n3\tx\ty\n'
    for name in ("in.tsv", "in.tab"):
        (tmp_path / name).write_text(text)
        reader = open_reader(str(tmp_path / name))
        got = list(reader)
        assert reader.format == "tsv" and reader.count() == 3
        assert [r.record for r in got[:2]] == [{"id": "1", "prompt": "What is 2, then 3?"},
                                               {"id": "2", "prompt": "a\ttab"}]
        assert got[2].error.startswith("line 4: the row has 3 fields but the header has 2; quote cells that contain "
                                       "tabs")
    (tmp_path / "in.tsv.gz").write_bytes(gzip.compress(text.encode()))
    assert records(open_reader(str(tmp_path / "in.tsv.gz")), 0)[:1] == [{"id": "1", "prompt": "What is 2, then 3?"}]
    (tmp_path / "odd.txt").write_text(text)
    assert open_reader(str(tmp_path / "odd.txt"), "tsv").format == "tsv"


def test_csv_duplicate_header_is_an_input_error(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text("prompt,prompt\na,b\n")
    with pytest.raises(InputError, match="column 'prompt' appears twice"):
        list(open_reader(str(path)))


# -- Hugging Face datasets -----------------------------------------------------------------------

def test_datasets_folder(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = [{"id": f"d{i}", "prompt": f"text {i}"} for i in range(5)]
    folder = tmp_path / "ds"
    Dataset.from_list(rows).save_to_disk(str(folder))
    reader = open_reader(str(folder))
    assert reader.format == "datasets" and reader.count() == 5
    assert records(reader) == rows
    assert [(r.index, r.line, r.record) for r in reader.iter_from(3)] == [(3, None, rows[3]), (4, None, rows[4])]

    splits = tmp_path / "dd"
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:2])}).save_to_disk(str(splits))
    with pytest.raises(InputError, match="is a DatasetDict of the splits test, train; choose one with --split"):
        open_reader(str(splits))  # never a guess at "train"
    assert records(open_reader(str(splits), split="train")) == rows
    assert records(open_reader(str(splits), split="test")) == rows[:2]
    with pytest.raises(InputError, match="has no split 'dev'; choose one of test, train"):
        open_reader(str(splits), split="dev")

    before = fingerprint(str(folder))
    assert fingerprint(str(folder)) == before
    Dataset.from_list(rows + rows).save_to_disk(str(tmp_path / "ds2"))
    assert fingerprint(str(tmp_path / "ds2")) != before


def test_hub_dataset_failure_is_a_clean_input_error(monkeypatch):
    import datasets

    def fail(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/data' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", fail)
    for kwargs in ({"input_format": "datasets"}, {"split": "train"}):
        with pytest.raises(InputError) as e:
            open_reader("someone/data", **kwargs)
        assert e.value.path == "someone/data"
        assert "Hugging Face hub" in e.value.message and "Couldn't reach" in e.value.message


def test_hub_dataset_streams_and_skips(monkeypatch):
    import datasets

    class FakeStream:
        def __init__(self, rows):
            self.rows = rows

        def skip(self, n):
            return FakeStream(self.rows[n:])

        def __iter__(self):
            return iter(self.rows)

    seen = {}

    def load(name, split, streaming):
        seen.update(name=name, split=split, streaming=streaming)
        return FakeStream([{"prompt": str(i)} for i in range(4)])

    monkeypatch.setattr(datasets, "load_dataset", load)
    reader = open_reader("someone/data", split="test")
    assert seen == {"name": "someone/data", "split": "test", "streaming": True}
    assert [(r.index, r.record) for r in reader.iter_from(2)] == [(2, {"prompt": "2"}), (3, {"prompt": "3"})]


# -- opening errors and fingerprints -------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(InputError) as e:
        open_reader(str(tmp_path / "nope.jsonl"))
    assert str(e.value) == f"{tmp_path / 'nope.jsonl'}: no such file; check the path"


def test_unknown_extension_and_format(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("{}\n")
    with pytest.raises(InputError) as e:
        open_reader(str(path))
    assert ".jsonl" in str(e.value) and ".parquet" in str(e.value) and "--input-format" in str(e.value)
    assert records(open_reader(str(path), input_format="jsonl")) == [{}]
    with pytest.raises(InputError, match="unknown input format 'xml'"):
        open_reader(str(path), input_format="xml")
    with pytest.raises(InputError, match="--split applies to Hugging Face datasets"):
        open_reader(str(path), input_format="jsonl", split="train")
    with pytest.raises(InputError, match="is a folder"):
        open_reader(str(tmp_path))


def test_input_error_text():
    assert str(InputError("data.jsonl", 3, "bad")) == "data.jsonl: line 3: bad"
    assert str(InputError("data.jsonl", None, "bad")) == "data.jsonl: bad"
    e = InputError("data.jsonl", 3, "bad")
    assert (e.path, e.line, e.message) == ("data.jsonl", 3, "bad")


def test_fingerprint_tracks_content_not_mtime(tmp_path):
    path = tmp_path / "in.jsonl"
    data = bytearray(b"x" * (3 << 20))
    path.write_bytes(data)
    st = os.stat(path)
    first = fingerprint(str(path))
    assert first == fingerprint(str(path)) and first.startswith("sha256:")
    data[len(data) // 2] = ord("y")  # an edit in the middle, same size, same mtime
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fingerprint(str(path)) != first
    same_content = fingerprint(str(path))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched or copied again: same bytes
    assert fingerprint(str(path)) == same_content


# -- what a hostile input holds: bad elements, oversized records, lone surrogates, digests -----------

def test_json_array_bad_elements_become_error_rows_and_the_rest_is_read(tmp_path):
    path = tmp_path / "in.json"
    path.write_text('[{"prompt": "a ] , } \\" [ {"},\n {"b": tru},\n {"prompt": "c"},\n {"x": 1} {"y": 2},\n'
                    ' "str", {"p": [1, {"q": "]"}]}, 1e999]', encoding="utf-8")
    got = list(open_reader(str(path)))
    assert [r.index for r in got] == list(range(7))
    assert got[0].record == {"prompt": 'a ] , } " [ {'} and got[2].record == {"prompt": "c"}
    assert "record 1 (line 2): invalid JSON" in got[1].error
    assert "record 3 (line 4): invalid JSON (extra data" in got[3].error
    assert "expected a JSON object, got a string" in got[4].error
    assert got[5].record == {"p": [1, {"q": "]"}]}
    assert "non-finite number" in got[6].error
    assert open_reader(str(path)).count() == 7


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_a_record_over_the_size_limit_is_an_error_row_and_the_next_is_read(tmp_path, monkeypatch, fmt):
    import conveyor.io.records.readers.json_array as json_array
    import conveyor.io.records.readers.jsonl as jsonl

    monkeypatch.setattr(json_array, "CHUNK", 64)  # the big element spans many refills
    monkeypatch.setattr(jsonl, "CHUNK", 64)
    records = [{"prompt": "small"}, {"prompt": "x" * 5000, "tail": ["]", "}"]}, {"prompt": "after"}]
    path = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    else:
        path.write_text(json.dumps(records), encoding="utf-8")
    got = list(open_reader(str(path), max_record_bytes=1000))
    assert got[0].record == {"prompt": "small"} and got[2].record == {"prompt": "after"}
    assert got[1].record is None and "over the 1,000 of --max-record-bytes" in got[1].error
    assert "5,0" in got[1].error  # its size, counted while reading past it
    assert list(open_reader(str(path), max_record_bytes=100_000))[1].record == records[1]


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_lone_surrogates_are_error_rows_naming_the_field_and_pairs_are_text(tmp_path, fmt):
    lines = ['{"id": "a", "prompt": "The sky is"}', '{"id": "b", "prompt": "Hello \\ud800 world"}',
             '{"id": "\\udfff", "prompt": "x"}', '{"prompt": "x", "meta": {"k": ["ok", "\\ud83d"]}}',
             '{"prompt": "smile \\ud83d\\ude00"}', '{"\\udc00key": 1, "prompt": "x"}']
    path = tmp_path / f"in.{fmt}"
    path.write_text("\n".join(lines) + "\n" if fmt == "jsonl" else "[" + ",\n".join(lines) + "]", encoding="utf-8")
    got = list(open_reader(str(path)))
    assert got[0].record is not None and got[4].record == {"prompt": "smile \U0001F600"}
    assert "field 'prompt' holds a lone UTF-16 surrogate (\\ud800" in got[1].error
    assert "field 'id' holds a lone UTF-16 surrogate (\\udfff" in got[2].error
    assert "field 'meta.k[1]'" in got[3].error
    assert "a field name" in got[5].error
    assert all(r.error.startswith(("line", "record")) for r in got if r.error)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_digests_name_a_record_by_its_content(tmp_path, fmt):
    def write_input(path, records, fmt):
        if fmt == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        elif fmt == "json":
            path.write_text(json.dumps(records), encoding="utf-8")
        elif fmt == "csv":
            path.write_text("prompt\n" + "".join(r["prompt"] + "\n" for r in records), encoding="utf-8")
        else:
            pq.write_table(pa.Table.from_pylist(records), path)
        return path

    a = [{"prompt": "one"}, {"prompt": "two"}, {"prompt": "three"}]
    b = [{"prompt": "one"}, {"prompt": "TWO"}, {"prompt": "three"}]

    def digests(records, name):
        reader = open_reader(str(write_input(tmp_path / f"{name}.{fmt}", records, fmt)))
        reader.with_digests = True
        return [r.digest for r in reader]

    da, db = digests(a, "a"), digests(b, "b")
    assert all(da) and len(set(da)) == 3
    assert da[0] == db[0] and da[1] != db[1] and da[2] == db[2]
    reader = open_reader(str(tmp_path / f"a.{fmt}"))
    assert all(r.digest is None for r in reader)  # only where asked for


def test_a_location_is_a_line_an_array_element_or_an_index():
    assert location(4, 5) == "line 5"
    assert location(4, element_line=9) == "record 4 (line 9)"
    assert location(4) == "record 4"
