"""The helpers every experiment shares: seeded splits, eval mode, settings, records, means."""

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from gpt2kimi.experiment import (
    cell_mean,
    evaluating,
    rounded,
    seeded_splits,
    settings_dict,
    training_settings,
)


def draw(generator):
    return torch.rand(2, generator=generator), torch.rand(1, generator=generator)


def test_seeded_splits_are_reproducible_separate_streams():
    a, b = seeded_splits(draw, seed=3), seeded_splits(draw, seed=3)
    assert torch.equal(a("train")[0], b("train")[0])
    assert not torch.equal(a("val")[0], b("train")[0])
    expected = torch.rand(2, generator=torch.Generator().manual_seed(2 * 3 + 1))
    assert torch.equal(b("val")[0], expected)  # "val" of seed s is generator 2s + 1
    per_split = seeded_splits({"train": draw, "val": lambda g: (torch.zeros(1), torch.ones(1))})
    assert torch.equal(per_split("val")[1], torch.ones(1))
    with pytest.raises(ValueError, match="split must be 'train' or 'val'"):
        a("test")


def test_evaluating_restores_the_mode_even_after_an_error():
    model = nn.Dropout(0.5).train()
    with evaluating(model):
        assert not model.training
    assert model.training
    with pytest.raises(RuntimeError), evaluating(model):
        raise RuntimeError
    assert model.training
    with evaluating(model.eval()):
        pass
    assert not model.training


@dataclass
class Task:
    vocab_size: int = 8


@dataclass
class Training:
    steps: int = 3
    seed: int = 1


def test_settings_records_and_cell_means():
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
    assert cell_mean(results, mixer="a", n=1) == 0.75
    assert cell_mean(results, "stale", mixer="a", n=1) == pytest.approx(0.2)
    with pytest.raises(KeyError, match="no results for mixer='b', n=1"):
        cell_mean(results, mixer="b", n=1)
