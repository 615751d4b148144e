"""Draw the introduction's figure: a memory that grows with the context against one that does not.

Run from the repository root: ``python book/figures/make_intro_figure.py``. The numbers are
computed here from GPT-2 small's configuration, not typed in.
"""

from pathlib import Path

from gpt2kimi.gpt2 import GPT2Config
from gpt2kimi.plotting import COLORS, new_axes, use_style

BYTES = 2  # bf16


def main() -> None:
    use_style()
    c = GPT2Config()
    head_dim = c.n_embd // c.n_head
    kv_per_token = 2 * c.n_layer * c.n_head * head_dim * BYTES  # K and V, every layer and head
    state = c.n_layer * c.n_head * head_dim * head_dim * BYTES  # one d×d matrix per head
    lengths = [2**i for i in range(4, 21)]
    ax = new_axes(
        "A KV cache grows with every token; a linear-attention state does not",
        "context length (tokens)",
        "memory per sequence (MiB)",
    )
    ax.loglog(lengths, [kv_per_token * t / 2**20 for t in lengths], color=COLORS["softmax"],
              label=f"KV cache: {kv_per_token:,} bytes per token")
    ax.loglog(lengths, [state / 2**20] * len(lengths), color=COLORS["linear"],
              label=f"fixed state: {state:,} bytes in all")
    crossing = state / kv_per_token
    ax.axvline(crossing, color="grey", linestyle=":", linewidth=1)
    ax.text(crossing * 1.3, state / 2**20 * 4, f"equal at {crossing:.0f} tokens", fontsize=8,
            color="grey")
    ax.legend(loc="upper left", title=f"GPT-2 small's shape ({c.n_layer} layers × {c.n_head} "
              f"heads × {head_dim}), bf16", title_fontsize=8)
    out = Path(__file__).with_name("memory_growth.png")
    ax.figure.savefig(out, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
