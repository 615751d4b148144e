"""Chapter 9: the small Kimi on many devices: expert, context and data parallelism.

One device holds neither Kimi Linear's 48B parameters with their optimizer state nor the
activations of a million-token context. This module splits chapter 8's hybrid over W processes
with PyTorch's own distributed engine (``torch.distributed``: a process group, all-to-all,
all-gather, ``fully_shard``; gloo on CPU, NCCL on GPUs, the code is the same), and each split
is **exactly** the one-process model on the same weights:

- **Expert parallelism** (GShard, arXiv 2006.16668; DeepSeek-V3, arXiv 2412.19437, used
  64-way, Kimi K2 16-way): :class:`ExpertParallelMoE` keeps ``E / W`` of a layer's experts on
  each rank. Each rank routes its own tokens, and two all-to-alls carry every token copy to its
  expert's rank and the result back.
- **Context parallelism** (LASP-2, arXiv 2502.07563, and its hybrid form LASP-2H;
  Megatron-Core's chunkwise context parallelism): :func:`context_parallel_forward` gives
  rank r the r-th slice of every sequence. A KDA layer summarises its slice as an affine map
  of the incoming memory, ``S_out = M S_in + ΔS``, whose size does not depend on the slice's
  length, and the ranks all-gather those summaries; an MLA layer all-gathers its compressed
  latents.
- **Data parallelism with sharded weights** (ZeRO, PyTorch's FSDP2): :func:`shard_data_parallel`
  wraps each block and the model in ``fully_shard``; each rank trains on its part of the batch
  and holds ``1 / W`` of every weight, gradient and optimizer state.

Every collective's traffic is counted in a :class:`Traffic` (bytes a rank sends to the others),
the numbers the chapter's communication model scales up. :func:`launch` runs a function on W
fresh local processes (gloo, a free localhost port, a timeout); ``python -m gpt2kimi.parallel
demo --nproc 2`` runs every check that way (``torchrun`` works as well: the functions only need
an initialised process group).
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpt2kimi.backbone import LanguageModel
from gpt2kimi.configs import HybridConfig, KDAConfig, MLAConfig, MoEConfig
from gpt2kimi.deltanet import DeltaNetState
from gpt2kimi.kda import KimiDeltaAttention
from gpt2kimi.kimi_linear import KimiHybrid
from gpt2kimi.mla import MultiHeadLatentAttention
from gpt2kimi.moe import MoE, Routing, dispatch
from gpt2kimi.ops import chunk_kda

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# ----------------------------------------------------------------------------------------------
# process groups, shares and traffic


def process_group(group: dist.ProcessGroup | None, what: str) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group`` (None: the default group), or a ValueError naming
    ``what`` when no process group has been initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{what} needs an initialised process group: call "
            "torch.distributed.init_process_group(...) in every process first (or start the "
            "processes with torchrun or gpt2kimi.parallel.launch)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def expert_range(n_experts: int, rank: int, world_size: int) -> range:
    """The experts rank ``rank`` holds: the ``rank``-th of ``world_size`` equal, contiguous
    shares of ``n_experts`` (GShard's layout: expert e lives on rank ``e // (E / W)``)."""
    if n_experts % world_size:
        raise ValueError(
            f"world size {world_size} does not divide the {n_experts} experts: expert "
            "parallelism gives every rank the same number of experts (choose a world size "
            f"that divides {n_experts})"
        )
    per_rank = n_experts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def sequence_slice(seq_len: int, rank: int, world_size: int) -> slice:
    """The positions rank ``rank`` holds under context parallelism: the ``rank``-th of
    ``world_size`` equal, contiguous slices of a sequence of ``seq_len`` tokens."""
    if seq_len % world_size:
        raise ValueError(
            f"world size {world_size} does not divide the sequence length {seq_len}: context "
            "parallelism gives every rank a slice of the same length (pad or trim the "
            f"sequence to a multiple of {world_size})"
        )
    n = seq_len // world_size
    return slice(rank * n, (rank + 1) * n)


def split_sequence(idx: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's slice ``[B, T / W]`` of token ids ``[B, T]`` (contiguous, rank order)."""
    rank, world = process_group(group, "split_sequence")
    return idx[:, sequence_slice(idx.size(1), rank, world)]


@dataclass
class Traffic:
    """The bytes one rank sent to the other ranks, by what they carried.

    Only what leaves the rank counts: the share of an all-to-all a rank keeps for itself, and
    its own piece of an all-gather, are local copies.
    """

    sent: dict[str, int] = field(default_factory=dict)

    def add(self, what: str, nbytes: int) -> None:
        self.sent[what] = self.sent.get(what, 0) + int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.sent.values())


def all_gather(x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Every rank's ``x`` (same shape on each), stacked in rank order: ``[W, *x.shape]``."""
    _, world = process_group(group, "all_gather")
    pieces = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.stack(pieces)


class AllToAll(torch.autograd.Function):
    """``torch.distributed.all_to_all_single`` with a backward pass.

    Rank r sends rows ``send[r → s]`` of x (consecutive runs of ``send_splits[s]`` rows) to each
    rank s and receives ``recv_splits[s]`` rows from each. The gradient of a permutation of rows
    is the inverse permutation: the backward pass is the same exchange with the splits swapped.
    (``torch.distributed._functional_collectives.all_to_all_single_autograd`` does the same.)
    """

    @staticmethod
    def forward(ctx, x, recv_splits, send_splits, group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        grad_x = grad.new_empty(sum(send_splits), *grad.shape[1:])
        dist.all_to_all_single(grad_x, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return grad_x, None, None, None


def all_to_all(
    x: Tensor,
    recv_splits: list[int],
    send_splits: list[int],
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Rows of x ``[sum(send_splits), ...]`` → ``[sum(recv_splits), ...]`` (autograd-aware)."""
    return AllToAll.apply(x, recv_splits, send_splits, group)


# ----------------------------------------------------------------------------------------------
# expert parallelism


class ExpertParallelMoE(nn.Module):
    """A :class:`~gpt2kimi.moe.MoE` whose experts are spread over the ranks of a process group.

    Built on every rank from the same full ``moe``; rank r keeps the experts
    :func:`expert_range` gives it (``E / W`` of them, under ``experts.gate_up_proj`` and
    ``experts.down_proj``, the full layer's names and a slice of its tensors), and a copy of the
    router and of the shared expert, which every rank runs on its own tokens. x [B, T, d] →
    [B, T, d], equal to ``moe(x)`` for this rank's tokens. A forward pass (GShard; torchtitan's
    ``expert_parallel.py``):

    1. route this rank's N tokens with the MoE's own :func:`~gpt2kimi.moe.route` and sort the
       N·k token copies by expert, so that each destination rank's copies form one run;
    2. exchange the per-expert counts (an all-to-all of E integers): each rank learns how many
       rows it will receive from each rank, for each of its experts;
    3. all-to-all the token copies to their experts' ranks;
    4. run the local experts with chapter 7's sorted :func:`~gpt2kimi.moe.dispatch`;
    5. all-to-all the results back, in the order they left;
    6. combine: ``y_n = Σ_j w_nj · expert_{e_nj}(x_n) + shared(x_n)``.

    Both exchanges carry gradients back (:class:`AllToAll`), so each expert's gradient collects
    the contributions of every rank's tokens. The router and the shared expert are replicated:
    like any replicated weight, their gradients must be summed or averaged over the ranks (data
    parallelism does it). ``traffic`` holds the bytes of the last forward pass's three
    exchanges; the backward pass sends as much again as the two token exchanges.
    """

    def __init__(self, moe: MoE, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        rank, world = process_group(group, "ExpertParallelMoE")
        self.config = moe.config
        self.group, self.rank, self.world_size = group, rank, world
        self.local_experts = expert_range(moe.config.n_experts, rank, world)
        self.gate = copy.deepcopy(moe.gate)
        self.shared_experts = copy.deepcopy(moe.shared_experts)
        here = slice(self.local_experts.start, self.local_experts.stop)
        self.experts = nn.Module()  # the full layer's parameter names, this rank's slice
        self.experts.gate_up_proj = nn.Parameter(moe.experts.gate_up_proj.detach()[here].clone())
        self.experts.down_proj = nn.Parameter(moe.experts.down_proj.detach()[here].clone())
        self.traffic = Traffic()
        self.last_routing: Routing | None = None

    def forward(self, x: Tensor) -> Tensor:
        W, E_local = self.world_size, len(self.local_experts)
        flat = x.reshape(-1, x.shape[-1])  # [N, d]
        routing = self.gate(flat)
        k = routing.experts.shape[1]
        # 1. token copies sorted by expert: destination ranks in order, each one run
        order = routing.experts.flatten().argsort(stable=True)
        token = order // k  # the token of each sorted copy
        send = routing.tokens_per_expert.view(W, E_local)  # [to rank, its expert]
        # 2. counts: recv[s, e] = copies rank s sends to this rank's expert e
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_splits, recv_splits = send.sum(dim=1).tolist(), recv.sum(dim=1).tolist()
        # 3. token copies to their experts' ranks: [Σ recv, d], by source rank, then expert
        received = all_to_all(flat.index_select(0, token), recv_splits, send_splits, self.group)
        # 4. the local experts, chapter 7's dispatch (one copy per row, weighted later)
        expert_of_row = torch.arange(E_local, device=x.device).repeat(W)
        here = Routing(
            experts=expert_of_row.repeat_interleave(recv.flatten())[:, None],
            weights=received.new_ones(received.size(0), 1),
            scores=None,  # dispatch reads the choice, its weights and the counts only
            tokens_per_expert=recv.sum(dim=0),
        )
        y_here = dispatch(received, here, self.experts.gate_up_proj, self.experts.down_proj)
        # 5. the results back to their tokens' ranks, in the order they left
        returned = all_to_all(y_here, send_splits, recv_splits, self.group)
        # 6. combine with the routing weights
        weight = routing.weights.flatten()[order, None].to(returned.dtype)
        y = torch.zeros_like(flat).index_add(0, token, returned * weight)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        self.last_routing = routing
        self.traffic = self.count_traffic(send, recv, flat)
        return y.view(x.shape)

    def count_traffic(self, send: Tensor, recv: Tensor, flat: Tensor) -> Traffic:
        """Bytes this rank sent to other ranks in the three exchanges of a forward pass."""
        others = torch.arange(self.world_size, device=send.device) != self.rank
        row = flat.size(1) * flat.element_size()
        traffic = Traffic()
        traffic.add("counts", send[others].numel() * send.element_size())
        traffic.add("tokens out", int(send[others].sum()) * row)
        traffic.add("results back", int(recv[others].sum()) * row)
        return traffic


# ----------------------------------------------------------------------------------------------
# context parallelism


def kda_slice_summary(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, chunk_size: int = 64
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A slice of KDA run from a zero memory, with what its true outputs need from the memory
    it should have started from: ``(o, reads, M, ΔS)``.

    Each token's transition ``S_t = A_t S_{t−1} + β_t k_t v_tᵀ`` with ``A_t = (I − β_t k_t
    k_tᵀ) Diag(α_t)`` is affine in S, so the slice maps an incoming memory ``S_in`` to
    ``S_t = M_t S_in + ΔS_t`` with ``M_t = A_t ⋯ A_1`` [K, K] per head and ``ΔS_t`` the memory
    after t tokens from zero (LASP-2; Megatron-Core's chunkwise context parallelism). Running
    the operator once on ``[v | 0]`` from ``[0 | I]`` computes both at once: the columns of S
    evolve independently, the first V from zero with the true values, the last K from the
    identity with zero values, which leaves ``A_t ⋯ A_1 · I``. The read-out ``S_tᵀ q_t`` splits
    the same way: ``o_t = ΔS_tᵀ q_t`` and ``reads_t = M_tᵀ q_t``, so that the true output is
    ``o_t + S_inᵀ reads_t``.

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H] (q and k normalised, as the layer gives
    them to :func:`~gpt2kimi.ops.chunk_kda`). Returns o [B, T, H, V], reads [B, T, H, K] (q's
    dtype), M [B, H, K, K] and ΔS [B, H, K, V] (fp32 or fp64). Fixed size: M and ΔS do not
    depend on T.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    start = torch.cat(
        [k.new_zeros(B, H, K, V), torch.eye(K, dtype=k.dtype, device=k.device).expand(B, H, K, K)],
        dim=-1,
    )
    values = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    o, S = chunk_kda(q, k, values, g, beta, initial_state=start, chunk_size=chunk_size)
    return o[..., :V], o[..., V:], S[..., V:], S[..., :V]


def incoming_memory(summaries: Tensor, rank: int) -> Tensor:
    """The memory rank ``rank``'s slice starts from: the earlier slices' maps composed,
    ``S_in = ΔS_{r−1} + M_{r−1}(ΔS_{r−2} + M_{r−2}(⋯))``.

    summaries [W, B, H, K, K + V]: every rank's ``[M | ΔS]``, in rank order. Returns [B, H, K, V]
    (zeros for rank 0: every sequence starts from an empty memory).
    """
    K = summaries.shape[-2]
    S = summaries.new_zeros(*summaries.shape[1:-1], summaries.shape[-1] - K)
    for M, dS in (s.split([K, s.shape[-1] - K], dim=-1) for s in summaries[:rank]):
        S = M @ S + dS
    return S


def conv_inputs(layer: KimiDeltaAttention, x: Tensor) -> Tensor:
    """What the layer's short convolution reads: q, k and v projections side by side (the first
    line of :meth:`~gpt2kimi.deltanet.DeltaNet.qkv`), [B, T, 3 · H · head_dim]."""
    return torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)


def incoming_conv_tail(
    layer: KimiDeltaAttention, x: Tensor, group: dist.ProcessGroup | None, traffic: Traffic
) -> Tensor | None:
    """The ``conv_size − 1`` convolution inputs just before this rank's slice (zeros before the
    first token), from an all-gather of every rank's last ones. A slice shorter than the tail
    takes inputs from several earlier ranks; otherwise the previous rank alone would do (a
    point-to-point send, as LASP's)."""
    rank, world = process_group(group, "incoming_conv_tail")
    n_past = layer.conv1d.kernel_size[0] - 1
    if n_past == 0:
        return None
    B, T, _ = x.shape
    mine = conv_inputs(layer, x[:, max(0, T - n_past) :])  # [B, min(T, n_past), C]
    everyone = all_gather(mine, group)
    traffic.add("conv tails", (world - 1) * mine.nbytes)
    tail = torch.cat([mine.new_zeros(B, n_past, mine.size(-1)), *everyone[:rank]], dim=1)
    return tail[:, tail.size(1) - n_past :]


def context_parallel_kda(
    layer: KimiDeltaAttention,
    x: Tensor,
    group: dist.ProcessGroup | None = None,
    traffic: Traffic | None = None,
) -> Tensor:
    """A KDA layer on this rank's slice x [B, T/W, d] of every sequence → its outputs, equal to
    those of the layer on the whole sequences.

    1. the short convolution starts from the previous slice's last inputs
       (:func:`incoming_conv_tail`);
    2. the slice runs once from a zero memory, giving its outputs and its affine summary
       ``(M, ΔS)`` (:func:`kda_slice_summary`);
    3. the ranks all-gather the summaries, ``H · K · (K + V)`` numbers per sequence whatever the
       length, and each composes the memory its slice starts from (:func:`incoming_memory`);
    4. each output is corrected by what that memory adds: ``o_t += S_inᵀ M_tᵀ q_t``.

    Then the layer's own output gate, norm and projection (as in
    :meth:`~gpt2kimi.kda.KimiDeltaAttention.forward`). Forward only: training through it would
    also need the adjoint exchange for the memory's gradient.
    """
    rank, _ = process_group(group, "context_parallel_kda")
    traffic = Traffic() if traffic is None else traffic
    B, T, _ = x.shape
    tail = incoming_conv_tail(layer, x, group, traffic)
    # qkv reads the convolution tail of the state only; the memory is handled below
    q, k, v, _ = layer.qkv(x, None if tail is None else DeltaNetState(None, tail))
    beta = torch.sigmoid(layer.b_proj(x))  # [B, T, H]
    g = layer.forget_gate(x)  # [B, T, H, K]
    o, reads, M, dS = kda_slice_summary(q, k, v, g, beta, chunk_size=layer.chunk_size)
    summary = torch.cat([M, dS], dim=-1)  # [B, H, K, K + V]
    summaries = all_gather(summary, group)
    traffic.add("KDA states", (summaries.size(0) - 1) * summary.nbytes)
    S_in = incoming_memory(summaries, rank)
    o = o + torch.einsum("bthk,bhkv->bthv", reads.to(S_in.dtype), S_in).to(o.dtype)
    gate = layer.g_b_proj(layer.g_a_proj(x)).view(B, T, layer.n_head, layer.head_dim)
    return layer.o_proj(layer.o_norm(o, gate).reshape(B, T, -1))


def context_parallel_mla(
    layer: MultiHeadLatentAttention,
    x: Tensor,
    group: dist.ProcessGroup | None = None,
    traffic: Traffic | None = None,
) -> Tensor:
    """An MLA layer on this rank's slice x [B, T/W, d] of every sequence → its outputs.

    The ranks all-gather what MLA would cache, the latents ``c_kv`` and the shared key
    ``k_rope`` (``kv_lora_rank + qk_rope_head_dim`` numbers per token, not per-head keys and
    values: the compression pays a second time), and each attends causally from its own
    queries over its own and the earlier slices' tokens (the mask offset by the earlier
    tokens, as after a cache; LASP-2H's all-gather for the softmax layers of a hybrid). This
    traffic grows with the sequence; KDA's does not.
    """
    rank, world = process_group(group, "context_parallel_mla")
    traffic = Traffic() if traffic is None else traffic
    start = rank * x.size(1)  # positions matter only with RoPE (Kimi Linear's MLA has none)
    q_nope, q_rope = layer.queries(x, start)
    c_kv, k_rope = layer.latents(x, start)
    mine = torch.cat([c_kv, k_rope], dim=-1)  # [B, T/W, kv_lora_rank + rope_dim]
    everyone = all_gather(mine, group)
    traffic.add("MLA latents", (world - 1) * mine.nbytes)
    seen = torch.cat(list(everyone[: rank + 1]), dim=1)  # the earlier slices and this one
    c_kv, k_rope = seen.split([c_kv.size(-1), k_rope.size(-1)], dim=-1)
    return layer.output(layer.attend_expanded(q_nope, q_rope, *layer.expand(c_kv, k_rope)))


def context_parallel_forward(
    model: LanguageModel,
    idx_local: Tensor,
    group: dist.ProcessGroup | None = None,
    traffic: Traffic | None = None,
) -> Tensor:
    """Logits [B, T/W, vocab] of this rank's slice idx_local [B, T/W] (see :func:`split_sequence`),
    equal to the same positions of ``model(idx)`` on the whole sequences.

    Rank r holds positions ``r·T/W … (r+1)·T/W − 1`` of every sequence. Embeddings, norms,
    feed-forwards (dense or MoE) and the head work token by token and need nothing from other
    ranks; the token mixers exchange what their memory needs: KDA layers a fixed-size summary
    of each slice (:func:`context_parallel_kda`), MLA layers the latents
    (:func:`context_parallel_mla`). ``traffic`` (optional) collects the bytes this rank sent.
    Every rank must hold a slice of the same length. In evaluation mode (no dropout).
    """
    rank, world = process_group(group, "context_parallel_forward")
    traffic = Traffic() if traffic is None else traffic
    shapes = all_gather(torch.tensor(idx_local.shape, device=idx_local.device), group)
    if not (shapes == shapes[0]).all():
        raise ValueError(
            "every rank must hold a slice of the same shape [B, T / W]; got "
            f"{[tuple(s) for s in shapes.tolist()]} (split_sequence cuts equal slices)"
        )
    model.check_input(idx_local)
    T = idx_local.size(1)
    x = model.embed(idx_local)
    if model.pos_embed is not None:
        x = x + model.pos_embed(torch.arange(rank * T, (rank + 1) * T, device=idx_local.device))
    layers = {
        KimiDeltaAttention: context_parallel_kda,
        MultiHeadLatentAttention: context_parallel_mla,
    }
    for i, block in enumerate(model.blocks):
        run = layers.get(type(block.mixer))
        if run is None or block.shift is not None:
            raise ValueError(
                f"block {i}: context parallelism runs KDA and MLA mixers without a token shift, "
                f"got {type(block.mixer).__name__}"
                + (" with a token shift" if block.shift is not None else "")
            )
        x = x + run(block.mixer, block.norm_1(x), group, traffic)
        x = x + block.ffn(block.norm_2(x))
    return model.lm_head(model.norm_f(x))


# ----------------------------------------------------------------------------------------------
# data parallelism with sharded weights


def shard_data_parallel(model: LanguageModel, mesh: DeviceMesh | None = None) -> LanguageModel:
    """Wrap ``model`` for data parallelism with sharded weights (FSDP2, PyTorch's ZeRO-3).

    ``fully_shard`` each block, then the whole model (for the embedding, the final norm and
    the head): every parameter becomes a ``DTensor`` of which each rank stores a ``1 / W``
    slice along its first dimension, and so does its gradient and the optimizer state built
    from it. A block's weights are all-gathered just before it runs (forward, and again in the
    backward pass) and freed after; its gradients are reduce-scattered and averaged over the
    ranks, so W ranks on W equal parts of a batch take the step of one process on the whole
    batch. ``mesh`` defaults to a one-dimensional mesh over the default group, on the device
    type of the model's weights (``init_device_mesh("cpu", (W,))`` on CPU, with gloo). Changes
    ``model`` in place and returns it; build the optimizer afterwards.
    """
    # imported here: FSDP's machinery takes a second to import, and only this function needs it
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _, world = process_group(None, "shard_data_parallel")
    if mesh is None:
        mesh = init_device_mesh(next(model.parameters()).device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def data_parallel_traffic(model: LanguageModel, world_size: int, element_size: int) -> Traffic:
    """Bytes one rank sends in a training step of :func:`shard_data_parallel`'s model (before
    the shards' padding): each block's weights all-gathered twice (forward and backward: blocks
    free them in between), the root's once (FSDP2 keeps them for the backward), and every
    gradient reduce-scattered once. In a ring, each of these moves ``(W − 1) / W`` of the
    tensor out of every rank."""
    share = (world_size - 1) / world_size
    blocks = sum(p.numel() for p in model.blocks.parameters()) * element_size
    total = sum(p.numel() for p in model.parameters()) * element_size
    traffic = Traffic()
    traffic.add("weights all-gathered", round(share * (2 * blocks + (total - blocks))))
    traffic.add("gradients reduce-scattered", round(share * total))
    return traffic


def check_data_parallel(
    config: HybridConfig | None = None,
    steps: int = 3,
    batch: int = 4,
    seq_len: int = 12,
    lr: float = 1e-2,
) -> dict:
    """FSDP2 data parallelism against one process, in fp64, over ``steps`` AdamW steps.

    Every rank builds the same model and draws the same global batches. A reference copy
    trains on each whole batch in this process; the sharded model trains on this rank's
    ``batch / W`` rows. Returns the largest difference between the reference's losses and
    the ranks' mean loss, between the updated weights (all-gathered) and the reference's,
    and the step's :func:`data_parallel_traffic`.
    """
    rank, world = process_group(None, "check_data_parallel")
    rows = sequence_slice(batch, rank, world)  # this rank's part of the batch
    reference = demo_hybrid(config).train()
    model = shard_data_parallel(copy.deepcopy(reference))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=lr) for m in (reference, model)]
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        data = torch.randint(reference.config.vocab_size, (batch, seq_len + 1), generator=generator)
        x, y = data[:, :-1], data[:, 1:]
        _, expected = reference(x, y)
        _, loss = model(x[rows], y[rows])
        for optimizer, lost in zip(optimizers, (expected, loss), strict=True):
            lost.backward()
            optimizer.step()
            optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(max_difference(mean / world, expected))
    weights = dict(reference.named_parameters())
    return {
        "losses": max(losses),
        "weights": max(
            max_difference(p.full_tensor(), weights[name]) for name, p in model.named_parameters()
        ),
        "bytes": data_parallel_traffic(reference, world, 8).sent,
    }


# ----------------------------------------------------------------------------------------------
# the checks: each runs on every rank of an initialised group and reports its largest difference


def max_difference(a: Tensor, b: Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def demo_moe_config(d_model: int = 32) -> MoEConfig:
    """A small MoE with every option of Kimi's: sigmoid routing, grouped, one shared expert."""
    return MoEConfig(
        d_model, n_experts=8, top_k=2, expert_hidden=16, n_shared_experts=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5,
    )  # fmt: skip


def check_expert_parallel(config: MoEConfig | None = None, tokens: int = 24, seed: int = 0) -> dict:
    """Expert parallelism against the full layer, forward and backward, in fp64.

    Every rank builds the same full MoE (random correction biases, so that selection and
    weighting differ) and the same global batch; the full layer runs on all of it, the expert-
    parallel one on this rank's ``tokens``. Compares this rank's outputs, and the gradients of
    ``Σ y · probe``: this rank's experts directly, the replicated router and shared expert after
    summing over the ranks. Returns the differences and the forward pass's :class:`Traffic`.
    """
    rank, world = process_group(None, "check_expert_parallel")
    torch.manual_seed(seed)
    moe = MoE(demo_moe_config() if config is None else config).double()
    nn.init.normal_(moe.gate.e_score_correction_bias, 0.0, 0.1)
    x = torch.randn(world, tokens, moe.config.d_model, dtype=torch.float64)
    probe = torch.randn_like(x)
    parallel = ExpertParallelMoE(moe)
    (moe(x) * probe).sum().backward()
    y = parallel(x[rank])
    (y * probe[rank]).sum().backward()
    expected = moe(x)[rank]
    here = slice(parallel.local_experts.start, parallel.local_experts.stop)
    grads = [
        max_difference(parallel.experts.gate_up_proj.grad, moe.experts.gate_up_proj.grad[here]),
        max_difference(parallel.experts.down_proj.grad, moe.experts.down_proj.grad[here]),
    ]
    replicated = [parallel.gate, parallel.shared_experts]
    for mine, full in zip(replicated, [moe.gate, moe.shared_experts], strict=True):
        for p, q in zip(mine.parameters(), full.parameters(), strict=True):
            dist.all_reduce(p.grad)  # the sum over the ranks' tokens
            grads.append(max_difference(p.grad, q.grad))
    return {
        "forward": max_difference(y, expected),
        "backward": max(grads),
        "bytes": dict(parallel.traffic.sent),
    }


def demo_hybrid_config(chunk_size: int = 8) -> HybridConfig:
    """A small Kimi-Linear hybrid (KDA, MLA, KDA, MLA; dense first, then MoE) whose every width
    differs, with short KDA chunks so that the checks' slices end inside a chunk."""
    return HybridConfig(
        vocab_size=64,
        d_model=32,
        mixers=("kda", "mla", "kda", "mla"),
        ffns=("dense", "moe", "moe", "moe"),
        kda=KDAConfig(n_head=3, head_dim=8, chunk_size=chunk_size, output_gate_bias=False),
        mla=MLAConfig(32, n_head=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                      v_head_dim=6, rope=False),
        moe=demo_moe_config(32),
        dense_hidden=48,
    )  # fmt: skip


def demo_hybrid(config: HybridConfig | None = None, seed: int = 0) -> KimiHybrid:
    """The hybrid in fp64 and eval mode, with every norm gain, gate bias and routing bias moved
    off its initial value (so that no part of the model is an identity the checks could miss)."""
    torch.manual_seed(seed)
    model = KimiHybrid(demo_hybrid_config() if config is None else config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("A_log"):
                p.add_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


@torch.no_grad()
def check_context_parallel(
    config: HybridConfig | None = None, seq_lens: tuple[int, ...] = (26, 52), batch: int = 2
) -> list[dict]:
    """Context parallelism against the whole model, in fp64, for each total length in
    ``seq_lens``: this rank's logits from :func:`context_parallel_forward` on its slice against
    the same positions of ``model(idx)``. Returns per length the largest difference and the
    bytes this rank sent (KDA's are the same for every length, MLA's grow with it)."""
    model = demo_hybrid(config)
    results = []
    for seq_len in seq_lens:
        idx = torch.randint(model.config.vocab_size, (batch, seq_len))
        full = model(idx)
        traffic = Traffic()
        local = context_parallel_forward(model, split_sequence(idx), traffic=traffic)
        rank, world = process_group(None, "check_context_parallel")
        expected = full[:, sequence_slice(seq_len, rank, world)]
        results.append(
            {"seq_len": seq_len, "forward": max_difference(local, expected), "bytes": traffic.sent}
        )
    return results


# ----------------------------------------------------------------------------------------------
# launching W local processes


def free_port() -> int:
    """A TCP port on localhost that no one listens on (asked of the operating system)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, args: tuple, world_size: int, port: int, out_dir: str) -> None:
    """One spawned process: join the gloo group, run ``fn(*args)``, save its result."""
    torch.set_num_threads(1)  # W processes share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        result = fn(*args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, nproc: int = 2, args: tuple = (), timeout: float = 120.0) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` fresh processes forming one gloo group; each rank's result.

    The processes are spawned (``torch.multiprocessing.start_processes``), meet on a free
    localhost port and run on CPU; ``fn`` must be importable (a module-level function) and its
    result picklable. A process that raises fails the launch with its traceback; a launch that
    outlives ``timeout`` seconds (a collective waiting for a rank that never comes) is ended and
    raises ``TimeoutError`` instead of hanging.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    with tempfile.TemporaryDirectory() as out_dir:
        context = torch.multiprocessing.start_processes(
            _worker,
            args=(fn, args, nproc, free_port(), out_dir),
            nprocs=nproc,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                        process.join()
                raise TimeoutError(
                    f"{getattr(fn, '__name__', fn)} on {nproc} processes did not finish within "
                    f"{timeout} s"
                )
        return [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(nproc)]


# ----------------------------------------------------------------------------------------------
# the command line: python -m gpt2kimi.parallel demo --nproc 2

CHECKS = ("expert", "context", "data")


def run_checks(checks: tuple[str, ...] = CHECKS) -> dict[str, Any]:
    """The chosen checks on this rank, sized to the world size (W divides the sequences and the
    batch; it must divide the demo MoE's 8 experts)."""
    _, world = process_group(None, "run_checks")
    runs = {
        "expert": lambda: check_expert_parallel(),
        "context": lambda: check_context_parallel(seq_lens=(13 * world, 26 * world)),
        "data": lambda: check_data_parallel(batch=2 * world),
    }
    return {name: runs[name]() for name in checks}


def report(results: list[dict[str, Any]]) -> str:
    """Each check's largest difference over the ranks, and the bytes each rank sent."""

    def sent(per_rank: list[dict[str, int]]) -> str:
        return "; ".join(
            f"rank {r}: " + ", ".join(f"{what} {n:,}" for what, n in b.items())
            for r, b in enumerate(per_rank)
        )

    W, lines = len(results), []
    if "expert" in results[0]:
        runs = [r["expert"] for r in results]
        lines += [
            f"expert parallel MoE on {W} processes: largest difference "
            f"forward {max(r['forward'] for r in runs):.1e}, "
            f"gradients {max(r['backward'] for r in runs):.1e}",
            f"  bytes sent, {sent([r['bytes'] for r in runs])}",
        ]
    if "context" in results[0]:
        for i, first in enumerate(results[0]["context"]):
            runs = [r["context"][i] for r in results]
            lines += [
                f"context parallel hybrid, {first['seq_len']} tokens on {W} processes: largest "
                f"difference in the logits {max(r['forward'] for r in runs):.1e}",
                f"  bytes sent, {sent([r['bytes'] for r in runs])}",
            ]
    if "data" in results[0]:
        runs = [r["data"] for r in results]
        lines += [
            f"fully sharded data parallel training on {W} processes: largest difference "
            f"losses {max(r['losses'] for r in runs):.1e}, "
            f"weights {max(r['weights'] for r in runs):.1e}",
            f"  bytes sent per step, {sent([r['bytes'] for r in runs])}",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gpt2kimi.parallel",
        description="Chapter 9's checks: expert, context and data parallelism against one process.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="spawn gloo processes on this machine (or run as one rank under torchrun) and "
        "print each check's largest difference and the bytes sent",
    )
    demo.add_argument("--nproc", type=int, default=2, help="processes to spawn (default 2)")
    demo.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS))
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")
    args = parser.parse_args(argv)
    checks = tuple(args.checks)
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    try:  # before starting any process: the demo MoE's experts must split evenly
        expert_range(demo_moe_config().n_experts, 0, world)
    except ValueError as error:
        parser.error(str(error))
    if "LOCAL_RANK" in os.environ:  # started by torchrun: this process is one of the ranks
        dist.init_process_group("gloo")
        try:
            mine = run_checks(checks)
            results = [None] * dist.get_world_size()
            dist.all_gather_object(results, mine)
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) == 0:
            print(report(results))
        return
    from gpt2kimi.parallel import run_checks as importable  # not __main__.run_checks

    print(report(launch(importable, args.nproc, args=(checks,), timeout=args.timeout)))


if __name__ == "__main__":
    main()
