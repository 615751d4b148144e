"""Compiled C for a decoded token of KDA, where PyTorch's per-call cost outweighs the arithmetic.

A decode step of a small KDA layer makes about fifty PyTorch calls over a few thousand numbers,
and each call costs microseconds of dispatch whatever it computes. On a GPU, fla fuses such a
step into one Triton kernel; on a CPU the same fusion is a C loop. :func:`fused_kda_decode_step`
runs ``csrc/kda_step.c``: :meth:`~gpt2kimi.kda.KimiDeltaAttention.step`'s arithmetic from the
projected token on, in one call, tested equal to it (``tests/test_native.py``).

The C file is compiled once per machine with the system's C compiler (``cc``, or ``$CC``) into
``$GPT2KIMI_CACHE`` (default ``~/.cache/gpt2kimi``) and loaded with ``ctypes``: no build step, no
PyTorch headers. Where there is no compiler, or ``GPT2KIMI_NATIVE=0``, :func:`native_available`
is False and the layer runs its PyTorch step instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import subprocess
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("csrc") / "kda_step.c"


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
    """Compile :data:`SOURCE` into ``path``, for this CPU if the compiler can, else generic."""
    compiler = os.environ.get("CC", "cc")
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    for flags in (["-O3", "-march=native"], ["-O3"]):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # (a read-only home: no C step)
            subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", str(partial),
                            str(SOURCE), "-lm"], check=True, capture_output=True, timeout=300)
            os.replace(partial, path)  # whole or not at all, should two processes build it
        except (OSError, subprocess.SubprocessError):
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            continue
        return True
    return False


@functools.cache
def _kernel() -> ctypes._CFuncPtr | None:
    """The compiled ``kda_decode_step``, built at the first call (about a second), or None."""
    if os.environ.get("GPT2KIMI_NATIVE", "1") == "0":
        return None
    # built for this CPU's instructions (-march=native), so the file is named by the CPU too
    key = hashlib.sha256(SOURCE.read_bytes() + _machine().encode()).hexdigest()[:16]
    path = _cache_dir() / f"kda_step-{key}.so"
    if not path.exists() and not _build(path):
        return None
    kernel = ctypes.CDLL(str(path)).kda_decode_step
    kernel.restype = None
    kernel.argtypes = ([ctypes.c_int] * 4 + [ctypes.c_void_p] * 9 + [ctypes.c_float] * 2
                       + [ctypes.c_void_p] * 5)
    return kernel


_ARGUMENTS = ("h", "conv", "conv_w", "f_b", "A_log", "dt_bias", "g_b", "g_b_bias", "norm_w",
              "memory")


def _expected_shapes(B: int, H: int, D: int, C: int) -> dict[str, tuple[int, ...]]:
    N = 3 * H * D
    return {"h": (B, N + H + 2 * D), "conv": (B, C - 1, N), "conv_w": (C, N), "f_b": (D, H * D),
            "A_log": (H, 1), "dt_bias": (H, D), "g_b": (D, H * D), "g_b_bias": (H * D,),
            "norm_w": (D,), "memory": (B, H, D, D)}


def native_available() -> bool:
    """Whether the C step is built and loaded (it is built at the first call)."""
    return _kernel() is not None


def fused_kda_decode_step(
    h: Tensor, conv: Tensor, conv_w: Tensor, f_b: Tensor, A_log: Tensor, dt_bias: Tensor,
    g_b: Tensor, g_b_bias: Tensor | None, norm_w: Tensor, norm_eps: float, scale: float,
    memory: Tensor,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """One decoded token of a KDA layer from its projected token on, in one C call.

    h [B, 3·H·D + H + 2·D]: the token through the stacked projections (q, k, v, β, the forget
    gate's and the output gate's low-rank halves); conv [B, C − 1, 3·H·D] the convolution's last
    inputs and conv_w [C, 3·H·D] its kernel; f_b, g_b [D, H·D] (g_b_bias [H·D] or None),
    A_log [H, 1], dt_bias [H, D]: the gates; norm_w [D] and norm_eps: the output RMSNorm;
    memory [B, H, D, D] (read, never written).

    Returns ``(out [B, H·D], the new memory, the new convolution inputs)``, out being
    ``RMSNorm(o) · sigmoid(gate)`` before the output projection; or None where the C step does
    not apply: not built, gradients on, or anything but contiguous fp32 on the CPU.
    """
    kernel = _kernel()
    if kernel is None or torch.is_grad_enabled():
        return None
    weights = (conv_w, f_b, A_log, dt_bias, g_b, norm_w) + (() if g_b_bias is None else (g_b_bias,))
    if any(t.dtype != torch.float32 or t.device.type != "cpu"
           for t in (h, conv, memory, *weights)) or not all(t.is_contiguous() for t in weights):
        return None
    # a state straight from a prompt's chunk form may be a view: the loop reads it whole
    conv, memory = conv.contiguous(), memory.contiguous()
    B, H, D, _ = memory.shape
    C, N = conv_w.shape[0], 3 * H * D
    # the C loop trusts these shapes: a mismatch would read past an array, so it is an error
    if not (h.shape == (B, N + H + 2 * D) and conv.shape == (B, C - 1, N) and C >= 2
            and conv_w.shape == (C, N) and f_b.shape == g_b.shape == (D, H * D)
            and A_log.shape == (H, 1) and dt_bias.shape == (H, D) and norm_w.shape == (D,)
            and memory.shape == (B, H, D, D) and (g_b_bias is None or g_b_bias.shape == (H * D,))):
        got = {name: tuple(t.shape) for name, t in zip(_ARGUMENTS, (h, conv, conv_w, f_b, A_log,
               dt_bias, g_b, g_b_bias, norm_w, memory), strict=True) if t is not None}
        raise ValueError(f"fused_kda_decode_step: shapes {got} do not fit one another; expected "
                         f"{_expected_shapes(B, H, D, C)} (memory [B, H, D, D], conv_w [C, ·])")
    new_memory, new_conv = torch.empty_like(memory), torch.empty_like(conv)
    out, work = h.new_empty(B, H * D), h.new_empty(N + 3 * H * D)
    kernel(B, H, D, C, h.data_ptr(), conv.data_ptr(), conv_w.data_ptr(), f_b.data_ptr(),
           A_log.data_ptr(), dt_bias.data_ptr(), g_b.data_ptr(),
           None if g_b_bias is None else g_b_bias.data_ptr(), norm_w.data_ptr(),
           norm_eps, scale, memory.data_ptr(), new_memory.data_ptr(), new_conv.data_ptr(),
           out.data_ptr(), work.data_ptr())
    return out, new_memory, new_conv
