"""The fixed validation set, train's losses without a per-step sync, and chapter 8's ablation
models (gpt2, gpt2_conv, 3:1, 3:1_dense and the ratios) at equal active parameters."""

import pytest
import torch

from gpt2kimi.data import fixed_val_batches, fixed_windows, lm_batches, load_corpus
from gpt2kimi.experiments import sweep
from gpt2kimi.experiments.lm_ablation import (
    LM_ABLATION_TRAINING,
    LM_MODELS,
    build_lm,
    run_lm_fixed,
)
from gpt2kimi.experiments.tasks import TASKS
from gpt2kimi.gpt2 import GPT2, GPT2Config
from gpt2kimi.train import (
    TrainConfig,
    configure_optimizer,
    evaluate_fixed,
    lr_at,
    train,
)


def test_fixed_windows_cover_the_split_once_in_order():
    ids = torch.arange(103)
    batches = fixed_windows(ids, block_size=10, batch_size=4)
    assert [x.shape[0] for x, _ in batches] == [4, 4, 2]  # (103 - 1) // 10 = 10 windows
    x = torch.cat([x for x, _ in batches])
    y = torch.cat([y for _, y in batches])
    assert torch.equal(x.flatten(), ids[:100]) and torch.equal(y.flatten(), ids[1:101])


def test_fixed_val_set_is_the_whole_split_and_seed_free():
    corpus = load_corpus()
    val = fixed_val_batches(corpus, block_size=64)
    n = (len(corpus.val) - 1) // 64 * 64
    assert torch.equal(torch.cat([x for x, _ in val]).flatten(), corpus.val[:n])
    assert len(corpus.val) - n < 65  # at most one window's tail left out
    # two models trained with different seeds are scored on the very same batches
    scores = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = GPT2(GPT2Config(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=16))
        history = train(model, lm_batches(corpus, 4, 64, seed=seed),
                        TrainConfig(steps=2, warmup_steps=1, seed=seed), val_set=val[:2])
        assert history.val_loss[-1] == evaluate_fixed(model, val[:2])  # same set every time
        scores.append(history.val_loss[-1])
    assert scores[0] != scores[1]


def test_train_losses_equal_a_loss_item_every_step_loop():
    """The losses train() copies in bulk are bit-identical to ``loss.item()`` at every step."""
    corpus = load_corpus()
    cfg = TrainConfig(steps=12, lr=3e-3, warmup_steps=3, eval_interval=5, eval_batches=1, seed=3)
    config = GPT2Config(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    model = GPT2(config)
    history = train(model, lm_batches(corpus, 4, 16, seed=3), cfg)

    torch.manual_seed(0)
    reference = GPT2(config)
    torch.manual_seed(cfg.seed)
    optimizer = configure_optimizer(reference, cfg)
    batches = lm_batches(corpus, 4, 16, seed=3)
    losses = []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        _, loss = reference(*batches("train"))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
    assert history.train_loss == losses and history.val_steps == [5, 10, 12]


def test_baselines_have_the_hybrids_active_parameters():
    """gpt2, gpt2_conv and 3:1_dense within 1% of the 3:1 hybrid's active parameters."""
    target = build_lm("3:1")[1]
    for name in ("gpt2", "gpt2_conv", "3:1_dense"):
        model, active = build_lm(name)
        assert active == sum(p.numel() for p in model.parameters())  # dense: all active
        assert abs(active - target) / target < 0.01, name
    conv = build_lm("gpt2_conv")[0]
    assert all(block.shift.conv.kernel_size == (4,) for block in conv.blocks)


@pytest.mark.parametrize("name", LM_MODELS)
def test_each_model_trains_three_steps(name):
    corpus = load_corpus()
    torch.manual_seed(0)
    model, _ = build_lm(name, block_size=32)
    history = train(model, lm_batches(corpus, 2, 32, seed=0),
                    TrainConfig(steps=3, warmup_steps=1, eval_interval=3),
                    val_set=fixed_val_batches(corpus, 32, 2)[:1])
    assert len(history.train_loss) == 3 and history.val_steps == [3]
    assert torch.isfinite(torch.tensor(history.val_loss)).all()


def test_run_record_and_task():
    settings = {**LM_ABLATION_TRAINING, "steps": 3, "eval_interval": 2, "batch_size": 2,
                "block_size": 16}
    record = run_lm_fixed("gpt2", 0, settings, device="cpu")
    assert record["val_steps"] == [2, 3] and record["device"] == "cpu"
    assert record["final_val_loss"] == record["val_loss"][-1] and record["tokens_per_s"] > 0
    assert TASKS["lm_hybrid_ablation"].settings()["steps"] == 1500


def test_moe_task_with_fixed_validation():
    task = TASKS["lm_moe_fixed"]
    record = task.train_and_score({"variant": "moe_bias", "steps": 2, "eval_interval": 2,
                                   "batch_size": 2, "block_size": 16, "d_model": 16,
                                   "expert_hidden": 8, "warmup_steps": 1}, seed=0)
    assert record["val_steps"] == [2] and "load_imbalance" in record and record["device"] == "cpu"


def test_bad_names_list_the_options():
    with pytest.raises(ValueError, match="gpt2_conv.*3:1_dense"):
        build_lm("gpt3")
    with pytest.raises(ValueError, match="moe_bias"):
        TASKS["lm_moe_fixed"].train_and_score({"variant": "moe_big"}, seed=0)


def test_run_device_reads_the_environment(monkeypatch):
    monkeypatch.delenv("GPT2KIMI_DEVICE", raising=False)
    assert sweep.run_device() == torch.device("cpu")
    monkeypatch.setenv("GPT2KIMI_DEVICE", "meta")
    assert sweep.run_device() == torch.device("meta")
