"""The configurations of the book's layers and of chapter 8's model (a support module).

One frozen dataclass per layer type, each checked when it is built (a ``ValueError`` naming the
field and what it must be) and each read from ``transformers`` by one classmethod, ``from_hf``,
which takes a config object or its dict (``config.to_dict()``, a ``config.json``):

- :class:`KDAConfig`: a Kimi Delta Attention layer (chapter 5);
- :class:`MLAConfig`: a Multi-head Latent Attention layer (chapter 6);
- :class:`MoEConfig`: a Mixture-of-Experts feed-forward layer (chapter 7);
- :class:`HybridConfig`: chapter 8's Kimi-Linear-style model, which nests the three.

The chapters build their layers from these, and :mod:`gpt2kimi.accounting` counts parameters and
bytes from the same objects. Like ``transformers``' configuration files, this module holds no
layer: it imports only support modules, never a chapter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpt2kimi.backbone import BackboneConfig

_REQUIRED = object()


def _as_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A ``transformers`` config object or its dict, as a dict of its fields."""
    return dict(config if isinstance(config, Mapping) else config.to_dict())


def _get(d: Mapping[str, Any], *names: str, default: Any = _REQUIRED) -> Any:
    """The first of ``names`` that ``d`` holds (not None): configs name one field differently
    (``num_experts`` in Kimi Linear, ``n_routed_experts`` in DeepSeek-V3, ...)."""
    for name in names:
        if d.get(name) is not None:
            return d[name]
    if default is _REQUIRED:
        raise ValueError(f"the transformers config has no {' / '.join(names)}")
    return default


def _at_least_one(config: Any, *names: str) -> None:
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(config, name)}")


# ----------------------------------------------------------------------------------------------
# Kimi Delta Attention (chapter 5)


@dataclass(frozen=True)
class KDAConfig:
    """The shape of one Kimi Delta Attention layer; its width ``d_model`` is the model's.

    ``n_head`` memories of ``head_dim × head_dim`` (``n_head · head_dim`` need not equal
    d_model), a causal convolution of ``conv_size`` taps over q|k|v, the chunk length of the
    chunkwise form, the output norm's epsilon. ``output_gate_bias``: chapter 5's layer has a bias
    on the output gate's ``g_b_proj``, Kimi Linear's has none (:meth:`from_hf` sets False).
    """

    n_head: int
    head_dim: int
    conv_size: int = 4
    chunk_size: int = 64
    norm_eps: float = 1e-5
    output_gate_bias: bool = True

    def __post_init__(self) -> None:
        _at_least_one(self, "n_head", "head_dim", "conv_size", "chunk_size")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | Any) -> KDAConfig:
        """The KDA layers of a Kimi Linear config, in either of its forms.

        ``KimiLinearConfig`` names them ``linear_num_heads``, ``linear_head_dim`` and
        ``linear_conv_kernel_dim``; the released ``config.json`` has ``linear_attn_config =
        {num_heads, head_dim, short_conv_kernel_size, ...}``. Missing values take
        ``transformers``' defaults (32, 128, 4); the output norm's epsilon is ``rms_norm_eps``.
        """
        d = _as_dict(config)
        linear = d.get("linear_attn_config") or {}
        return cls(
            n_head=linear.get("num_heads", _get(d, "linear_num_heads", default=32)),
            head_dim=linear.get("head_dim", _get(d, "linear_head_dim", default=128)),
            conv_size=linear.get(
                "short_conv_kernel_size", _get(d, "linear_conv_kernel_dim", default=4)
            ),
            norm_eps=float(_get(d, "rms_norm_eps", default=1e-5)),
            output_gate_bias=False,
        )


# ----------------------------------------------------------------------------------------------
# Multi-head Latent Attention (chapter 6)


