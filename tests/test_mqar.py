import json

import pytest
import torch
from torch import nn

from gpt2kimi.attention import SoftmaxAttention
from gpt2kimi.backbone import BackboneConfig, LanguageModel
from gpt2kimi.experiments.mqar import (
    IGNORE,
    MQARConfig,
    MQARTraining,
    format_table,
    mqar_accuracy,
    mqar_batch,
    mqar_batches,
    mqar_sweep,
    recall_accuracy,
    run_mqar,
    sample_distinct,
    train_mqar,
)
from gpt2kimi.experiments.sweep import mean_over_seeds

CFG = MQARConfig(vocab_size=64, seq_len=48, num_pairs=6)


def batch(cfg: MQARConfig = CFG, B: int = 256, seed: int = 0):
    return mqar_batch(cfg, B, torch.Generator().manual_seed(seed))


def test_shapes_and_dtypes():
    x, y = batch()
    assert x.shape == y.shape == (256, 48)
    assert x.dtype == y.dtype == torch.long
    assert x.min() >= 0 and x.max() < 64


def test_keys_and_values_come_from_disjoint_halves_and_keys_are_distinct():
    x, _ = batch()
    keys, values = x[:, 0:12:2], x[:, 1:12:2]
    assert keys.min() >= 1 and keys.max() < 32
    assert values.min() >= 32 and values.max() < 64
    assert all(len(set(row.tolist())) == 6 for row in keys)


def test_every_key_is_queried_once_and_its_target_is_its_value():
    x, y = batch()
    N = CFG.num_pairs
    for b in range(len(x)):
        pairs = dict(zip(x[b, 0 : 2 * N : 2].tolist(), x[b, 1 : 2 * N : 2].tolist(), strict=True))
        positions = (y[b] != IGNORE).nonzero().flatten().tolist()
        assert len(positions) == N
        assert min(positions) >= 2 * N  # queries come after the pairs
        queried = [x[b, t].item() for t in positions]
        assert sorted(queried) == sorted(pairs)  # each key exactly once
        for t in positions:
            assert y[b, t].item() == pairs[x[b, t].item()]
            assert x[b, t + 1].item() == y[b, t].item()  # the value follows, as in text
    assert ((y == IGNORE) | (y >= 32)).all()  # every target is -100 or a value


def test_fillers_are_random_or_zero():
    cfg = MQARConfig(vocab_size=64, seq_len=48, num_pairs=6, random_fillers=False)
    x, y = batch(cfg)
    query = y != IGNORE
    answer = torch.zeros_like(query)
    answer[:, 1:] = query[:, :-1]
    filler = ~(query | answer)
    filler[:, :12] = False
    assert (x[filler] == 0).all()
    x, _ = batch()
    assert len(set(x[:, 12:].flatten().tolist())) > 40  # random fillers use the whole vocabulary


def test_query_slots_follow_a_power_law_favouring_short_gaps():
    cfg = MQARConfig(vocab_size=64, seq_len=64, num_pairs=2)
    _, y = batch(cfg, B=4000)
    slots = ((y != IGNORE).nonzero()[:, 1] - 4) // 2
    counts = torch.bincount(slots, minlength=cfg.num_slots).float()
    assert counts[0] > 3 * counts[-1]
    assert counts[:5].sum() > counts[-5:].sum()
    p = cfg.slot_probs()
    assert torch.isclose(p.sum(), torch.tensor(1.0, dtype=p.dtype))
    assert (p[1:] < p[:-1]).all()


def test_sample_distinct_returns_distinct_indices():
    idx = sample_distinct(torch.ones(10), 100, 10, torch.Generator().manual_seed(0))
    assert (idx.sort(dim=-1).values == torch.arange(10)).all()


def test_generation_is_reproducible_and_seed_dependent():
    assert all(torch.equal(a, b) for a, b in zip(batch(seed=3), batch(seed=3), strict=True))
    assert not torch.equal(batch(seed=3)[0], batch(seed=4)[0])
    batches = mqar_batches(CFG, 8, seed=0)
    assert not torch.equal(batches("train")[0], batches("val")[0])
    with pytest.raises(ValueError, match="split must be"):
        batches("test")


