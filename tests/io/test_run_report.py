"""The typed run report: a RunResult's summary as --summary-json has it (every key a run wrote before, the finish
reasons and structured-output counts besides), and RunSummary.merge over the workers of a split run (counts added,
times the longest, finish reasons added, the latency figures over every part's rows, the worst outcome)."""

from __future__ import annotations

import dataclasses

import pytest

from conveyor.io.rows.figures import LatencyFigures, run_figures
from conveyor.io.rows.sink import RunTotals
from conveyor.io.run_report import Outcome, RunResult, RunSetup, RunSummary, rule_of

KEYS_BEFORE = ["records", "samples", "ok", "errors", "prompt_tokens", "completion_tokens", "load_s", "elapsed_s",
               "output_tokens_per_s", "preemptions", "prefix_cache_hit_rate", "draft_tokens", "accepted_draft_tokens",
               "draft_acceptance_rate", "resumed_from", "continued", "tokens_carried_over", "in_flight_saved",
               "keep_fields_missing", "wall_s", "model", "model_path", "dtype", "backend", "ttft_s", "latency_s",
               "queue_s", "tpot_s", "mean_running", "occupancy", "steps", "status"]


@dataclasses.dataclass
class Stats:  # the EngineStats fields a summary reads
    num_preemptions: int = 1
    prefix_cache_hit_rate: float = 0.25
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_scheduled_rows: int = 12
    num_forward_steps: int = 6


def _summary(outcome: Outcome, latencies: list[float], reasons: dict[str, int], cut: int = 0) -> RunSummary:
    totals = RunTotals(total=len(latencies), done=len(latencies), samples=len(latencies), ok=len(latencies),
                       completion_tokens=10 * len(latencies), prompt_tokens=5 * len(latencies), load_s=2.0,
                       first_admit=100.0, last_active=104.0, generated_tokens=40, structured_outputs=len(latencies),
                       structured_outputs_cut=cut)
    totals.finish_reasons.update(reasons)
    for value in latencies:
        totals.latency.add_row({"status": "ok", "queue_s": 0.0, "ttft_s": value / 2, "latency_s": value,
                                "completion_tokens": 10})
    setup = RunSetup("tiny", "/models/tiny", "float32", "torch", 4)
    return RunResult(outcome, totals, setup, Stats(), wall_s=7.0).summary()


def test_the_summary_json_keeps_every_key_and_adds_the_finish_reasons():
    summary = _summary(Outcome.SOME_ERRORS, [0.1, 0.2, 0.3], {"length": 2, "stop": 1}, cut=2)
    said = summary.to_json()
    assert list(said)[:len(KEYS_BEFORE) - 1] == KEYS_BEFORE[:-1] and list(said)[-1] == "status"
    assert said["status"] == "some_errors" and summary.records == said["records"] == 3
    assert (said["load_s"], said["elapsed_s"], said["output_tokens_per_s"], said["wall_s"]) == (2.0, 4.0, 10.0, 7.0)
    assert (said["model"], said["dtype"], said["backend"]) == ("tiny", "float32", "torch")
    assert said["finish_reasons"] == {"length": 2, "stop": 1}
    assert (said["structured_outputs"], said["structured_outputs_cut"]) == (3, 2)
    assert said["latency_s"]["max"] == 0.3 and said["mean_running"] == 2.0 and said["occupancy"] == 0.5


def test_merge_adds_the_workers_summaries():
    one = _summary(Outcome.OK, [0.1, 0.2], {"stop": 2})
    two = _summary(Outcome.SOME_ERRORS, [0.4, 0.5, 0.6], {"stop": 1, "length": 2}, cut=1)
    merged = RunSummary.merge([one, two])
    assert merged.outcome is Outcome.SOME_ERRORS
    assert (merged.records, merged.ok, merged.completion_tokens, merged.preemptions) == (5, 5, 50, 2)
    assert merged.finish_reasons == {"stop": 3, "length": 2}
    assert (merged.structured_outputs, merged.structured_outputs_cut) == (5, 1)
    assert merged.load_s == 2.0 and merged.elapsed_s == 4.0  # side by side: the longest, not the sum
    assert merged.output_tokens_per_s == 20.0 and merged.prefix_cache_hit_rate == pytest.approx(0.25)
    assert merged.setup == one.setup
    # the percentiles over both workers' rows (exact: a small run), the occupancy over both engines' steps
    assert merged.latency_s["max"] == 0.6 and merged.latency_s["p50"] == pytest.approx(0.4)
    assert (merged.steps, merged.mean_running, merged.occupancy) == (12, 2.0, 0.5)
    assert RunSummary.merge([one, two, _summary(Outcome.STOPPED, [], {})]).outcome is Outcome.STOPPED
    assert RunSummary.merge([one]).to_json() == one.to_json()


