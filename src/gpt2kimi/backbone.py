"""One language model whose token mixer and feed-forward can be swapped (a support module).

Every chapter from 3 on compares memories "with everything else held equal": the same embedding,
the same pre-norm blocks, the same feed-forward, the same head; only the token mixer changes.
This module never imports a chapter. It receives its parts as constructors:

- ``mixer(d_model, n_head) -> nn.Module`` maps ``x [B, T, d_model]`` to ``[B, T, d_model]``
  (softmax attention, linear attention, DeltaNet, ...). One constructor for every layer, or a
  list with one per layer (a hybrid such as Kimi Linear's KDA ×3 + MLA).
- ``ffn(d_model) -> nn.Module`` likewise (default: :class:`SwiGLU`; chapter 7 passes experts).

The names (``"softmax"``, ``"linear"``, ...) live in :mod:`gpt2kimi.experiments.registry`:
:mod:`gpt2kimi.experiments` is the only package that imports every chapter.

**The state contract.** Every token mixer of the book remembers earlier tokens in its own state
object, and they all take it the same way::

    y = mixer(x)                                        # whole sequences (training, scoring)
    y, state = mixer(x, state=None, return_state=True)  # x starts a sequence; its memory after x
    y, state = mixer(x_next, state, return_state=True)  # x_next continues it

- ``forward(x, state=None, return_state=False)``: ``state=None`` means that x starts its
  sequences; otherwise x holds the tokens that follow the ones ``state`` remembers. With
  ``return_state=True`` it returns ``(y, state)``, the memory after x. Feeding a sequence in
  pieces (a prompt, then one token at a time), passing each returned state to the next call,
  gives the outputs of one call on the whole sequence.
- The state is the mixer's own object: a :class:`gpt2kimi.kv_cache.LayerKVCache` (softmax
  attention), a fixed-size recurrent memory (linear attention, the DeltaNet family), a latent
  cache (MLA). Whatever it holds, it has ``nbytes`` (the bytes it takes for this layer),
  ``reset()`` (forget every token, keep the allocation) and ``crop(n)`` (keep the first n
  tokens): a cache of tokens rewinds, a fixed-size memory (:class:`RecurrentState`) cannot and
  says so. A state that keeps every token also has ``bytes_per_token``, ``pos`` and
  ``batch_size``, which :class:`ModelCache` sums.
- A mixer may update the state it is given in place (a pre-allocated KV cache does, so a step
  copies nothing) and return that same object: callers always continue with the returned one.
- A mixer whose state must be allocated up front for the longest sequence (a KV cache) also has
  ``init_state(batch_size, max_len, *, dtype, device)``, returning an empty state with room for
  ``max_len`` tokens. Without it, a state starts as None (a recurrent memory of zeros). Called
  with ``state=None, return_state=True``, such a mixer returns a state holding exactly x's tokens.

:class:`LanguageModel` threads the states: :meth:`LanguageModel.new_cache` makes a
:class:`ModelCache` (one :class:`BlockState` per block, each holding its mixer's state, and the
number of tokens seen), and ``model(idx, cache=cache)`` runs idx after the cached tokens, storing
every block's new state back into the cache. ``gpt2kimi.kv_cache.generate`` needs nothing else
(``model.new_cache`` and ``model(idx, cache=cache)``), so one ``generate`` decodes every mixer
and every mix of mixers, chapter 2's ``GPT2WithCache`` included.

Positions: by default there is no positional embedding at all (NoPE), as in the MLA layers of
Kimi Linear: a causal mask already tells a token which tokens came before it, and mixers with a
short convolution (DeltaNet and its successors) see local order directly. Set
``block_size`` to add GPT-2's learned absolute positions instead, or ``short_conv`` to put a
token shift (:class:`TokenShift`, a short causal convolution) in front of every mixer, which
gives every token its predecessors whatever the mixer (the MQAR experiments use it).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpt2kimi.native import fused_rms_norm
from gpt2kimi.train import evaluating

MixerFactory = Callable[[int, int | None], nn.Module]
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
    n_head: int | None = 2  # passed to each mixer constructor; None where mixers bring their own
    block_size: int | None = None  # learned positions for this many tokens; None: NoPE
    short_conv: int = 0  # taps of a causal convolution in front of every mixer; 0: none
    norm: str = "rmsnorm"  # or "layernorm"
    norm_eps: float = 1e-5
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_head is not None and self.n_head < 1:
            raise ValueError(f"n_head must be None or at least 1, got {self.n_head}")
        if self.n_head is not None and self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head}: "
                "each head needs an equal share of the model width"
            )
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be None (NoPE) or >= 1, got {self.block_size}")
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
        if x.dtype == torch.float32 == self.weight.dtype and is_decode_step(x):
            # a decoded token: the six calls below in one C call where it is built (equal up to
            # fp32 rounding), else PyTorch's F.rms_norm (one Python call, bit for bit the six)
            y = fused_rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps) if y is None else y
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
        if not is_decode_step(x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        # a decoded token: gate and up in one product over their weights stacked once
        gate_up = decode_layout(self, lambda: torch.cat([self.gate_proj.weight,
                                                         self.up_proj.weight]))
        return swiglu(x, gate_up, self.down_proj.weight)


def swiglu(
    x: Tensor, gate_up: Tensor, down: Tensor, weight: Tensor | float | None = None
) -> Tensor:
    """A SwiGLU from stacked weights: x [n, d], gate_up [2I, d] (gate rows, then up rows),
    down [d, I] → [n, d] (chapter 7's experts are stored this way).

    With ``weight [n, 1]`` (or one number) the output is scaled per row, applied to the I-wide
    hidden activation before ``down`` (the same by linearity, and cheaper when I < d).
    """
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    hidden = F.silu(gate) * up
    return F.linear(hidden if weight is None else hidden * weight, down)


class CausalConv1d(nn.Conv1d):
    """A depthwise causal convolution over time that can continue where it stopped.

    Each channel mixes its own last ``kernel_size`` inputs: token t reads tokens
    t − kernel_size + 1 … t. ``forward(x [B, T, C], tail)`` returns ``(y [B, T, C], tail)``, where
    ``tail`` [B, kernel_size − 1, C] holds the last inputs seen (None: zeros before the first
    token), so a sequence fed in pieces gives the outputs of one call.
    """

    def __init__(self, channels: int, kernel_size: int) -> None:
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be at least 1, got {kernel_size}")
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False)

    def forward(self, x: Tensor, tail: Tensor | None = None) -> tuple[Tensor, Tensor]:
        n_past = self.kernel_size[0] - 1
        if tail is None:  # a fresh sequence: the past is zeros (causal left padding)
            tail = x.new_zeros(x.size(0), n_past, x.size(2))
        x = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, n_past + T, C]
        if x.size(1) == self.kernel_size[0]:  # one decoding step: a dot product per channel,
            # far cheaper than a convolution call for a single output (fla's conv update)
            y = (x * self.weight[:, 0].t()).sum(dim=1, keepdim=True)  # [B, 1, C]
        else:
            y = super().forward(x.transpose(1, 2)).transpose(1, 2)  # no future input is seen
        return y, x[:, x.size(1) - n_past :]


class TokenShift(nn.Module):
    """``h + conv(h)``: a residual causal convolution over each channel's last few values.

    Each channel adds a learned mix of its own last ``kernel_size`` values, so every token can see
    its predecessor without positions (the token shift of RWKV, the short convolution of H3, Based
    and fla's layers). x [B, T, C] → [B, T, C]. Its state (for decoding, as a token mixer's) is
    the last ``kernel_size − 1`` inputs.
    """

    def __init__(self, d_model: int, kernel_size: int) -> None:
        super().__init__()
        self.conv = CausalConv1d(d_model, kernel_size)

    def forward(
        self, x: Tensor, state: Tensor | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        y, state = self.conv(x, state)
        return (x + y, state) if return_state else x + y


class RecurrentState:
    """A fixed-size memory of everything a layer has read: linear attention's ``S``, the DeltaNet
    family's ``S`` and convolution tail. It has the same bytes at any length.

    Subclasses are dataclasses of tensors. The state summarises its tokens instead of keeping
    them, so it cannot rewind (:meth:`crop` raises); :meth:`reset` zeroes it in place, which is
    exactly the state of a fresh sequence.
    """

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def reset(self) -> None:
        """Forget every token: the memory and any tail of inputs become zeros."""
        for t in self.tensors():
            t.zero_()

    def crop(self, n: int) -> None:
        raise ValueError(
            f"{type(self).__name__} cannot rewind to {n} tokens: a fixed-size memory keeps a "
            "summary of every token it read, not the tokens; keep a copy of the state from that "
            "point instead (or reset() and feed the tokens again)"
        )


class BlockState(NamedTuple):
    """What one block remembers while decoding: its mixer's state and its token shift's."""

    mixer: Any = None  # the token mixer's own state object (None: a fresh sequence)
    shift: Tensor | None = None  # the token shift's last inputs, when the block has one

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self if part is not None)

    @property
    def rewinds(self) -> bool:
        """Whether :meth:`crop` can go back: a cache of tokens can, a fixed-size memory cannot."""
        return self.shift is None and not isinstance(self.mixer, RecurrentState)

    def reset(self) -> None:
        if self.mixer is not None:
            self.mixer.reset()
        if self.shift is not None:
            self.shift.zero_()  # the last inputs of a fresh sequence are zeros

    def crop(self, n: int) -> None:
        if self.shift is not None:  # a token shift's tail is a fixed-size memory too
            raise ValueError(f"a token shift's last inputs cannot rewind to {n} tokens")
        if self.mixer is not None:
            self.mixer.crop(n)


class Block(nn.Module):
    """A pre-norm block: ``x + mixer(norm(x))`` mixes tokens, ``x + ffn(norm(x))`` each token.

    With ``config.short_conv`` the mixer reads ``TokenShift(norm(x))`` instead of ``norm(x)``.
    ``state`` and ``return_state`` work as a token mixer's (module notes), with a
    :class:`BlockState`.
    """

    def __init__(self, config: BackboneConfig, mixer: nn.Module, ffn: nn.Module) -> None:
        super().__init__()
        make_norm = NORMS[config.norm]
        self.norm_1 = make_norm(config.d_model, config.norm_eps)
        self.shift = TokenShift(config.d_model, config.short_conv) if config.short_conv else None
        self.mixer = mixer
        self.norm_2 = make_norm(config.d_model, config.norm_eps)
        self.ffn = ffn
        self.drop = nn.Dropout(config.dropout)
        check_mixer_output(mixer, config.d_model)

    def forward(
        self, x: Tensor, state: BlockState | None = None, return_state: bool = False
    ) -> Tensor | tuple[Tensor, BlockState]:
        h = self.norm_1(x)
        if return_state:  # decoding: every part reads and returns its state
            mixer_state, shift_state = BlockState() if state is None else state
            if self.shift is not None:
                h, shift_state = self.shift(h, shift_state, return_state=True)
            mixed, mixer_state = self.mixer(h, mixer_state, return_state=True)
        else:
            mixed = self.mixer(h if self.shift is None else self.shift(h))
        x = x + dropout(self.drop, mixed)
        x = x + dropout(self.drop, self.ffn(self.norm_2(x)))
        return (x, BlockState(mixer_state, shift_state)) if return_state else x


def dropout(drop: nn.Dropout, x: Tensor) -> Tensor:
    """``drop(x)`` while training; outside training the identity, without the module call
    (which a decoded token would pay at every block)."""
    return drop(x) if drop.training else x


def check_mixer_output(mixer: nn.Module, d_model: int) -> None:
    """Run ``mixer`` once on two tokens and raise a clear error unless it keeps x's shape.

    Done once, when a block is built, so that a mixer of the wrong width fails there, naming
    itself, instead of deep inside a forward pass.
    """
    x = next(mixer.parameters(), torch.zeros(())).new_zeros(1, 2, d_model)  # its dtype, device
    with torch.no_grad(), evaluating(mixer):
        mixed = mixer(x)
    if not isinstance(mixed, Tensor) or mixed.shape != x.shape:
        got = tuple(mixed.shape) if isinstance(mixed, Tensor) else type(mixed).__name__
        raise ValueError(
            f"the token mixer {type(mixer).__name__} must map [B, T, C] = "
            f"{tuple(x.shape)} to a tensor of the same shape, got {got}"
        )


def takes_state(mixer: nn.Module) -> bool:
    """Whether ``mixer.forward`` follows the state contract: ``(x, state, return_state=...)``."""
    params = inspect.signature(mixer.forward).parameters
    return len(params) >= 2 and "return_state" in params


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


@dataclass
class ModelCache:
    """What a :class:`LanguageModel` remembers of a batch of sequences between calls.

    ``layers`` holds one :class:`BlockState` per block; ``pos`` counts the tokens seen so far
    (the position of the next one). ``model(idx, cache=cache)`` updates both.
    """

    layers: list[BlockState]
    pos: int = 0
    # the output head's weight as [d, vocab] (a view where the model stores it so, else a
    # copy), set at the first decoded token (:meth:`LanguageModel.decode_logits`)
    head: Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes allocated by every layer's state (a KV cache counts its whole buffer)."""
        return sum(layer.nbytes for layer in self.layers)

    def growing(self) -> list:
        """The layer states that keep every token (KV and latent caches: they have
        ``bytes_per_token``); the others are fixed-size memories."""
        return [layer.mixer for layer in self.layers if hasattr(layer.mixer, "bytes_per_token")]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more token of one sequence adds, over every layer that keeps its tokens."""
        return sum(state.bytes_per_token for state in self.growing())

    @property
    def growing_bytes(self) -> int:
        """Bytes holding the tokens cached so far (not the room allocated for later ones)."""
        return sum(s.batch_size * s.pos * s.bytes_per_token for s in self.growing())

    @property
    def fixed_bytes(self) -> int:
        """Bytes of the fixed-size states (recurrent memories, convolution tails)."""
        growing = {id(state) for state in self.growing()}
        return sum(
            part.nbytes
            for layer in self.layers
            for part in layer
            if part is not None and id(part) not in growing
        )

    @property
    def used_bytes(self) -> int:
        """What the cache holds now: the tokens cached so far plus every fixed-size state."""
        return self.growing_bytes + self.fixed_bytes

    def reset(self) -> None:
        """Forget every sequence: caches empty, memories zero (allocations are kept)."""
        for layer in self.layers:
            layer.reset()
        self.pos = 0

    def crop(self, n: int) -> None:
        """Keep only the first ``n`` tokens (to undo decode steps, or reuse a prompt).

        Caches of tokens rewind; a fixed-size memory cannot, and a cache holding one raises a
        ``ValueError`` naming the block, before anything changes.
        """
        if not 0 <= n <= self.pos:
            raise ValueError(f"can keep 0 … {self.pos} cached tokens, got {n}")
        for i, layer in enumerate(self.layers):
            if not layer.rewinds:
                raise ValueError(
                    f"block {i} keeps a fixed-size memory ({type(layer.mixer).__name__}"
                    f"{' and a token shift' if layer.shift is not None else ''}), which cannot "
                    "rewind: only caches of tokens can be cropped"
                )
        for layer in self.layers:
            layer.crop(n)
        self.pos = n


class LanguageModel(nn.Module):
    """Token embedding (+ optional learned positions), pre-norm blocks, final norm, tied head.

    ``model(idx)`` returns logits [B, T, vocab]; ``model(idx, targets)`` returns
    ``(logits, loss)`` with targets equal to -100 ignored, like :class:`gpt2kimi.gpt2.GPT2`.
    ``model(idx, cache=cache)`` continues the sequences a :class:`ModelCache` holds.
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
        self.pos_embed = None if config.block_size is None else nn.Embedding(config.block_size, d)
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

    def new_cache(self, batch_size: int, max_len: int | None = None) -> ModelCache:
        """An empty cache for decoding ``batch_size`` sequences of up to ``max_len`` tokens.

        A mixer with ``init_state`` allocates its state now (a KV cache with room for ``max_len``
        tokens, in the model's dtype and device); the others start from None. ``max_len``
        defaults to ``block_size``, and may not exceed it.
        """
        n_pos = self.config.block_size
        if max_len is None:
            max_len = n_pos
        if max_len is not None and n_pos is not None and max_len > n_pos:
            raise ValueError(
                f"max_len={max_len} is longer than block_size={n_pos}: the model has no "
                "position embedding beyond it"
            )
        for i, block in enumerate(self.blocks):
            if not takes_state(block.mixer):
                raise TypeError(
                    f"the token mixer of block {i}, {type(block.mixer).__name__}, cannot decode: "
                    "its forward must take (x, state=None, return_state=False) (gpt2kimi.backbone)"
                )
        if max_len is None and any(hasattr(b.mixer, "init_state") for b in self.blocks):
            raise ValueError("max_len is needed: a KV cache is allocated for the longest sequence")
        weight = self.embed.weight
        return ModelCache(
            [
                BlockState(
                    block.mixer.init_state(
                        batch_size, max_len, dtype=weight.dtype, device=weight.device
                    )
                    if hasattr(block.mixer, "init_state")
                    else None
                )
                for block in self.blocks
            ]
        )

    def check_input(self, idx: Tensor, start: int = 0) -> None:
        """Raise a clear error for ids of the wrong shape, out of range, or too long.

        ``start`` is the position of idx's first token. Ids that continue a sequence
        (``start > 0``) are not range-checked: that check waits for the device (a sync at every
        decoding step), the prompt had it, and generated ids lie in range by construction.
        """
        if idx.dim() != 2:
            raise ValueError(f"expected token ids of shape [B, T], got {tuple(idx.shape)}")
        if idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"token ids must be integers, got {idx.dtype}")
        if idx.size(1) == 0:
            raise ValueError(
                f"a sequence needs at least one token: expected ids of shape [B, T] with T >= 1, "
                f"got {tuple(idx.shape)}"
            )
        n_pos = self.config.block_size
        if n_pos is not None and start + idx.size(1) > n_pos:
            raise ValueError(
                f"sequence of {start + idx.size(1)} tokens is longer than block_size={n_pos}, "
                "the number of learned positions"
            )
        if start == 0 and idx.numel() and (idx.min() < 0 or idx.max() >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}), "
                f"got min {idx.min().item()} and max {idx.max().item()}"
            )

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, *, cache: ModelCache | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """idx [B, T] → logits [B, T, vocab]; with targets [B, T], also the mean loss.

        With a cache (:meth:`new_cache`), idx holds the T tokens that follow the ``cache.pos``
        cached ones; every block's state and ``cache.pos`` are updated in place.
        """
        start = 0 if cache is None else cache.pos
        self.check_input(idx, start)
        x = self.embed(idx)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(start, start + idx.size(1), device=idx.device))
        x = dropout(self.drop, x)
        for i, block in enumerate(self.blocks):
            if cache is None:
                x = block(x)
            else:  # thread the states: each block reads its own and leaves the new one
                x, cache.layers[i] = block(x, cache.layers[i], return_state=True)
        if cache is not None:
            cache.pos += idx.size(1)
        if cache is not None and idx.size(1) == 1 and not torch.is_grad_enabled():
            logits = self.decode_logits(self.norm_f(x), cache)  # one decoded token
        else:
            logits = self.lm_head(self.norm_f(x))
        if targets is None:
            return logits
        if targets.shape != idx.shape:
            raise ValueError(
                f"targets must have the shape of idx {tuple(idx.shape)}, got {tuple(targets.shape)}"
            )
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return logits, loss

    def decode_logits(self, h: Tensor, cache: ModelCache) -> Tensor:
        """The logits of one decoded token, h [B, 1, d] → [B, 1, vocab]: ``lm_head``'s product,
        its weight read in [d, vocab] memory order from ``cache.head`` (set at the first decoded
        token, for as long as the cache lives): the stored matrix itself where the model keeps
        it in that order (:func:`store_transposed`, as chapter 2's GPT-2 does), otherwise a
        transposed copy.

        A matrix-vector product reads a wide matrix faster in that layout than in
        ``nn.Linear``'s [vocab, d], and at batch 1 the head is one long read (a third of GPT-2
        small's weights); a copy costs the head's bytes once more while decoding.
        """
        weight, head = self.lm_head.weight, cache.head
        if head is None or (head.dtype, head.device) != (weight.dtype, weight.device):
            head = cache.head = d_by_vocab(weight)
        logits = h @ head
        return logits if self.lm_head.bias is None else logits + self.lm_head.bias


