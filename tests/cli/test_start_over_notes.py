"""What a run says when it starts over: --restart names the rows it set aside or dropped, and a run whose every
finished row is an error row starts over with changed settings without --restart, saying so."""

from __future__ import annotations

from cli_helpers import read_rows, run_in_process, tiny_args, write_jsonl

FAST = ("--max-tokens", "3", "--temperature", "0")


def test_restart_says_what_it_does_with_the_rows(tiny_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Say {i}."} for i in range(3)])
    out = tmp_path / "out.jsonl"
    assert run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *FAST).code == 0
    same = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *FAST, "--restart")
    assert same.code == 0, same.err
    assert "--restart: the 3 finished rows of the earlier run are dropped; every record is computed again" in same.err
    other = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), "--max-tokens", "2", "--restart")
    assert other.code == 0, other.err
    assert ("--restart: the 3 finished rows of the earlier run (other settings) are set aside in "
            f"{tmp_path / 'out.jsonl.conveyor' / 'set-aside'}") in other.err
    back = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *FAST, "--restart")
    assert back.code == 0, back.err
    assert "the 3 finished rows of the earlier run (other settings) are set aside in" in back.err
    assert "took back the 3 rows of an earlier run with these settings" in back.err


def test_a_run_of_error_rows_only_starts_over_with_new_settings(tiny_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x" * 400}, {"prompt": "y" * 400}])
    out = tmp_path / "out.jsonl"
    first = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *FAST, "--max-record-bytes", "100")
    assert first.code == 3, first.err
    assert {r["status"] for r in read_rows(out)} == {"error"}
    again = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *FAST, "--max-record-bytes", "4096")
    assert again.code == 0, again.err
    assert f"every row {tmp_path / 'out.jsonl.conveyor'} held was an error row (2), so the run starts over" in again.err
    assert {r["status"] for r in read_rows(out)} == {"ok"}
    some_ok = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "ok"}, {"prompt": "z" * 400}])
    mixed_out = tmp_path / "mixed.out.jsonl"
    assert run_in_process("run", some_ok, "-o", mixed_out, *tiny_args(tiny_model), *FAST,
                          "--max-record-bytes", "100").code == 3
    refused = run_in_process("run", some_ok, "-o", mixed_out, *tiny_args(tiny_model), *FAST, "--max-record-bytes", "4096")
    assert refused.code == 2 and "--restart" in refused.err, refused.err
