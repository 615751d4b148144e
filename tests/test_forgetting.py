"""Sliding-window recall (a task that needs forgetting), the ablation layers, the machine record."""

from functools import partial

import pytest
import torch
from torch import nn

from gpt2kimi.backbone import BackboneConfig, LanguageModel
from gpt2kimi.deltanet import DeltaNet
from gpt2kimi.experiments.ablations import (
    AdditiveDeltaNet,
    GatedLinearAttention,
    KDAWithoutForgetting,
)
from gpt2kimi.experiments.mqar import IGNORE, MQARTraining
from gpt2kimi.experiments.recall import (
    WINDOW_PARTS,
    WindowRecallConfig,
    run_window_recall,
    window_recall_batch,
    window_recall_batches,
    window_recall_scores,
    window_recall_sweep,
)
from gpt2kimi.experiments.registry import MIXERS, build_model
from gpt2kimi.experiments.sweep import machine_info
from gpt2kimi.gated_deltanet import log_decay
from gpt2kimi.ops import chunk_delta_rule, chunk_linear_attn, recurrent_simple_gla

CFG = WindowRecallConfig(vocab_size=64, seq_len=61, num_queries=8, window=3)
TINY = BackboneConfig(vocab_size=64, d_model=16, n_layer=1, n_head=2)
QUICK = MQARTraining(steps=2, batch_size=4, warmup_steps=1, eval_sequences=8)


def replay(row: list[int], cfg: WindowRecallConfig):
    """Walk one sequence with a list of facts: expected targets, and each query's distance back
    (0: the latest fact)."""
    facts: list[tuple[int, int]] = []
    targets, distances = [IGNORE] * len(row), []
    for e in range(cfg.num_events):
        key, value = row[2 * e], row[2 * e + 1]
        seen = [i for i, (k, _) in enumerate(facts) if k == key]
        if not seen:  # a new fact
            facts.append((key, value))
            continue
        (i,) = seen  # a key is written once
        assert facts[i][1] == value  # a query restates the fact's value
        targets[2 * e] = value
        distances.append(len(facts) - 1 - i)
    return targets, distances, len(facts)


def test_layout_and_targets_follow_the_rules():
    x, y = window_recall_batch(CFG, 200, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (200, 61) and x.dtype == y.dtype == torch.long
    half, E = CFG.vocab_size // 2, CFG.num_events
    keys, values = x[:, 0 : 2 * E : 2], x[:, 1 : 2 * E : 2]
    assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < 64)).all()
    assert (y[:, 1::2] == IGNORE).all() and (y[:, : 2 * CFG.window] == IGNORE).all()
    assert ((y != IGNORE).sum(dim=1) == CFG.num_queries).all()
    all_distances = []
    for row, target in zip(x.tolist(), y.tolist(), strict=True):
        expected, distances, n_facts = replay(row, CFG)
        assert target == expected
        assert n_facts == CFG.num_facts == E - CFG.num_queries
        assert all(0 <= d < CFG.window for d in distances)  # only the latest facts are asked
        all_distances += distances
    # the queried fact is uniform over the window: 1600 queries, 3 distances
    counts = torch.bincount(torch.tensor(all_distances), minlength=CFG.window).double()
    assert ((counts / counts.sum() - 1 / CFG.window).abs() < 0.05).all()


def test_the_default_stream_holds_three_times_more_facts_than_a_head_has_key_directions():
    cfg = WindowRecallConfig()
    head_dim = 8  # the sweep's model: d_model 64 in 8 heads
    assert cfg.num_facts == 24 and cfg.num_facts >= 3 * head_dim and cfg.window < head_dim


def test_deterministic_and_splits_differ():
    a = window_recall_batch(CFG, 4, torch.Generator().manual_seed(3))
    b = window_recall_batch(CFG, 4, torch.Generator().manual_seed(3))
    assert all(torch.equal(s, t) for s, t in zip(a, b, strict=True))
    batches = window_recall_batches(CFG, 4, seed=1)
    assert not torch.equal(batches("train")[0], batches("val")[0])
    with pytest.raises(ValueError, match="split must be"):
        batches("test")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(window=0), "window must be at least 1"),
        (dict(num_queries=0), "num_queries must be at least 1"),
        (dict(seq_len=20, num_queries=8, window=3), "at most 7 can be queries"),
        (dict(vocab_size=32, seq_len=61), "use vocab_size >= 46"),
    ],
)
def test_bad_configs_say_what_to_change(kwargs, message):
    settings = dict(vocab_size=64, seq_len=61, num_queries=8, window=3) | kwargs
    with pytest.raises(ValueError, match=message):
        WindowRecallConfig(**settings)
    with pytest.raises(ValueError, match="batch_size"):
        window_recall_batch(CFG, 0)


class Lookup(nn.Module):
    """Exact memory as a model: at a key, predict the token that followed its last occurrence.

    ``horizon`` keeps only the facts of the last ``horizon`` events (a memory that forgets)."""

    def __init__(self, vocab_size: int, horizon: int | None = None) -> None:
        super().__init__()
        self.vocab_size, self.horizon = vocab_size, horizon
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*x.shape, self.vocab_size)
        for b, row in enumerate(x.tolist()):
            for t in range(0, len(row) - 1, 2):
                start = 0 if self.horizon is None else max(0, t - 2 * self.horizon)
                earlier = [s for s in range(start, t, 2) if row[s] == row[t]]
                if earlier:
                    logits[b, t, row[earlier[-1] + 1]] = 1.0
        return logits


