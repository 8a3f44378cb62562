"""An option is its alias, its command parameter and its field: the option table, the config file's types and
choices, --help's choices and the drift of a run directory are all read from the fields (core/fields.py)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from typer.testing import CliRunner

from conveyor.cli.app import app
from conveyor.cli.config import OPTIONS, _meta, build_config, load_config_file
from conveyor.cli.exit_codes import UsageError
from conveyor.cli.option_names import option_name
from conveyor.cli.run import run_command
from conveyor.core import ConfigError, EngineConfig, SamplingParams
from conveyor.core.fields import field_kinds, option_fields
from conveyor.io.records.build_options import BuildOptions
from conveyor.io.run_spec import ROW_NEUTRAL, InputOptions, OutputOptions, RunSpec, StateOptions

NOT_OPTIONS = {"input", "output", "config"}  # the arguments and --config itself


def _parameters(command) -> set[str]:
    return {name for name in inspect.signature(command).parameters
            if name not in NOT_OPTIONS and not name.startswith("no_")}


def test_every_run_parameter_is_an_option_field_and_every_option_field_a_parameter():
    assert _parameters(run_command) == {key for key in OPTIONS if _meta(key).flag}  # (the rest: config files only)


def test_validate_takes_options_of_the_table_only():
    from conveyor.cli.app import validate_command

    assert _parameters(validate_command) - {"show_errors"} <= set(OPTIONS)


def test_every_choice_of_an_option_is_named_in_its_help():
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "400"}, terminal_width=400)
    assert result.exit_code == 0
    lines = result.output.splitlines()
    for key in OPTIONS:
        choices = [c for c in _meta(key).choices if c is not None]
        if not choices:
            continue
        line = next(line for line in lines if f"{option_name(key)} " in line)
        missing = [c for c in choices if str(c) not in line]
        assert not missing, f"{option_name(key)}'s help does not name {missing}: {line}"


def _config(**values):
    return build_config({"input": "in.jsonl", "output": "out.jsonl", **values}, None)


@pytest.mark.parametrize(("values", "message"), [
    ({"max_tokens": "many"}, "--max-tokens: expected an integer, got 'many'"),
    ({"temperature": "hot"}, "--temperature: expected a number, got 'hot'"),
    ({"ignore_eos": "yes"}, "--ignore-eos: expected true or false, got 'yes'"),
    ({"prompt_logprobs": 3}, "--prompt-logprobs: expected true or false, got 3"),
    ({"model": 5}, "--model: expected a string, got 5"),
    ({"checkpoint_every": 0}, "--checkpoint-every: must be positive, got 0"),
    ({"log_every": -1.0}, "--log-every: must be positive, got -1.0"),
    ({"limit": -1}, "--limit: must be >= 0, got -1"),
    ({"on_error": "ignore"}, "--on-error: 'ignore' is not one of record, skip, fail"),
    ({"input_format": "xml"}, "--input-format: 'xml' is not one of jsonl, json, parquet, csv, tsv, datasets"),
    ({"executor": "slurm"}, "--executor: 'slurm' is not one of local, ray"),
    ({"device": "tpu"}, "--device: 'tpu' is not one of auto, cpu, cuda or cuda:N"),
    ({"max_record_bytes": "lots"}, "--max-record-bytes: cannot read 'lots'"),
    ({"checkpoint_seconds": 0}, "--checkpoint-seconds: must be positive, got 0"),
    ({"json_schema": 3}, "--json-schema: expected a string, got 3"),
    ({"regex": ["a"]}, "--regex: expected a string, got ['a']"),
])
def test_a_bad_value_is_a_usage_error_naming_its_option(values, message):
    with pytest.raises(UsageError) as e:
        _config(**values)
    assert str(e.value).startswith(message)


def test_values_are_held_as_their_fields_declare():
    invocation = _config(temperature=1, max_record_bytes="1KiB", kv_cache_memory="8MiB", prompt_logprobs=True)
    spec = invocation.spec
    assert spec.sampling.temperature == 1.0 and isinstance(spec.sampling.temperature, float)
    assert spec.input.max_record_bytes == 1024 and spec.engine.kv_cache_memory == "8MiB"
    assert spec.sampling.prompt_logprobs == 0


def test_the_options_dataclasses_check_themselves():
    for make, field in ((lambda: InputOptions("in", limit=-1), "limit"),
                        (lambda: OutputOptions("out", on_error="drop"), "on_error"),
                        (lambda: StateOptions(checkpoint_seconds=0.0), "checkpoint_seconds"),
                        (lambda: BuildOptions(prompt_template_as="markdown"), "prompt_template_as"),
                        (lambda: RunSpec(InputOptions("in"), OutputOptions("out"), reasoning_parser="r2"),
                         "reasoning_parser")):
        with pytest.raises(ConfigError) as e:
            make()
        assert e.value.field == field


def test_a_config_key_without_a_value_is_the_options_default(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("seed:\nquiet:\ndtype:\nmax_tokens: 7\n")
    invocation = build_config({"input": "in.jsonl", "output": "out.jsonl"}, str(config))
    assert invocation.spec.build.seed == BuildOptions().seed and invocation.cli.quiet is False
    assert invocation.spec.engine.dtype == EngineConfig().dtype and invocation.spec.sampling.max_tokens == 7


@pytest.mark.parametrize(("text", "message"), [
    ("max_tokens: 3\ntemperature: 0\nmax_tokens: 4\n", "the key max_tokens is given twice (line 1 and line 3) and "
                                                         "only one would be used; keep one"),
    ("max_tokens: 3\nmax-tokens: 4\n", "max_tokens and max-tokens are one option, given twice; keep one"),
])
def test_a_config_key_given_twice_is_refused(tmp_path, text, message):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    with pytest.raises(UsageError) as e:
        load_config_file(str(config))
    assert str(e.value) == f"--config {config}: {message}"


def test_every_unknown_config_key_is_listed_with_the_nearest_option(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("max_token: 3\ntempreature: 0\nbanana: 1\ntemperature: 0\n")
    with pytest.raises(UsageError) as e:
        load_config_file(str(config))
    message = str(e.value)
    assert message.startswith(f"--config {config}: unknown keys ")
    assert "'max_token' (did you mean max_tokens?)" in message
    assert "'tempreature' (did you mean temperature?)" in message and "'banana'" in message
    assert "'temperature'" not in message


# -- drift comes from the fields ---------------------------------------------------------------------

_PARTS = {"engine": EngineConfig, "sampling": SamplingParams, "build": BuildOptions, "input": InputOptions,
          "output": OutputOptions}


def _other_values(owner: type, f: dataclasses.Field) -> list:
    """Values other than field f's default, for the test to try (the first its dataclass accepts)."""
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    meta = _meta(next(k for k, (o, n) in OPTIONS.items() if o is owner and n == f.name)) \
        if any(o is owner and n == f.name for o, n in OPTIONS.values()) else None
    if meta is not None and meta.choices:
        return [c for c in meta.choices if c != default and c is not None]
    kinds = field_kinds(owner, f.name)
    candidates = []
    if bool in kinds:
        candidates.append(not default)
    if int in kinds or float in kinds:
        candidates += [v for v in (2, 3, 0, 64, 0.5) if v != default and (float in kinds or isinstance(v, int))]
    if str in kinds:
        candidates += ["x{a}", "other", "cpu"]
    if tuple in kinds:
        candidates.append(("x",))
    return candidates


