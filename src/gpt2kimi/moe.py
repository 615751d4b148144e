"""Mixture of Experts: many feed-forward networks, a router that picks a few for each token.

A dense feed-forward network applies all its parameters to every token. A Mixture of Experts
(MoE) layer holds E feed-forward networks, the *experts*, and a *router* that sends each token to
only k of them: the layer's parameters grow with E, its compute per token only with k. This is
how DeepSeek-V3, Kimi K2, Kimi Linear and Kimi K3 hold hundreds of billions of parameters and use
a few percent of them per token.

The module follows the MoE of ``transformers``' Kimi Linear and DeepSeek-V3 (names and shapes,
so ``MoE.load_state_dict(hf_moe.state_dict())`` works as is):

- ``gate.weight [E, d]`` and the buffer ``gate.e_score_correction_bias [E]``: the router;
- ``experts.gate_up_proj [E, 2I, d]`` (each expert's gate rows, then its up rows) and
  ``experts.down_proj [E, d, I]``: E SwiGLU experts of width I, stored as stacked tensors;
- ``shared_experts.{gate_proj, up_proj, down_proj}``: one SwiGLU of width
  ``I · n_shared_experts`` that every token passes through.

The layer's shape and routing are a :class:`~gpt2kimi.configs.MoEConfig`; its parameters, total
and active, are counted by :func:`gpt2kimi.accounting.moe_param_count`.

The pieces the chapter shows are plain functions: :func:`route` (scores, top-k choice, weights),
:func:`dispatch` (sort token copies by expert, one matrix product per expert hit, scatter back),
:func:`moe_reference` (the same layer as a loop over tokens, the definition the tests compare
with), and the two ways to balance the experts' load: :func:`load_balancing_loss` (Switch
Transformer's auxiliary loss) and :meth:`MoE.update_bias` (DeepSeek-V3's auxiliary-loss-free
bias). :class:`AuxLossWrapper` connects both to :func:`gpt2kimi.train.train` without changing it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpt2kimi.backbone import SwiGLU, decode_layout, is_decode_step, swiglu
from gpt2kimi.configs import MoEConfig
from gpt2kimi.native import (
    NativeWeights,
    fused_moe_decode_step,
    moe_step_weights,
    native_available,
)

# ----------------------------------------------------------------------------------------------
# routing


@dataclass
class Routing:
    """What the router decided for N tokens (everything the chapter plots).

    ``experts [N, k]`` the chosen experts, ``weights [N, k]`` their weights (fp32),
    ``scores [N, E]`` the router's scores (sigmoid or softmax, fp32, before any bias),
    ``tokens_per_expert [E]`` how many tokens each expert received.
    """

    experts: Tensor
    weights: Tensor
    scores: Tensor
    tokens_per_expert: Tensor


def route(x: Tensor, weight: Tensor, bias: Tensor | None, config: MoEConfig) -> Routing:
    """Score every expert for every token, choose k, and weight the chosen ones.

    x [N, d], weight [E, d], bias [E] or None. The bias only *selects* (``scores + bias`` picks
    the experts); the weights come from the unbiased scores. Computed in fp32, as the reference.
    """
    # (in fp32: .float() costs a call even on an fp32 tensor, which a decoded token notices)
    x, weight = (t if t.dtype == torch.float32 else t.float() for t in (x, weight))
    scores = F.linear(x, weight)
    scores = scores.sigmoid() if config.router == "sigmoid" else scores.softmax(dim=-1)
    choice = scores if bias is None else scores + bias
    if config.n_group > 1:
        choice = limit_to_best_groups(choice, config.n_group, config.topk_group)
    experts = choice.topk(config.top_k, dim=-1, sorted=False).indices  # [N, k]
    weights = scores.gather(1, experts)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if config.routed_scaling_factor != 1.0:  # (skipped: a multiply by 1 changes no bit)
        weights = weights * config.routed_scaling_factor
    tokens_per_expert = torch.bincount(experts.flatten(), minlength=config.n_experts)
    return Routing(experts, weights, scores, tokens_per_expert)


def limit_to_best_groups(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """Set to -inf the experts outside each token's ``topk_group`` best groups.

    choice [N, E]; a group's score is the sum of its two best experts' values (DeepSeek-V3).
    """
    N, E = choice.shape
    grouped = choice.view(N, n_group, E // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, n_group]
    best = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(N, E)


# ----------------------------------------------------------------------------------------------
# experts and dispatch


def dispatch(x: Tensor, routing: Routing, gate_up_proj: Tensor, down_proj: Tensor) -> Tensor:
    """Σ_j w_j · expert_{e_j}(x) for every token, with one matrix product per expert hit.

    x [N, d] → [N, d]. The N·k (token, expert) pairs are sorted by expert, so each expert's
    tokens form one contiguous slice of the sorted list; each expert runs once on its slice and
    adds its weighted outputs back to their tokens with ``index_add_``. An expert that received
    no token costs nothing. The Python loop runs over experts, never over tokens.
    """
    k = routing.experts.shape[1]
    order = routing.experts.flatten().argsort(stable=True)  # pairs grouped by expert
    token = order // k  # the token of each sorted pair
    weight = routing.weights.flatten()[order, None].to(x.dtype)  # [N·k, 1]
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(routing.tokens_per_expert.tolist()):
        if count == 0:
            continue  # an idle expert: no work at all
        rows = slice(start, start + count)
        x_e = x.index_select(0, token[rows])  # this expert's tokens, gathered
        y_e = swiglu(x_e, gate_up_proj[e], down_proj[e], weight[rows])
        # under autocast the expert computes in bf16: accumulate in x's own dtype
        out.index_add_(0, token[rows], y_e.to(out.dtype))
        start += count
    return out


def dispatch_pairs(
    x: Tensor, routing: Routing, gate_up_proj: Tensor, down_proj: Tensor
) -> Tensor:
    """:func:`dispatch` for a handful of tokens (a decoded token or a few): one expert call per
    (token, expert) pair, with none of the sorting, gathering and scattering that pays off only
    when an expert serves many tokens. x [N, d] → [N, d]; equal to :func:`dispatch` up to the
    order of the sum over a token's k experts.
    """
    rows = []
    for n, (experts, weights) in enumerate(
        zip(routing.experts.tolist(), routing.weights.tolist(), strict=True)
    ):
        x_n = x if len(x) == 1 else x[n : n + 1]
        y = [swiglu(x_n, gate_up_proj[e], down_proj[e], w)
             for e, w in zip(experts, weights, strict=True)]
        rows.append(sum(y[1:], y[0]))  # Σ_j w_j · expert_{e_j}(x_n)
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def dispatch_all(x: Tensor, routing: Routing, gate_up_proj: Tensor, down_proj: Tensor) -> Tensor:
    """:func:`dispatch` for a decoded batch whose tokens reach about every expert: every expert
    runs on every token, in one batched matrix product per weight, and each token's experts it
    did not choose are weighted 0. x [N, d] → [N, d]; equal to :func:`dispatch` up to the order
    of the sum over experts.

    E/k times the arithmetic of :func:`dispatch`, on weights it reads anyway (with N·k >= E
    pairs most experts are hit), in a fixed handful of calls instead of several per expert: at
    a few tokens the calls, not the arithmetic, set the time.
    """
    E = gate_up_proj.shape[0]
    weights = x.new_zeros(len(x), E).scatter_(1, routing.experts, routing.weights.to(x.dtype))
    gate, up = torch.matmul(x, gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I] each
    hidden = F.silu(gate) * up * weights.t()[..., None]  # scaled by w_{n,e}, 0 if not chosen
    return torch.bmm(hidden, down_proj.transpose(1, 2)).sum(dim=0)  # Σ_e: [N, d]


class Experts(nn.Module):
    """E SwiGLU experts stored as two stacked tensors, the layout of ``transformers``.

    Fewer (token, expert) pairs than experts (decoding) go through :func:`dispatch_pairs`, and
    a decoded batch with more through :func:`dispatch_all`; everything else through
    :func:`dispatch`, whose loop runs at most ``min(N·k, E)`` expert calls.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        E, d, I = config.n_experts, config.d_model, config.expert_hidden
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, d) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(E, d, I) * 0.02)

    def forward(self, x: Tensor, routing: Routing) -> Tensor:
        if 0 < routing.experts.numel() < len(self.gate_up_proj):
            run = dispatch_pairs
        else:
            run = dispatch_all if is_decode_step(x) else dispatch
        return run(x, routing, self.gate_up_proj, self.down_proj)


