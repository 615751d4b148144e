"""Accounting: the KV cache (and recurrent state) of real models, computed from their configs.

One table, :data:`MODELS`, holds the configurations the book compares, each with its source.
The formulas:

- multi-head / grouped / multi-query attention caches a key and a value per layer and key/value
  head: ``2 · layers · n_kv_heads · head_dim · bytes_per_element`` bytes per token;
- Multi-head Latent Attention (MLA, DeepSeek-V2) caches one compressed vector ``c_kv`` and one
  shared RoPE key per layer: ``layers · (kv_lora_rank + rope_dim) · bytes_per_element``;
- a linear-attention layer (Kimi Delta Attention) keeps a fixed ``heads × d_k × d_v`` state per
  sequence, whatever the context length.

Only layers with softmax attention (or MLA) have a KV cache; in a hybrid the others carry the
fixed state. Unknown values are ``None``; a formula that needs one raises a clear error.

Parameters, total and active (chapter 7), are counted from the layers' configs in
:mod:`gpt2kimi.configs`: :func:`param_count` of a :class:`~gpt2kimi.configs.HybridConfig` (the
released models in :data:`RELEASED_CONFIGS`), one formula per layer type. :class:`ModelConfig`,
the type of :data:`MODELS`, is built from a GPT-2 config (:meth:`ModelConfig.from_gpt2`) or a
hybrid's (:meth:`ModelConfig.from_hybrid`).

GPT-2's sizes (:data:`PRESETS`) and its parameter formula (:func:`gpt2_param_count`) live here
too: chapter 1's :mod:`gpt2kimi.gpt2` reads them. A support module: it imports no chapter, and
takes the chapters' configs by their fields.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Protocol

from gpt2kimi.configs import HybridConfig, KDAConfig, MLAConfig, MoEConfig

# GPT-2's four released sizes (Radford et al. 2019), read by chapter 1's GPT2Config.from_name.
PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}

# what every size shares: the BPE vocabulary and 1024 learned positions (GPT2Config's defaults)
GPT2_VOCAB_SIZE, GPT2_BLOCK_SIZE = 50257, 1024


class GPT2Shape(Protocol):
    """What the GPT-2 formulas read of a config: a :class:`gpt2kimi.gpt2.GPT2Config` has it all
    (this support module takes the config by its fields and imports no chapter)."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int


def gpt2_param_count(config: GPT2Shape) -> int:
    """GPT-2's parameters: ``vocab_size·d + block_size·d + L (12 d² + 13 d) + 2 d`` (head tied).

    Per layer: attention ``4 d² + 4 d`` (q, k, v and output projections with biases), MLP
    ``8 d² + 5 d`` (d → 4d → d with biases), two LayerNorms ``4 d``.
    """
    d, L = config.n_embd, config.n_layer
    return config.vocab_size * d + config.block_size * d + L * (12 * d * d + 13 * d) + 2 * d


ATTENTION_KINDS = ("mha", "gqa", "mqa", "mla")