def test_merge_needs_a_summary():
    with pytest.raises(ValueError, match="no summaries"):
        RunSummary.merge([])


def test_a_summary_with_no_rows_has_no_figures():
    summary = _summary(Outcome.STOPPED, [], {})
    assert summary.finish_reasons == {} and summary.latency_s == LatencyFigures().summary()["latency_s"]


KEYS = ["records", "samples", "ok", "errors", "prompt_tokens", "completion_tokens", "load_s", "elapsed_s",
        "output_tokens_per_s", "preemptions", "prefix_cache_hit_rate", "draft_tokens", "accepted_draft_tokens",
        "draft_acceptance_rate", "resumed_from", "continued", "tokens_carried_over", "in_flight_saved",
        "keep_fields_missing", "wall_s", "model", "model_path", "dtype", "backend", "ttft_s", "latency_s", "queue_s",
        "tpot_s", "mean_running", "occupancy", "steps", "finish_reasons", "structured_outputs",
        "structured_outputs_cut", "reuse", "retried_errors", "task", "records_per_s", "prompt_tokens_per_s",
        "cpu_isa", "batch_invariant", "status"]  # --summary-json's keys, in their order (scripts read them)


def test_the_summary_json_keys_keep_their_order_and_a_pooling_task_has_no_generation_keys():
    summary = _summary(Outcome.OK, [0.1], {"stop": 1})
    assert list(summary.to_json()) == KEYS
    pooled = dataclasses.replace(summary, setup=dataclasses.replace(summary.setup, task="embed"))
    generation = {key for f in dataclasses.fields(RunSummary) if rule_of(f).generation
                  for key, _ in rule_of(f).keys(f.name)}
    assert list(pooled.to_json()) == [key for key in KEYS if key not in generation]
    assert generation == {"completion_tokens", "output_tokens_per_s", "preemptions", "prefix_cache_hit_rate",
                          "draft_tokens", "accepted_draft_tokens", "draft_acceptance_rate", "continued",
                          "tokens_carried_over", "in_flight_saved", "ttft_s", "tpot_s", "mean_running", "occupancy",
                          "finish_reasons", "structured_outputs", "structured_outputs_cut"}


def test_every_summary_field_has_a_merge_rule_and_reaches_the_json():
    """A new figure is a RunSummary field with its rule (`figure`): to_json and merge read the rules, so one that
    has none, or whose key is not in the JSON, is caught here."""
    summary = _summary(Outcome.OK, [0.1], {"stop": 1})
    said = summary.to_json()
    made_by_figures = set(run_figures([]))
    for f in dataclasses.fields(RunSummary):
        rule = rule_of(f)  # (KeyError: a field with no rule)
        assert (rule.merge is None) == (f.name in made_by_figures), f.name
        if f.name == "figures_states":  # what the figures are made of: merged, never written
            assert rule.keys(f.name) == ()
            continue
        keys = [key for key, _ in rule.keys(f.name)]
        assert keys and set(keys) <= set(said), f.name
        if f.name not in ("setup", "outcome"):  # (those two write other names: the setup's, "status")
            assert f.name in keys and said[f.name] == _plain(getattr(summary, f.name)), f.name


def test_merge_reads_every_field_and_a_merged_figure_reaches_the_json():
    one = dataclasses.replace(_summary(Outcome.OK, [0.1], {"stop": 1}), retried_errors=2, in_flight_saved=1)
    two = dataclasses.replace(_summary(Outcome.OK, [0.2], {"stop": 1}), retried_errors=3, in_flight_saved=0)
    said = RunSummary.merge([one, two]).to_json()
    assert (said["retried_errors"], said["in_flight_saved"], said["records"]) == (5, 1, 2)


def _plain(value):
    return list(value) if isinstance(value, tuple) else dict(value) if isinstance(value, dict) else value


@pytest.mark.parametrize(("errors", "skip", "outcome"), [
    (0, False, Outcome.OK), (3, False, Outcome.SOME_ERRORS), (3, True, Outcome.OK), (True, False, Outcome.SOME_ERRORS),
    (False, True, Outcome.OK)])
def test_the_outcome_of_a_finished_run(errors, skip, outcome):
    assert Outcome.of(errors, skip) is outcome
