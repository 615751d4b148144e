"""The clock the benchmarks read: interleaved rounds, fastest of each, and growth slopes."""

import pytest

from gpt2kimi.timing import (
    fastest_interleaved,
    loglog_slope,
    median_in_turns,
    synchronize,
    timed,
)


def test_fastest_interleaved_runs_each_once_per_round_after_a_warm_up():
    calls = {"a": 0, "b": 0}

    def run(name, seconds):
        def go():
            calls[name] += 1
            return seconds.pop(0)
        return go

    best = fastest_interleaved({"a": run("a", [9.0, 3.0, 2.0, 4.0]),
                                "b": run("b", [9.0, 5.0, 6.0, 1.0])}, rounds=3)
    assert calls == {"a": 4, "b": 4}
    assert best == {"a": 2.0, "b": 1.0}  # the warm-up's 9.0 is not counted


def test_median_in_turns_runs_each_once_per_turn_in_order():
    calls = []

    def run(name, seconds):
        def go():
            calls.append(name)
            return seconds.pop(0)
        return go

    median = median_in_turns({"a": run("a", [5.0, 1.0, 3.0]),
                              "b": run("b", [2.0, 8.0, 4.0])}, turns=3)
    assert calls == ["a", "b"] * 3  # no warm-up: each turn, every run once
    assert median == {"a": 3.0, "b": 4.0}


def test_timed_measures_positive_seconds_and_sync_is_safe_on_cpu():
    synchronize()  # no CUDA work queued (or no CUDA): returns at once
    assert timed(lambda: sum(range(1000)))() > 0


@pytest.mark.parametrize("power", [1, 2])
def test_loglog_slope_reads_the_power(power):
    xs = [1.0, 2.0, 4.0, 8.0]
    assert loglog_slope(xs, [3 * x**power for x in xs]) == pytest.approx(power)
