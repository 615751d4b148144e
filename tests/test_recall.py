"""Rewritten facts: the sequences follow the rules, the scores count current and stale answers."""

from functools import partial

import pytest
import torch
from torch import nn

from gpt2kimi.experiments.mqar import IGNORE, MQARTraining
from gpt2kimi.experiments.recall import (
    RewriteConfig,
    rewrite_batch,
    rewrite_batches,
    rewrite_scores,
    rewrite_sweep,
    run_rewrite,
    stale_values,
    train_rewrite,
)
from gpt2kimi.experiments.sweep import mean_over_seeds, settings_dict

CFG = RewriteConfig(vocab_size=32, seq_len=41, num_keys=3, query_prob=0.5)


def replay(row: list[int], cfg: RewriteConfig):
    """Walk one sequence event by event with a dict: the expected targets and stale sets."""
    memory, history = {}, {}
    targets, stale = [IGNORE] * len(row), []
    for e in range(cfg.num_events):
        key, value = row[2 * e], row[2 * e + 1]
        if key in memory and memory[key] == value:  # a query restates the current value
            targets[2 * e] = value
        stale.append({v for v in history.get(key, []) if v != value})
        memory[key] = value
        history.setdefault(key, []).append(value)
    return targets, stale


def test_layout_and_targets_follow_the_rules():
    x, y = rewrite_batch(CFG, 64, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (64, 41) and x.dtype == y.dtype == torch.long
    half, N = CFG.vocab_size // 2, CFG.num_keys
    keys, values = x[:, 0:40:2], x[:, 1:40:2]
    assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < 32)).all()
    first = keys[:, :N]
    assert all(len(set(r.tolist())) == N for r in first)  # every key written once, first
    assert all(set(k.tolist()) <= set(f.tolist()) for k, f in zip(keys, first, strict=True))
    assert (y[:, 1::2] == IGNORE).all() and (y[:, : 2 * N] == IGNORE).all()
    n_queries = n_rewrites = 0
    for row, target in zip(x.tolist(), y.tolist(), strict=True):
        expected, _ = replay(row, CFG)
        assert target == expected
        n_queries += sum(t != IGNORE for t in target)
        n_rewrites += CFG.num_events - N - sum(t != IGNORE for t in target)
    # query_prob = 0.5: about as many queries as rewrites (a rewrite never repeats the value)
    assert 0.4 < n_queries / (n_queries + n_rewrites) < 0.6


def test_deterministic_and_splits_differ():
    a = rewrite_batch(CFG, 8, torch.Generator().manual_seed(3))
    b = rewrite_batch(CFG, 8, torch.Generator().manual_seed(3))
    assert all(torch.equal(u, w) for u, w in zip(a, b, strict=True))
    batches = rewrite_batches(CFG, 8, seed=1)
    assert not torch.equal(batches("train")[0], batches("val")[0])
    with pytest.raises(ValueError, match="split"):
        batches("test")


def test_stale_values_match_a_replay():
    x, _ = rewrite_batch(CFG, 16, torch.Generator().manual_seed(1))
    stale = stale_values(x, CFG.vocab_size)
    assert stale.shape == (16, CFG.num_events, CFG.vocab_size)
    for b, row in enumerate(x.tolist()):
        _, expected = replay(row, CFG)
        for e, values in enumerate(expected):
            assert set(torch.nonzero(stale[b, e]).flatten().tolist()) == values


