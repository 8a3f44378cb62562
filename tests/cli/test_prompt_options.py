"""`conveyor run` / `validate` with --chat-field, --system-prompt, --prompt-template, --truncate-prompt-tokens and
--served-model-name: the usage errors before the model loads, the rows they give, and (slow) the embedded instruct
model answering a questions column through its chat template where the raw column gives it nothing to answer."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from cli_helpers import read_rows, run_in_process, tiny_args, write_input, write_jsonl

from conveyor.cli.validate import prompt_block

SAMPLE_DATA = Path(__file__).resolve().parents[2] / "sample_data"
FIXED = ("--temperature", "0", "--max-tokens", "3", "--quiet")
QUESTIONS = [{"id": "q1", "topic": "maths", "question": "What is 2+2?"},
             {"id": "q2", "topic": "geography", "question": "What is the capital of France?"}]


def _run(tiny_model, input_path, output_path, *extra):
    return run_in_process("run", input_path, "-o", output_path, *tiny_args(tiny_model), *FIXED, *extra)


@pytest.mark.parametrize(("args", "says"), [
    (("--prompt-field", "question", "--system-prompt", "Be brief."), ("--system-prompt", "--chat-field question")),
    (("--prompt-template", "Q: {question}", "--system-prompt", "Be brief."), ("--prompt-template-as chat",)),
    (("--prompt-template", "Q: {question.text}"), ("--prompt-template", "{question.text}", "field name only")),
    (("--prompt-template", "Q: {question!r}"), ("--prompt-template", "field name only")),
    (("--prompt-template", "no placeholder"), ("--prompt-template", "no {field} placeholder")),
    (("--prompt-template-as", "chat"), ("--prompt-template-as", "no --prompt-template")),
    (("--prompt-template", "{question}", "--prompt-template-as", "user"), ("--prompt-template-as", "prompt, chat")),
    (("--chat-field", "question", "--prompt-template", "{question}"), ("--chat-field and --prompt-template",)),
    (("--system-prompt", "@missing-system.txt", "--chat-field", "question"), ("--system-prompt @missing-system.txt",
                                                                               "cannot be read")),
    (("--prompt-template", "@missing-template.txt"), ("--prompt-template @missing-template.txt",)),
    (("--truncate-prompt-tokens", "0"), ("--truncate-prompt-tokens", "auto or a number")),
    (("--truncate-prompt-tokens", "some"), ("--truncate-prompt-tokens",)),
    (("--served-model-name", " , "), ("--served-model-name",)),
])
def test_usage_errors_before_the_model_loads(tmp_path, args, says):
    source = write_jsonl(tmp_path / "in.jsonl", QUESTIONS)
    result = run_in_process("run", source, "-o", tmp_path / "out.jsonl", "--model", tmp_path / "no-such-model", *args)
    assert result.code == 2, result.err
    assert len(result.err_lines) == 1 and all(s in result.err for s in says), result.err
    assert not (tmp_path / "out.jsonl.conveyor").exists()


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_chat_field_run_with_a_system_prompt_file(tiny_model, tmp_path, fmt):
    source = write_input(tmp_path / f"questions.{fmt}", QUESTIONS, fmt)
    system = tmp_path / "system.txt"
    system.write_text("Answer in one sentence.\n", encoding="utf-8")
    out = tmp_path / "out.parquet"
    result = _run(tiny_model, source, out, "--chat-field", "question", "--system-prompt", f"@{system}",
                  "--keep-fields", "topic")
    assert result.code == 0, result.err
    rows = read_rows(out)
    assert [(r["id"], r["status"], r["topic"]) for r in rows] == [("q1", "ok", "maths"), ("q2", "ok", "geography")]
    assert "prompt_tokens_truncated" not in rows[0]  # no truncation asked: the file's columns are as before
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    expected = tokenizer.apply_chat_template([{"role": "system", "content": "Answer in one sentence.\n"},
                                              {"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert rows[0]["prompt_tokens"] == len(expected)


def test_a_csv_messages_column_of_json_text_and_a_template(tiny_model, tmp_path):
    chat = [{"role": "user", "content": "Hi!"}]
    source = tmp_path / "chats.csv"
    with open(source, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "messages"])
        writer.writerow(["c1", json.dumps(chat)])
        writer.writerow(["c2", "[not json"])
    result = _run(tiny_model, source, tmp_path / "out.jsonl")
    assert result.code == 3, result.err
    ok, bad = read_rows(tmp_path / "out.jsonl")
    assert ok["status"] == "ok" and bad["status"] == "error" and "field 'messages'" in bad["error"]

    template = tmp_path / "template.txt"
    template.write_text("Topic: {topic}\nQuestion: {question}\nAnswer:", encoding="utf-8")
    source = write_jsonl(tmp_path / "q.jsonl", [*QUESTIONS, {"id": "q3", "question": "Why?"}])
    result = _run(tiny_model, source, tmp_path / "t.jsonl", "--prompt-template", f"@{template}")
    assert result.code == 3, result.err
    rows = read_rows(tmp_path / "t.jsonl")
    assert [r["status"] for r in rows] == ["ok", "ok", "error"]
    assert "--prompt-template" in rows[2]["error"] and "field 'topic' is missing" in rows[2]["error"]


def test_an_over_long_prompt_is_answered_with_truncation(tiny_model, tmp_path):
    long_prompt = "word " * 2500  # past the tiny model's 2048-token context
    records = [{"id": "long", "prompt": long_prompt}, {"id": "short", "prompt": "The sky is"}]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    result = _run(tiny_model, source, tmp_path / "refused.jsonl")
    assert result.code == 3
    refused = read_rows(tmp_path / "refused.jsonl")
    assert refused[0]["status"] == "error" and "--truncate-prompt-tokens auto" in refused[0]["error"]
    assert "prompt_tokens_truncated" not in refused[0]

    out = tmp_path / "out.parquet"
    result = _run(tiny_model, source, out, "--truncate-prompt-tokens", "auto")
    assert result.code == 0, result.err
    long, short = read_rows(out)
    assert long["status"] == "ok" and long["prompt_tokens"] == 2048 - 3
    assert long["prompt_tokens_truncated"] > 400 and short["prompt_tokens_truncated"] == 0
    import pyarrow.parquet as pq

    assert str(pq.read_schema(out).field("prompt_tokens_truncated").type) == "int64"


def test_batch_lines_name_their_model_and_custom_id(tiny_model, tmp_path):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "gpt-4o-mini", **chat}},
             {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"model": tiny_model.name,
                                                                                          **chat}},
             {"method": "POST", "url": "/v1/chat/completions", "body": chat}]
    source = write_jsonl(tmp_path / "batch.jsonl", lines)
    result = _run(tiny_model, source, tmp_path / "out.jsonl", "--output-format", "openai-batch")
    assert result.code == 3
    a, b, c = read_rows(tmp_path / "out.jsonl")
    assert "gpt-4o-mini" in a["error"]["message"] and "--served-model-name" in a["error"]["message"]
    assert b["error"] is None
    assert "custom_id" in c["error"]["message"]
    result = _run(tiny_model, write_jsonl(tmp_path / "two.jsonl", lines[:1]), tmp_path / "two-out.jsonl",
                  "--output-format", "openai-batch", "--served-model-name", "gpt-4o-mini,gpt-4o")
    assert result.code == 0, result.err


def test_validate_shows_the_first_prompt_as_the_model_gets_it(tiny_model, tmp_path):
    source = write_input(tmp_path / "q.csv", QUESTIONS, "csv")
    result = run_in_process("validate", source, "--model", tiny_model, "--chat-field", "question",
                            "--system-prompt", "Be brief.")
    assert result.code == 0, result.err
    assert "first prompt (line 2)" in result.out
    assert "  | <|im_start|>system" in result.out and "  | What is 2+2?<|im_end|>" in result.out
    assert "France" not in result.out


def test_a_long_prompt_block_is_cut():
    block = prompt_block("\n".join(f"line {i}" for i in range(100)), max_lines=3)
    assert block.splitlines()[:3] == ["  | line 0", "  | line 1", "  | line 2"]
    assert block.splitlines()[3].startswith("  ... (") and len(block.splitlines()) == 4


@pytest.mark.slow
def test_the_instruct_model_answers_a_questions_column_given_as_chat(tmp_path):
    """The embedded instruct model mostly ends a raw question at once (empty outputs, status ok); sent as the user
    message of a chat, every question gets an answer."""
    source = write_input(tmp_path / "questions.parquet", list(csv.DictReader(open(SAMPLE_DATA / "questions.csv"))),
                         "parquet")
    common = ("--model", "smollm2-135m-instruct", "--temperature", "0", "--max-tokens", "6", "--quiet")
    result = run_in_process("run", source, "-o", tmp_path / "raw.jsonl", "--prompt-field", "question", *common)
    assert result.code == 0, result.err
    raw = read_rows(tmp_path / "raw.jsonl")
    assert sum(not r["output"].strip() for r in raw) >= len(raw) // 2
    result = run_in_process("run", source, "-o", tmp_path / "a.parquet", "--chat-field", "question",
                            "--system-prompt", "Answer in one sentence.", "--keep-fields", "topic", *common)
    assert result.code == 0, result.err
    rows = read_rows(tmp_path / "a.parquet")
    assert len(rows) == 20 and all(r["status"] == "ok" and r["output"].strip() and r["topic"] for r in rows)
