"""Compiled C for a decoded token, where PyTorch's per-call cost outweighs the arithmetic.

A decode step of a small KDA layer makes about fifty PyTorch calls over a few thousand numbers,
a small MoE layer about forty over the few experts a token chose, and an RMSNorm half a dozen
over one row; each call costs microseconds of dispatch whatever it computes. On a GPU, fla fuses
such a step into one Triton kernel; on a CPU the same fusion is a C loop.
:func:`fused_kda_decode_step` runs ``csrc/kda_step.c``,
:meth:`~gpt2kimi.kda.KimiDeltaAttention.step`'s arithmetic from the projected token on;
:func:`fused_moe_decode_step` runs ``csrc/moe_step.c``, a :class:`~gpt2kimi.moe.MoE` layer from
router to output; :func:`fused_rms_norm` runs ``csrc/rms_norm.c``, the backbone's
:class:`~gpt2kimi.backbone.RMSNorm` at a decoded token. Each is one call, tested equal to the
PyTorch it replaces (``tests/test_native.py``). A support module: it imports nothing of the
package, so that the backbone's norm can use it as the chapters' layers do.

The C files are compiled once per machine with the system's C compiler (``cc``, or ``$CC``) into
``$GPT2KIMI_CACHE`` (default ``~/.cache/gpt2kimi``) and loaded with ``ctypes``: no build step, no
PyTorch headers. Where there is no compiler, or ``GPT2KIMI_NATIVE=0``, :func:`native_available`
is False and the layers run their PyTorch steps instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("kda_step.c", "moe_step.c", "rms_norm.c"))
# -fopenmp-simd: the dot products' `#pragma omp simd` vectorizes them (no OpenMP runtime); the
# last set is for a compiler that knows neither flag
FLAGS = (["-O3", "-march=native", "-fopenmp-simd"], ["-O3", "-fopenmp-simd"], ["-O3"])


def _cache_dir() -> Path:
    if os.environ.get("GPT2KIMI_CACHE"):
        return Path(os.environ["GPT2KIMI_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gpt2kimi"


def _machine() -> str:
    """The platform and the CPU's model and features: what a -march=native build depends on."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:  # Linux: the first processor's model and flags
            cpu += "".join(line for line in f.read().split("\n\n")[0].splitlines(True)
                           if line.startswith(("model name", "flags", "Features", "CPU part")))
    except OSError:
        pass
    return platform.platform() + cpu


def _build(path: Path) -> bool:
    """Compile :data:`SOURCES` into ``path``, for this CPU if the compiler can, else generic."""
    compiler = os.environ.get("CC", "cc")
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    for flags in FLAGS:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # (a read-only home: no C step)
            subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", str(partial),
                            *map(str, SOURCES), "-lm"], check=True, capture_output=True,
                           timeout=300)
            os.replace(partial, path)  # whole or not at all, should two processes build it
        except (OSError, subprocess.SubprocessError):
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            continue
        return True
    return False


@dataclass(frozen=True)
class Kernels:
    """The compiled functions, with their argument types declared."""

    kda_decode_step: ctypes._CFuncPtr
    moe_decode_step: ctypes._CFuncPtr
    rms_norm: ctypes._CFuncPtr


@functools.cache
def _kernel() -> Kernels | None:
    """The compiled steps, built at the first call (a second or two), or None."""
    if os.environ.get("GPT2KIMI_NATIVE", "1") == "0":
        return None
    # built for this CPU's instructions (-march=native), so the file is named by the CPU too
    key = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES)
                         + (repr(FLAGS) + _machine()).encode()).hexdigest()[:16]
    path = _cache_dir() / f"steps-{key}.so"
    if not path.exists() and not _build(path):
        return None
    library, ptr, i32 = ctypes.CDLL(str(path)), ctypes.c_void_p, ctypes.c_int
    kda, moe, norm = library.kda_decode_step, library.moe_decode_step, library.rms_norm
    kda.restype = moe.restype = norm.restype = None
    kda.argtypes = [ctypes.POINTER(_KDAWeights), i32] + [ptr] * 6
    moe.argtypes = [ctypes.POINTER(_MoEWeights), i32] + [ptr] * 7
    norm.argtypes = [i32, i32, ctypes.c_float] + [ptr] * 3
    return Kernels(kda, moe, norm)


def native_available() -> bool:
    """Whether the C steps are built and loaded (they are built at the first call)."""
    return _kernel() is not None


class _KDAWeights(ctypes.Structure):
    """``kda_weights`` of ``csrc/kda_step.c``: a layer's shape and weight pointers."""

    _fields_ = ([(name, ctypes.c_int) for name in ("H", "D", "C")]
                + [(name, ctypes.c_float) for name in ("norm_eps", "scale")]
                + [(name, ctypes.c_void_p) for name in ("conv_w", "f_b", "A_log", "dt_bias",
                                                         "g_b", "g_b_bias", "norm_w")])


