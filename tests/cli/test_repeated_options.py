"""An option given more than once on one command line: a list option takes every value given, any other the last
with a warning naming what it drops (never a value dropped without a word); --stop repeats, the last switch says."""

from __future__ import annotations

import json

from cli_helpers import read_rows, run_in_process, tiny_args, write_jsonl

from conveyor.cli.app import app
from conveyor.cli.repeated_options import merge_repeated_options


def _merged(*args: str) -> tuple[list[str], list[str]]:
    import typer

    return merge_repeated_options(typer.main.get_command(app), list(args))


def test_list_options_take_every_value_and_others_the_last_with_a_warning():
    args, warnings = _merged("run", "in.jsonl", "--keep-fields", "a", "--max-tokens", "5", "--keep-fields=b,c",
                             "--max-tokens=6", "--stop", "x", "--stop", "y", "--served-model-name", "m",
                             "--quiet", "--no-quiet")
    assert args == ["run", "in.jsonl", "--keep-fields=a,b,c", "--max-tokens", "5", "--max-tokens=6", "--stop", "x",
                    "--stop", "y", "--served-model-name", "m", "--quiet", "--no-quiet"]
    assert warnings == ["--max-tokens is given 2 times ('5', then '6'): the last, '6', is used"]
    # an option's value that looks like an option is its value; nothing after "--" is an option
    assert _merged("run", "in.jsonl", "--stop", "--max-tokens", "--max-tokens", "2", "--", "--max-tokens") == \
        (["run", "in.jsonl", "--stop", "--max-tokens", "--max-tokens", "2", "--", "--max-tokens"], [])
    assert _merged("validate", "in.jsonl", "--limit", "1", "--limit", "2")[1] == \
        ["--limit is given 2 times ('1', then '2'): the last, '2', is used"]
    assert _merged("--version") == (["--version"], [])


def test_a_run_with_repeated_options_uses_them_all_and_says_which_value_wins(tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi", "topic": "t", "lang": "en"}])
    result = run_in_process("run", src, "-o", tmp_path / "out.jsonl", *tiny_args(tiny_model), "--keep-fields",
                            "topic", "--keep-fields", "lang", "--max-tokens", "9", "--max-tokens", "2",
                            "--ignore-eos", "--quiet", "--summary-json", tmp_path / "summary.json")
    assert result.code == 0, result.err
    assert "conveyor: warning: --max-tokens is given 2 times ('9', then '2'): the last, '2', is used" in result.err
    [row] = read_rows(tmp_path / "out.jsonl")
    assert (row["topic"], row["lang"], row["completion_tokens"]) == ("t", "en", 2)
    assert json.loads((tmp_path / "summary.json").read_text())["records"] == 1
