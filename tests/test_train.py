import pytest
import torch
from torch import nn

from gpt2kimi.data import lm_batches, load_corpus
from gpt2kimi.gpt2 import GPT2, GPT2Config
from gpt2kimi.train import TrainConfig, evaluating, lr_at, seeded_splits, train

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


# seeded batch sources and eval mode, shared by every task


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