@dataclass(frozen=True)
class NativeWeights:
    """A layer's weights checked and bound for its C step once (:func:`kda_step_weights`,
    :func:`moe_step_weights`); the tensors are kept, so that the addresses it reads stay
    theirs."""

    bound: ctypes.Structure
    tensors: tuple[Tensor, ...]


def _usable(tensors: tuple[Tensor, ...]) -> bool:
    """Whether the C steps can read these as they are: contiguous fp32 on the CPU."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
               for t in tensors)


def _check_shapes(function: str, got: dict[str, Tensor | None],
                  expected: dict[str, tuple[int, ...]], note: str) -> None:
    """The C loops trust their shapes: a mismatch would read past an array, so it is an error."""
    if any(t is not None and t.shape != expected[name] for name, t in got.items()):
        shapes = {name: tuple(t.shape) for name, t in got.items() if t is not None}
        wanted = {name: expected[name] for name in shapes}
        raise ValueError(f"{function}: shapes {shapes} do not fit one another; expected "
                         f"{wanted} ({note})")


def kda_step_weights(
    conv_w: Tensor, f_b: Tensor, A_log: Tensor, dt_bias: Tensor, g_b: Tensor,
    g_b_bias: Tensor | None, norm_w: Tensor, norm_eps: float, scale: float,
) -> NativeWeights | None:
    """Check a KDA layer's step weights once and bind them for :func:`fused_kda_decode_step`.

    conv_w [C, 3·H·D] the short convolution's kernel; f_b, g_b [D, H·D] (g_b_bias [H·D] or
    None), A_log [H, 1], dt_bias [H, D]: the gates; norm_w [D] and norm_eps: the output
    RMSNorm; scale: the read's scale. None where the C step cannot read them: anything but
    contiguous fp32 on the CPU.
    """
    tensors = (conv_w, f_b, A_log, dt_bias, g_b, norm_w) + (() if g_b_bias is None else (g_b_bias,))
    if not _usable(tensors):
        return None
    C, H, D = len(conv_w), len(A_log), len(norm_w)
    _check_shapes("kda_step_weights", {
        "conv_w": conv_w, "f_b": f_b, "A_log": A_log, "dt_bias": dt_bias, "g_b": g_b,
        "g_b_bias": g_b_bias, "norm_w": norm_w,
    }, {"conv_w": (max(C, 2), 3 * H * D), "f_b": (D, H * D), "A_log": (H, 1),
        "dt_bias": (H, D), "g_b": (D, H * D), "g_b_bias": (H * D,), "norm_w": (D,)},
        "A_log [H, 1], norm_w [D], a kernel of two taps or more")
    pointers = [t.data_ptr() for t in (conv_w, f_b, A_log, dt_bias, g_b)]
    bound = _KDAWeights(H, D, C, norm_eps, scale, *pointers,
                        None if g_b_bias is None else g_b_bias.data_ptr(), norm_w.data_ptr())
    return NativeWeights(bound, tensors)


def fused_kda_decode_step(
    h: Tensor, conv: Tensor, memory: Tensor, weights: NativeWeights
) -> tuple[Tensor, Tensor, Tensor] | None:
    """One decoded token of a KDA layer from its projected token on, in one C call, with the
    layer's weights as :func:`kda_step_weights` bound them.

    h [B, 3·H·D + H + 2·D]: the token through the stacked projections (q, k, v, β, the forget
    gate's and the output gate's low-rank halves); conv [B, C − 1, 3·H·D] the convolution's
    last inputs; memory [B, H, D, D] (read, never written).

    Returns ``(out [B, H·D], the new memory, the new convolution inputs)``, out being
    ``RMSNorm(o) · sigmoid(gate)`` before the output projection; or None where the C step does
    not apply: not built, gradients on, or anything but fp32 on the CPU.
    """
    kernels = _kernel()
    if kernels is None or torch.is_grad_enabled() or not all(
            t.dtype == torch.float32 and t.device.type == "cpu" for t in (h, conv, memory)):
        return None
    w = weights.bound
    B, H, D, C = len(memory), w.H, w.D, w.C
    N = 3 * H * D
    _check_shapes("fused_kda_decode_step", {"h": h, "conv": conv, "memory": memory},
                  {"h": (B, N + H + 2 * D), "conv": (B, C - 1, N), "memory": (B, H, D, D)},
                  f"the layer's H={H}, D={D}, conv_size={C}")
    # a state straight from a prompt's chunk form may be a view: the loop reads it whole
    h, conv, memory = h.contiguous(), conv.contiguous(), memory.contiguous()
    new_memory, new_conv, out = torch.empty_like(memory), torch.empty_like(conv), h.new_empty(
        B, H * D)
    kernels.kda_decode_step(w, B, h.data_ptr(), conv.data_ptr(), memory.data_ptr(),
                            new_memory.data_ptr(), new_conv.data_ptr(), out.data_ptr())
    return out, new_memory, new_conv


class _MoEWeights(ctypes.Structure):
    """``moe_weights`` of ``csrc/moe_step.c``: a layer's shape, routing and weight pointers."""

    _fields_ = ([(name, ctypes.c_int) for name in ("d", "E", "k", "I", "Is", "softmax",
                                                   "norm_topk")]
                + [("scaling", ctypes.c_float)]
                + [(name, ctypes.c_void_p) for name in ("router", "gate_up", "down", "s_gate",
                                                         "s_up", "s_down")])


