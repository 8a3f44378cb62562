"""--reasoning-parser from the command line, on a tiny random model whose tokenizer has think tags (`think_model`): a
record's logit bias closes its reasoning at once, so its answer follows the run's grammar; the `reasoning` column
in Parquet (typed, null where an output had none) and `message.reasoning_content` in OpenAI batch output; a model
without think tags is a usage error before it loads; the parser is part of the run's settings (drift)."""

from __future__ import annotations

from cli_helpers import read_rows, run_in_process, tiny_args, write_jsonl

FAST = ["--temperature", "0", "--quiet", "--max-tokens", "12"]


def _end_id(think_model) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(think_model).convert_tokens_to_ids("</think>")


def test_reasoning_column_and_the_answer_under_the_grammar(think_model, tmp_path):
    import pyarrow.parquet as pq

    end = _end_id(think_model)
    records = [{"id": "closed", "prompt": "Is it?", "logit_bias": {str(end): 100}}, {"id": "plain", "prompt": "Hi"}]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.parquet"
    args = [source, "-o", out, *tiny_args(think_model), *FAST, "--choice", "yes,no"]
    result = run_in_process("run", *args, "--reasoning-parser", "auto")
    assert result.code == 0, result.err
    table = pq.read_table(out)
    assert str(table.schema.field("reasoning").type) == "string"
    closed, plain = table.to_pylist()
    assert closed["reasoning"] == "" and closed["output"] in ("yes", "no")  # the bias closed it; then the grammar
    # never closed, and qwen3's output need not open one: all answer, no grammar applied
    assert plain["reasoning"] is None and plain["finish_reason"] == "length"
    # the parser is one of the run's settings: another one under the same run directory is drift
    again = run_in_process("run", *args, "--reasoning-parser", "deepseek_r1")
    assert again.code == 2 and "reasoning_parser" in again.err


def test_openai_batch_carries_reasoning_content(think_model, tmp_path):
    end = _end_id(think_model)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"Q{i}"}], "logit_bias": {str(end): 100},
                       "response_format": {"type": "json_object"}}} for i in range(2)]
    out = tmp_path / "out.jsonl"
    result = run_in_process("run", write_jsonl(tmp_path / "batch.jsonl", lines), "-o", out, "--output-format",
                            "openai-batch", "--reasoning-parser", "qwen3", *tiny_args(think_model), *FAST)
    assert result.code == 0, result.err
    for line in read_rows(out):
        message = line["response"]["body"]["choices"][0]["message"]
        assert message["reasoning_content"] == ""
        assert message["content"].startswith("{")  # the answer is the grammar's, from its first token


def test_a_model_without_think_tags_is_refused_before_it_loads(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    for name in ("auto", "deepseek_r1"):
        result = run_in_process("run", source, "-o", tmp_path / "o.jsonl", *tiny_args(tiny_model), *FAST,
                                "--reasoning-parser", name)
        assert result.code == 2 and len(result.err_lines) == 1, result.err
        assert result.err_lines[0].startswith(f"conveyor: error: --reasoning-parser {name}:")
        assert not (tmp_path / "o.jsonl.conveyor" / "journal.sqlite").exists()
    bad = run_in_process("run", source, "-o", tmp_path / "o.jsonl", *tiny_args(tiny_model), "--reasoning-parser", "x")
    assert bad.code == 2 and "--reasoning-parser" in bad.err and "deepseek_r1" in bad.err