@dataclass(frozen=True)
class MLAConfig:
    """Widths of one MLA layer, named as in ``transformers``' DeepSeek-V3 / Kimi Linear configs.

    ``q_lora_rank=None`` gives one ``q_proj`` (Kimi Linear, DeepSeek-V2-Lite); an int gives the
    low-rank query path ``q_a_proj → q_a_layernorm → q_b_proj`` (DeepSeek-V3: 1536).
    ``rope=False`` is Kimi Linear's NoPE MLA; ``rope_interleave=True`` reads checkpoints that
    store the rotary dims as pairs (x0, x1), (x2, x3), … as DeepSeek-V3's do.
    """

    d_model: int
    n_head: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope: bool = True
    rope_theta: float = 10000.0
    rope_interleave: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        _at_least_one(self, "d_model", "n_head", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")
        if self.qk_rope_head_dim < 0:
            raise ValueError(f"qk_rope_head_dim must be >= 0, got {self.qk_rope_head_dim}")
        if self.rope and (self.qk_rope_head_dim == 0 or self.qk_rope_head_dim % 2):
            raise ValueError(
                f"qk_rope_head_dim={self.qk_rope_head_dim}: RoPE rotates pairs of dims, so it "
                "needs a positive even width (or rope=False for a NoPE layer)"
            )
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(
                f"q_lora_rank must be None (one q_proj) or at least 1, got {self.q_lora_rank}"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")

    @property
    def qk_head_dim(self) -> int:
        """Width of each head's query and key: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Numbers cached per token: ``kv_lora_rank + qk_rope_head_dim`` (no heads, no factor 2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def param_count(self) -> int:
        """Parameters of the layer (no biases; norm gains included): the query path, then
        ``kv_a_proj_with_mqa`` [d → r + rope] and its norm [r], ``kv_b_proj`` [r → H · (nope +
        v)], ``o_proj`` [H · v → d]. The query path is ``q_proj`` [d → H · qk], or ``q_a_proj``,
        ``q_a_layernorm`` and ``q_b_proj`` with a ``q_lora_rank``. (The one MLA formula:
        :meth:`for_width` solves it for the latent, :mod:`gpt2kimi.accounting` sums it.)"""
        d, H, qk = self.d_model, self.n_head, self.qk_head_dim
        if self.q_lora_rank is None:
            q = d * H * qk
        else:
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * H * qk
        kv_a = d * self.cache_dim + self.kv_lora_rank
        kv_b = self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_a + kv_b + H * self.v_head_dim * d

    @classmethod
    def for_width(
        cls,
        d_model: int,
        n_head: int,
        kv_lora_rank: int | None = None,
        qk_rope_head_dim: int | None = None,
        **kwargs,
    ) -> MLAConfig:
        """DeepSeek-V3's proportions at width ``d_model``, as a drop-in for softmax attention.

        Each head's nope part and value are ``d_model // n_head`` wide and the shared rope key
        about half that (DeepSeek-V3: 128 and 64). Unless given, the latent is the widest that
        keeps the layer within the parameters of multi-head attention of the same width
        (``4 d² + 4 d``, chapter 2's layer with biases), so that swapping one for the other
        holds the parameter budget. NoPE (``rope=False``) unless ``rope=True`` is passed.
        """
        if d_model < 1 or n_head < 1 or d_model % n_head != 0:
            raise ValueError(
                f"d_model={d_model} is not divisible by n_head={n_head}: "
                "each head needs an equal share of the model width"
            )
        head_dim = d_model // n_head
        # about half a head, even so that RoPE can rotate it in pairs
        rope_dim = max(2, 2 * (head_dim // 4)) if qk_rope_head_dim is None else qk_rope_head_dim
        widths = dict(
            d_model=d_model,
            n_head=n_head,
            qk_nope_head_dim=head_dim,
            qk_rope_head_dim=rope_dim,
            v_head_dim=head_dim,
            **{"rope": False, **kwargs},
        )
        if kv_lora_rank is None:
            per_latent_dim = d_model + 1 + n_head * 2 * head_dim  # kv_a row, norm gain, kv_b col
            without_latent = cls(kv_lora_rank=1, **widths).param_count - per_latent_dim
            budget = 4 * d_model * d_model + 4 * d_model
            kv_lora_rank = (budget - without_latent) // per_latent_dim
            if kv_lora_rank < 1:
                raise ValueError(
                    f"no latent fits the parameter budget of attention at d_model={d_model}; "
                    "pass kv_lora_rank"
                )
        return cls(kv_lora_rank=kv_lora_rank, **widths)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | Any, rope: bool | None = None) -> MLAConfig:
        """The MLA widths of a ``transformers`` ``DeepseekV3Config`` or ``KimiLinearConfig``.

        ``rope`` defaults to True for DeepSeek-V3 (a ``rope_interleave`` field) and False for
        Kimi Linear. YaRN-scaled RoPE is not supported.
        """
        d = _as_dict(config)
        rope = "rope_interleave" in d if rope is None else rope
        params = d.get("rope_parameters") or {}
        if rope and params.get("rope_type", "default") != "default":
            raise ValueError(f"only plain RoPE is supported, got {params['rope_type']!r}")
        return cls(
            d_model=_get(d, "hidden_size"),
            n_head=_get(d, "num_attention_heads"),
            kv_lora_rank=_get(d, "kv_lora_rank"),
            qk_nope_head_dim=_get(d, "qk_nope_head_dim"),
            qk_rope_head_dim=_get(d, "qk_rope_head_dim"),
            v_head_dim=_get(d, "v_head_dim"),
            q_lora_rank=d.get("q_lora_rank"),
            rope=rope,
            rope_theta=params.get("rope_theta", 10000.0),
            rope_interleave=bool(d.get("rope_interleave", False)) and rope,
        )


# ----------------------------------------------------------------------------------------------
# Mixture of Experts (chapter 7)

ROUTERS = ("sigmoid", "softmax")


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of one MoE layer (names as in DeepSeek-V3's and Kimi's configs).

    ``router="sigmoid"``: DeepSeek-V3 / Kimi scores, an independent sigmoid per expert, chosen by
    score + bias. ``router="softmax"``: Mixtral's, a softmax over the experts. With
    ``norm_topk_prob`` the k chosen weights are divided by their sum; then multiplied by
    ``routed_scaling_factor``. ``n_group > 1`` is DeepSeek-V3's group-limited routing: the
    experts form ``n_group`` equal groups and a token may only choose experts in its
    ``topk_group`` best groups.
    """

    d_model: int
    n_experts: int
    top_k: int
    expert_hidden: int
    n_shared_experts: int = 0
    router: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        _at_least_one(self, "d_model", "n_experts", "top_k", "expert_hidden", "n_group",
                      "topk_group")  # fmt: skip
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.top_k > self.n_experts:
            raise ValueError(
                f"top_k={self.top_k} is larger than n_experts={self.n_experts}: "
                "a token cannot choose more experts than there are"
            )
        if self.n_experts % self.n_group != 0:
            raise ValueError(
                f"n_experts={self.n_experts} is not divisible by n_group={self.n_group}: "
                "group-limited routing needs groups of equal size"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} is larger than n_group={self.n_group}")
        per_group = self.n_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError(
                f"n_group={self.n_group} leaves {per_group} expert per group; a group is scored "
                "by its two best experts, so each group needs at least 2"
            )
        if self.top_k > self.topk_group * per_group:
            raise ValueError(
                f"top_k={self.top_k} is larger than the {self.topk_group * per_group} experts in "
                f"the topk_group={self.topk_group} groups a token may use"
            )

    @property
    def active_hidden(self) -> int:
        """Hidden width a token passes through: k routed experts plus the shared ones."""
        return (self.top_k + self.n_shared_experts) * self.expert_hidden

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | Any) -> MoEConfig:
        """The MoE of a ``transformers`` ``KimiLinearConfig`` or ``DeepseekV3Config`` (or a
        released ``config.json``), each field under any of its names (``num_experts``,
        ``num_local_experts`` or ``n_routed_experts``, ...); sigmoid routing as both."""
        d = _as_dict(config)
        return cls(
            d_model=_get(d, "hidden_size"),
            n_experts=_get(d, "num_experts", "num_local_experts", "n_routed_experts"),
            top_k=_get(d, "num_experts_per_token", "num_experts_per_tok"),
            expert_hidden=_get(d, "moe_intermediate_size"),
            n_shared_experts=_get(d, "num_shared_experts", "n_shared_experts", default=1),
            router="sigmoid",
            n_group=_get(d, "num_expert_group", "n_group", default=1),
            topk_group=_get(d, "topk_group", default=1),
            routed_scaling_factor=float(_get(d, "routed_scaling_factor", default=1.0)),
            norm_topk_prob=bool(_get(d, "moe_renormalize", "norm_topk_prob", default=True)),
        )


# ----------------------------------------------------------------------------------------------
# Kimi Linear (chapter 8): the three nested

MIXER_TYPES = ("kda", "mla")
FFN_TYPES = ("dense", "moe")
# transformers' names for the same layer types
HF_MIXER_TYPES = {"linear_attention": "kda", "full_attention": "mla"}
HF_FFN_TYPES = {"dense": "dense", "sparse": "moe"}
# the layer type of each nested config, and the field of HybridConfig that holds it
_NESTED = (("kda", "mixers", KDAConfig), ("mla", "mixers", MLAConfig), ("moe", "ffns", MoEConfig))


@dataclass(frozen=True)
class HybridConfig:
    """A Kimi-Linear-style model: per-layer mixer and feed-forward types, and their configs.

    ``mixers[i]`` is ``"kda"`` or ``"mla"``, ``ffns[i]`` ``"dense"`` or ``"moe"``. Each layer
    type in use needs its config (``kda``, ``mla``, ``moe``; None where no layer has that type);
    MLA and MoE layers read the model's stream, so their ``d_model`` must be the model's
    (:meth:`replace` carries a new ``d_model`` into them). The dense feed-forward is a SwiGLU of
    width ``dense_hidden``; ``norm_eps`` is the blocks' RMSNorm epsilon. :meth:`from_hf` reads
    both forms of a Kimi Linear configuration.
    """

    vocab_size: int
    d_model: int
    mixers: tuple[str, ...]  # per layer: "kda" | "mla"
    ffns: tuple[str, ...]  # per layer: "dense" | "moe"
    kda: KDAConfig | None = None  # chapter 5's layer, heads × head_dim independent of d_model
    mla: MLAConfig | None = None  # chapter 6's layer (NoPE in Kimi Linear)
    moe: MoEConfig | None = None  # chapter 7's layer
    dense_hidden: int = 128
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        object.__setattr__(self, "mixers", tuple(self.mixers))
        object.__setattr__(self, "ffns", tuple(self.ffns))
        _at_least_one(self, "vocab_size", "d_model", "dense_hidden")
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
        # the nested configs check their own widths (divisibility, top_k <= experts, ...)
        for name, types, config_class in _NESTED:
            nested = getattr(self, name)
            if nested is None:
                if name in getattr(self, types):
                    raise ValueError(
                        f"{types} has {name.upper()} layers but {name}=None: pass "
                        f"{name}={config_class.__name__}(...)"
                    )
            elif not isinstance(nested, config_class):
                raise ValueError(
                    f"{name} must be a {config_class.__name__}(...) or None, got "
                    f"{type(nested).__name__}"
                )
            elif getattr(nested, "d_model", self.d_model) != self.d_model:
                raise ValueError(
                    f"{name}.d_model={nested.d_model} but d_model={self.d_model}: every layer "
                    "reads the model's stream (config.replace(d_model=...) changes both)"
                )

    @property
    def n_layer(self) -> int:
        return len(self.mixers)

    @property
    def n_kda(self) -> int:
        return self.mixers.count("kda")

    @property
    def n_mla(self) -> int:
        return self.mixers.count("mla")

    def backbone_config(self) -> BackboneConfig:
        """The shared backbone: RMSNorm pre-norm blocks, no positions, no ``n_head`` (every
        layer's heads are in its own config)."""
        return BackboneConfig(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layer=self.n_layer,
            n_head=None,
            norm="rmsnorm",
            norm_eps=self.norm_eps,
        )

    def replace(self, **changes: Any) -> HybridConfig:
        """A copy with some fields changed (``mixers=...`` for another KDA:MLA mix). A new
        ``d_model`` carries into the nested MLA and MoE configs unless they are given too."""
        if "d_model" in changes:
            for name in ("mla", "moe"):
                nested = getattr(self, name)
                if name not in changes and nested is not None:
                    changes[name] = dataclasses.replace(nested, d_model=changes["d_model"])
        return dataclasses.replace(self, **changes)

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

        The layers' configs come from their own ``from_hf`` (:meth:`KDAConfig.from_hf`,
        :meth:`MLAConfig.from_hf` without RoPE, :meth:`MoEConfig.from_hf`), for the layer types
        in use. Raises ``ValueError`` naming what is missing or unsupported.
        """
        d = _as_dict(config)
        n_layer = _get(d, "num_hidden_layers")
        linear = d.get("linear_attn_config") or {}
        if d.get("layer_types") is not None:
            mixers = [_hf_type(t, HF_MIXER_TYPES, "layer_types", i)
                      for i, t in enumerate(d["layer_types"])]  # fmt: skip
        elif linear:
            mixers = _mixers_from_layer_numbers(linear, n_layer)
        else:
            raise ValueError(
                "Kimi Linear config names no layer types: expected layer_types or "
                "linear_attn_config with kda_layers and full_attn_layers"
            )
        if d.get("mlp_layer_types") is not None:
            ffns = [_hf_type(t, HF_FFN_TYPES, "mlp_layer_types", i)
                    for i, t in enumerate(d["mlp_layer_types"])]  # fmt: skip
        else:
            first_dense = _get(d, "first_k_dense_replace", default=1)  # transformers' default
            ffns = ["dense" if i < first_dense else "moe" for i in range(n_layer)]
        if len(mixers) != n_layer or len(ffns) != n_layer:
            raise ValueError(
                f"num_hidden_layers={n_layer}, but {len(mixers)} mixer types and "
                f"{len(ffns)} feed-forward types"
            )
        if _get(d, "tie_word_embeddings", default=False):
            raise ValueError("Kimi Linear has an untied head: tie_word_embeddings must be False")
        if _get(d, "hidden_act", default="silu") != "silu":
            raise ValueError(f"only SiLU (SwiGLU) is supported, got {d['hidden_act']!r}")
        for name in ("attention_bias", "mla_use_rope"):
            if d.get(name):
                raise ValueError(f"{name}=True is not Kimi Linear's layout and is not supported")
        return cls(
            vocab_size=_get(d, "vocab_size"),
            d_model=_get(d, "hidden_size"),
            mixers=tuple(mixers),
            ffns=tuple(ffns),
            kda=KDAConfig.from_hf(d) if "kda" in mixers else None,
            mla=MLAConfig.from_hf(d, rope=False) if "mla" in mixers else None,
            moe=MoEConfig.from_hf(d) if "moe" in ffns else None,
            dense_hidden=_get(d, "intermediate_size"),
            norm_eps=float(_get(d, "rms_norm_eps", default=1e-5)),
        )

    def to_hf(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.KimiLinearConfig`` describing this model.

        Raises ``ValueError`` for what Kimi Linear's config cannot say: a bias on KDA's output
        gate, a KDA norm epsilon other than the blocks', RoPE in MLA, a softmax router.
        """
        kda, mla, moe = self.kda, self.mla, self.moe
        problems = [
            what
            for what, bad in (
                ("kda.output_gate_bias=True", kda is not None and kda.output_gate_bias),
                ("kda.norm_eps != norm_eps", kda is not None and kda.norm_eps != self.norm_eps),
                ("mla.rope=True", mla is not None and mla.rope),
                ("moe.router='softmax'", moe is not None and moe.router != "sigmoid"),
            )
            if bad
        ]
        if problems:
            raise ValueError(f"Kimi Linear's config cannot describe {', '.join(problems)}")
        inverse_mixer = {v: k for k, v in HF_MIXER_TYPES.items()}
        inverse_ffn = {v: k for k, v in HF_FFN_TYPES.items()}
        hf: dict[str, Any] = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.d_model,
            num_hidden_layers=self.n_layer,
            layer_types=[inverse_mixer[m] for m in self.mixers],
            mlp_layer_types=[inverse_ffn[f] for f in self.ffns],
            intermediate_size=self.dense_hidden,
            rms_norm_eps=self.norm_eps,
            tie_word_embeddings=False,
        )
        if kda is not None:
            hf.update(
                linear_num_heads=kda.n_head,
                linear_head_dim=kda.head_dim,
                linear_conv_kernel_dim=kda.conv_size,
            )
        if mla is not None:
            hf.update(
                num_attention_heads=mla.n_head,
                num_key_value_heads=mla.n_head,
                kv_lora_rank=mla.kv_lora_rank,
                qk_nope_head_dim=mla.qk_nope_head_dim,
                qk_rope_head_dim=mla.qk_rope_head_dim,
                v_head_dim=mla.v_head_dim,
                q_lora_rank=mla.q_lora_rank,
            )
        if moe is not None:
            hf.update(
                num_experts=moe.n_experts,
                num_experts_per_token=moe.top_k,
                moe_intermediate_size=moe.expert_hidden,
                num_shared_experts=moe.n_shared_experts,
                num_expert_group=moe.n_group,
                topk_group=moe.topk_group,
                routed_scaling_factor=moe.routed_scaling_factor,
                moe_renormalize=moe.norm_topk_prob,
            )
        return hf

    # -- what decoding keeps -------------------------------------------------------------------

    def cache_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Bytes one more token of one sequence adds: ``n_mla · (kv_lora_rank + rope) · e``."""
        if self.mla is None:
            return 0
        return self.n_mla * self.mla.cache_dim * bytes_per_element

    def state_bytes(self, bytes_per_element: int = 4) -> int:
        """Bytes of one sequence's fixed state, whatever its length: per KDA layer the memory
        ``heads · d_k · d_k`` and the convolution's last ``conv_size − 1`` inputs of q|k|v."""
        if self.kda is None:
            return 0
        H, D = self.kda.n_head, self.kda.head_dim
        memory = H * D * D
        conv = 3 * H * D * (self.kda.conv_size - 1)
        return self.n_kda * (memory + conv) * bytes_per_element


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
