"""Chapter 8's training runs: the hybrid against GPT-2 on the byte corpus, the KDA:MLA ratio,
and the hybrid on MQAR.

:func:`run_lm` trains GPT-2 of equal active parameters or the tiny hybrid (:data:`LM_CONFIG`)
at a KDA:MLA mix (:data:`RATIOS`) on the built-in byte corpus (the ``lm_hybrid`` task);
:func:`run_mqar_job` trains a per-layer mix of :data:`MQAR_MIXES` (the hybrid: KDA then MLA) on
MQAR at chapter 3's settings (the ``mqar`` task, :mod:`gpt2kimi.experiments.tasks`). The book's
results files are recorded by ``python -m gpt2kimi.experiments run NAME``
(:mod:`gpt2kimi.experiments.results`).
"""

from __future__ import annotations

import torch
from torch import nn

from gpt2kimi.accounting import gpt2_param_count, param_count
from gpt2kimi.configs import HybridConfig, KDAConfig, MLAConfig, MoEConfig
from gpt2kimi.data import lm_batches, load_corpus
from gpt2kimi.experiments.mqar import run_mqar
from gpt2kimi.gpt2 import GPT2, GPT2Config
from gpt2kimi.kimi_linear import KimiHybrid
from gpt2kimi.moe import AuxLossWrapper
from gpt2kimi.train import TrainConfig, train

# The tiny hybrid the chapter trains: width 64, 4 layers, a dense first layer, then 8 experts
# (2 routed + 1 shared active, as wide as the dense one).
LM_CONFIG = HybridConfig(
    vocab_size=256,
    d_model=64,
    mixers=("kda", "kda", "kda", "mla"),
    ffns=("dense", "moe", "moe", "moe"),
    kda=KDAConfig(n_head=2, head_dim=32, output_gate_bias=False),
    mla=MLAConfig(d_model=64, n_head=2, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                  v_head_dim=32, rope=False),
    moe=MoEConfig(d_model=64, n_experts=8, top_k=2, expert_hidden=64, n_shared_experts=1),
    dense_hidden=192,
)
# KDA:MLA mixes of the same 4 layers (the paper's ratio ablation, at this scale)
RATIOS: dict[str, tuple[str, ...]] = {
    "0:1": ("mla", "mla", "mla", "mla"),
    "1:1": ("kda", "mla", "kda", "mla"),
    "3:1": ("kda", "kda", "kda", "mla"),
    "all-KDA": ("kda", "kda", "kda", "kda"),
}
LM_TRAINING = dict(
    steps=200, batch_size=16, block_size=64, lr=3e-3, warmup_steps=20, eval_interval=25,
    eval_batches=4, bias_gamma=1e-3,
)


def gpt2_baseline_config(
    active_params: int, config: HybridConfig = LM_CONFIG, block_size: int = 64
) -> GPT2Config:
    """GPT-2 of the hybrid's depth whose width makes its parameters closest to
    ``active_params`` (widths in steps of the head count, 2)."""
    def gpt2(width: int) -> GPT2Config:
        return GPT2Config(vocab_size=config.vocab_size, block_size=block_size,
                          n_layer=config.n_layer, n_head=2, n_embd=width)

    widths = range(8, 4 * config.d_model, 2)
    return gpt2(min(widths, key=lambda w: abs(gpt2_param_count(gpt2(w)) - active_params)))


def lm_model(name: str, config: HybridConfig = LM_CONFIG, block_size: int = 64) -> nn.Module:
    """``"gpt2"`` (the baseline of equal active parameters) or a ratio name of :data:`RATIOS`."""
    if name == "gpt2":
        touched = param_count(config).active_with_embedding  # as GPT-2's count has its table
        return GPT2(gpt2_baseline_config(touched, config, block_size))
    return KimiHybrid(config.replace(mixers=RATIOS[name]))


def run_lm(job: tuple[str, int, dict]) -> dict:
    """Train one model on the byte corpus; its validation curve in nats per byte."""
    name, seed, settings = job
    s = settings
    torch.manual_seed(seed)
    model = lm_model(name, block_size=s["block_size"])
    total = sum(p.numel() for p in model.parameters())
    # parameters one token uses, the embedding row included (GPT-2's embedding is its head)
    active = total if name == "gpt2" else param_count(model.hybrid_config).active_with_embedding
    trained = model if name == "gpt2" else AuxLossWrapper(model, bias_gamma=s["bias_gamma"])
    cfg = TrainConfig(steps=s["steps"], lr=s["lr"], warmup_steps=min(s["warmup_steps"], s["steps"]),
                      eval_interval=s["eval_interval"], eval_batches=s["eval_batches"], seed=seed)
    batches = lm_batches(load_corpus(), s["batch_size"], s["block_size"], seed=seed)
    history = train(trained, batches, cfg)
    return {
        "model": name, "seed": seed, "params": total, "active_params": active,
        "val_steps": history.val_steps,
        "val_loss": [round(v, 4) for v in history.val_loss],
        "seconds": round(history.seconds, 1),
    }


def run_mqar_job(job: tuple[str, int, int, dict]) -> dict:
    """One MQAR run of the book's setting with a named mix of mixers (registry names per layer)."""
    name, num_pairs, seed, kwargs = job
    record = run_mqar(MQAR_MIXES[name], num_pairs, seed=seed, **kwargs)
    return {**record, "mixer": name}


MQAR_MIXES: dict[str, list[str]] = {"hybrid": ["kda", "mla"], "KDA": ["kda", "kda"],
                                    "MLA": ["mla", "mla"]}
