"""Chapter 8's byte-level language models, run long enough and scored on a fixed validation set,
with the baselines that attribute the hybrid's gain.

Every run trains one model with one seed on the built-in byte corpus for
:data:`LM_ABLATION_TRAINING` ``steps`` (1,500) and scores it on the **whole validation split**,
cut into fixed windows (:func:`gpt2kimi.data.fixed_val_batches`): the same tokens for every seed,
every model and every evaluation. The models (:data:`LM_MODELS`), all 4 layers deep:

``gpt2``        chapter 1's GPT-2, its width chosen for the active parameters of the hybrid
                (:func:`gpt2kimi.experiments.hybrid_train.lm_model`, as in ``lm_hybrid``);
``gpt2_conv``   the same GPT-2 (learned positions, LayerNorm, GELU MLP, tied head) built on the
                backbone with a short causal convolution of the KDA's ``conv_size`` taps in front of
                every attention (``BackboneConfig(short_conv=4)``: a residual depthwise
                :class:`~gpt2kimi.backbone.TokenShift` on the normed stream), its width chosen for
                the same active parameters;
``3:1``         the hybrid (:data:`~gpt2kimi.experiments.hybrid_train.LM_CONFIG`: KDA x3 + MLA,
                a dense first feed-forward, then MoE);
``3:1_dense``   the same hybrid with a dense SwiGLU of ``(top_k + shared) * expert_hidden`` (192)
                in every layer: the MoE's active width without the idle experts (and router);
``0:1``, ``1:1``, ``all-KDA``
                the ratio ablation (:data:`~gpt2kimi.experiments.hybrid_train.RATIOS`).

The KDA's own convolution runs over its q|k|v projections (fla's ``ShortConvolution``), the
``gpt2_conv``'s over the attention's input: both give each token its last 3 predecessors before
the mixer reads them, which is the property the baseline isolates.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from torch import nn

from gpt2kimi.accounting import gpt2_param_count, param_count
from gpt2kimi.attention import SoftmaxAttention
from gpt2kimi.backbone import BackboneConfig, LanguageModel
from gpt2kimi.configs import HybridConfig
from gpt2kimi.data import fixed_val_batches, lm_batches, load_corpus
from gpt2kimi.experiments.hybrid_train import LM_CONFIG, RATIOS, lm_model
from gpt2kimi.experiments.sweep import run_device
from gpt2kimi.gpt2 import MLP, GPT2Config
from gpt2kimi.kimi_linear import KimiHybrid
from gpt2kimi.moe import AuxLossWrapper
from gpt2kimi.train import TrainConfig, train

LM_MODELS: tuple[str, ...] = (
    "gpt2", "gpt2_conv", "3:1", "3:1_dense", *(r for r in RATIOS if r != "3:1")
)
CONV_TAPS = LM_CONFIG.kda.conv_size  # 4, the KDA's short convolution
# Batches of 8 (not chapter 8's 16) keep one run of the slowest models (3:1, all-KDA) near four
# minutes on one CPU thread; the whole validation split is scored every 125 steps (12 times, the
# last after step 1500).
LM_ABLATION_TRAINING = dict(
    steps=1500, batch_size=8, block_size=64, lr=3e-3, warmup_steps=50, eval_interval=125,
    val_batch_size=64, bias_gamma=1e-3,
)


def dense_hybrid_config(config: HybridConfig = LM_CONFIG) -> HybridConfig:
    """``config`` with a dense SwiGLU of the MoE's active width in every layer."""
    moe = config.moe
    hidden = (moe.top_k + moe.n_shared_experts) * moe.expert_hidden
    return config.replace(ffns=("dense",) * config.n_layer, dense_hidden=hidden)


def gpt2_conv_model(width: int, n_layer: int = 4, block_size: int = 64,
                    taps: int = CONV_TAPS) -> LanguageModel:
    """GPT-2 (as :class:`~gpt2kimi.attention.GPT2WithCache` builds it on the backbone) with a
    short causal convolution of ``taps`` in front of every attention; width ``width``, 2 heads."""
    gpt2 = GPT2Config(vocab_size=256, block_size=block_size, n_layer=n_layer, n_head=2,
                      n_embd=width)
    backbone = BackboneConfig(
        vocab_size=gpt2.vocab_size, d_model=width, n_layer=n_layer, n_head=gpt2.n_head,
        block_size=block_size, norm="layernorm", norm_eps=gpt2.layer_norm_eps, short_conv=taps,
    )
    return LanguageModel(backbone, partial(SoftmaxAttention, dropout=gpt2.dropout),
                         lambda d_model: MLP(gpt2))


