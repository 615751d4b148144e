"""Chapter 8: Kimi Linear, a hybrid of fast memory, exact memory and sparse experts.

Kimi Linear (Kimi Team 2025) puts the book's pieces into one stack of pre-norm blocks:

- about three in four token mixers are **Kimi Delta Attention** (chapter 5): a fixed
  ``heads × d_k × d_v`` memory per layer, whatever the context length;
- the others are **Multi-head Latent Attention** without positions (chapter 6): exact recall of
  every earlier token from a small latent cache that grows with the context;
- every feed-forward but the first is a **Mixture of Experts** (chapter 7); the first is dense.

:class:`~gpt2kimi.configs.HybridConfig` names each layer's mixer (``"kda"`` / ``"mla"``) and
feed-forward (``"dense"`` / ``"moe"``), nests their configs and reads both forms of a Kimi Linear
configuration (``HybridConfig.from_hf``); :func:`gpt2kimi.accounting.param_count` counts the
model's parameters from it. :class:`KimiHybrid` is chapter 3's
:class:`~gpt2kimi.backbone.LanguageModel` with those layers and an untied head, so it decodes
with the backbone's cache and :func:`gpt2kimi.kv_cache.generate`. :meth:`KimiHybrid.from_hf` loads a
``transformers`` ``KimiLinearForCausalLM`` state dict: the layers carry ``transformers``' own
parameter names, so only the prefixes in :data:`HF_PREFIXES` change.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from gpt2kimi.backbone import LanguageModel, SwiGLU
from gpt2kimi.configs import HybridConfig
from gpt2kimi.gpt2 import CheckpointError, checkpoint_problems
from gpt2kimi.kda import KimiDeltaAttention
from gpt2kimi.mla import MultiHeadLatentAttention
from gpt2kimi.moe import MoE

# ----------------------------------------------------------------------------------------------
# the model


def make_mixer(config: HybridConfig, kind: str) -> nn.Module:
    """A ``"kda"`` or ``"mla"`` token mixer with the config's shapes (Kimi Linear's: chapter 5's
    KDA with heads × head_dim independent of d_model, chapter 6's MLA without positions)."""
    if kind == "kda":
        return KimiDeltaAttention.from_config(config.d_model, config.kda)
    return MultiHeadLatentAttention(config.mla)  # absorbed decoding by itself


def make_ffn(config: HybridConfig, kind: str) -> nn.Module:
    """A ``"dense"`` SwiGLU or ``"moe"`` feed-forward with the config's shapes."""
    if kind == "dense":
        return SwiGLU(config.d_model, config.dense_hidden)
    return MoE(config.moe)


class KimiHybrid(LanguageModel):
    """Kimi Linear's architecture: ``model(idx) → logits [B, T, vocab]``.

    The backbone's pre-norm blocks (``x + mixer(RMSNorm(x))``, ``x + ffn(RMSNorm(x))``), each
    with its layer's mixer (KDA or MLA) and feed-forward (dense SwiGLU or MoE), no positional
    embedding, a final RMSNorm and an **untied** head. ``model(idx, targets)`` also returns the
    loss; ``model(idx, cache=model.new_cache(B, max_len))`` decodes
    (:func:`~gpt2kimi.kv_cache.generate`).
    """

    def __init__(self, config: HybridConfig) -> None:
        self.hybrid_config = config
        super().__init__(
            config.backbone_config(),
            [lambda d, h, kind=kind: make_mixer(config, kind) for kind in config.mixers],
            [lambda d, kind=kind: make_ffn(config, kind) for kind in config.ffns],
        )
        # untie the head: Kimi Linear reads tokens in and out with two different matrices
        self.lm_head.weight = nn.Parameter(torch.empty_like(self.embed.weight))
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.02)

    @classmethod
    def from_hf(
        cls, state_dict: Mapping[str, Tensor], config: Mapping[str, Any] | Any
    ) -> KimiHybrid:
        """A model with ``transformers``' ``KimiLinearForCausalLM`` weights.

        ``config`` is either form :meth:`HybridConfig.from_hf` reads (or a ``HybridConfig``).
        Raises :class:`~gpt2kimi.gpt2.CheckpointError` listing every missing, unexpected and
        mis-shaped key.
        """
        if not isinstance(config, HybridConfig):
            config = HybridConfig.from_hf(config)
        first = next(iter(state_dict.values()), None)
        dtype = first.dtype if first is not None and first.is_floating_point() else None
        model = cls(config)
        if dtype is not None:
            model = model.to(dtype)
        model.load_state_dict(convert_hf_state_dict(state_dict, model))
        return model.eval()


# ----------------------------------------------------------------------------------------------
# loading transformers' checkpoints

# transformers' prefix → this model's ({i}: the layer number); the layers themselves carry
# transformers' parameter names, so nothing else changes.
HF_PREFIXES: dict[str, str] = {
    "model.embed_tokens.": "embed.",
    "model.norm.": "norm_f.",
    "lm_head.": "lm_head.",
    "model.layers.{i}.input_layernorm.": "blocks.{i}.norm_1.",
    "model.layers.{i}.self_attn.": "blocks.{i}.mixer.",
    "model.layers.{i}.post_attention_layernorm.": "blocks.{i}.norm_2.",
    "model.layers.{i}.mlp.": "blocks.{i}.ffn.",
}


def rename(key: str, table: dict[str, str]) -> str | None:
    """``key`` with the first matching prefix of ``table`` replaced, or None if none matches."""
    for source, target in table.items():
        pattern = "^" + re.escape(source).replace(re.escape("{i}"), r"(?P<i>\d+)")
        match = re.match(pattern, key)
        if match:
            return target.format(**match.groupdict()) + key[match.end() :]
    return None


def hf_to_local(key: str) -> str | None:
    """This model's name for a ``transformers`` key, or None if no prefix matches."""
    return rename(key, HF_PREFIXES)


def to_hf_state_dict(model: KimiHybrid) -> dict[str, Tensor]:
    """``model``'s weights under ``transformers``' names (the prefix table read backwards)."""
    backwards = {local: hf for hf, local in HF_PREFIXES.items()}
    return {rename(key, backwards): tensor for key, tensor in model.state_dict().items()}


def convert_hf_state_dict(
    state_dict: Mapping[str, Tensor], model: KimiHybrid
) -> dict[str, Tensor]:
    """Rename a ``KimiLinearForCausalLM`` state dict to ``model``'s keys, checking everything.

    Raises :class:`~gpt2kimi.gpt2.CheckpointError` listing missing keys, unexpected keys (with
    what they would have been called here) and mismatched shapes, all at once.
    """
    expected = model.state_dict()
    converted: dict[str, Tensor] = {}
    unexpected: list[str] = []
    for key, tensor in state_dict.items():
        local = hf_to_local(key)
        if local is None or local not in expected:
            unexpected.append(key if local is None or local == key else f"{key} (as {local})")
            continue
        converted[local] = tensor
    backwards = {local: hf for hf, local in HF_PREFIXES.items()}
    names = {k: rename(k, backwards) or k for k in expected}  # problems named as in the checkpoint
    report = checkpoint_problems(expected, converted, unexpected, names)
    if report:
        raise CheckpointError("cannot load Kimi Linear checkpoint; " + report)
    return converted