@dataclass(frozen=True)
class ModelConfig:
    """What the cache of a model depends on, plus its size, and where the numbers come from."""

    name: str
    n_layer: int  # all layers (attention + linear)
    d_model: int
    attention: str  # kind of the KV-cached layers: "mha" | "gqa" | "mqa" | "mla"
    n_head: int | None = None  # query heads of the attention layers
    n_kv_heads: int | None = None  # key/value heads (mha/gqa/mqa); MLA caches no per-head k, v
    head_dim: int | None = None  # per-head key/value width (MLA: the non-RoPE part, d_nope)
    kv_lora_rank: int | None = None  # MLA: width of the cached latent c_kv
    rope_dim: int | None = None  # MLA: width of the one decoupled (RoPE) key shared by all heads
    n_attn_layers: int | None = None  # layers with a KV cache; None = all n_layer
    n_linear_layers: int = 0  # layers with a fixed recurrent state (KDA) instead of a cache
    linear_heads: int | None = None  # heads of each linear layer
    linear_key_dim: int | None = None  # d_k of each head's state
    linear_value_dim: int | None = None  # d_v of each head's state
    # kernel of the short convolution on q, k, v before each linear layer: the layer keeps its
    # last linear_conv_size − 1 inputs of each as part of the fixed state
    linear_conv_size: int | None = None
    n_experts: int | None = None  # routed experts (MoE), None = dense
    n_active_experts: int | None = None  # routed experts per token
    n_shared_experts: int | None = None
    total_params: int | None = None
    active_params: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(
                f"{self.name}: attention must be one of {ATTENTION_KINDS}, got {self.attention!r}"
            )
        if self.n_attn_layers is not None and self.n_attn_layers + self.n_linear_layers != (
            self.n_layer
        ):
            raise ValueError(
                f"{self.name}: {self.n_attn_layers} attention + {self.n_linear_layers} linear "
                f"layers != n_layer={self.n_layer}"
            )

    @property
    def cached_layers(self) -> int:
        """Number of layers that keep a KV cache."""
        return (
            self.n_layer - self.n_linear_layers
            if self.n_attn_layers is None
            else (self.n_attn_layers)
        )

    @property
    def is_hybrid(self) -> bool:
        return self.n_linear_layers > 0

    @property
    def kind(self) -> str:
        """A short description such as ``"GQA 32q/8kv"`` or ``"20 KDA + 7 MLA"``."""
        if self.attention == "mla":
            heads = f" {self.n_head} heads" if self.n_head else ""
            core = f"{self.cached_layers} MLA" if self.is_hybrid else f"MLA{heads}"
        else:
            heads = f"{self.n_head}q/{self.n_kv_heads}kv" if self.n_head else "?"
            core = f"{self.attention.upper()} {heads}"
        return f"{self.n_linear_layers} KDA + {core}" if self.is_hybrid else core

    @classmethod
    def from_gpt2(
        cls, name: str, config: GPT2Shape, n_kv_heads: int | None = None, source: str = ""
    ) -> ModelConfig:
        """The config of a GPT-2 (``n_kv_heads`` < ``n_head`` for its GQA/MQA variants)."""
        kv = config.n_head if n_kv_heads is None else n_kv_heads
        kind = "mha" if kv == config.n_head else ("mqa" if kv == 1 else "gqa")
        params = gpt2_param_count(config) if kv == config.n_head else None
        return cls(
            name=name,
            n_layer=config.n_layer,
            d_model=config.n_embd,
            attention=kind,
            n_head=config.n_head,
            n_kv_heads=kv,
            head_dim=config.n_embd // config.n_head,
            total_params=params,
            active_params=params,
            source=source,
        )


    @classmethod
    def from_hybrid(cls, name: str, config: HybridConfig, **kwargs: Any) -> ModelConfig:
        """The config of a hybrid (chapter 8): its MLA layers cache, its KDA layers keep a fixed
        ``heads × head_dim × head_dim`` state. ``kwargs``: the other fields (``source``, ...)."""
        mla, kda, moe = config.mla, config.kda, config.moe
        return cls(
            name=name,
            n_layer=config.n_layer,
            d_model=config.d_model,
            attention="mla",
            n_head=mla.n_head if mla else None,
            head_dim=mla.v_head_dim if mla else None,
            kv_lora_rank=mla.kv_lora_rank if mla else 0,  # no MLA layer: nothing cached
            rope_dim=mla.qk_rope_head_dim if mla else 0,
            n_attn_layers=config.n_mla,
            n_linear_layers=config.n_kda,
            linear_heads=kda.n_head if config.n_kda else None,
            linear_key_dim=kda.head_dim if config.n_kda else None,
            linear_value_dim=kda.head_dim if config.n_kda else None,
            linear_conv_size=kda.conv_size if config.n_kda else None,
            n_experts=moe.n_experts if "moe" in config.ffns else None,
            n_active_experts=moe.top_k if "moe" in config.ffns else None,
            n_shared_experts=moe.n_shared_experts if "moe" in config.ffns else None,
            **kwargs,
        )


