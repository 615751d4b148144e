"""The registry: one table from names to token mixers (and feed-forwards), and models by name.

Part of :mod:`gpt2kimi.experiments`, the only package allowed to import every chapter (the
chapters and the support modules never import it). Adding a chapter's mixer is one line in
:data:`MIXERS`; every constructor is called as ``constructor(d_model, n_head)`` and returns a
module mapping ``[B, T, C] → [B, T, C]``.

``build_model("linear", config)`` builds the shared :class:`~gpt2kimi.backbone.LanguageModel`
with that mixer in every layer; ``build_model(["kda", "kda", "kda", "mla"], config)`` builds a
hybrid. :func:`mqar_model_config` is the backbone of the recall experiments
(:func:`gpt2kimi.experiments.mqar.run_mqar` trains such models on MQAR, the ``mqar`` task of
:mod:`gpt2kimi.experiments.tasks` that ``python -m gpt2kimi.experiments run NAME`` records).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from functools import partial

from gpt2kimi.attention import SoftmaxAttention
from gpt2kimi.backbone import BackboneConfig, FFNFactory, LanguageModel, MixerFactory, SwiGLU
from gpt2kimi.deltanet import DeltaNet
from gpt2kimi.experiments.ablations import (
    AdditiveDeltaNet,
    GatedLinearAttention,
    KDAWithoutForgetting,
)
from gpt2kimi.experiments.sweep import run_device
from gpt2kimi.gated_deltanet import GatedDeltaNet
from gpt2kimi.kda import KimiDeltaAttention
from gpt2kimi.linear_attention import LinearAttention
from gpt2kimi.mla import mla_mixer
from gpt2kimi.moe import moe_ffn

MIXERS: dict[str, MixerFactory] = {
    # chapter 2: the exact memory, a KV cache that grows with every token
    "softmax": SoftmaxAttention,
    # chapter 3: a fixed [K, V] memory per head, S += k vᵀ
    "linear": partial(LinearAttention, feature_map="identity"),
    # chapter 3: Katharopoulos et al.'s positive feature map elu(x)+1 with its normaliser
    "linear_elu": partial(LinearAttention, feature_map="elu1", normalize=True),
    # chapter 4: the delta rule
    "deltanet": DeltaNet,
    # chapter 4's ablation: DeltaNet's layer with linear attention's additive update
    "deltanet_additive": AdditiveDeltaNet,
    # chapter 5: forgetting without the delta rule, S ← α S + k vᵀ (Mamba-2's update)
    "gated_linear": GatedLinearAttention,
    # chapter 5: forgetting, one gate per head
    "gated_deltanet": GatedDeltaNet,
    # chapter 5: the same with a sigmoid output gate instead of swish (a small-budget ablation)
    "gated_deltanet_sigmoid": partial(GatedDeltaNet, output_gate="sigmoid"),
    # chapter 5: forgetting, one gate per key channel (Kimi Delta Attention)
    "kda": KimiDeltaAttention,
    # chapter 5's ablation: KDA with its forget gate off (every decay exactly 1)
    "kda_no_forget": KDAWithoutForgetting,
    # chapter 6: exact memory, compressed: Multi-head Latent Attention (NoPE, as in Kimi Linear)
    "mla": mla_mixer,
}

FFNS: dict[str, FFNFactory] = {
    "swiglu": SwiGLU,
    # chapter 7: 8 SwiGLU experts of width d, top-2, one shared expert
    "moe": moe_ffn,
}


def mixer_factory(name: str, **kwargs) -> MixerFactory:
    """The constructor registered as ``name``, with keyword arguments bound (``chunk_size=...``)."""
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; expected one of {sorted(MIXERS)}")
    return partial(MIXERS[name], **kwargs) if kwargs else MIXERS[name]


def ffn_factory(ffn: str | FFNFactory | None) -> FFNFactory | None:
    """A feed-forward constructor from a name in :data:`FFNS`, a constructor, or None (SwiGLU)."""
    if ffn is None or callable(ffn):
        return ffn
    if ffn not in FFNS:
        raise ValueError(f"unknown feed-forward {ffn!r}; expected one of {sorted(FFNS)}")
    return FFNS[ffn]


def build_model(
    mixer: str | Sequence[str],
    config: BackboneConfig,
    ffn: str | FFNFactory | Sequence[FFNFactory] | None = None,
    per_mixer: dict[str, dict] | None = None,
    **mixer_kwargs,
) -> LanguageModel:
    """The shared backbone with the named mixer in every layer (or one name per layer).

    ``mixer_kwargs`` go to every mixer's constructor, ``per_mixer[name]`` to that mixer's only
    (``{"kda": {"head_dim": 4}}`` shrinks the KDA layers of a hybrid and leaves its MLA layer
    as it is); ``ffn`` is a name, a constructor, a list of
    constructors (one per layer), or None for the default SwiGLU. The model is on
    :func:`~gpt2kimi.experiments.sweep.run_device` (the CPU unless ``$GPT2KIMI_DEVICE`` says).
    """
    per_mixer = per_mixer or {}
    names = [mixer] if isinstance(mixer, str) else list(mixer)
    unused = sorted(set(per_mixer) - set(names))
    if unused:
        raise ValueError(f"per_mixer names {unused}, which the model {names} does not use")

    def factory(name: str) -> MixerFactory:
        return mixer_factory(name, **mixer_kwargs, **per_mixer.get(name, {}))

    if isinstance(mixer, str):
        mixers: MixerFactory | list[MixerFactory] = factory(mixer)
    else:
        if len(names) != config.n_layer:
            raise ValueError(f"got {len(names)} mixer names for n_layer={config.n_layer} layers")
        mixers = [factory(name) for name in names]
    per_layer_ffns = isinstance(ffn, Sequence) and not isinstance(ffn, str)
    model = LanguageModel(config, mixers, ffn if per_layer_ffns else ffn_factory(ffn))
    return model.to(run_device())


# ----------------------------------------------------------------------------------------------
# the backbone of the recall experiments

# The chapter-3 setting: small enough for two CPU cores, large enough for memory to matter.
MQAR_VOCAB = 64
MQAR_SEQ_LEN = 32
MQAR_D_MODEL = 64
MQAR_N_LAYER = 2
MQAR_N_HEAD = 2
MQAR_SHORT_CONV = 2
# what a results file records of the backbone
RECORDED_BACKBONE = ("d_model", "n_layer", "n_head", "short_conv")
BACKBONE_FIELDS = {f.name for f in fields(BackboneConfig)}


def mqar_model_config(vocab_size: int = MQAR_VOCAB, **backbone) -> BackboneConfig:
    """The backbone used for MQAR: no positions (NoPE), a short convolution before each mixer.

    ``backbone`` overrides its other fields (``d_model``, ``n_layer``, ``n_head``, ...).
    """
    defaults = dict(
        d_model=MQAR_D_MODEL, n_layer=MQAR_N_LAYER, n_head=MQAR_N_HEAD, short_conv=MQAR_SHORT_CONV
    )
    return BackboneConfig(vocab_size=vocab_size, **{**defaults, **backbone})