_NEEDS = {"lookahead": {"schedule": "sjf"}, "num_speculative_tokens": {"speculative": "ngram"}}  # row-neutral too


def _spec_with(part: str, name: str, value) -> RunSpec:
    base = RunSpec(InputOptions("in.jsonl"), OutputOptions("out.jsonl"))
    if part == "spec":
        return dataclasses.replace(base, **{name: value})
    changes = {**_NEEDS.get(name, {}), name: value}
    return dataclasses.replace(base, **{part: dataclasses.replace(getattr(base, part), **changes)})


def _option_fields_of_parts():
    for part, owner in _PARTS.items():
        for f in option_fields(owner):
            yield part, owner, f
    for f in option_fields(RunSpec):
        yield "spec", RunSpec, f


@pytest.mark.parametrize(("part", "owner", "f"), list(_option_fields_of_parts()),
                         ids=lambda x: getattr(x, "name", x) if not isinstance(x, type) else x.__name__)
def test_an_option_field_is_drift_unless_it_is_row_neutral(part, owner, f):
    base = RunSpec(InputOptions("in.jsonl"), OutputOptions("out.jsonl")).generation_config()
    for value in _other_values(owner, f):
        try:
            changed = _spec_with(part, f.name, value).generation_config()
        except ConfigError:
            continue
        # (--task generate is recorded as a generation run's manifest always was: a run resolves auto first)
        if f"{part}.{f.name}" in ROW_NEUTRAL or (f.name == "schedule" and value != "priority") or \
                (f.name == "task" and value == "generate"):
            assert changed == base, f"{part}.{f.name} = {value!r} is row-neutral, yet the generation config moved"
        else:
            assert changed != base, f"{part}.{f.name} = {value!r} changes rows, yet it is not in the generation config"
        return
    pytest.fail(f"no value other than the default was accepted for {part}.{f.name}")


def test_the_limits_that_decide_error_rows_are_drift():  # (--on-error is not: every bad record's row is journaled)
    config = _spec_with("input", "max_record_bytes", 100).generation_config()
    assert config["max_record_bytes"] == 100
    assert _spec_with("engine", "max_grammar_bytes", 10).generation_config()["max_grammar_bytes"] == 10
    assert _spec_with("engine", "max_grammar_compile_s", 1.0).generation_config()["max_grammar_compile_s"] == 1.0


