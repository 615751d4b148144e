"""Random inputs for the memory operators' tests, in the library's layout (a test helper).

q, k [B, T, H, K] (k unit length), v [B, T, H, V], beta [B, T, H] in (0, 1), the log-decay g
(per head [B, T, H] or per key channel [B, T, H, K], <= 0) and an initial state [B, H, K, V].
"""

import torch
import torch.nn.functional as F

B, H, K, V = 2, 3, 8, 5  # K != V on purpose
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-10)}


def random_inputs(
    T: int,
    dtype: torch.dtype,
    seed: int = 0,
    *,
    beta: bool = False,
    gate: str | None = None,
    log_decay_scale: float = 1.0,
) -> tuple[torch.Tensor, ...]:
    """``(q, k, v[, beta][, g], S0)``: beta if asked, g if ``gate`` is "head" or "channel"."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    out = [q, k, v]
    if beta:
        out.append(torch.rand(B, T, H, generator=gen, dtype=dtype))
    if gate is not None:
        shape = {"head": (B, T, H), "channel": (B, T, H, K)}[gate]
        out.append(F.logsigmoid(torch.randn(*shape, generator=gen, dtype=dtype)) * log_decay_scale)
    out.append(torch.randn(B, H, K, V, generator=gen, dtype=dtype))
    return tuple(out)