def test_scores_count_right_answers_per_quarter():
    perfect = window_recall_scores(Lookup(64), CFG, n_sequences=40, batch_size=16)
    assert perfect == {"accuracy": 1.0, "by_part": [1.0] * WINDOW_PARTS}
    # a memory that keeps only the latest events still answers every query (the point of the
    # task): a fact asked about is at most `window` facts back, plus the queries in between
    windowed = window_recall_scores(Lookup(64, horizon=CFG.window + CFG.num_queries), CFG, 40)
    assert windowed["accuracy"] == 1.0
    # one that keeps only the last event does not
    short = window_recall_scores(Lookup(64, horizon=1), CFG, n_sequences=40)
    assert short["accuracy"] < 0.9
    assert window_recall_scores(Lookup(64, horizon=0), CFG, 40)["accuracy"] == 0.0


def test_run_and_sweep_record_each_run_and_the_settings():
    torch.manual_seed(0)
    make = partial(build_model, "linear", TINY)
    record = run_window_recall(make, CFG, QUICK, seed=2)
    assert list(record) == [
        "seq_len",
        "window",
        "seed",
        "accuracy",
        "seconds",
        "final_loss",
        "by_part",
    ]
    assert record["seed"] == 2 and 0.0 <= record["accuracy"] <= 1.0
    assert len(record["by_part"]) == WINDOW_PARTS
    assert run_window_recall(make, CFG, QUICK, seed=2)["accuracy"] == record["accuracy"]
    task = dict(vocab_size=64, seq_len=61, num_queries=8, window=3)
    models = {"linear": make, "deltanet": partial(build_model, "deltanet", TINY)}
    sweep = window_recall_sweep(models, [0, 1], training=QUICK, **task)
    assert [(r["mixer"], r["seed"]) for r in sweep["results"]] == [
        ("linear", 0),
        ("linear", 1),
        ("deltanet", 0),
        ("deltanet", 1),
    ]
    settings = sweep["settings"]
    assert settings["num_facts"] == CFG.num_facts and settings["window"] == 3
    assert settings["train_steps"] == 2 and settings["mixers"] == ["linear", "deltanet"]


# ----------------------------------------------------------------------------------------------
# the ablation layers


def test_the_ablations_are_registered():
    assert MIXERS["deltanet_additive"] is AdditiveDeltaNet
    assert MIXERS["kda_no_forget"] is KDAWithoutForgetting
    assert MIXERS["gated_linear"] is GatedLinearAttention


def test_gated_linear_attention_is_gated_deltanets_layer_with_the_faded_additive_update():
    torch.manual_seed(0)
    layer = GatedLinearAttention(16, 2, chunk_size=4).double()
    assert not hasattr(layer, "b_proj")
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    y, state = layer(x, return_state=True)
    # the memory is S_t = α_t S_{t−1} + k_t v_tᵀ on the layer's own q, k, v and gate
    q, k, v, _ = layer.qkv(x, None)
    g = log_decay(layer.a_proj(x), layer.A_log, layer.dt_bias)
    _, memory = recurrent_simple_gla(q, k, v, g)
    torch.testing.assert_close(state.memory, memory)
    # a prefix, then the rest (the last token through the one-token step), equals one call
    y1, s1 = layer(x[:, :10], return_state=True)
    y2, _ = layer(x[:, 10:], s1, return_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y)


def test_additive_deltanet_is_deltanets_layer_with_linear_attentions_update():
    torch.manual_seed(0)
    layer = AdditiveDeltaNet(16, 2, chunk_size=4).double()
    reference = DeltaNet(16, 2, chunk_size=4).double()
    reference.load_state_dict(layer.state_dict(), strict=False)  # all but β's projection
    assert not hasattr(layer, "b_proj")
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    y, state = layer(x, return_state=True)
    q, k, v, _ = reference.qkv(x, None)
    o, memory = chunk_linear_attn(q, k, v)
    expected = reference.o_proj(reference.o_norm(o).reshape(2, 11, 16))
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(state.memory, memory)
    # the state contract: a prefix, then the rest, equals one call
    y1, s1 = layer(x[:, :6], return_state=True)
    y2, _ = layer(x[:, 6:], s1, return_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y)


def test_additive_deltanet_takes_a_narrow_memory():
    """A head_dim other than d_model / n_head (chapter 4's 4 x 4 memories) keeps the shapes."""
    layer = AdditiveDeltaNet(16, 2, head_dim=4)
    y, state = layer(torch.randn(3, 5, 16), return_state=True)
    assert y.shape == (3, 5, 16) and state.memory.shape == (3, 2, 4, 4)


def test_kda_without_forgetting_never_decays_and_trains():
    torch.manual_seed(0)
    layer = KDAWithoutForgetting(16, 2, chunk_size=4).double()
    assert "forget_gate.A_log" not in dict(layer.named_parameters())
    assert torch.isneginf(layer.forget_gate.A_log).all()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    _, state = layer(x, return_state=True)
    # every decay is 1: the memory is the plain delta rule's on the layer's q, k, v and β
    q, k, v, _ = layer.qkv(x, None)
    beta = torch.sigmoid(layer.b_proj(x))
    _, memory = chunk_delta_rule(q, k, v, beta)
    torch.testing.assert_close(state.memory, memory)
    # trainable as any mixer: finite gradients, none into the switched-off gate's input
    model = LanguageModel(TINY, KDAWithoutForgetting)
    idx = torch.randint(0, 64, (2, 9))
    _, loss = model(idx, idx)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.isfinite(g).all() for g in grads)
    f_proj = model.blocks[0].mixer.forget_gate
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in f_proj.parameters())


# ----------------------------------------------------------------------------------------------
# the record of the machine


def test_machine_info_names_the_cpu_threads_and_versions():
    info = machine_info(jobs=2)
    assert info["cpu"] and info["threads_per_run"] == 1 and info["parallel_runs"] == 2
    assert info["torch"] == torch.__version__ and info["logical_cpus"] >= 1