def test_repetition_penalty_applies_as_a_records_own_field_does(tiny_model, tmp_path):
    from cli_helpers import read_rows, run_in_process, tiny_args, write_jsonl

    prompts = [{"id": f"r{i}", "prompt": f"one two {i} one two"} for i in range(3)]
    common = [*tiny_args(tiny_model), "--temperature", "0", "--max-tokens", "12", "--ignore-eos", "-q"]

    def outputs(name, records, *options):
        source = write_jsonl(tmp_path / f"{name}.jsonl", records)
        result = run_in_process("run", source, "-o", tmp_path / f"{name}.out.jsonl", *common, *options)
        assert result.code == 0, result.err
        return [r["output"] for r in read_rows(tmp_path / f"{name}.out.jsonl")]

    plain = outputs("plain", prompts)
    by_flag = outputs("flag", prompts, "--repetition-penalty", "1.5")
    config = tmp_path / "c.yaml"
    config.write_text("repetition_penalty: 1.5\n")
    assert outputs("config", prompts, "--config", config) == by_flag
    assert outputs("field", [{**r, "repetition_penalty": 1.5} for r in prompts]) == by_flag
    assert by_flag != plain


# What run directories of config version 1 recorded beyond the first keys, for these settings: a run started then
# resumes now, so the derived config must give the same (settings of version 2 aside).
VERSION_1 = [
    ({"sampling": SamplingParams(temperature=0.5, stop=("x",), logprobs=2, prompt_logprobs=0)},
     {"temperature": 0.5, "stop": ["x"]}, {"logprobs": 2, "prompt_logprobs": True}),
    ({"build": BuildOptions(n=3, chat_field="q", served_model_names=("x",), chat_template="{{x}}",
                            truncate_prompt_tokens="auto")}, {},
     {"chat_field": "q", "truncate_prompt_tokens": "auto", "served_model_names": ["x"], "n": 3,
      "chat_template": "fd805e2acba5213e"}),
    ({"build": BuildOptions(prompt_template="{a}")}, {}, {"prompt_template": "{a}", "prompt_template_as": "prompt"}),
    ({"build": BuildOptions(prompt_template="{a}", prompt_template_as="chat")}, {},
     {"prompt_template": "{a}", "prompt_template_as": "chat"}),
    ({"engine": EngineConfig(schedule="priority", max_num_seqs=3, dtype="float32", max_grammar_bytes=10)},
     {"dtype": "float32"}, {"schedule": "priority"}),
    ({"engine": EngineConfig(schedule="sjf", lookahead=4, speculative="ngram")}, {}, {}),
    ({"input": InputOptions("in.jsonl", max_record_bytes=100), "output": OutputOptions("out.jsonl", on_error="skip"),
      "reasoning_parser": "qwen3"}, {}, {"reasoning_parser": "qwen3"}),
]


@pytest.mark.parametrize(("changes", "first", "later"), VERSION_1)
def test_the_generation_config_of_version_1_is_what_it_recorded(changes, first, later):
    from conveyor.io.run_spec import RECORDED_SINCE_VERSION_2

    spec = dataclasses.replace(RunSpec(InputOptions("in.jsonl"), OutputOptions("out.jsonl")), **changes)
    base = RunSpec(InputOptions("in.jsonl"), OutputOptions("out.jsonl")).generation_config(1)
    assert spec.generation_config(1) == {**base, **first, **later}
    assert {k: v for k, v in spec.generation_config().items() if k not in RECORDED_SINCE_VERSION_2} == \
        spec.generation_config(1)


def test_a_run_directory_of_version_1_resumes_with_a_limit_it_did_not_record(tiny_model, tmp_path):
    import json

    from cli_helpers import read_rows, run_in_process, tiny_args, write_jsonl

    source = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"p {i}"} for i in range(4)])
    output = tmp_path / "out.jsonl"
    command = ["run", source, "-o", output, *tiny_args(tiny_model), "--max-tokens", "3", "--max-record-bytes",
               "1MiB", "-q"]
    assert run_in_process(*command, "--limit", "2").code == 0
    manifest_path = tmp_path / "out.jsonl.conveyor" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["config_version"] == 2 and manifest["generation_config"]["max_record_bytes"] == 1 << 20
    # As a version 1 run directory holds it: no config_version, the limit not recorded.
    del manifest["config_version"], manifest["generation_config"]["max_record_bytes"]
    manifest_path.write_text(json.dumps(manifest))
    output.unlink()
    resumed = run_in_process(*command)
    assert resumed.code == 0, resumed.err
    assert [r["id"] for r in read_rows(output)] == ["r0", "r1", "r2", "r3"]
    other = run_in_process(*command[:-3], "--temperature", "0.5", "-q")
    assert other.code == 2 and "temperature" in other.err
