"""One language model whose token mixer and feed-forward can be swapped (a support module).

Every chapter from 3 on compares memories "with everything else held equal": the same embedding,
the same pre-norm blocks, the same feed-forward, the same head; only the token mixer changes.
This module never imports a chapter. It receives its parts as constructors:

- ``mixer(d_model, n_head) -> nn.Module`` maps ``x [B, T, d_model]`` to ``[B, T, d_model]``
  (softmax attention, linear attention, DeltaNet, ...). One constructor for every layer, or a
  list with one per layer (a hybrid such as Kimi Linear's KDA ×3 + MLA).
- ``ffn(d_model) -> nn.Module`` likewise (default: :class:`SwiGLU`; chapter 7 passes experts).

The names (``"softmax"``, ``"linear"``, ...) live in :mod:`gpt2kimi.zoo`, the only module that
imports every chapter.

Positions: by default there is no positional embedding at all (NoPE), as in the MLA layers of
Kimi Linear: a causal mask already tells a token which tokens came before it, and mixers with a
short convolution (DeltaNet and its successors) see local order directly. Set
``n_positions`` to add GPT-2's learned absolute positions instead, or ``short_conv`` to put the
same short causal convolution (:class:`ShortConv`) in front of every mixer, which gives every
token its predecessors whatever the mixer (the MQAR experiments use it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MixerFactory = Callable[[int, int], nn.Module]
FFNFactory = Callable[[int], nn.Module]

# Conventional names of the projection that writes a sublayer's output into the residual stream
# (GPT-2's ``c_proj``, Llama's and fla's ``o_proj`` / ``down_proj``, PyTorch's ``out_proj``).
RESIDUAL_PROJECTIONS = ("c_proj", "o_proj", "out_proj", "down_proj")


@dataclass
class BackboneConfig:
    """The parts of a language model that stay fixed while the token mixer changes."""

    vocab_size: int
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_positions: int | None = None  # learned positions for this many tokens; None: NoPE
    short_conv: int = 0  # taps of a causal convolution in front of every mixer; 0: none
    norm: str = "rmsnorm"  # or "layernorm"
    norm_eps: float = 1e-5
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head}: "
                "each head needs an equal share of the model width"
            )
        if self.n_positions is not None and self.n_positions < 1:
            raise ValueError(f"n_positions must be None (NoPE) or >= 1, got {self.n_positions}")
        if self.short_conv < 0:
            raise ValueError(
                f"short_conv must be 0 (none) or a kernel size >= 1, got {self.short_conv}"
            )
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {sorted(NORMS)}, got {self.norm!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")


class RMSNorm(nn.Module):
    """``x / rms(x) · weight`` over the last dim (Zhang & Sennrich 2019), in fp32 or fp64."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x if x.dtype == torch.float64 else x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)


NORMS: dict[str, Callable[[int, float], nn.Module]] = {
    "rmsnorm": lambda dim, eps: RMSNorm(dim, eps),
    "layernorm": lambda dim, eps: nn.LayerNorm(dim, eps=eps),
}


