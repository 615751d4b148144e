"""The learned forget gates of a trained model, read as half-lives.

A log-decay ``g`` (<= 0) fades the memory by ``e^g`` per token, so a gate whose mean log-decay is
``ḡ`` halves what the memory holds every ``ln 2 / (−ḡ)`` tokens: its half-life. Gated DeltaNet
and gated linear attention learn one gate per head, KDA one per head and key channel.
:func:`gate_half_lives` runs a model on a batch and returns the half-life of every gate of every
layer, averaged over the batch's tokens.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from gpt2kimi.gated_deltanet import GatedDeltaNet, log_decay
from gpt2kimi.kda import ForgetGate

# a gate that (almost) never decays: its half-life is reported as this many tokens
MAX_HALF_LIFE = 1e6


def half_life(mean_log_decay: Tensor) -> Tensor:
    """``ln 2 / (−ḡ)`` tokens, capped at :data:`MAX_HALF_LIFE` (a gate that never forgets)."""
    rate = (-mean_log_decay).clamp_min(math.log(2) / MAX_HALF_LIFE)
    return math.log(2) / rate


@torch.no_grad()
def gate_half_lives(model: nn.Module, x: Tensor) -> list[float]:
    """The half-life in tokens of every learned forget gate of ``model`` on the batch x [B, T].

    Gated DeltaNet layers (and their subclasses) give one value per head, KDA's forget gates one
    per head and key channel; in module order, rounded to 0.01 token. Empty for a model with no
    forget gate. The mean log-decay is taken over the batch's tokens.
    """
    means: list[Tensor] = []

    def per_head(module: GatedDeltaNet, _inputs, a: Tensor) -> None:  # a_proj's output [B, T, H]
        means.append(log_decay(a, module.A_log, module.dt_bias).mean(dim=(0, 1)).flatten())

    def per_channel(_module: ForgetGate, _inputs, g: Tensor) -> None:  # g [B, T, H, K]
        means.append(g.mean(dim=(0, 1)).flatten())

    hooks = []
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            hook = module.a_proj.register_forward_hook(
                lambda _m, i, o, layer=module: per_head(layer, i, o)
            )
            hooks.append(hook)
        elif isinstance(module, ForgetGate):
            hooks.append(module.register_forward_hook(per_channel))
    was_training = model.training
    try:
        model.eval()
        model(x.to(next(model.parameters()).device))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    if not means:
        return []
    return [round(float(h), 2) for h in half_life(torch.cat(means).double().cpu())]