# At most this many tokens, and no autograd: a decode step. There each PyTorch call's fixed cost
# outweighs its arithmetic, and layers take paths with fewer calls (equal up to rounding).
DECODE_TOKENS = 8


def is_decode_step(x: Tensor) -> bool:
    """Whether x [..., d] is a decode step's input: at most DECODE_TOKENS rows, no autograd."""
    return not torch.is_grad_enabled() and x.numel() <= DECODE_TOKENS * x.shape[-1]


def decode_layout(module: nn.Module, make: Callable[[], Any]) -> Any:
    """``make()``: weights of ``module`` copied into the layout a decode step reads (stacked,
    transposed), kept on the module and made again only when one of its parameters changes
    (an optimizer step or ``load_state_dict`` bumps a parameter's version, ``.to()`` gives it
    new storage, ``load_state_dict(assign=True)`` a new tensor). A decoded token runs every
    layer once, so the copy is paid once, not per token.

    One layout per module (``make`` must always build the same thing). With gradients enabled
    it is made afresh at each call, so that autograd sees the parameters themselves. A layout
    costs the bytes it copies for as long as it is kept: :func:`release_decode_layouts` drops
    them (``generate`` does, once its tokens are out).
    """
    if torch.is_grad_enabled():
        return make()
    cached = module.__dict__.get("_decode_layout")
    if cached is None or cached[1] != _parameter_versions(cached[0]):
        # each parameter by its owner and name: a parameter replaced by a new tensor is seen
        owners = [(m, name) for m in module.modules() for name, p in m._parameters.items()
                  if p is not None]
        cached = module.__dict__["_decode_layout"] = (owners, _parameter_versions(owners), make())
    return cached[2]


