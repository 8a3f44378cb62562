"""No record wedges a run and no journal is trusted blindly: a record whose data would break a step is an error row
and the run finishes; a journal or shard marker changed outside conveyor is refused naming what is wrong; shard
counts are bounded; options the engine would refuse only after loading the model are usage errors before it."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import time

import pytest
from cli_helpers import Child, num_committed, read_rows, run_in_process, tiny_args, write_jsonl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

QUIET = ("--quiet", "--max-tokens", "4", "--temperature", "0")


def _run(tiny_model, *args):
    return run_in_process("run", *args, *tiny_args(tiny_model), *QUIET)


def test_a_record_with_token_ids_past_the_vocabulary_is_an_error_row_and_the_run_finishes(tiny_model, tmp_path):
    records = [{"id": "a", "prompt": "hello there"},
               {"id": "crash", "prompt": "Say hi:", "stop_token_ids": [999999], "min_tokens": 1},
               {"id": "bias", "prompt": "Say hi:", "logit_bias": {"123456": 5}},
               {"id": "b", "prompt": "goodbye"}]
    src, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    first = _run(tiny_model, src, "-o", out)
    assert first.code == 3, first.err
    rows = {r["id"]: r for r in read_rows(out)}
    assert rows["crash"]["error"].startswith("line 2: stop_token_ids: 999999 is not a token id of this model")
    assert rows["bias"]["error"].startswith("line 3: logit_bias: 123456 is not a token id")
    assert rows["a"]["status"] == rows["b"]["status"] == "ok"
    again = _run(tiny_model, src, "-o", out)  # a finished run reruns to the same output: nothing is retried
    assert again.code == 3 and {r["id"]: r for r in read_rows(out)} == rows


def _finished_shards(tiny_model, tmp_path, n=6):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"record {i}"} for i in range(n)])
    out = tmp_path / "sh.jsonl"
    first = _run(tiny_model, src, "-o", out, "--shard", "0/2")
    assert first.code == 0 and not out.exists(), first.err
    assert "wrote" not in first.err  # a shard that did not write the output never says it did
    return src, out, tmp_path / "sh.jsonl.conveyor"


def test_a_row_deleted_from_a_shards_journal_is_refused_by_the_merge_and_shown_by_status(tiny_model, tmp_path):
    src, out, run_dir = _finished_shards(tiny_model, tmp_path)
    journal = run_dir / "shard-1-of-2" / "journal.sqlite"
    assert _run(tiny_model, src, "-o", out, "--shard", "1/2").code == 0 and out.exists()
    out.unlink()
    with sqlite3.connect(journal) as db:
        db.execute("DELETE FROM rows WHERE idx = 3")
    merged = run_in_process("merge", "-o", out)
    assert merged.code == 2 and not out.exists(), merged.err
    assert "shard 1/2" in merged.err and "no row for record 3" in merged.err and "--restart --shard 1/2" in merged.err
    status = run_in_process("status", out)
    assert "shard 1/2: 2 / 3 done" in status.out and "changed outside conveyor" in status.out, status.out


@pytest.mark.parametrize("marker", ["[]", "{}", '{"shard": 1, "of": 2, "input_records": "6"}'])
def test_a_shard_marker_conveyor_did_not_write_is_refused_naming_the_file(tiny_model, tmp_path, marker):
    src, out, run_dir = _finished_shards(tiny_model, tmp_path)
    assert _run(tiny_model, src, "-o", out, "--shard", "1/2").code == 0
    out.unlink()
    (run_dir / "shard-1-of-2" / "shard.json").write_text(marker, encoding="utf-8")
    merged = run_in_process("merge", "-o", out)
    assert merged.code == 2 and "shard 1/2" in merged.err and "shard.json is not what conveyor writes" in merged.err


def test_a_deleted_row_below_the_committed_prefix_is_refused_at_the_final_write(tiny_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"record {i}"} for i in range(5)])
    out = tmp_path / "out.jsonl"
    assert _run(tiny_model, src, "-o", out).code == 0
    with sqlite3.connect(tmp_path / "out.jsonl.conveyor" / "journal.sqlite") as db:
        db.execute("DELETE FROM rows WHERE idx = 1")
    out.unlink()
    again = _run(tiny_model, src, "-o", out)
    assert again.code == 1 and not out.exists()
    assert "no row for record 1" in again.err and "--restart" in again.err, again.err


def test_a_shard_count_past_the_bound_is_refused_at_once_leaving_nothing(tiny_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    result = _run(tiny_model, src, "-o", tmp_path / "o.jsonl", "--shard", "5/100000000000")
    assert result.code == 2 and "more than 100,000 shards" in result.err
    assert not (tmp_path / "o.jsonl.conveyor").exists()


@pytest.mark.parametrize("config, option", [("kv_cache_memory: 1\n", "--kv-cache-memory"),
                                            ("regex: '(('\n", "--regex")])
def test_options_the_loaded_model_would_refuse_are_usage_errors_before_it_loads(tiny_model, tmp_path, config,
                                                                                option):
    (tmp_path / "c.yaml").write_text(config, encoding="utf-8")
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    result = run_in_process("run", src, "-o", tmp_path / "o.jsonl", "--model", tiny_model, "-c", tmp_path / "c.yaml")
    assert result.code == 2 and result.err.startswith(f"conveyor: error: {option}"), result.err
    assert "loading" not in result.err and not (tmp_path / "o.jsonl.conveyor").exists()


def test_a_batch_line_with_an_empty_custom_id_keeps_it_in_its_error_line(tiny_model, tmp_path):
    lines = [{"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
             {"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions", "body": {"prompt": "x"}}]
    src, out = write_jsonl(tmp_path / "batch.jsonl", lines), tmp_path / "out.jsonl"
    assert _run(tiny_model, src, "-o", out, "--output-format", "openai-batch").code == 3
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [g["custom_id"] for g in got] == ["", "ok"]
    assert "custom_id" in got[0]["error"]["message"] and "takes body.messages" in got[1]["error"]["message"]


# -- grammars: compiled off the step loop, within limits, never left unenforced without a word -----------------

SLOW_CHOICES = [f"option number {i} of the list" for i in range(5000)]  # ~1 s to compile on a 2-core EPYC


def test_grammars_past_their_limits_or_that_cannot_be_enforced_are_error_rows_and_the_rest_run(tiny_model, tmp_path):
    big = {"enum": [f"{i:06d}" * 10 for i in range(5000)]}  # ~330 KB of schema
    records = [{"id": "slow", "prompt": "pick one", "guided_choice": SLOW_CHOICES},
               {"id": "big", "prompt": "x", "guided_json": big},
               {"id": "external", "prompt": "x", "guided_json": {"$ref": "https://example.com/schema.json"}},
               {"id": "empty", "prompt": "x", "guided_regex": "[^\\s\\S]"},
               *({"id": f"ok{i}", "prompt": f"record {i}"} for i in range(4))]
    src, out = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    result = _run(tiny_model, src, "-o", out, "--max-grammar-compile-s", "0.2")
    assert result.code == 3, result.err
    rows = {r["id"]: r for r in read_rows(out)}
    assert "did not compile within 0.2 s" in rows["slow"]["error"] and "--max-grammar-compile-s" in rows["slow"]["error"]
    assert "more than max_grammar_bytes (262,144; --max-grammar-bytes)" in rows["big"]["error"]
    assert "$ref 'https://example.com/schema.json' points outside the schema" in rows["external"]["error"]
    assert "matches no text at all" in rows["empty"]["error"]
    assert all(rows[f"ok{i}"]["status"] == "ok" for i in range(4))


def _deep_schema(depth: int) -> dict:
    """A small schema whose compile takes long (cubic in its depth: ~20 s at 400 on a 2-core EPYC)."""
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema, "b": {"type": "integer"}}, "required": ["a", "b"]}
    return schema


def test_records_behind_a_compiling_grammar_make_progress_and_sigterm_stops_at_once(tiny_model, tmp_path):
    records = [{"id": "slow", "prompt": "fill it in", "guided_json": _deep_schema(400)}]
    records += [{"id": f"r{i}", "prompt": f"record {i}"} for i in range(400)]
    src, run_dir = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl.conveyor"
    child = Child(["run", src, "-o", tmp_path / "out.jsonl", *tiny_args(tiny_model), "--quiet", "--max-tokens", "32",
                   "--ignore-eos", "--checkpoint-every", "1", "--max-grammar-compile-s", "600"], tmp_path, "slow")
    child.wait_until(lambda: num_committed(run_dir, strict=False) >= 3, timeout=300,
                     what="rows committed while the grammar compiles")
    child.send(signal.SIGTERM)
    sent = time.monotonic()
    result = child.wait(timeout=60)
    assert result.code == 75 and time.monotonic() - sent < 10, result.err
    assert num_committed(run_dir) >= 3


# -- a property: whatever token ids, schemas and choices records carry, each ends as one row ---------------------

_WORDS = st.text(alphabet="abcdefghij ", min_size=1, max_size=12)
_SCHEMA = st.recursive(
    st.sampled_from([{"type": "string"}, {"type": "integer", "minimum": 3}, {"type": "boolean"}, {"enum": ["a", 1]},
                     {"type": "string", "maxLength": 4}, {"const": "x"}, {"type": "nosuchtype"}, {"not": {}}]),
    lambda inner: st.one_of(
        st.builds(lambda props, req: {"type": "object", "properties": props, "required": req},
                  st.dictionaries(st.sampled_from("abc"), inner, max_size=3), st.lists(st.sampled_from("abcd"),
                                                                                      max_size=2)),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 3))),
    max_leaves=6)
_FIELDS = st.fixed_dictionaries({}, optional={
    "stop_token_ids": st.lists(st.integers(-3, 60000), max_size=3),
    "logit_bias": st.dictionaries(st.integers(-2, 60000).map(str), st.floats(-100, 100), max_size=3),
    "min_tokens": st.integers(0, 3),
    "guided_json": _SCHEMA,
    "guided_choice": st.lists(st.text(alphabet="xyz", max_size=4), max_size=4),
    "guided_regex": st.sampled_from(["[a-c]{1,3}", "((", "[^\\s\\S]", "x|y", ""]),
})
_RECORDS = st.lists(st.builds(lambda prompt, fields: {"prompt": prompt, **fields}, _WORDS, _FIELDS),
                    min_size=1, max_size=8)


def _restart_peak_rss() -> bool:
    """Start this process's peak resident size afresh (Linux: 5 written to /proc/self/clear_refs), so that it is
    this run's, not that of whatever the worker ran before; False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(records=_RECORDS)
