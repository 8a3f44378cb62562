"""`--speculative ngram` from the command line: the same rows as without it (with `--schedule lpm` too), across
stops and resumes; rows and the summary say what the drafts did; settings that cannot work are usage errors
naming their option."""

from __future__ import annotations

import json

import pytest
from cli_helpers import read_rows, run_in_process, stable, tiny_args, window_of, write_jsonl

from conveyor.core.model_runner import ModelRunner

# The tiny random model's outputs do not repeat, unless a logit bias narrows them to a few tokens: then drafts
# from their own output are often right (all of them greedy, some of them sampled), and the processors run on
# draft rows (a bias; a repetition penalty, whose state the drafts must not touch).
RECORDS = [{"id": f"r{i}", "prompt": f"count {i} {i} {i} and so on", "max_tokens": 60 + 10 * i,
            **({"temperature": 0.9, "seed": i} if i % 2 else {}),
            **({"logit_bias": {"1000": 40, "1001": 40, "1002": 39}} if i % 3 else {}),
            **({"repetition_penalty": 1.05} if i == 4 else {})} for i in range(6)]
OPTS = ("--temperature", "0", "--ignore-eos", "--dtype", "float32", "--max-num-seqs", "2", "--quiet")


@pytest.fixture(autouse=True)
def _drafts_ride_along(monkeypatch):
    """A flat forward cost per row: the engine's timing of it as it starts, on a busy machine, can make drafts look
    not worth it, and these tests count accepted drafts (tests/core/test_speculative.py tests which drafts pay)."""
    monkeypatch.setattr(ModelRunner, "measure_rows", lambda self, counts, **kw: [1.0] * len(counts))


def test_the_same_rows_with_speculation_and_lpm_as_without(tiny_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    plain_summary = tmp_path / "plain.json"
    plain = run_in_process("run", src, "-o", tmp_path / "plain.jsonl", *tiny_args(tiny_model), *OPTS,
                           "--summary-json", plain_summary)
    assert plain.code == 0, plain.err
    said_plain = json.loads(plain_summary.read_text())
    assert (said_plain["draft_tokens"], said_plain["draft_acceptance_rate"]) == (0, None)  # no rate, not a rate of 0
    summary = tmp_path / "s.json"
    spec = run_in_process("run", src, "-o", tmp_path / "spec.parquet", *tiny_args(tiny_model), *OPTS,
                          "--speculative", "ngram", "--schedule", "lpm", "--summary-json", summary)
    assert spec.code == 0, spec.err
    rows, reference = read_rows(tmp_path / "spec.parquet"), read_rows(tmp_path / "plain.jsonl")
    assert stable(rows) == stable(reference)
    said = json.loads(summary.read_text())
    assert said["accepted_draft_tokens"] > 0 and said["draft_tokens"] >= said["accepted_draft_tokens"]
    assert said["draft_acceptance_rate"] == round(said["accepted_draft_tokens"] / said["draft_tokens"], 4)
    assert sum(r["accepted_draft_tokens"] for r in rows) == said["accepted_draft_tokens"]
    assert sum(r["draft_tokens"] for r in rows) == said["draft_tokens"]
    assert "draft_tokens" not in reference[0]  # only where speculation is on


def test_speculation_across_stops_and_resumes_gives_the_rows_of_one_run(tiny_model, tmp_path):
    records = [{**r, "max_tokens": 700 + 10 * i} for i, r in enumerate(RECORDS)]  # longer than a window
    src = write_jsonl(tmp_path / "in.jsonl", records)
    opts = (*OPTS, "--max-num-seqs", "6")
    said = tmp_path / "ref-summary.json"
    ref = run_in_process("run", src, "-o", tmp_path / "ref.jsonl", *tiny_args(tiny_model), *opts, "--speculative",
                         "ngram", "--summary-json", said)
    assert ref.code == 0, ref.err
    for parts in (4, 8, 16):  # a window a quarter of the reference's generation; shorter where a machine under
        window = window_of(json.loads(said.read_text()), parts)  # load ran the reference slower than this run
        out = tmp_path / f"out-{parts}.jsonl"
        windows = 0
        for _ in range(40):
            windows += 1
            result = run_in_process("run", src, "-o", out, *tiny_args(tiny_model), *opts, "--speculative", "ngram",
                                    "--num-speculative-tokens", "3", "--max-runtime", window)
            if result.code != 75:
                break
        assert result.code == 0, result.err
        if windows >= 2:
            break
    assert windows >= 2, "the windows were meant to stop the run"
    rows = read_rows(out)
    plain = run_in_process("run", src, "-o", tmp_path / "plain.jsonl", *tiny_args(tiny_model), *opts)
    assert plain.code == 0, plain.err
    assert stable(rows) == stable(read_rows(tmp_path / "plain.jsonl")) == stable(read_rows(tmp_path / "ref.jsonl"))
    assert sum(r["accepted_draft_tokens"] for r in rows) > 0


def test_speculation_settings_that_cannot_work_are_usage_errors_naming_the_option(tiny_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1])
    cases = [(("--num-speculative-tokens", "3"), "--num-speculative-tokens"),
             (("--speculative", "eagle"), "--speculative"),
             (("--speculative", "ngram", "--num-speculative-tokens", "0"), "--num-speculative-tokens"),
             (("--speculative", "ngram", "--num-speculative-tokens", "99"), "--num-speculative-tokens")]
    for args, option in cases:
        result = run_in_process("run", src, "-o", tmp_path / "o.jsonl", *tiny_args(tiny_model), *args)
        assert result.code == 2 and option in result.err, (args, result.err)
    assert not (tmp_path / "o.jsonl").exists()