def moe_step_weights(
    router: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
    shared: tuple[Tensor, Tensor, Tensor] | None, *, top_k: int, softmax: bool,
    norm_topk_prob: bool, scaling: float,
) -> NativeWeights | None:
    """Check an MoE layer's weights once and bind them for :func:`fused_moe_decode_step`.

    router [E, d]: scores by a sigmoid per expert or (``softmax``) a softmax, ``top_k``
    chosen by score + bias, their scores divided by their sum if ``norm_topk_prob``, then
    times ``scaling``; gate_up_proj [E, 2I, d] and down_proj [E, d, I]: the experts; shared:
    the shared expert's gate and up [Is, d] and down [d, Is] weights, or None.

    None where the C step does not apply: anything but contiguous fp32 on the CPU.
    """
    tensors = (router, gate_up_proj, down_proj, *(shared or ()))
    if not _usable(tensors):
        return None
    E, d, I = len(gate_up_proj), router.shape[-1], gate_up_proj.shape[1] // 2
    Is = 0 if shared is None else len(shared[0])
    if not 1 <= top_k <= E:
        raise ValueError(f"moe_step_weights: top_k={top_k} must be between 1 and E={E}")
    expected = {"router": (E, d), "gate_up_proj": (E, 2 * I, d), "down_proj": (E, d, I),
                "shared gate": (Is, d), "shared up": (Is, d), "shared down": (d, Is)}
    _check_shapes("moe_step_weights",
                  dict(zip(expected, (*tensors, *(() if shared else [None] * 3)), strict=True)),
                  expected, "gate_up_proj [E, 2I, d]")
    pointers = [t.data_ptr() for t in tensors] + [None] * (3 - len(shared or ()))
    bound = _MoEWeights(d, E, top_k, I, Is, int(softmax), int(norm_topk_prob), scaling,
                        *pointers)
    return NativeWeights(bound, tensors)


def fused_moe_decode_step(
    x: Tensor, bias: Tensor | None, weights: NativeWeights
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None:
    """A few decoded tokens x [N, d] through an MoE layer (:class:`~gpt2kimi.moe.MoE`) whose
    weights :func:`moe_step_weights` bound, in one C call; bias [E] (or None) the router's
    selection bias, read at each call (balancing moves it).

    Returns ``(y [N, d], scores [N, E], experts [N, k], weights [N, k], tokens_per_expert
    [E])`` (the last two int64, as :class:`~gpt2kimi.moe.Routing` holds them); or None where
    the C step does not apply: not built, gradients on, x not fp32 on the CPU.
    """
    kernels = _kernel()
    if kernels is None or torch.is_grad_enabled() or x.dtype != torch.float32 or (
            x.device.type != "cpu"):
        return None
    w = weights.bound
    N, E, k = len(x), w.E, w.k
    if x.shape != (N, w.d) or bias is not None and (
            bias.shape != (E,) or bias.dtype != torch.float32 or bias.device.type != "cpu"):
        raise ValueError(f"fused_moe_decode_step: expected x [N, d={w.d}] and an fp32 bias "
                         f"[E={E}] on the CPU, got x {tuple(x.shape)} and bias "
                         f"{None if bias is None else (tuple(bias.shape), bias.dtype)}")
    x, bias = x.contiguous(), None if bias is None else bias.contiguous()
    y, scores, chosen = x.new_empty(N, w.d), x.new_empty(N, E), x.new_empty(N, k)
    experts, per_expert = torch.empty(N, k, dtype=torch.int64), torch.empty(E, dtype=torch.int64)
    kernels.moe_decode_step(
        w, N, x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
        scores.data_ptr(), experts.data_ptr(), chosen.data_ptr(), per_expert.data_ptr())
    return y, scores, experts, chosen, per_expert


def fused_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """``F.rms_norm(x, weight.shape, weight, eps)`` for x [..., d] and weight [d], in one C call
    (``csrc/rms_norm.c``): for a decoded token's few rows, where PyTorch's half a dozen calls
    cost more than the arithmetic. None where the C code does not apply: not built, gradients
    on, anything but contiguous fp32 on the CPU.
    """
    kernels = _kernel()
    if kernels is None or torch.is_grad_enabled() or not _usable((x, weight)):
        return None
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"fused_rms_norm: expected a weight of shape ({x.shape[-1]},) for x of "
                         f"shape {tuple(x.shape)}, got {tuple(weight.shape)}")
    out = torch.empty_like(x)
    kernels.rms_norm(x.numel() // max(x.shape[-1], 1), x.shape[-1], eps, x.data_ptr(),
                     weight.data_ptr(), out.data_ptr())
    return out
