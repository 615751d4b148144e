"""Chapter 9: the small Kimi on many devices: expert, context and data parallelism.

One device holds neither Kimi Linear's 48B parameters with their optimizer state nor the
activations of a million-token context. This module splits chapter 8's hybrid over W processes
with PyTorch's own distributed engine (``torch.distributed``: a process group, all-to-all,
all-gather, ``fully_shard``; gloo on CPU, NCCL on GPUs, the code is the same), and each split
is **exactly** the one-process model on the same weights:

- **Expert parallelism** (GShard; DeepSeek-V3 used 64-way, Kimi K2 16-way):
  :class:`ExpertParallelMoE` keeps ``E / W`` of a layer's experts on each rank. Each rank routes
  its own tokens, and two all-to-alls carry every token copy to its expert's rank and the result
  back.
- **Context parallelism** (LASP-2 and its hybrid form LASP-2H; Megatron-Core's chunkwise
  context parallelism): :func:`context_parallel_forward` gives rank r the r-th slice of every
  sequence. A KDA layer summarises its slice as an affine map of the incoming memory,
  ``S_out = M S_in + ΔS``, whose size does not depend on the slice's length, and the ranks
  all-gather those summaries; an MLA layer all-gathers its compressed latents.
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

import copy
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpt2kimi.configs import MoEConfig
from gpt2kimi.moe import MoE, Routing, dispatch

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