def test_bad_parameters_raise_clear_errors():
    with pytest.raises(ValueError, match="too small for 40 distinct keys"):
        MQARConfig(vocab_size=64, seq_len=256, num_pairs=40)
    with pytest.raises(ValueError, match="seq_len=30 is too short for 8 pairs"):
        MQARConfig(vocab_size=64, seq_len=30, num_pairs=8)
    with pytest.raises(ValueError, match="num_pairs must be at least 1"):
        MQARConfig(num_pairs=0)
    with pytest.raises(ValueError, match="power_a"):
        MQARConfig(power_a=0.0)
    with pytest.raises(ValueError, match="batch_size"):
        mqar_batch(CFG, 0)
    MQARConfig(vocab_size=20, seq_len=36, num_pairs=9)  # the limits themselves are fine


class Oracle(nn.Module):
    """Looks each queried key up in the pairs: a perfect memory, for testing the metric."""

    def __init__(self, cfg: MQARConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N, V = self.cfg.num_pairs, self.cfg.vocab_size
        keys, values = x[:, 0 : 2 * N : 2], x[:, 1 : 2 * N : 2]
        match = x[:, :, None] == keys[:, None, :]  # [B, T, N]
        answer = (match.long() * values[:, None, :]).sum(-1)
        return nn.functional.one_hot(answer, V).float()


def test_accuracy_of_a_perfect_memory_is_one_and_of_a_constant_is_low():
    assert mqar_accuracy(Oracle(CFG), CFG, n_sequences=100, batch_size=32) == 1.0
    x, y = batch(B=64)
    constant = torch.zeros(64, 48, 64)
    constant[..., 40] = 1.0
    correct, total = recall_accuracy(constant, y)
    assert total == 64 * 6 and correct / total < 0.1


def test_a_tiny_softmax_model_learns_a_tiny_mqar():
    torch.manual_seed(0)
    cfg = MQARConfig(vocab_size=32, seq_len=16, num_pairs=2)
    model = LanguageModel(
        BackboneConfig(vocab_size=32, d_model=32, n_layer=1, n_head=2, short_conv=2),
        SoftmaxAttention,
    )
    training = MQARTraining(steps=100, batch_size=32, lr=5e-3, warmup_steps=10, eval_sequences=256)
    result = train_mqar(model, cfg, training)
    # chance is about 1/16 (a value picked at random); the model recalls most values
    assert result.accuracy > 0.5, result.accuracy
    assert result.history.train_loss[-1] < result.history.train_loss[0]


# ---------------------------------------------------------------------------------------------
# the runs by mixer name

QUICK = MQARTraining(steps=2, batch_size=4, warmup_steps=1, eval_sequences=8)


def test_run_mqar_returns_a_reproducible_record():
    a = run_mqar("linear", 2, seq_len=16, training=QUICK, seed=3)
    b = run_mqar("linear", 2, seq_len=16, training=QUICK, seed=3)
    assert {"mixer", "num_pairs", "seed", "accuracy", "seconds", "final_loss"} <= set(a)
    assert (a["mixer"], a["num_pairs"], a["seed"]) == ("linear", 2, 3)
    assert a["accuracy"] == b["accuracy"] and a["final_loss"] == b["final_loss"]
    assert 0.0 <= a["accuracy"] <= 1.0


def test_sweep_covers_the_grid_in_order_and_summarises():
    sweep = mqar_sweep(["softmax", "linear"], [1, 2], seeds=[0, 1], seq_len=8, training=QUICK)
    grid = [(r["mixer"], r["num_pairs"], r["seed"]) for r in sweep["results"]]
    assert grid == [(m, n, s) for m in ("softmax", "linear") for n in (1, 2) for s in (0, 1)]
    assert sweep["results"][0] == run_mqar("softmax", 1, seq_len=8, training=QUICK, seed=0) | {
        "seconds": sweep["results"][0]["seconds"]
    }
    assert sweep["settings"]["seq_len"] == 8 and sweep["settings"]["train_steps"] == 2
    json.dumps(sweep)  # JSON-ready
    expected = (sweep["results"][0]["accuracy"] + sweep["results"][1]["accuracy"]) / 2
    assert mean_over_seeds(sweep["results"], mixer="softmax", num_pairs=1) == pytest.approx(
        expected
    )
    with pytest.raises(KeyError):
        mean_over_seeds(sweep["results"], mixer="kda", num_pairs=1)
    table = format_table(sweep)
    assert table.splitlines()[0].split() == ["mixer", "N=1", "N=2"]
