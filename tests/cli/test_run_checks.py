"""A field an option names that the input does not have is a usage error before the model loads, with the nearest
field: a table's columns, a JSON input's first records' fields (a misspelled --chat-field would otherwise make
every record an error row, counted as finished)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_helpers import read_rows, run_in_process, tiny_args, write_input, write_jsonl

RECORDS = [{"id": f"q{i}", "question": f"What is {i} + {i}?", "topic": "sums"} for i in range(3)]


def _csv(path):
    path.write_text("id,question,topic\n" + "".join(f"{r['id']},{r['question']},{r['topic']}\n" for r in RECORDS))
    return path


def _parquet(path):
    pq.write_table(pa.Table.from_pylist(RECORDS), path)
    return path


@pytest.mark.parametrize(("options", "message"), [
    (["--chat-field", "questoin"], "--chat-field questoin: {src} has no column 'questoin' (did you mean question?); "
                                   "its columns: id, question, topic"),
    (["--chat-field", "question", "--keep-fields", "topic,tpoic"],
     "--keep-fields tpoic: {src} has no column 'tpoic' (did you mean topic?)"),
    (["--prompt-field", "qestion"], "--prompt-field qestion: {src} has no column 'qestion' (did you mean question?)"),
    (["--prompt-template", "Q: {question} ({topc})"], "--prompt-template topc: {src} has no column 'topc' (did you "
                                                      "mean topic?)"),
])
@pytest.mark.parametrize("make", [_csv, _parquet], ids=["csv", "parquet"])
def test_a_misspelled_column_is_refused_before_the_model_loads(tiny_model, tmp_path, make, options, message):
    source = make(tmp_path / f"in.{make.__name__[1:]}")
    result = run_in_process("run", source, "-o", tmp_path / "out.jsonl", *tiny_args(tiny_model), *options)
    assert result.code == 2, result.err
    assert message.format(src=source) in result.err and len(result.err_lines) == 1
    assert not (tmp_path / "out.jsonl.conveyor" / "journal.sqlite").exists()


def test_a_json_inputs_first_records_are_checked(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    result = run_in_process("run", source, "-o", tmp_path / "out.jsonl", *tiny_args(tiny_model), "--chat-field",
                            "question", "--id-field", "key")
    assert result.code == 2
    assert (f"--id-field key: none of the first 3 records of {source} has a field 'key'; their fields: id, "
            "question, topic") in result.err
    checked = run_in_process("validate", source, "--model", tiny_model, "--chat-field", "qustion")
    assert checked.code == 2 and "did you mean question?" in checked.err
    kept = run_in_process("run", source, "-o", tmp_path / "out.jsonl", *tiny_args(tiny_model), "--chat-field",
                          "question", "--keep-fields", "tpoic")
    assert kept.code == 2 and len(kept.err_lines) == 1, kept.err
    assert (f"--keep-fields tpoic: none of the first 3 records of {source} has a field 'tpoic' (did you mean "
            "topic?)") in kept.err
    assert not (tmp_path / "out.jsonl.conveyor" / "journal.sqlite").exists()


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_a_json_input_without_a_prompt_field_is_refused_before_the_model_loads(tiny_model, tmp_path, fmt):
    source = write_input(tmp_path / f"in.{fmt}", RECORDS, fmt)
    result = run_in_process("run", source, "-o", tmp_path / "out.jsonl", *tiny_args(tiny_model))
    assert result.code == 2, result.err
    assert (f"none of the first 3 records of {source} has a 'prompt' or 'messages' field to take each prompt from "
            "(their fields: id, question, topic); name the field with --chat-field FIELD") in result.err
    assert len(result.err_lines) == 1 and "loading" not in result.err
    assert not (tmp_path / "out.jsonl.conveyor" / "journal.sqlite").exists()


def test_fields_that_are_there_pass_and_batch_lines_are_not_checked(tiny_model, tmp_path):
    source = _csv(tmp_path / "in.csv")
    fine = run_in_process("run", source, "-o", tmp_path / "out.jsonl", *tiny_args(tiny_model), "--max-tokens", "2",
                          "--chat-field", "question", "--keep-fields", "topic", "-q")
    assert fine.code == 0, fine.err
    assert [r["topic"] for r in read_rows(tmp_path / "out.jsonl")] == ["sums"] * 3
    lines = write_jsonl(tmp_path / "batch.jsonl", [
        {"custom_id": "b0", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}}])
    batch = run_in_process("run", lines, "-o", tmp_path / "batch.out.jsonl", *tiny_args(tiny_model),
                           "--keep-fields", "custom_id", "-q")
    assert batch.code == 0, batch.err


@pytest.mark.parametrize("make", [_csv, _parquet], ids=["csv", "parquet"])
def test_a_table_without_a_prompt_column_is_refused_before_the_model_loads(tiny_model, tmp_path, make):
    """(every row would be an error row, and naming the column then would need --restart)"""
    source = make(tmp_path / f"in.{make.__name__[1:]}")
    result = run_in_process("run", source, "-o", tmp_path / "out.jsonl", *tiny_args(tiny_model))
    assert result.code == 2, result.err
    assert (f"{source} has no 'prompt' or 'messages' column to take each prompt from (its columns: id, question, "
            "topic); name the column with --chat-field COLUMN") in result.err and len(result.err_lines) == 1
    assert not (tmp_path / "out.jsonl.conveyor" / "journal.sqlite").exists()
    named = run_in_process("run", source, "-o", tmp_path / "out.jsonl", *tiny_args(tiny_model), "--prompt-field",
                           "question", "--max-tokens", "2", "-q")
    assert named.code == 0, named.err
    assert len(read_rows(tmp_path / "out.jsonl")) == len(RECORDS)