def _require(cfg: ModelConfig, *fields: str) -> None:
    missing = [f for f in fields if getattr(cfg, f) is None]
    if missing:
        raise ValueError(
            f"{cfg.name}: {', '.join(missing)} unknown (not given by the sources), so its cache "
            "size cannot be computed"
        )


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_element: int = 2) -> int:
    """KV-cache bytes one token of one sequence adds, over all cached layers (default bf16)."""
    if cfg.attention == "mla":
        _require(cfg, "kv_lora_rank", "rope_dim")
        return cfg.cached_layers * (cfg.kv_lora_rank + cfg.rope_dim) * bytes_per_element
    _require(cfg, "n_kv_heads", "head_dim")
    return 2 * cfg.cached_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_element


def kv_cache_bytes(
    cfg: ModelConfig, context_len: int, batch: int = 1, bytes_per_element: int = 2
) -> int:
    """KV-cache bytes for ``batch`` sequences of ``context_len`` tokens (no recurrent state)."""
    if context_len < 0 or batch < 0:
        raise ValueError(f"context_len and batch must be >= 0, got {context_len}, {batch}")
    return batch * context_len * kv_cache_bytes_per_token(cfg, bytes_per_element)


def recurrent_state_bytes(cfg: ModelConfig, batch: int = 1, bytes_per_element: int = 4) -> int:
    """Bytes of the linear layers' fixed state per sequence, whatever the context: per layer
    and head the memory ``d_k · d_v`` and the short convolution's last ``conv_size − 1``
    inputs of q, k and v (``2 d_k + d_v`` numbers each), the count
    :meth:`gpt2kimi.configs.HybridConfig.state_bytes` makes from a built model's config.

    fp32 by default, as implementations keep this state. 0 for models without linear layers.
    """
    if not cfg.is_hybrid:
        return 0
    _require(cfg, "linear_heads", "linear_key_dim", "linear_value_dim", "linear_conv_size")
    d_k, d_v = cfg.linear_key_dim, cfg.linear_value_dim
    per_head = d_k * d_v + (cfg.linear_conv_size - 1) * (2 * d_k + d_v)
    return batch * cfg.n_linear_layers * cfg.linear_heads * per_head * bytes_per_element