class Lookup(nn.Module):
    """A perfect memory (latest value) or a stuck one (first value) over the events seen so far."""

    def __init__(self, vocab_size: int, latest: bool) -> None:
        super().__init__()
        self.vocab_size, self.latest = vocab_size, latest
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        logits = torch.zeros(*x.shape, self.vocab_size)
        for b, row in enumerate(x.tolist()):
            memory = {}
            for e in range(len(row) // 2):
                key, value = row[2 * e], row[2 * e + 1]
                if key in memory:
                    logits[b, 2 * e, memory[key]] = 1.0
                if self.latest or key not in memory:
                    memory[key] = value
        return logits


def test_scores_count_current_and_stale_answers():
    cfg = RewriteConfig(vocab_size=32, seq_len=40, num_keys=2, query_prob=0.5)
    perfect = rewrite_scores(Lookup(32, latest=True), cfg, n_sequences=64, batch_size=32)
    assert perfect == {"accuracy": 1.0, "stale": 0.0}
    stuck = rewrite_scores(Lookup(32, latest=False), cfg, n_sequences=64, batch_size=32)
    assert stuck["accuracy"] + stuck["stale"] == pytest.approx(1.0)  # current or first value
    assert stuck["stale"] > 0.5  # with two keys, most keys get rewritten


def test_bad_configs():
    with pytest.raises(ValueError, match="num_keys"):
        RewriteConfig(num_keys=0)
    with pytest.raises(ValueError, match="key tokens"):
        RewriteConfig(vocab_size=16, num_keys=8)
    with pytest.raises(ValueError, match="seq_len"):
        RewriteConfig(seq_len=8, num_keys=4)
    with pytest.raises(ValueError, match="query_prob"):
        RewriteConfig(query_prob=0.0)
    with pytest.raises(ValueError, match="batch_size"):
        rewrite_batch(CFG, 0)


class Tiny(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, vocab_size)

    def forward(self, x, y=None):
        logits = self.embed(x)
        if y is None:
            return logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        return logits, loss


def test_train_rewrite_runs_and_records():
    torch.manual_seed(0)
    training = MQARTraining(steps=5, batch_size=8, warmup_steps=1, eval_sequences=16)
    result = train_rewrite(Tiny(32), CFG, training)
    record = result.as_dict()
    assert set(record) == {"accuracy", "stale", "seconds", "final_loss"}
    assert 0.0 <= record["accuracy"] <= 1.0 and 0.0 <= record["stale"] <= 1.0
    assert len(result.history.train_loss) == 5
    settings = settings_dict(CFG, training)
    assert settings["num_keys"] == 3 and settings["train_steps"] == 5


def test_sweep_records_every_run_and_repeats_itself():
    training = MQARTraining(steps=3, batch_size=4, warmup_steps=1, eval_sequences=8)
    models = {"a": lambda: Tiny(32), "b": lambda: Tiny(32)}
    sweep = rewrite_sweep(models, [2, 3], [0, 1], training=training, vocab_size=32, seq_len=16)
    results, settings = sweep["results"], sweep["settings"]
    assert [(r["mixer"], r["num_keys"], r["seed"]) for r in results] == [
        (m, n, s) for m in "ab" for n in (2, 3) for s in (0, 1)
    ]
    assert settings["mixers"] == ["a", "b"] and settings["num_keys"] == [2, 3]
    assert settings["vocab_size"] == 32 and settings["seq_len"] == 16
    assert settings["train_steps"] == 3 and settings["seeds"] == [0, 1]
    again = run_rewrite(lambda: Tiny(32), RewriteConfig(32, 16, num_keys=3), training, seed=1)
    first = next(r for r in results if (r["mixer"], r["num_keys"], r["seed"]) == ("a", 3, 1))
    assert again["accuracy"] == first["accuracy"] and again["final_loss"] == first["final_loss"]
    cell = [r["accuracy"] for r in results if r["mixer"] == "b" and r["num_keys"] == 2]
    assert mean_over_seeds(results, mixer="b", num_keys=2) == pytest.approx(sum(cell) / 2)
    with pytest.raises(KeyError):
        mean_over_seeds(results, mixer="c", num_keys=2)


def test_sweep_in_worker_processes_matches_one_process():
    training = MQARTraining(steps=2, batch_size=4, warmup_steps=1, eval_sequences=8)
    models = {"a": partial(Tiny, 32)}  # picklable: the workers build their own model
    kwargs = dict(training=training, vocab_size=32, seq_len=16)
    parallel = rewrite_sweep(models, [2, 3], [0], jobs=2, **kwargs)["results"]
    serial = rewrite_sweep(models, [2, 3], [0], jobs=1, **kwargs)["results"]
    for p, s in zip(parallel, serial, strict=True):
        assert p["mixer"] == s["mixer"] and p["num_keys"] == s["num_keys"]
        assert p["final_loss"] == pytest.approx(s["final_loss"], abs=1e-3)