class TopKRouter(nn.Module):
    """The router: ``weight [E, d]`` (trained) and ``e_score_correction_bias [E]`` (a buffer,
    moved by :meth:`MoE.update_bias`, never by gradients)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.randn(config.n_experts, config.d_model) * 0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_experts))

    def forward(self, x: Tensor) -> Routing:
        return route(x, self.weight, self.e_score_correction_bias, self.config)


class MoE(nn.Module):
    """A Mixture-of-Experts feed-forward layer: x [B, T, d] → [B, T, d].

    ``y = Σ_j w_j · expert_{e_j}(x) + shared(x)`` per token. After each forward pass the layer
    keeps its decision in ``last_routing`` (for plots and for :meth:`aux_loss`), and, in training
    mode, adds the tokens each expert received to ``load`` (for :meth:`update_bias`).
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        shared_hidden = config.expert_hidden * config.n_shared_experts
        self.shared_experts = SwiGLU(config.d_model, shared_hidden) if shared_hidden else None
        self.last_routing: Routing | None = None
        self.register_buffer("load", torch.zeros(config.n_experts), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.config.d_model:
            raise ValueError(f"expected [..., d_model={self.config.d_model}], got {tuple(x.shape)}")
        flat = x.reshape(-1, x.shape[-1])
        fused = self.fused_step(flat) if is_decode_step(x) and not self.training else None
        if fused is not None:  # a decoded token: the same layer in one compiled call
            y, routing = fused
        else:
            routing = self.gate(flat)
            y = self.experts(flat, routing)
            if self.shared_experts is not None:
                y = y + self.shared_experts(flat)
        self.last_routing = routing
        if self.training:
            self.load += routing.tokens_per_expert
        return y.view(x.shape)

    def fused_step(self, x: Tensor) -> tuple[Tensor, Routing] | None:
        """The layer for a few decoded tokens x [N, d] in one compiled C call
        (:func:`~gpt2kimi.native.fused_moe_decode_step`, tested equal to :meth:`forward`'s
        PyTorch path): ``(y [N, d], the routing)``, or None where that does not apply: no C
        compiler, gradients on, group-limited routing, not fp32 on the CPU. A decoded token's forty
        PyTorch calls become one C call and seven PyTorch calls (the outputs' allocations)."""
        if self.config.n_group > 1 or torch.is_grad_enabled() or not native_available():
            return None
        weights = decode_layout(self, self._step_weights)  # checked once, not per token
        fused = None if weights is None else fused_moe_decode_step(
            x, self.gate.e_score_correction_bias, weights)
        if fused is None:
            return None
        y, scores, experts, chosen, tokens_per_expert = fused
        return y, Routing(experts, chosen, scores, tokens_per_expert)

    def _step_weights(self) -> NativeWeights | None:
        c, shared = self.config, self.shared_experts
        return moe_step_weights(
            self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj,
            None if shared is None else (shared.gate_proj.weight, shared.up_proj.weight,
                                         shared.down_proj.weight),
            top_k=c.top_k, softmax=c.router == "softmax", norm_topk_prob=c.norm_topk_prob,
            scaling=c.routed_scaling_factor)

    def aux_loss(self) -> Tensor:
        """Switch Transformer's balance loss ``E · Σ f_i P_i`` of the last forward pass."""
        if self.last_routing is None:
            raise RuntimeError("aux_loss() needs a forward pass first")
        return load_balancing_loss(self.last_routing)

    @torch.no_grad()
    def update_bias(self, gamma: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing, called once after each training step.

        Each expert whose load (tokens since the last call) is above the mean has its bias
        lowered by γ, each one below raised by γ; then the load counter restarts. The bias only
        changes which experts are chosen, never the weights of a chosen expert.
        """
        self.gate.e_score_correction_bias += gamma * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


def load_balancing_loss(routing: Routing) -> Tensor:
    """Switch Transformer's auxiliary loss ``E · Σ_i f_i P_i`` (multiply by α to train with it).

    ``f_i``: the share of the N·k token copies sent to expert i (counted, no gradient);
    ``P_i``: the mean over tokens of the router's probability for expert i (sigmoid scores are
    first normalised per token to sum to 1, as in DeepSeek-V3's balance loss). Equals 1 when
    load and probabilities are uniform, and grows as they concentrate on the same experts.
    """
    E = routing.scores.shape[-1]
    f = routing.tokens_per_expert.float() / routing.experts.numel()
    probs = routing.scores / routing.scores.sum(dim=-1, keepdim=True)
    return E * (f * probs.mean(dim=0)).sum()


def moe_reference(moe: MoE, x: Tensor) -> Tensor:
    """The same layer as a plain loop over tokens and their chosen experts (the definition).

    x [B, T, d] → [B, T, d]. Slow on purpose: the tests check :class:`MoE` against it.
    """
    flat = x.reshape(-1, x.shape[-1])
    routing = moe.gate(flat)
    w_gate_up, w_down = moe.experts.gate_up_proj, moe.experts.down_proj
    rows = []
    for n in range(flat.shape[0]):
        y = torch.zeros_like(flat[n])
        for e, w in zip(routing.experts[n].tolist(), routing.weights[n], strict=True):
            y = y + w * swiglu(flat[n : n + 1], w_gate_up[e], w_down[e])[0]
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(flat[n])
        rows.append(y.to(x.dtype))
    return torch.stack(rows).view(x.shape)


def dense_equivalent(config: MoEConfig) -> SwiGLU:
    """A dense SwiGLU with as many active parameters as the MoE (minus the small router).

    Hidden width ``(top_k + n_shared_experts) · expert_hidden``: every token goes through as many
    weights as through its k routed experts and the shared ones.
    """
    return SwiGLU(config.d_model, config.active_hidden)


def moe_ffn(
    d_model: int,
    n_experts: int = 8,
    top_k: int = 2,
    n_shared_experts: int = 1,
    expert_hidden: int | None = None,
) -> MoE:
    """A feed-forward constructor for :class:`gpt2kimi.backbone.LanguageModel`.

    By default 8 experts, top-2, one shared, each expert ``d_model`` wide, so that a token's
    active width ``(2 + 1) · d_model`` is close to the backbone's default SwiGLU (``8/3 · d``).
    """
    hidden = d_model if expert_hidden is None else expert_hidden
    return MoE(MoEConfig(d_model, n_experts, top_k, hidden, n_shared_experts=n_shared_experts))


# ----------------------------------------------------------------------------------------------
# balancing during training, without changing the training loop


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every :class:`MoE` inside ``model``."""
    return [m for m in model.modules() if isinstance(m, MoE)]


class AuxLossWrapper(nn.Module):
    """Adds MoE balancing to any model whose ``model(x, y)`` returns ``(logits, loss)``.

    - ``aux_alpha > 0``: the training loss becomes ``loss + α · mean over layers of
      aux_loss()`` (Switch Transformer). Validation losses (eval mode) stay the plain loss.
    - ``bias_gamma > 0``: DeepSeek-V3's bias update with step γ. The update for step t runs at
      the start of the training forward pass of step t + 1 (and only then: evaluation passes do
      not count), which is the same as running it right after step t's optimizer step, without
      needing a hook in :func:`gpt2kimi.train.train`.

    ``load_history`` records, for every training step, each layer's tokens per expert.
    """

    def __init__(self, model: nn.Module, aux_alpha: float = 0.0, bias_gamma: float = 0.0) -> None:
        super().__init__()
        if aux_alpha < 0 or bias_gamma < 0:
            raise ValueError(
                f"aux_alpha and bias_gamma must be >= 0, got {aux_alpha} and {bias_gamma}"
            )
        self.model = model
        self.aux_alpha = aux_alpha
        self.bias_gamma = bias_gamma
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("the model has no MoE layer to balance")
        self.load_history: list[list[list[int]]] = []  # [step][layer][expert]

    def forward(self, x: Tensor, y: Tensor | None = None):
        if self.training and self.bias_gamma > 0 and self.load_history:
            for layer in self.layers:  # the previous training step's update
                layer.update_bias(self.bias_gamma)
        out = self.model(x, y) if y is not None else self.model(x)
        if self.training:
            self.load_history.append(
                [layer.last_routing.tokens_per_expert.tolist() for layer in self.layers]
            )
            if y is not None and self.aux_alpha > 0:
                logits, loss = out
                aux = torch.stack([layer.aux_loss() for layer in self.layers]).mean()
                return logits, loss + self.aux_alpha * aux
        return out