def attention_param_count(d_model: int, n_head: int, n_kv_heads: int, bias: bool = True) -> int:
    """Parameters of :class:`gpt2kimi.attention.SoftmaxAttention`.

    q and the output projection are ``d × d`` each; k and v are ``d × (n_kv_heads · head_dim)``
    each, so fewer key/value heads also mean fewer parameters.
    """
    kv_dim = n_kv_heads * (d_model // n_head)
    weights = d_model * (d_model + 2 * kv_dim) + d_model * d_model
    biases = (d_model + 2 * kv_dim) + d_model if bias else 0
    return weights + biases


def format_bytes(n: float) -> str:
    """Binary units, three significant figures (whole from 1000 up): ``36 KiB``, ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 1000 else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------------------------
# Multi-head Latent Attention (chapter 6): the latent cache and the per-head cache it replaces


def mla_latent_bytes_per_token(cfg: ModelConfig, bytes_per_element: int = 2) -> int:
    """MLA's cache per token: ``layers · (kv_lora_rank + rope_dim) · e`` (one latent ``c_kv`` and
    one shared RoPE key per layer; no heads, no factor 2)."""
    if cfg.attention != "mla":
        raise ValueError(f"{cfg.name} has {cfg.attention.upper()} attention, not MLA")
    return kv_cache_bytes_per_token(cfg, bytes_per_element)


def mla_expanded_bytes_per_token(cfg: ModelConfig, bytes_per_element: int = 2) -> int:
    """What the same MLA layers would cache as per-head keys and values (the naive decode path):
    ``layers · n_head · (d_nope + rope_dim + d_v) · e``, with ``d_nope = d_v = head_dim`` (as in
    DeepSeek-V3 and Kimi Linear: each key is its own nope part plus the shared rope key)."""
    if cfg.attention != "mla":
        raise ValueError(f"{cfg.name} has {cfg.attention.upper()} attention, not MLA")
    _require(cfg, "n_head", "head_dim", "rope_dim")
    per_head = cfg.head_dim + cfg.rope_dim + cfg.head_dim
    return cfg.cached_layers * cfg.n_head * per_head * bytes_per_element


_GPT2_NAMES = {
    "gpt2": "GPT-2 small",
    "gpt2-medium": "GPT-2 medium",
    "gpt2-large": "GPT-2 large",
    "gpt2-xl": "GPT-2 XL",
}
_GPT2_SRC = "Radford et al. 2019; parameters from accounting.gpt2_param_count"

# The one table of real models. Values are those of the book's reference sheet; None = unknown.
MODELS: dict[str, ModelConfig] = {
    **{
        name: ModelConfig.from_gpt2(
            _GPT2_NAMES[name],
            SimpleNamespace(vocab_size=GPT2_VOCAB_SIZE, block_size=GPT2_BLOCK_SIZE, **preset),
            source=_GPT2_SRC,
        )
        for name, preset in PRESETS.items()
    },
    "llama-3-8b": ModelConfig(
        name="Llama-3-8B",
        n_layer=32,
        d_model=4096,
        attention="gqa",
        n_head=32,
        n_kv_heads=8,
        head_dim=128,
        total_params=8_000_000_000,  # "8B" as rounded in the sheet
        active_params=8_000_000_000,
        source="The Llama 3 Herd of Models (Meta 2024), via the reference sheet",
    ),
    "deepseek-v3": ModelConfig(
        name="DeepSeek-V3",
        n_layer=61,  # 3 of them with a dense feed-forward
        d_model=7168,
        attention="mla",
        n_head=128,
        head_dim=128,  # d_nope of each head's key (and width of its value)
        kv_lora_rank=512,
        rope_dim=64,
        n_experts=256,
        n_active_experts=8,
        n_shared_experts=1,
        total_params=671_000_000_000,
        active_params=37_000_000_000,
        source="DeepSeek-V3 (DeepSeek-AI 2024), via the reference sheet",
    ),
    "kimi-k2": ModelConfig(
        name="Kimi K2",
        n_layer=61,  # 1 of them with a dense feed-forward
        d_model=7168,
        attention="mla",
        n_head=64,
        kv_lora_rank=512,  # the sheet gives 576 cached numbers per layer, as DeepSeek-V3's MLA
        rope_dim=64,
        n_experts=384,
        n_active_experts=8,
        n_shared_experts=1,
        total_params=1_040_000_000_000,
        active_params=32_000_000_000,
        source="Kimi K2 (Kimi Team 2025), via the reference sheet",
    ),
    "kimi-linear-48b-a3b": ModelConfig(
        name="Kimi-Linear-48B-A3B",
        n_layer=27,
        d_model=2304,
        attention="mla",
        n_head=32,  # MLA heads
        head_dim=128,  # d_nope of each head's key (and width of its value)
        kv_lora_rank=512,
        # NoPE: no rotary embedding is applied, but the sheet's 576 cached numbers per MLA layer
        # include a 64-wide decoupled key, as in DeepSeek-V3.
        rope_dim=64,
        n_attn_layers=7,  # MLA at layers 4, 8, 12, 16, 20, 24, 27
        n_linear_layers=20,  # Kimi Delta Attention
        linear_heads=32,
        linear_key_dim=128,
        linear_value_dim=128,
        linear_conv_size=4,
        n_experts=256,
        n_active_experts=8,
        n_shared_experts=1,
        total_params=48_000_000_000,
        active_params=3_000_000_000,
        source="Kimi Linear (Kimi Team 2025) and its released config.json, via the reference sheet",
    ),
    "kimi-k3": ModelConfig(
        name="Kimi K3",
        n_layer=93,
        d_model=7168,
        attention="mla",
        # MLA widths and KDA head sizes are not in the sources: left unknown (None), so byte
        # formulas raise for this model rather than guess.
        n_attn_layers=24,
        n_linear_layers=69,
        n_experts=896,
        n_active_experts=16,
        total_params=2_800_000_000_000,
        active_params=104_000_000_000,
        source="Kimi K3 (Kimi Team 2026) and its model card, via the reference sheet",
    ),
}


# ----------------------------------------------------------------------------------------------
# Hybrids (chapter 8): what replacing attention layers by linear ones saves


def all_attention(cfg: ModelConfig) -> ModelConfig:
    """The same model with an attention layer (of its kind) in every layer: a hybrid's
    full-attention baseline, e.g. Kimi Linear with MLA in all 27 layers."""
    return replace(
        cfg,
        name=f"{cfg.name}, all {cfg.attention.upper()}",
        n_attn_layers=cfg.n_layer,
        n_linear_layers=0,
        linear_heads=None,
        linear_key_dim=None,
        linear_value_dim=None,
        linear_conv_size=None,
    )


def kv_cache_saving(cfg: ModelConfig) -> float:
    """The share of the KV cache a hybrid saves against :func:`all_attention`:
    ``1 − attention layers / layers`` (3 linear layers per attention layer: 75%)."""
    return 1 - kv_cache_bytes_per_token(cfg) / kv_cache_bytes_per_token(all_attention(cfg))


def decode_memory_bytes(
    cfg: ModelConfig,
    context_len: int,
    batch: int = 1,
    cache_bytes_per_element: int = 2,
    state_bytes_per_element: int = 4,
) -> int:
    """What decoding keeps for ``batch`` sequences of ``context_len`` tokens: the KV cache (bf16
    by default) plus the linear layers' fixed states (fp32 by default, as implementations keep
    them, see :func:`recurrent_state_bytes`)."""
    return kv_cache_bytes(cfg, context_len, batch, cache_bytes_per_element) + (
        recurrent_state_bytes(cfg, batch, state_bytes_per_element)
    )


# ----------------------------------------------------------------------------------------------
# Parameters of Mixture-of-Experts models: total and active (chapter 7)
#
# A token passes through the attention of every layer, the dense feed-forward layers, and in each
# MoE layer the router, its k chosen experts and the shared experts. "Active" counts those, plus
# the output head, and leaves out the experts a token does not use and the input embedding table
# when it is a separate matrix (a token only reads its own row; DeepSeek-V3's report counts that
# table in the total but not among the activated parameters). A tied table is the output head, so
# GPT-2's counts as active: for a dense model active = total.
#
# One formula per layer type, each reading that layer's config from gpt2kimi.configs: MLA's is
# MLAConfig.param_count (MLAConfig.for_width solves it for the widest latent in a budget, so it
# lives on the config), KDA's is kda_param_count, MoE's moe_param_count; param_count sums them
# over a HybridConfig's layers.


def swiglu_param_count(d_model: int, hidden: int) -> int:
    """A SwiGLU feed-forward: gate, up ``[hidden, d]`` and down ``[d, hidden]``, no biases."""
    return 3 * d_model * hidden


def kda_param_count(config: KDAConfig, d_model: int) -> int:
    """Parameters of one KDA layer (``transformers``' Kimi Linear layout, ``H`` heads of ``D``):
    q, k, v ``[d → H·D]`` and their depthwise convolution, the forget gate (low rank ``d → D →
    H·D``, ``dt_bias`` per channel, ``A_log`` per head), β ``[d → H]``, the output gate (low rank,
    with a bias in chapter 5's layer), the output norm ``[D]`` and ``o_proj`` ``[H·D → d]``."""
    H, D = config.n_head, config.head_dim
    qkv = 3 * d_model * H * D + 3 * H * D * config.conv_size
    forget_gate = d_model * D + D * H * D + H * D + H
    beta = d_model * H
    output_gate = d_model * D + D * H * D + (H * D if config.output_gate_bias else 0) + D
    return qkv + forget_gate + beta + output_gate + H * D * d_model


@dataclass(frozen=True)
class ParamCount:
    """Parameters by part. ``total`` and ``active`` follow the convention stated above.

    The count of a model (:func:`param_count`) or of one MoE layer (:func:`moe_param_count`,
    whose other parts are 0).
    """

    name: str = ""
    embedding: int = 0  # input table (0 when tied to the head)
    head: int = 0
    kda: int = 0  # Kimi Delta Attention layers
    mla: int = 0  # Multi-head Latent Attention layers
    norms: int = 0  # the blocks' and the final norm (the layers' own norms are in their parts)
    dense_ffn: int = 0
    router: int = 0
    routed: int = 0  # every routed expert
    routed_active: int = 0  # the k routed experts one token uses
    shared: int = 0

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.head
            + self.attention
            + self.norms
            + self.dense_ffn
            + self.router
            + self.routed
            + self.shared
        )

    @property
    def active(self) -> int:
        return self.total - self.embedding - (self.routed - self.routed_active)

    @property
    def attention(self) -> int:
        """The token mixers' parameters: the KDA and MLA layers."""
        return self.kda + self.mla

    @property
    def active_with_embedding(self) -> int:
        """``active`` plus the input table (a token reads one row of it: the convention of
        counts that compare with GPT-2, whose table is its head)."""
        return self.active + self.embedding

    @property
    def by_part(self) -> dict[str, int]:
        """The layers' parameters by kind: ``kda``, ``mla``, ``dense``, ``moe`` (router, every
        expert, shared experts) and ``norms``; with ``embedding`` and ``head`` they sum to
        ``total``."""
        moe = self.router + self.routed + self.shared
        return dict(kda=self.kda, mla=self.mla, dense=self.dense_ffn, moe=moe, norms=self.norms)


def moe_param_count(config: MoEConfig) -> ParamCount:
    """One MoE layer: the router ``[E, d]``, ``E`` routed SwiGLU experts of width
    ``expert_hidden`` (``top_k`` of them per token), and the shared experts."""
    expert = swiglu_param_count(config.d_model, config.expert_hidden)
    return ParamCount(
        router=config.n_experts * config.d_model,
        routed=config.n_experts * expert,
        routed_active=config.top_k * expert,
        shared=config.n_shared_experts * expert,
    )


def param_count(config: HybridConfig, name: str = "") -> ParamCount:
    """Total and active parameters of a model, part by part, from its config alone.

    Per layer its mixer (:func:`kda_param_count` or ``MLAConfig.param_count``), its feed-forward
    (a dense SwiGLU or :func:`moe_param_count`) and two RMSNorms; a final RMSNorm, the input
    table and the untied head. Equal to the parameters of
    :class:`gpt2kimi.kimi_linear.KimiHybrid` and of ``transformers``' Kimi Linear and DeepSeek-V3
    models built from the same config.
    """
    d = config.d_model
    moe = moe_param_count(config.moe) if config.moe is not None else ParamCount()
    n_moe = config.ffns.count("moe")
    table = config.vocab_size * d
    return ParamCount(
        name=name,
        embedding=table,
        head=table,
        kda=config.n_kda * kda_param_count(config.kda, d) if config.n_kda else 0,
        mla=config.n_mla * config.mla.param_count if config.n_mla else 0,
        norms=(2 * config.n_layer + 1) * d,
        dense_ffn=config.ffns.count("dense") * swiglu_param_count(d, config.dense_hidden),
        router=n_moe * moe.router,
        routed=n_moe * moe.routed,
        routed_active=n_moe * moe.routed_active,
        shared=n_moe * moe.shared,
    )


def dense_param_count(name: str, total: int) -> ParamCount:
    """A dense model known by its total (GPT-2: every parameter is active)."""
    return ParamCount(name, head=total)


def _released(n_layer: int, n_dense: int, **fields: Any) -> HybridConfig:
    """A released model's config: MLA in every layer unless ``mixers`` says otherwise, the first
    ``n_dense`` feed-forwards dense and the rest MoE."""
    return HybridConfig(
        mixers=fields.pop("mixers", ("mla",) * n_layer),
        ffns=("dense",) * n_dense + ("moe",) * (n_layer - n_dense),
        **fields,
    )


def _deepseek_mla(d_model: int, n_head: int) -> MLAConfig:
    """DeepSeek-V3's MLA widths (Kimi K2 keeps them with half the heads)."""
    return MLAConfig(
        d_model=d_model, n_head=n_head, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536,
    )  # fmt: skip


# Configs of the released checkpoints (config.json on the Hugging Face hub), cited in chapter 7;
# their names are those of MODELS.
RELEASED_CONFIGS: dict[str, HybridConfig] = {
    "deepseek-v3": _released(
        n_layer=61, n_dense=3,
        vocab_size=129_280, d_model=7168, dense_hidden=18_432,
        mla=_deepseek_mla(7168, 128),
        moe=MoEConfig(7168, n_experts=256, top_k=8, expert_hidden=2048, n_shared_experts=1,
                      n_group=8, topk_group=4, routed_scaling_factor=2.5),
    ),
    "kimi-k2": _released(
        n_layer=61, n_dense=1,
        vocab_size=163_840, d_model=7168, dense_hidden=18_432,
        mla=_deepseek_mla(7168, 64),
        # routing (groups, scaling) left at the defaults: it does not change the counts
        moe=MoEConfig(7168, n_experts=384, top_k=8, expert_hidden=2048, n_shared_experts=1),
    ),
    "kimi-linear-48b-a3b": _released(
        n_layer=27, n_dense=1,
        # MLA at 1-indexed layers 4, 8, 12, 16, 20, 24, 27; KDA in the 20 others
        mixers=tuple("mla" if i in (4, 8, 12, 16, 20, 24, 27) else "kda" for i in range(1, 28)),
        vocab_size=163_840, d_model=2304, dense_hidden=9216,
        kda=KDAConfig(n_head=32, head_dim=128, conv_size=4, output_gate_bias=False),
        mla=MLAConfig(
            d_model=2304, n_head=32, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, rope=False,
        ),
        moe=MoEConfig(2304, n_experts=256, top_k=8, expert_hidden=1024, n_shared_experts=1,
                      routed_scaling_factor=2.446),
    ),
}  # fmt: skip
RELEASED_SOURCES: dict[str, str] = {
    "deepseek-v3": "deepseek-ai/DeepSeek-V3 config.json; DeepSeek-AI 2024 (arXiv:2412.19437)",
    "kimi-k2": "moonshotai/Kimi-K2-Instruct config.json; Kimi Team 2025 (arXiv:2507.20534)",
    "kimi-linear-48b-a3b": "moonshotai/Kimi-Linear-48B-A3B-Instruct config.json; Kimi Team 2025",
}

# Kimi K3's routed experts (a third-party reading of the released files; chapter 7 says so): 92
# MoE layers of 896 experts (16 per token) of width 3072, running in a 3584-wide latent space (so
# the layer's d_model here is that latent's, not the model's 7168). Its other widths (attention,
# shared experts, latent projections) are not in the sources the book cites.
KIMI_K3_MOE_LAYERS = 92
KIMI_K3_MOE = MoEConfig(3584, n_experts=896, top_k=16, expert_hidden=3072, n_shared_experts=2)


def kimi_k3_routed_params() -> tuple[int, int]:
    """(all routed expert parameters, routed parameters one token uses) of Kimi K3."""
    counts = moe_param_count(KIMI_K3_MOE)
    return KIMI_K3_MOE_LAYERS * counts.routed, KIMI_K3_MOE_LAYERS * counts.routed_active
