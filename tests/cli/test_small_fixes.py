"""Small things of the command line: --version; `run --help` at 80 columns; `conveyor merge OUTPUT`; --choice keeps
a user's spaces; a --json-schema file that is not a schema, and a --model that is nowhere to be had, refused at once
(exit 2, one line) before the model loads; --keep-fields naming a field no record had is said; --quiet prints
warnings and errors only."""

from __future__ import annotations

import json
import re

from cli_helpers import read_rows, run_in_process, tiny_args, write_jsonl

FAST = ["--temperature", "0", "--max-tokens", "4"]


def test_version():
    from importlib.metadata import version

    result = run_in_process("--version")
    assert result.code == 0 and result.out.strip() == f"conveyor {version('conveyor')}"


def test_run_help_reads_at_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = run_in_process("run", "--help")
    assert result.code == 0
    lines = result.out.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in result.out  # no option name cut short
    starts = []
    for line in lines:
        found = re.match(r"│ \*? *--\S+(?: +-\w)? +<[^>]+> +(?=\S)", line)
        if found:
            starts.append(found.end())
    assert len(starts) > 40
    assert 80 - max(starts) >= 30, "some option's help is squeezed into a narrow column"
    assert "--ignore-eos" in result.out and "--no-ignore-eos" not in result.out  # (accepted, not listed)


def test_of_a_switch_and_its_negative_the_later_wins():
    from conveyor.cli.command_line import set_command_line
    from conveyor.cli.options import negatives

    cases = [(["--quiet", "--no-quiet"], False), (["--no-quiet", "-q"], True), (["--no-quiet", "--quiet"], True),
             (["--no-quiet"], False), (["-q"], True)]
    try:
        for args, quiet in cases:
            set_command_line(["run", "in.jsonl", *args])
            flags = {"quiet": "--quiet" in args or "-q" in args or None, "no_quiet": "--no-quiet" in args}
            assert negatives(flags)["quiet"] is quiet, args
        set_command_line(["run", "in.jsonl", "--no-ignore-eos"])
        assert negatives({"ignore_eos": None, "no_ignore_eos": True}) == {"ignore_eos": False}
    finally:
        set_command_line([])


def test_merge_takes_the_output_as_status_does(tmp_path):
    out = tmp_path / "answers.parquet"
    for args in ([out], ["-o", out]):
        result = run_in_process("merge", *args)
        assert result.code == 2 and "holds no shards" in result.err, result.err
    for args in ([], [out, "-o", out]):
        result = run_in_process("merge", *args)
        assert result.code == 2 and "name the output file once, as OUTPUT or with -o" in result.err


def test_choice_keeps_the_spaces_a_user_quoted(tiny_model, tmp_path):
    from conveyor.cli.config import build_config

    spec = build_config({"input": "x", "output": "y", "choice": " yes, no"}, None).spec
    assert json.loads(spec.sampling.grammar.spec) == [" yes", " no"]
    config = tmp_path / "c.yaml"
    config.write_text('choice: ["a, b", " c"]\n')
    assert json.loads(build_config({"input": "x", "output": "y"}, str(config)).spec.sampling.grammar.spec) == \
        ["a, b", " c"]  # a config file's list: item by item
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Is {i} odd?"} for i in range(3)])
    result = run_in_process("run", source, "-o", tmp_path / "o.jsonl", *tiny_args(tiny_model), *FAST, "--quiet",
                            "--choice", " yes, no")
    assert result.code == 0, result.err
    assert {row["output"] for row in read_rows(tmp_path / "o.jsonl")} <= {" yes", " no"}


def test_a_json_schema_file_that_is_no_schema_is_refused_naming_it(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "nonsense"}')
    result = run_in_process("run", tmp_path / "missing.jsonl", "-o", tmp_path / "o.jsonl", "--json-schema", schema,
                            "--model", tmp_path / "no-model")
    assert result.code == 2 and len(result.err_lines) == 1
    assert result.err_lines[0].startswith(f"conveyor: error: --json-schema {schema}: not a valid JSON schema")


def test_a_model_nowhere_to_be_had_fails_at_once_offline(tmp_path, monkeypatch):
    from conveyor.core.model_loader import check_hub_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_hub_model.cache_clear()
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    result = run_in_process("run", source, "-o", tmp_path / "o.jsonl", "--model", "nobody/no-such-model")
    check_hub_model.cache_clear()
    assert result.code == 2 and len(result.err_lines) == 1, result.err
    assert result.err_lines[0].startswith("conveyor: error: --model nobody/no-such-model: not an embedded model")
    assert "HF_HUB_OFFLINE is set" in result.err
    assert not (tmp_path / "o.jsonl.conveyor").exists()  # refused before any work
    missing = run_in_process("run", source, "-o", tmp_path / "o.jsonl", "--model", tmp_path / "nothing" / "here")
    assert missing.code == 2 and "no such file or folder" in missing.err


def test_the_online_check_is_one_request_without_retries(monkeypatch):
    import huggingface_hub
    import pytest

    from conveyor.core import ConfigError
    from conveyor.core.model_loader import check_hub_model

    calls = []

    def unreachable(self, repo_id, **kw):
        calls.append(repo_id)
        raise ConnectionError("Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    check_hub_model.cache_clear()
    with pytest.raises(ConfigError, match="the Hugging Face hub cannot be reached"):
        check_hub_model("nobody/x")
    check_hub_model.cache_clear()
    assert calls == ["nobody/x"]


def test_keep_fields_no_record_had_and_quiet(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x", "topic": "a"}, {"prompt": "y"}])
    summary = tmp_path / "summary.json"
    args = [source, "-o", tmp_path / "o.jsonl", *tiny_args(tiny_model), *FAST, "--keep-fields", "topic,tpoic",
            "--summary-json", summary]
    loud = run_in_process("run", *args)
    assert loud.code == 0, loud.err
    assert "conveyor run summary" in loud.out
    assert "keep field 'tpoic' was in no record" in loud.err and "'topic'" not in loud.err
    assert json.loads(summary.read_text())["keep_fields_missing"] == ["tpoic"]
    quiet = run_in_process("run", *args, "--quiet", "--restart")
    assert quiet.code == 0 and quiet.out == ""
    assert "keep field 'tpoic' was in no record" in quiet.err
    assert all("warning" in line or "batch-invariant" in line for line in quiet.err_lines[:-1]), quiet.err
    assert quiet.err_lines[-1].startswith("conveyor: 2/2 records have a row (0 errors); wrote")  # the closing line
