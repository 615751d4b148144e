"""Chapter 8: Kimi Linear, a hybrid of fast memory, exact memory and sparse experts.

Kimi Linear (Kimi Team 2025) puts the book's pieces into one stack of pre-norm blocks:

- about three in four token mixers are **Kimi Delta Attention** (chapter 5): a fixed
  ``heads × d_k × d_v`` memory per layer, whatever the context length;
- the others are **Multi-head Latent Attention** without positions (chapter 6): exact recall of
  every earlier token from a small latent cache that grows with the context;
- every feed-forward but the first is a **Mixture of Experts** (chapter 7); the first is dense.

:class:`HybridConfig` names each layer's mixer (``"kda"`` / ``"mla"``) and feed-forward
(``"dense"`` / ``"moe"``) and reads both forms of a Kimi Linear configuration
(:meth:`HybridConfig.from_hf`). :class:`KimiHybrid` is chapter 3's
:class:`~gpt2kimi.backbone.LanguageModel` with those layers and an untied head, so it decodes
with the backbone's cache and :func:`gpt2kimi.kv_cache.generate`. :meth:`KimiHybrid.from_hf` loads a
``transformers`` ``KimiLinearForCausalLM`` state dict: the layers carry ``transformers``' own
parameter names, so only the prefixes in :data:`HF_PREFIXES` change.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from gpt2kimi.accounting import ModelConfig
from gpt2kimi.backbone import BackboneConfig, LanguageModel, SwiGLU
from gpt2kimi.gpt2 import CheckpointError, checkpoint_problems
from gpt2kimi.kda import KimiDeltaAttention
from gpt2kimi.mla import MLAConfig, MultiHeadLatentAttention
from gpt2kimi.moe import MoE, MoEConfig

MIXER_TYPES = ("kda", "mla")
FFN_TYPES = ("dense", "moe")
# transformers' names for the same layer types
HF_MIXER_TYPES = {"linear_attention": "kda", "full_attention": "mla"}
HF_FFN_TYPES = {"dense": "dense", "sparse": "moe"}

# ----------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class HybridConfig:
    """A Kimi-Linear-style model: per-layer mixer and feed-forward types, and their widths.

    Field names follow the book (chapters 5-7); :meth:`from_hf` maps ``transformers``' names.
    """

    vocab_size: int
    d_model: int
    mixers: tuple[str, ...]  # per layer: "kda" | "mla"
    ffns: tuple[str, ...]  # per layer: "dense" | "moe"
    # Kimi Delta Attention (chapter 5): heads × head_dim, independent of d_model
    kda_heads: int = 2
    kda_head_dim: int = 16
    conv_size: int = 4
    chunk_size: int = 64
    # Multi-head Latent Attention (chapter 6), without positions (NoPE)
    mla_heads: int = 2
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    q_lora_rank: int | None = None
    # feed-forward (chapter 7): the dense SwiGLU and the experts
    dense_hidden: int = 128
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 32
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        object.__setattr__(self, "mixers", tuple(self.mixers))
        object.__setattr__(self, "ffns", tuple(self.ffns))
        for name in ("vocab_size", "d_model", "kda_heads", "kda_head_dim", "dense_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.mixers:
            raise ValueError("a model needs at least one layer: mixers is empty")
        if len(self.ffns) != len(self.mixers):
            raise ValueError(
                f"got {len(self.mixers)} mixer types but {len(self.ffns)} feed-forward types: "
                "give one of each per layer"
            )
        for i, (m, f) in enumerate(zip(self.mixers, self.ffns, strict=True)):
            if m not in MIXER_TYPES:
                raise ValueError(f"layer {i}: mixer must be one of {MIXER_TYPES}, got {m!r}")
            if f not in FFN_TYPES:
                raise ValueError(f"layer {i}: feed-forward must be one of {FFN_TYPES}, got {f!r}")
        # the chapters' own configs check their widths (divisibility, top_k <= experts, ...)
        if "mla" in self.mixers:
            self.mla_config()
        if "moe" in self.ffns:
            self.moe_config()

    @property
    def n_layer(self) -> int:
        return len(self.mixers)

    @property
    def n_kda(self) -> int:
        return self.mixers.count("kda")

    @property
    def n_mla(self) -> int:
        return self.mixers.count("mla")

    def mla_config(self) -> MLAConfig:
        """The MLA layers' widths (chapter 6), NoPE as in Kimi Linear; norm eps 1e-6 as there."""
        return MLAConfig(
            d_model=self.d_model,
            n_head=self.mla_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            q_lora_rank=self.q_lora_rank,
            rope=False,
        )

    def moe_config(self) -> MoEConfig:
        """The MoE layers' shape and routing (chapter 7): sigmoid scores, correction bias."""
        return MoEConfig(
            d_model=self.d_model,
            n_experts=self.n_experts,
            top_k=self.top_k,
            expert_hidden=self.expert_hidden,
            n_shared_experts=self.n_shared_experts,
            router="sigmoid",
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            norm_topk_prob=self.norm_topk_prob,
        )

    def backbone_config(self) -> BackboneConfig:
        """The shared backbone: RMSNorm pre-norm blocks, no positions (n_head is unused here:
        every layer's width comes from its own config)."""
        return BackboneConfig(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layer=self.n_layer,
            n_head=1,
            norm="rmsnorm",
            norm_eps=self.norm_eps,
        )

    def replace(self, **changes) -> HybridConfig:
        """A copy with some fields changed (``mixers=...`` for another KDA:MLA mix)."""
        return HybridConfig(**{**asdict(self), **changes})

    # -- transformers' two forms ---------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | Any) -> HybridConfig:
        """Read a Kimi Linear configuration in either form.

        - ``KimiLinearConfig(...).to_dict()`` (or the config object): ``layer_types``
          (``"linear_attention"`` / ``"full_attention"``), ``mlp_layer_types``
          (``"dense"`` / ``"sparse"``), ``linear_num_heads``, ``linear_head_dim``,
          ``linear_conv_kernel_dim``;
        - the released checkpoint's ``config.json``: ``linear_attn_config = {num_heads, head_dim,
          short_conv_kernel_size, kda_layers, full_attn_layers}`` with **1-indexed** layer
          numbers, and ``first_k_dense_replace`` leading dense layers.

        MoE fields are read under either of ``transformers``' names (``num_experts`` or
        ``num_local_experts``, ...). Raises ``ValueError`` naming what is missing or unsupported.
        """
        d = dict(config if isinstance(config, Mapping) else config.to_dict())

        def get(*names: str, default: Any = _REQUIRED) -> Any:
            for name in names:
                if name in d and d[name] is not None:
                    return d[name]
            if default is _REQUIRED:
                raise ValueError(f"Kimi Linear config has no {' / '.join(names)}")
            return default

        n_layer = get("num_hidden_layers")
        linear = d.get("linear_attn_config") or {}
        if d.get("layer_types") is not None:
            mixers = [_hf_type(t, HF_MIXER_TYPES, "layer_types", i)
                      for i, t in enumerate(d["layer_types"])]
        elif linear:
            mixers = _mixers_from_layer_numbers(linear, n_layer)
        else:
            raise ValueError(
                "Kimi Linear config names no layer types: expected layer_types or "
                "linear_attn_config with kda_layers and full_attn_layers"
            )
        if d.get("mlp_layer_types") is not None:
            ffns = [_hf_type(t, HF_FFN_TYPES, "mlp_layer_types", i)
                    for i, t in enumerate(d["mlp_layer_types"])]
        else:
            first_dense = get("first_k_dense_replace", default=1)  # transformers' default
            ffns = ["dense" if i < first_dense else "moe" for i in range(n_layer)]
        if len(mixers) != n_layer or len(ffns) != n_layer:
            raise ValueError(
                f"num_hidden_layers={n_layer}, but {len(mixers)} mixer types and "
                f"{len(ffns)} feed-forward types"
            )
        if get("tie_word_embeddings", default=False):
            raise ValueError("Kimi Linear has an untied head: tie_word_embeddings must be False")
        if get("hidden_act", default="silu") != "silu":
            raise ValueError(f"only SiLU (SwiGLU) is supported, got {d['hidden_act']!r}")
        for name in ("attention_bias", "mla_use_rope"):
            if d.get(name):
                raise ValueError(f"{name}=True is not Kimi Linear's layout and is not supported")
        return cls(
            vocab_size=get("vocab_size"),
            d_model=get("hidden_size"),
            mixers=tuple(mixers),
            ffns=tuple(ffns),
            kda_heads=linear.get("num_heads", get("linear_num_heads", default=32)),
            kda_head_dim=linear.get("head_dim", get("linear_head_dim", default=128)),
            conv_size=linear.get(
                "short_conv_kernel_size", get("linear_conv_kernel_dim", default=4)
            ),
            mla_heads=get("num_attention_heads"),
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=get("qk_nope_head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"),
            v_head_dim=get("v_head_dim"),
            q_lora_rank=d.get("q_lora_rank"),
            dense_hidden=get("intermediate_size"),
            n_experts=get("num_experts", "num_local_experts"),
            top_k=get("num_experts_per_token", "num_experts_per_tok"),
            expert_hidden=get("moe_intermediate_size"),
            n_shared_experts=get("num_shared_experts", "n_shared_experts", default=1),
            n_group=get("num_expert_group", "n_group", default=1),
            topk_group=get("topk_group", default=1),
            routed_scaling_factor=float(get("routed_scaling_factor", default=1.0)),
            norm_topk_prob=bool(get("moe_renormalize", "norm_topk_prob", default=True)),
            norm_eps=float(get("rms_norm_eps", default=1e-5)),
        )

    def to_hf(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.KimiLinearConfig`` describing this model."""
        inverse_mixer = {v: k for k, v in HF_MIXER_TYPES.items()}
        inverse_ffn = {v: k for k, v in HF_FFN_TYPES.items()}
        return dict(
            vocab_size=self.vocab_size,
            hidden_size=self.d_model,
            num_hidden_layers=self.n_layer,
            layer_types=[inverse_mixer[m] for m in self.mixers],
            mlp_layer_types=[inverse_ffn[f] for f in self.ffns],
            linear_num_heads=self.kda_heads,
            linear_head_dim=self.kda_head_dim,
            linear_conv_kernel_dim=self.conv_size,
            num_attention_heads=self.mla_heads,
            num_key_value_heads=self.mla_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            q_lora_rank=self.q_lora_rank,
            intermediate_size=self.dense_hidden,
            num_experts=self.n_experts,
            num_experts_per_token=self.top_k,
            moe_intermediate_size=self.expert_hidden,
            num_shared_experts=self.n_shared_experts,
            num_expert_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            moe_renormalize=self.norm_topk_prob,
            rms_norm_eps=self.norm_eps,
            tie_word_embeddings=False,
        )

    # -- what decoding keeps -------------------------------------------------------------------

    def cache_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Bytes one more token of one sequence adds: ``n_mla · (kv_lora_rank + rope) · e``."""
        return self.n_mla * (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_element

    def state_bytes(self, bytes_per_element: int = 4) -> int:
        """Bytes of one sequence's fixed state, whatever its length: per KDA layer the memory
        ``heads · d_k · d_k`` and the convolution's last ``conv_size − 1`` inputs of q|k|v."""
        memory = self.kda_heads * self.kda_head_dim * self.kda_head_dim
        conv = 3 * self.kda_heads * self.kda_head_dim * (self.conv_size - 1)
        return self.n_kda * (memory + conv) * bytes_per_element

    def model_config(self, name: str, **kwargs) -> ModelConfig:
        """This model as a row of :mod:`gpt2kimi.accounting`'s table (its cache formulas)."""
        return ModelConfig(
            name=name,
            n_layer=self.n_layer,
            d_model=self.d_model,
            attention="mla",
            n_head=self.mla_heads,
            head_dim=self.v_head_dim,
            kv_lora_rank=self.kv_lora_rank,
            rope_dim=self.qk_rope_head_dim,
            n_attn_layers=self.n_mla,
            n_linear_layers=self.n_kda,
            linear_heads=self.kda_heads if self.n_kda else None,
            linear_key_dim=self.kda_head_dim if self.n_kda else None,
            linear_value_dim=self.kda_head_dim if self.n_kda else None,
            n_experts=self.n_experts if "moe" in self.ffns else None,
            n_active_experts=self.top_k if "moe" in self.ffns else None,
            n_shared_experts=self.n_shared_experts if "moe" in self.ffns else None,
            **kwargs,
        )


_REQUIRED = object()


def _hf_type(name: str, table: dict[str, str], field_name: str, i: int) -> str:
    if name not in table:
        raise ValueError(f"{field_name}[{i}] = {name!r}: expected one of {sorted(table)}")
    return table[name]


def _mixers_from_layer_numbers(linear: Mapping[str, Any], n_layer: int) -> list[str]:
    """``kda_layers`` / ``full_attn_layers`` (1-indexed, as in the released config.json)."""
    mixers: list[str | None] = [None] * n_layer
    for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
        for number in linear.get(key, []):
            if not 1 <= number <= n_layer:
                raise ValueError(
                    f"linear_attn_config.{key} holds layer {number}; layers are numbered "
                    f"1 … {n_layer} (1-indexed)"
                )
            if mixers[number - 1] is not None:
                raise ValueError(f"layer {number} is listed twice in linear_attn_config")
            mixers[number - 1] = kind
    missing = [i + 1 for i, m in enumerate(mixers) if m is None]
    if missing:
        raise ValueError(
            f"linear_attn_config gives no type to layers {missing} (1-indexed): each layer must "
            "be in kda_layers or full_attn_layers"
        )
    return mixers  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
# the model


def kda_layer(config: HybridConfig) -> KimiDeltaAttention:
    """One KDA mixer with Kimi Linear's shapes: chapter 5's layer with heads × head_dim
    independent of d_model, one convolution over q|k|v, no bias on the output gate."""
    return KimiDeltaAttention(
        config.d_model,
        config.kda_heads,
        head_dim=config.kda_head_dim,
        conv_size=config.conv_size,
        chunk_size=config.chunk_size,
        norm_eps=config.norm_eps,
        output_gate_bias=False,
    )


def make_mixer(config: HybridConfig, kind: str) -> nn.Module:
    if kind == "kda":
        return kda_layer(config)
    return MultiHeadLatentAttention(config.mla_config())  # absorbed decoding by itself


def make_ffn(config: HybridConfig, kind: str) -> nn.Module:
    if kind == "dense":
        return SwiGLU(config.d_model, config.dense_hidden)
    return MoE(config.moe_config())


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


# ----------------------------------------------------------------------------------------------
# parameters


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a hybrid: all of them, and those one token uses (its k routed experts).

    ``active`` follows :mod:`gpt2kimi.accounting` (and DeepSeek-V3's report): the untied input
    embedding is left out, since a token only reads its own row of it;
    ``active_with_embedding`` counts the table too.
    """

    total: int
    active: int
    embedding: int  # the input embedding (a lookup: one row per token)
    head: int  # the output head
    by_part: dict[str, int] = field(default_factory=dict)  # kda / mla / dense / moe / norms

    @property
    def active_with_embedding(self) -> int:
        return self.active + self.embedding


def count_params(config: HybridConfig) -> ParamCount:
    """Count :class:`KimiHybrid`'s parameters on the meta device (no memory is allocated).

    ``active``: the total minus the input embedding and, in each MoE layer, the experts a token
    does not use (``n_experts − top_k`` of them); the head is counted in both.
    """
    with torch.device("meta"):
        model = KimiHybrid(config)
    by_part: dict[str, int] = {"kda": 0, "mla": 0, "dense": 0, "moe": 0, "norms": 0}
    inactive = 0
    for block, mixer, ffn in zip(model.blocks, config.mixers, config.ffns, strict=True):
        by_part[mixer] += sum(p.numel() for p in block.mixer.parameters())
        by_part[ffn] += sum(p.numel() for p in block.ffn.parameters())
        by_part["norms"] += block.norm_1.weight.numel() + block.norm_2.weight.numel()
        if ffn == "moe":
            per_expert = block.ffn.experts.gate_up_proj[0].numel()
            per_expert += block.ffn.experts.down_proj[0].numel()
            inactive += (config.n_experts - config.top_k) * per_expert
    by_part["norms"] += model.norm_f.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    return ParamCount(
        total=total,
        active=total - inactive - model.embed.weight.numel(),
        embedding=model.embed.weight.numel(),
        head=model.lm_head.weight.numel(),
        by_part=by_part,
    )
