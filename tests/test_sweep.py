"""What every sweep shares: the process pool, settings, records, means over seeds."""

from dataclasses import dataclass

import pytest
import torch

from gpt2kimi.experiments.sweep import (
    map_jobs,
    mean_over_seeds,
    rounded,
    settings_dict,
    training_settings,
)


@dataclass
class Task:
    vocab_size: int = 8


@dataclass
class Training:
    steps: int = 3
    seed: int = 1


def test_settings_records_and_means_over_seeds():
    assert settings_dict(Task(), Training()) == {
        "vocab_size": 8,
        "train_steps": 3,
        "train_seed": 1,
    }
    assert training_settings(Training()) == {"train_steps": 3}  # a sweep records its seeds
    assert rounded({"a": 0.123456, "b": 2, "c": "x"}) == {"a": 0.1235, "b": 2, "c": "x"}
    results = [
        {"mixer": "a", "n": 1, "accuracy": 0.5, "stale": 0.1},
        {"mixer": "a", "n": 1, "accuracy": 1.0, "stale": 0.3},
        {"mixer": "a", "n": 2, "accuracy": 0.0, "stale": 0.0},
    ]
    assert mean_over_seeds(results, mixer="a", n=1) == 0.75
    assert mean_over_seeds(results, "stale", mixer="a", n=1) == pytest.approx(0.2)
    with pytest.raises(KeyError, match="no results for mixer='b', n=1"):
        mean_over_seeds(results, mixer="b", n=1)


def _double_and_count_threads(x: int) -> dict:
    return {"x": 2 * x, "threads": torch.get_num_threads()}


def test_map_jobs_keeps_order_and_runs_workers_on_one_thread():
    seen = []
    threads = torch.get_num_threads()
    one = map_jobs(_double_and_count_threads, [3, 1, 2], jobs=1, log=seen.append)
    assert [r["x"] for r in one] == [6, 2, 4] and seen == one
    assert all(r["threads"] == threads for r in one)  # in this process: its threads untouched
    two = map_jobs(_double_and_count_threads, [3, 1, 2], jobs=2)
    assert [r["x"] for r in two] == [6, 2, 4] and all(r["threads"] == 1 for r in two)
    assert torch.get_num_threads() == threads