def transposed(weight: Tensor, rows: int = 256) -> Tensor:
    """``weight.t()`` [in, out] as a new contiguous tensor, from weight [out, in].

    Copied ``rows`` rows at a time: a large matrix transposed in one copy strides through
    memory, and on this CPU takes about twice as long as block by block, where each block's
    rows and the columns they become stay in cache (GPT-2 small's head, say). The values are
    the same.
    """
    out = weight.new_empty(weight.shape[1], weight.shape[0])
    for start in range(0, weight.shape[0], rows):
        out[:, start : start + rows] = weight[start : start + rows].t()
    return out


def d_by_vocab(weight: Tensor) -> Tensor:
    """An output head's ``weight`` [vocab, d] as the [d, vocab] matrix a decoded token's
    product reads: the stored matrix itself where it is kept in that memory order
    (:func:`store_transposed`), otherwise a :func:`transposed` copy."""
    stored = weight.detach().t()
    return stored if stored.is_contiguous() else transposed(weight.detach())


def store_transposed(module: nn.Module) -> nn.Module:
    """Keep the weight of every widening ``nn.Linear`` inside ``module`` (as many outputs as
    inputs, or more) in [in, out] memory order, in place, and return ``module``.

    Each such weight becomes a transposed copy seen through ``.t()``: still the [out, in]
    matrix ``nn.Linear`` computes with (same values, names, shapes), stored as GPT-2's
    checkpoint stores it. That changes how a decoded token's product reads it: in [out, in]
    each output is a dot product of one row, in [in, out] each input scales one contiguous row
    of outputs. On this CPU the second streams a widening matrix faster, while a narrowing one
    (few long rows, GPT-2's MLP output) reads faster as dot products and is left as it is
    (chapter 2 measures both). A weight that other modules share stays shared: each of them
    gets the copy (a head tied to the embedding, whose lookups then read strided rows).
    """
    # id(weight): (weight, its copy); the weight is kept so that its id cannot be reused by a
    # new object before the second loop has replaced it everywhere
    copies: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.out_features >= m.in_features:
            weight = m.weight
            if id(weight) not in copies:
                copy = nn.Parameter(transposed(weight.detach()).t(), weight.requires_grad)
                copies[id(weight)] = (weight, copy)
    for m in module.modules():  # every holder of a copied weight, tied ones included
        for name, p in m._parameters.items():
            if p is not None and id(p) in copies:
                m._parameters[name] = copies[id(p)][1]
    return module


def release_decode_layouts(model: nn.Module) -> None:
    """Drop the decode layouts (:func:`decode_layout`) kept on ``model``'s modules: their memory
    is freed, and the next decoded token makes them again."""
    for module in model.modules():
        module.__dict__.pop("_decode_layout", None)


def _parameter_versions(owners: list[tuple[nn.Module, str]]) -> tuple:
    """Storage, version counter and dtype of each parameter: they change when its values do."""
    return tuple(
        (p.data_ptr(), p._version, p.dtype) for p in (m._parameters[name] for m, name in owners)
    )


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
