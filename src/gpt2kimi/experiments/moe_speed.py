"""Chapter 7's speed: the MoE forward side by side with ``transformers``' KimiLinearMoE on the
same weights, and with a dense SwiGLU of as many active parameters.

The layers run in inference mode on the same input, one after the other within each round;
:func:`moe_speed` returns each one's fastest time over the rounds and its tokens per second,
:func:`format_table` prints them with the ratios (``python -m gpt2kimi.bench moe`` from the
command line). ``transformers`` is optional: without it its row is left out. Timings depend on
the machine; the unit tests never assert them.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from gpt2kimi.configs import MoEConfig
from gpt2kimi.moe import MoE, dense_equivalent
from gpt2kimi.timing import fastest_interleaved, timed


def kimi_linear_moe(config: MoEConfig, experts_implementation: str = "eager") -> nn.Module | None:
    """``transformers``' KimiLinearMoE with this config's shape, or None if not installed.

    ``experts_implementation``: ``"eager"``, what a model built from its config runs (a loop
    over the experts that were hit), or ``"grouped_mm"``, the kernel ``from_pretrained`` picks
    by default where it can (one grouped matrix product).
    """
    try:
        from transformers import KimiLinearConfig
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE
    except ImportError:
        return None
    hf_config = KimiLinearConfig(
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        hidden_size=config.d_model,
        moe_intermediate_size=config.expert_hidden,
        num_experts=config.n_experts,
        num_experts_per_token=config.top_k,
        num_shared_experts=config.n_shared_experts,
        num_expert_group=config.n_group,
        topk_group=config.topk_group,
        routed_scaling_factor=config.routed_scaling_factor,
        moe_renormalize=config.norm_topk_prob,
    )
    hf_config._experts_implementation = experts_implementation
    return KimiLinearMoE(hf_config)


def moe_speed(
    tokens: int = 4096,
    d_model: int = 512,
    n_experts: int = 64,
    top_k: int = 8,
    expert_hidden: int = 128,
    n_shared_experts: int = 1,
    rounds: int = 5,
    seed: int = 0,
) -> dict:
    """Forward time of the MoE, ``transformers``' MoE on the same weights, and the dense FFN.

    Returns ``{"settings": {...}, "seconds": {name: s}, "tokens_per_s": {name: tok/s},
    "max_abs_diff": float | None}`` with names ``"moe"``, ``"dense"`` and, if ``transformers``
    is installed, ``"transformers"`` (its eager loop) and ``"transformers_grouped_mm"``;
    ``max_abs_diff`` is the largest difference between the library's and ``transformers``'
    outputs on the timed input.
    """
    torch.manual_seed(seed)
    config = MoEConfig(d_model, n_experts, top_k, expert_hidden, n_shared_experts=n_shared_experts)
    moe, dense = MoE(config).eval(), dense_equivalent(config).eval()
    x = torch.randn(1, tokens, d_model)
    fns: dict[str, nn.Module] = {"moe": moe, "dense": dense}
    diff = None
    with torch.inference_mode():
        for name, kind in (("transformers", "eager"), ("transformers_grouped_mm", "grouped_mm")):
            hf = kimi_linear_moe(config, kind)
            if hf is None:
                break
            hf.load_state_dict(moe.state_dict())
            fns[name] = hf.eval()
            try:
                diff = max(diff or 0.0, (moe(x) - hf(x)).abs().max().item())
            except (RuntimeError, NotImplementedError):  # a kernel this build lacks
                del fns[name]
        runs = {name: timed(partial(fn, x)) for name, fn in fns.items()}
        seconds = fastest_interleaved(runs, rounds)
    settings = dict(
        tokens=tokens,
        d_model=d_model,
        n_experts=n_experts,
        top_k=top_k,
        expert_hidden=expert_hidden,
        n_shared_experts=n_shared_experts,
        dense_hidden=config.active_hidden,
        rounds=rounds,
        threads=torch.get_num_threads(),
    )
    return dict(
        settings=settings,
        seconds=seconds,
        tokens_per_s={name: tokens / s for name, s in seconds.items()},
        max_abs_diff=diff,
    )


def format_table(result: dict) -> str:
    """One row per implementation: ms per forward, tokens/s, time relative to the library."""
    s = result["settings"]
    names = {
        "moe": "gpt2kimi MoE",
        "transformers": "transformers KimiLinearMoE",
        "transformers_grouped_mm": "  the same, grouped_mm kernel",
        "dense": f"dense SwiGLU, hidden {s['dense_hidden']}",
    }
    lines = [
        f"{s['tokens']} tokens, d={s['d_model']}, {s['n_experts']} experts of width "
        f"{s['expert_hidden']}, top-{s['top_k']}, {s['n_shared_experts']} shared",
        f"fp32, {s['threads']} thread(s), fastest of {s['rounds']} interleaved rounds",
        f"{'':<34}{'ms':>8}{'tokens/s':>11}{'time / MoE':>12}",
    ]
    base = result["seconds"]["moe"]
    for key in ("moe", "transformers", "transformers_grouped_mm", "dense"):
        if key in result["seconds"]:
            sec = result["seconds"][key]
            lines.append(
                f"{names[key]:<34}{sec * 1e3:>8.1f}{result['tokens_per_s'][key]:>11.0f}"
                f"{sec / base:>11.2f}x"
            )
    if result["max_abs_diff"] is not None:
        lines.append(f"largest |MoE - transformers| on this input: {result['max_abs_diff']:.1e}")
    return "\n".join(lines)