def swiglu_hidden(d_model: int, multiple_of: int = 8) -> int:
    """The SwiGLU width of Llama: ``8/3 · d`` (as many parameters as a 4d GELU MLP), rounded up."""
    hidden = int(8 * d_model / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


class SwiGLU(nn.Module):
    """The gated feed-forward of modern models (Shazeer 2020): ``down(silu(gate x) ⊙ up x)``.

    Three matrices without biases. Chapter 7's experts are SwiGLUs too.
    """

    def __init__(self, d_model: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = swiglu_hidden(d_model) if hidden is None else hidden
        if hidden < 1:
            raise ValueError(f"hidden must be at least 1, got {hidden}")
        self.hidden = hidden
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ShortConv(nn.Module):
    """``h + conv(h)``: a depthwise causal convolution over the last ``kernel_size`` tokens.

    Each channel adds a learned mix of its own recent values, so every token can see its
    predecessor without positions (the token shift of RWKV, the short convolution of H3, Based
    and fla's layers). x [B, T, C] → [B, T, C]; token t reads tokens t − kernel_size + 1 … t.
    """

    def __init__(self, d_model: int, kernel_size: int) -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be at least 1, got {kernel_size}")
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(d_model, d_model, kernel_size, groups=d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = F.pad(x.transpose(1, 2), (self.kernel_size - 1, 0))  # zeros before the first token
        return x + self.conv(h).transpose(1, 2)


class Block(nn.Module):
    """A pre-norm block: ``x + mixer(norm(x))`` mixes tokens, ``x + ffn(norm(x))`` each token.

    With ``config.short_conv`` the mixer reads ``ShortConv(norm(x))`` instead of ``norm(x)``.
    """

    def __init__(self, config: BackboneConfig, mixer: nn.Module, ffn: nn.Module) -> None:
        super().__init__()
        make_norm = NORMS[config.norm]
        self.norm_1 = make_norm(config.d_model, config.norm_eps)
        self.shift = ShortConv(config.d_model, config.short_conv) if config.short_conv else None
        self.mixer = mixer
        self.norm_2 = make_norm(config.d_model, config.norm_eps)
        self.ffn = ffn
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm_1(x)
        mixed = self.mixer(h if self.shift is None else self.shift(h))
        if not isinstance(mixed, Tensor) or mixed.shape != x.shape:
            got = tuple(mixed.shape) if isinstance(mixed, Tensor) else type(mixed).__name__
            raise ValueError(
                f"the token mixer {type(self.mixer).__name__} must map [B, T, C] = "
                f"{tuple(x.shape)} to a tensor of the same shape, got {got}"
            )
        x = x + self.drop(mixed)
        return x + self.drop(self.ffn(self.norm_2(x)))


def per_layer(parts, n_layer: int, what: str) -> list:
    """One constructor for every layer, or check that a list has exactly ``n_layer`` of them."""
    if callable(parts):
        return [parts] * n_layer
    if not isinstance(parts, Sequence) or isinstance(parts, str):
        raise TypeError(
            f"{what} must be a constructor or a list of {n_layer} constructors, "
            f"got {type(parts).__name__}"
        )
    if len(parts) != n_layer:
        raise ValueError(f"got {len(parts)} {what} constructors for n_layer={n_layer} layers")
    for i, part in enumerate(parts):
        if not callable(part):
            raise TypeError(f"{what} {i} is not callable: {type(part).__name__}")
    return list(parts)


class LanguageModel(nn.Module):
    """Token embedding (+ optional learned positions), pre-norm blocks, final norm, tied head.

    ``model(idx)`` returns logits [B, T, vocab]; ``model(idx, targets)`` returns
    ``(logits, loss)`` with targets equal to -100 ignored, like :class:`gpt2kimi.gpt2.GPT2`.
    """

    def __init__(
        self,
        config: BackboneConfig,
        mixer: MixerFactory | Sequence[MixerFactory],
        ffn: FFNFactory | Sequence[FFNFactory] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        mixers = per_layer(mixer, config.n_layer, "mixer")
        ffns = per_layer(SwiGLU if ffn is None else ffn, config.n_layer, "ffn")
        d = config.d_model
        self.embed = nn.Embedding(config.vocab_size, d)
        self.pos_embed = None if config.n_positions is None else nn.Embedding(config.n_positions, d)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            [Block(config, m(d, config.n_head), f(d)) for m, f in zip(mixers, ffns, strict=True)]
        )
        self.norm_f = NORMS[config.norm](d, config.norm_eps)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: one matrix reads tokens in and out
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) for every linear and embedding matrix, zero biases,
        and N(0, 0.02/√(2L)) for each projection that writes into the residual stream.

        Parameters outside ``nn.Linear`` / ``nn.Embedding`` (norm gains, convolutions, decay
        parameters such as ``A_log``) keep the initialisation their module gave them.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            for sublayer in (block.mixer, block.ffn):
                proj = residual_projection(sublayer)
                if proj is not None:
                    nn.init.normal_(proj.weight, mean=0.0, std=std)

    def check_input(self, idx: Tensor) -> None:
        """Raise a clear error for ids of the wrong shape, out of range, or too long."""
        if idx.dim() != 2:
            raise ValueError(f"expected token ids of shape [B, T], got {tuple(idx.shape)}")
        if idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"token ids must be integers, got {idx.dtype}")
        n_pos = self.config.n_positions
        if n_pos is not None and idx.size(1) > n_pos:
            raise ValueError(
                f"sequence of {idx.size(1)} tokens is longer than n_positions={n_pos}, "
                "the number of learned positions"
            )
        if idx.numel() and (idx.min() < 0 or idx.max() >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}), "
                f"got min {idx.min().item()} and max {idx.max().item()}"
            )

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """idx [B, T] → logits [B, T, vocab]; with targets [B, T], also the mean loss."""
        self.check_input(idx)
        x = self.embed(idx)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(idx.size(1), device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm_f(x))
        if targets is None:
            return logits
        if targets.shape != idx.shape:
            raise ValueError(
                f"targets must have the shape of idx {tuple(idx.shape)}, got {tuple(targets.shape)}"
            )
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return logits, loss


def residual_projection(module: nn.Module) -> nn.Linear | None:
    """The linear layer with which ``module`` writes into the residual stream, if it has one.

    Looks for the conventional names in :data:`RESIDUAL_PROJECTIONS`; a module with none of them
    keeps its projection's plain N(0, 0.02) initialisation.
    """
    for name in RESIDUAL_PROJECTIONS:
        proj = getattr(module, name, None)
        if isinstance(proj, nn.Linear):
            return proj
    return None


def count_parameters(model: nn.Module) -> int:
    """Parameters, each shared tensor (the tied head) counted once."""
    return sum(p.numel() for p in model.parameters())
