"""Chapter 1: GPT-2, a pure Transformer. Attention reads everything, every time.

Faithful to GPT-2 (Radford et al. 2019) as released in Hugging Face ``transformers``: pre-norm
blocks, GELU with the tanh approximation, LayerNorm eps 1e-5, learned positions, a head tied to the
token embedding, biases everywhere, and nanoGPT's initialisation. ``GPT2(GPT2Config())`` is GPT-2
small with exactly 124,439,808 parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpt2kimi.accounting import PRESETS


@dataclass
class GPT2Config:
    """Defaults are GPT-2 small."""

    vocab_size: int = 50257
    block_size: int = 1024  # the longest sequence the learned positions cover
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                "each head needs an equal share of the embedding"
            )

    @classmethod
    def from_name(cls, name: str, **overrides) -> GPT2Config:
        """One of ``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT-2 size {name!r}; expected one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def causal_attention_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Attention probabilities ``softmax(Q Kᵀ / √d + mask)``: q, k [B, H, T, D] → [B, H, T, T].

    The mask sets every score of a future position to -inf, so its probability is 0.
    """
    T = q.size(-2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # [B, H, T, T]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), diagonal=1)
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention written out: q, k, v [B, H, T, D] → [B, H, T, D].

    Materialises the full T×T matrix; ``F.scaled_dot_product_attention`` computes the same thing
    without storing it.
    """
    return causal_attention_probs(q, k) @ v


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, C] → q, k, v, each [B, H, T, C/H]."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        return tuple(t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, C] → [B, T, C]. Every position attends to itself and all earlier ones."""
        B, T, C = x.shape
        q, k, v = self.split_heads(x)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads
        return self.c_proj(y)

    @torch.no_grad()
    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """The attention probabilities [B, H, T, T] for input x [B, T, C] (for plots)."""
        q, k, _ = self.split_heads(x)
        return causal_attention_probs(q, k)


class MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 used the tanh approximation of GELU; keep it to match the released weights.
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """A pre-norm Transformer block: attention mixes tokens, the MLP processes each token."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2(nn.Module):
    """GPT-2: token + position embeddings, ``n_layer`` blocks, a final LayerNorm, a tied head."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying: one matrix, two uses
        self.apply(self._init_weights)
        # GPT-2 scales the init of each residual output projection by 1/√(2L): every block adds
        # two of them to the residual stream, and the sum should not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def check_input(self, idx: torch.Tensor, start: int = 0) -> None:
        """Raise a clear error for ids of the wrong shape, out of range, or too long."""
        if idx.dim() != 2:
            raise ValueError(f"expected token ids of shape [B, T], got {tuple(idx.shape)}")
        if idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"token ids must be integers, got {idx.dtype}")
        T = idx.size(1)
        if T == 0:
            raise ValueError(
                f"a sequence needs at least one token: expected ids of shape [B, T] with T >= 1, "
                f"got {tuple(idx.shape)}"
            )
        if start + T > self.config.block_size:
            raise ValueError(
                f"sequence of {start + T} tokens is longer than block_size="
                f"{self.config.block_size}, the number of learned positions"
            )
        if idx.numel() and (idx.min() < 0 or idx.max() >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}), "
                f"got min {idx.min().item()} and max {idx.max().item()}"
            )

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """idx [B, T] → logits [B, T, vocab_size]; with targets [B, T], also the mean loss.

        Targets equal to -100 are ignored by the loss.
        """
        self.check_input(idx)
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` tokens to idx [B, T]; returns [B, T + max_new_tokens].

        Each step runs the whole sequence through the model again (chapter 2 fixes that), and
        keeps only the last ``block_size`` tokens as context.
        """
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits = self(context)[:, -1, :]
            next_id = sample_next_token(logits, temperature, top_k, generator)
            idx = torch.cat([idx, next_id], dim=1)
        return idx

    @classmethod
    def from_hf_state_dict(cls, state_dict: dict[str, torch.Tensor], config: GPT2Config) -> GPT2:
        """Build a model from a Hugging Face ``GPT2LMHeadModel`` state dict (see module notes)."""
        model = cls(config)
        model.load_state_dict(convert_hf_state_dict(state_dict, model))
        return model

    @classmethod
    def from_pretrained(cls, name: str = "gpt2") -> GPT2:
        """Load the released GPT-2 weights with ``transformers`` (needs internet; optional)."""
        try:
            from transformers import GPT2LMHeadModel
        except ImportError as err:
            raise ImportError(
                "from_pretrained needs the optional 'transformers' package: "
                "pip install 'gpt2kimi[hf]'"
            ) from err
        hf = GPT2LMHeadModel.from_pretrained(name)
        return cls.from_hf_state_dict(hf.state_dict(), GPT2Config.from_name(name))


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick the next token from logits [B, V] → ids [B, 1]. Temperature 0 means greedy."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator)


# Hugging Face's GPT-2 stores these four projections as Conv1D, with weights shaped (in, out).
CONV1D_WEIGHTS = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)
# Causal-mask buffers saved by some versions of transformers; not parameters.
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


class CheckpointError(ValueError):
    """A state dict that does not fit the model; the message lists every problem."""


def convert_hf_state_dict(
    state_dict: dict[str, torch.Tensor], model: GPT2
) -> dict[str, torch.Tensor]:
    """Map a Hugging Face GPT-2 state dict onto ``model``'s keys and layouts.

    Accepts keys with or without the ``transformer.`` prefix, transposes the Conv1D weights, skips
    the causal-mask buffers (and nothing else), and accepts a missing ``lm_head.weight`` (it is
    tied to the token embedding). Raises :class:`CheckpointError` listing missing keys, unexpected
    keys and mismatched shapes.
    """
    expected = model.state_dict()
    converted: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for key, tensor in state_dict.items():
        if key.endswith(MASK_BUFFERS):
            continue
        name = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
        if name not in expected:
            unexpected.append(key)
            continue
        converted[name] = tensor.t() if name.endswith(CONV1D_WEIGHTS) else tensor
    if "lm_head.weight" not in converted and "transformer.wte.weight" in converted:
        converted["lm_head.weight"] = converted["transformer.wte.weight"]
    # report in the checkpoint's names and layout: its prefix (if it has one), Conv1D as (in, out)
    prefixed = not state_dict or any(k.startswith("transformer.") for k in state_dict)
    names = {k: k if prefixed else k.removeprefix("transformer.") for k in expected}
    wanted = {k: t for k, t in expected.items() if k != "lm_head.weight" or k in converted}
    report = checkpoint_problems(  # (a missing head is tied: the missing wte is named)
        conv1d_as_stored(wanted), conv1d_as_stored(converted), unexpected, names
    )
    if report:
        raise CheckpointError("cannot load GPT-2 checkpoint; " + report)
    return converted


def conv1d_as_stored(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with the Conv1D weights transposed (views) to Hugging Face's (in, out)."""
    return {k: t.t() if k.endswith(CONV1D_WEIGHTS) else t for k, t in state_dict.items()}


def checkpoint_problems(
    expected: dict[str, torch.Tensor],
    found: dict[str, torch.Tensor],
    unexpected: list[str],
    names: dict[str, str] | None = None,
) -> str:
    """One message naming every missing key, unexpected key and shape mismatch ('' if none).

    ``expected`` and ``found`` are keyed by the model's names; ``names`` maps those back to the
    checkpoint's, so that missing and mis-shaped keys are named as the checkpoint spells them
    (``unexpected`` already is).
    """
    names = names or {}
    missing = sorted(names.get(k, k) for k in set(expected) - set(found))
    mismatched = [
        f"{names.get(k, k)}: checkpoint {tuple(t.shape)} vs model {tuple(expected[k].shape)}"
        for k, t in found.items()
        if t.shape != expected[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {missing}")
    if unexpected:
        problems.append(f"unexpected keys: {sorted(unexpected)}")
    if mismatched:
        problems.append(f"mismatched shapes: {mismatched}")
    return "; ".join(problems)