def gpt2_conv_width(active_params: int, n_layer: int = 4, block_size: int = 64,
                    taps: int = CONV_TAPS) -> int:
    """The width (a multiple of the 2 heads) whose ``gpt2_conv`` has parameters closest to
    ``active_params``: GPT-2's count plus ``taps`` weights per channel per layer."""
    def count(width: int) -> int:
        gpt2 = GPT2Config(vocab_size=256, block_size=block_size, n_layer=n_layer, n_head=2,
                          n_embd=width)
        return gpt2_param_count(gpt2) + n_layer * taps * width

    return min(range(8, 512, 2), key=lambda w: abs(count(w) - active_params))


def build_lm(name: str, block_size: int = 64) -> tuple[nn.Module, int]:
    """The model ``name`` of :data:`LM_MODELS` and its active parameters (the embedding row
    included, as :func:`gpt2kimi.experiments.hybrid_train.run_lm` counts them)."""
    if name not in LM_MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {list(LM_MODELS)}")
    hybrid_active = param_count(LM_CONFIG).active_with_embedding
    if name in ("gpt2", "gpt2_conv"):
        if name == "gpt2":
            model = lm_model("gpt2", block_size=block_size)
        else:
            model = gpt2_conv_model(gpt2_conv_width(hybrid_active, LM_CONFIG.n_layer, block_size),
                                    LM_CONFIG.n_layer, block_size)
        return model, sum(p.numel() for p in model.parameters())  # dense: every one is active
    config = dense_hybrid_config() if name == "3:1_dense" else LM_CONFIG.replace(
        mixers=RATIOS[name])
    return KimiHybrid(config), param_count(config).active_with_embedding


def run_lm_fixed(name: str, seed: int, settings: dict,
                 device: torch.device | str | None = None) -> dict:
    """Train model ``name`` with ``seed`` and ``settings`` (:data:`LM_ABLATION_TRAINING`'s keys)
    on ``device`` (None: :func:`~gpt2kimi.experiments.sweep.run_device`); score it on the whole
    validation split at every ``eval_interval`` steps and after the last.

    Returns ``model, seed, params, active_params, val_steps, val_loss (nats per byte),
    final_val_loss, seconds`` (training and its evaluations) ``, tokens_per_s`` (training
    tokens per second of that time) ``, device``.
    """
    s = settings
    device = run_device() if device is None else torch.device(device)
    torch.manual_seed(seed)
    model, active = build_lm(name, s["block_size"])
    total = sum(p.numel() for p in model.parameters())
    has_moe = isinstance(model, KimiHybrid) and "moe" in model.hybrid_config.ffns
    trained = AuxLossWrapper(model, bias_gamma=s["bias_gamma"]) if has_moe else model
    trained.to(device)
    cfg = TrainConfig(steps=s["steps"], lr=s["lr"], warmup_steps=min(s["warmup_steps"], s["steps"]),
                      eval_interval=s["eval_interval"], seed=seed)
    corpus = load_corpus()
    batches = lm_batches(corpus, s["batch_size"], s["block_size"], seed=seed)
    val_set = fixed_val_batches(corpus, s["block_size"], s["val_batch_size"])
    start = time.perf_counter()
    history = train(trained, batches, cfg, val_set=val_set)
    seconds = time.perf_counter() - start
    return {
        "model": name, "seed": seed, "params": total, "active_params": active,
        "val_steps": history.val_steps,
        "val_loss": [round(v, 4) for v in history.val_loss],
        "final_val_loss": round(history.val_loss[-1], 4),
        "seconds": round(seconds, 1),
        "tokens_per_s": round(s["steps"] * s["batch_size"] * s["block_size"] / seconds),
        "device": str(device),
    }