def test_any_token_ids_schemas_and_choices_end_as_one_row_each(tiny_model, tmp_path_factory, records):
    tmp = tmp_path_factory.mktemp("any")
    src, out = write_jsonl(tmp / "in.jsonl", records), tmp / "out.jsonl"
    peak_measured = _restart_peak_rss()
    result = _run(tiny_model, src, "-o", out, "--max-grammar-compile-s", "5")
    assert result.code in (0, 3), result.err
    rows = read_rows(out)
    assert [r["index"] for r in rows] == list(range(len(records)))
    assert all((r["status"] == "ok") == (r["output"] is not None) for r in rows)
    if peak_measured:  # (the grammars' cache is bounded: the test process stays under 6 GiB through the run)
        assert _peak_rss_kib() < 6 << 20


def test_sigterm_at_a_random_moment_exits_75_within_10_seconds(tiny_model, tmp_path):
    rng = random.Random()
    records = [{"prompt": f"record {i}", "guided_json": {"type": "object", "properties": {f"k{i}": {"type": "integer"}}}}
               if i % 3 == 0 else {"prompt": f"record {i}", "stop_token_ids": [rng.randrange(60000)]}
               for i in range(300)]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    child = Child(["run", src, "-o", tmp_path / "out.jsonl", *tiny_args(tiny_model), "--quiet", "--max-tokens", "16"],
                  tmp_path, "random-stop")
    time.sleep(rng.uniform(0.5, 8.0))  # while it imports, loads, compiles or generates
    child.send(signal.SIGTERM)
    sent = time.monotonic()
    result = child.wait(timeout=60)
    assert time.monotonic() - sent < 10, result.err
    assert result.code == 75 or (result.code in (0, 3) and (tmp_path / "out.jsonl").exists()), result.err
