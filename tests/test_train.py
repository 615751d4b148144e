import pytest
import torch

from gpt2kimi.data import lm_batches, load_corpus
from gpt2kimi.gpt2 import GPT2, GPT2Config
from gpt2kimi.train import TrainConfig, lr_at, train

CFG = GPT2Config(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32)


def test_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, lr=1e-2, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[9] == pytest.approx(1e-2)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))  # monotone decay
    assert lrs[-1] >= 1e-3 and lrs[-1] < 1.1e-3


def test_bad_config():
    with pytest.raises(ValueError):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="warmup"):
        TrainConfig(steps=10, warmup_steps=20)


def run(seed: int = 0):
    torch.manual_seed(seed)
    model = GPT2(CFG)
    history = train(model, lm_batches(load_corpus(), 8, 16, seed=seed),
                    TrainConfig(steps=60, lr=3e-3, warmup_steps=5, eval_interval=20,
                                eval_batches=2, seed=seed))
    return model, history


def test_training_learns_and_is_deterministic():
    model, history = run()
    assert history.val_steps == [20, 40, 60]
    assert len(history.train_loss) == 60 and len(history.lr) == 60
    # Starts near ln(256) = 5.55 and learns the byte statistics quickly.
    assert history.train_loss[0] > 5.0
    assert history.val_loss[-1] < 3.6
    assert not model.training  # handed back in eval mode
    _, again = run()
    assert again.train_loss == history.train_loss and again.val_loss == history.val_loss


def test_progress_output(capsys):
    torch.manual_seed(0)
    train(GPT2(CFG), lm_batches(load_corpus(), 2, 16),
          TrainConfig(steps=4, warmup_steps=1, eval_interval=2, eval_batches=1, log_interval=2))
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("step     2/4 | train") and "val" in lines[0]
