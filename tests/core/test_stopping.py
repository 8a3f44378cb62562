"""Stop rules, stop strings, SamplingParams and EngineConfig validation. Never imports torch."""

from __future__ import annotations

import pytest

from conveyor.core.config import EngineConfig, parse_memory
from conveyor.core.request import FinishReason, Request
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.stopping import check_token_stop, find_stop_string

EOS = 2


def _after(outputs: list[int], **sampling) -> FinishReason | None:
    """check_token_stop once the outputs are appended, as update_from_output calls it."""
    r = Request("r", [5, 6, 7], SamplingParams(**sampling))
    r.token_ids.extend(outputs)
    return check_token_stop(r, {EOS})


def test_eos_stops():
    assert _after([9, EOS], max_tokens=10) is FinishReason.STOP
    assert _after([9, 9], max_tokens=10) is None


def test_ignore_eos_runs_on_to_max_tokens():
    assert _after([9, EOS], max_tokens=10, ignore_eos=True) is None
    assert _after([EOS] * 3, max_tokens=3, ignore_eos=True) is FinishReason.LENGTH


def test_stop_token_ids_stop_even_with_ignore_eos():
    assert _after([9, 42], max_tokens=10, stop_token_ids=[42]) is FinishReason.STOP
    assert _after([9, 42], max_tokens=10, stop_token_ids=[42], ignore_eos=True) is FinishReason.STOP
    assert _after([42, 9], max_tokens=10, stop_token_ids=[42]) is None


def test_min_tokens_holds_back_eos_and_stop_ids():
    assert _after([EOS], max_tokens=10, min_tokens=2) is None
    assert _after([9, EOS], max_tokens=10, min_tokens=2) is FinishReason.STOP
    assert _after([42], max_tokens=10, min_tokens=2, stop_token_ids=[42]) is None


def test_max_tokens_is_length_unless_the_last_token_is_a_stop():
    assert _after([9, 9, 9], max_tokens=3) is FinishReason.LENGTH
    assert _after([9, 9, EOS], max_tokens=3) is FinishReason.STOP
    assert _after([9, 9], max_tokens=3) is None


def test_no_eos_ids_means_only_length_stops():
    r = Request("r", [1], SamplingParams(max_tokens=2))
    r.token_ids.append(EOS)
    assert check_token_stop(r, ()) is None


def test_find_stop_string_finds_the_earliest_stop_ending_in_new_text():
    assert find_stop_string("hello world", ["wor"], 3) == 6
    assert find_stop_string("hello world", ["o w", "ld"], 11) == 4
    assert find_stop_string("abc", ["x"], 3) is None


def test_find_stop_string_finds_a_stop_spanning_old_and_new_text():
    assert find_stop_string("the end", ["e e"], 3) == 2  # "e " old, "e" new
    assert find_stop_string("STOP", ["STOP"], 1) == 0  # completed by its last char
    assert find_stop_string("the end", ["e e"], 2) is None  # completed before the new "nd"


def test_find_stop_string_ignores_stops_wholly_in_old_text():
    # "ab" ended before the 2 new chars, so an earlier step already reported it
    assert find_stop_string("xxabyyzz", ["ab"], 2) is None
    assert find_stop_string("xxabyyzz", ["ab"], 5) == 2


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5),
    ("min_p", -0.1), ("min_p", 2.0), ("max_tokens", 0), ("max_tokens", 3.0), ("max_tokens", True),
    ("min_tokens", -1), ("seed", "x"), ("stop", [1]), ("stop", [""]), ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]), ("ignore_eos", "yes"),
])
def test_sampling_params_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(ValueError, match="min_tokens.*max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_sampling_params_freeze_lists_and_accept_a_single_stop_string():
    sp = SamplingParams(stop="###", stop_token_ids=[3, 4], temperature=0)
    assert sp.stop == ("###",) and sp.stop_token_ids == (3, 4) and sp.is_greedy
    assert not SamplingParams().is_greedy
    hash(sp)  # frozen and hashable


@pytest.mark.parametrize("field, value", [
    ("block_size", 0), ("max_num_seqs", -1), ("max_num_batched_tokens", 1.5), ("num_kv_blocks", 0),
    ("kv_cache_memory", "lots"), ("dtype", "fp8"), ("max_waiting", True),
])
def test_engine_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_parse_memory():
    assert parse_memory("2GiB") == 2 * 1024**3
    assert parse_memory("500MB") == 500 * 1000**2
    assert parse_memory("1.5 kib") == 1536
    assert parse_memory(1234) == 1234
    with pytest.raises(ValueError):
        parse_memory("-1GB")
