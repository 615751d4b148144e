"""Reading the experiments: current files only, each cell at its own tuned rate, orderings that
hold in every seed, live re-runs within a tolerance, the verifications a file records."""

import pytest

from gpt2kimi.experiments import results
from gpt2kimi.experiments.__main__ import main
from gpt2kimi.experiments.evidence import (
    StaleResults,
    Tuned,
    beats,
    load,
    order,
    read_rows,
    rerun,
    select,
    tuned,
    verifications,
)
from gpt2kimi.experiments.results import ResultsEntry

TINY = dict(vocab_size=16, seq_len=8, d_model=16, train_steps=3, train_warmup_steps=1,
            train_eval_sequences=32, train_batch_size=8)


def rows(values: dict[tuple[str, float], list[float]]) -> list[dict]:
    """Rows of mixer × rate with one accuracy per seed."""
    return [{"mixer": m, "train_lr": lr, "seed": s, "accuracy": a}
            for (m, lr), accs in values.items() for s, a in enumerate(accs)]


def test_each_cell_at_its_best_rate_and_whether_the_grid_brackets_it():
    cells = tuned(rows({("a", 1e-3): [0.5, 0.6, 0.7], ("a", 1e-2): [0.9, 0.8, 0.7],
                        ("a", 3e-3): [0.2, 0.2, 0.2], ("b", 1e-3): [0.1, 0.1, 0.1],
                        ("b", 3e-3): [0.4, 0.3, 0.5], ("b", 1e-2): [0.2, 0.2, 0.2]}), ["mixer"])
    a, b = cells[("a",)], cells[("b",)]
    assert a.rate == 1e-2 and a.by_seed == {0: 0.9, 1: 0.8, 2: 0.7} and not a.bracketed
    assert b.rate == 3e-3 and b.bracketed and (b.low, b.high) == (0.3, 0.5)
    assert a.mean == pytest.approx(0.8) and a.means[1e-3] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="different seeds"):
        tuned(rows({("a", 1e-3): [0.5, 0.6], ("a", 1e-2): [0.9]}), ["mixer"])


def test_an_ordering_holds_only_in_every_paired_seed():
    a = Tuned(1e-3, {0: 0.9, 1: 0.8, 2: 0.7}, 0.8, {}, True)
    b = Tuned(1e-3, {0: 0.5, 1: 0.6, 2: 0.75}, 0.62, {}, True)  # seed 2: b is better
    c = Tuned(1e-3, {0: 0.1, 1: 0.2, 2: 0.3}, 0.2, {}, True)
    assert beats(a, c) and not beats(a, b) and not beats(b, a)
    assert beats(c, a, higher_is_better=False)
    assert order({"a": a, "b": b, "c": c}) == "a ≈ b > c"
    with pytest.raises(ValueError, match="unpaired"):
        beats(a, Tuned(1e-3, {0: 0.1}, 0.1, {}, True))


def test_load_refuses_a_file_that_is_not_current_and_rerun_checks_a_tolerance(
    tmp_path, monkeypatch
):
    entry = ResultsEntry("tiny", "mqar", [{"mixer": "linear", "num_pairs": 1, **TINY}], (0, 1),
                         "a tiny sweep", "-", 0.1)
    monkeypatch.setattr(results, "REGISTRY", {"tiny": entry})
    monkeypatch.setattr("gpt2kimi.experiments.evidence.REGISTRY", {"tiny": entry})
    with pytest.raises(StaleResults, match="missing"):
        load("tiny", tmp_path)
    with pytest.raises(KeyError, match="no results file 'other'"):
        load("other", tmp_path)
    main(["run", "tiny", "--jobs", "1", "--data", str(tmp_path)])
    got = load("tiny", tmp_path)
    assert got == read_rows(tmp_path / "tiny.jsonl") and len(got) == 2
    assert got[0]["mixer"] == "linear" and got[0]["train_steps"] == 3 and "accuracy" in got[0]
    assert select(got, seed=1) == [got[1]]
    assert verifications("tiny", tmp_path) == []  # none yet
    main(["verify", "tiny", "--data", str(tmp_path)])  # against the file's own numbers
    (check,) = verifications("tiny", tmp_path)
    assert {run["seed"] for run in check["runs"]} == {0, 1} and check["tolerance"] == 1e-4
    assert all(run["differences"] == 0 for run in check["runs"]) and "baseline" not in check
    with pytest.raises(KeyError, match="no results file 'other'"):
        verifications("other", tmp_path)
    # the same runs again, in this process: equal, so within any tolerance
    checked = rerun("tiny", tolerance=0.0, data_dir=tmp_path, seed=1)
    assert len(checked) == 1 and checked[0][1] == checked[0][2]
    with pytest.raises(ValueError, match="no recorded run"):
        rerun("tiny", 0.0, data_dir=tmp_path, mixer="softmax")
    with pytest.raises(AssertionError, match="more than the tolerance 0.01"):
        rerun("tiny", 0.01, data_dir=tmp_path, run=lambda s, seed: {"accuracy": 2.0})
    # a file whose grid the registry no longer has is refused
    monkeypatch.setattr(results, "REGISTRY", {"tiny": ResultsEntry(
        "tiny", "mqar", [{"mixer": "softmax", "num_pairs": 1, **TINY}], (0, 1), "-", "-", 0.1)})
    monkeypatch.setattr("gpt2kimi.experiments.evidence.REGISTRY", results.REGISTRY)
    with pytest.raises(StaleResults, match="settings differ"):
        load("tiny", tmp_path)
    assert len(load("tiny", tmp_path, current=False)) == 2
