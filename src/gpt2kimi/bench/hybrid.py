"""``python -m gpt2kimi.bench hybrid``: decoding speed of the hybrid against full attention.

Three models of the same width, depth and feed-forwards decode side by side in one run, from
caches filled with random numbers to a growing context
(:func:`gpt2kimi.experiments.hybrid_speed.decode_sweep`): the Kimi-Linear-style hybrid (KDA ×3 +
MLA), the same model with MLA in every layer, and with chapter 2's multi-head softmax attention
in every layer. Then the same tiny hybrid generates with this library and with
``transformers``' ``KimiLinearForCausalLM`` on the same weights (when ``transformers`` is
installed).

    python -m gpt2kimi.bench hybrid                          # 1K … 16K tokens, batch 8
    python -m gpt2kimi.bench hybrid --contexts 1024 4096 --batch 4

Chapter 8's training runs are ``python -m gpt2kimi.experiments run NAME`` (``list`` names them).
"""

from __future__ import annotations

import argparse
import time

import torch

from gpt2kimi.experiments.hybrid_speed import against_transformers, decode_sweep, format_sweep


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.bench hybrid", description=__doc__)
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=24, help="steps of each model, in turn")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--prompts", nargs="+", type=int, default=[32, 1024],
                   help="prompt lengths of the comparison with transformers' generate")
    return p.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    print(format_sweep(decode_sweep(args.contexts, batch=args.batch, steps=args.steps)))
    if not args.no_transformers:
        try:
            for prompt_len in args.prompts:
                r = against_transformers(prompt_len=prompt_len)
                print(
                    f"generate {r['new_tokens']} tokens after {r['prompt_len']}: this library "
                    f"{r['ours_s']:.3f} s, transformers {r['transformers_s']:.3f} s "
                    f"({r['transformers_s'] / r['ours_s']:.1f}x), same tokens: "
                    f"{r['same_tokens']}"
                )
        except ImportError:
            print("transformers is not installed: skipped the comparison with it")
    print(f"({time.perf_counter() - start:.0f} s)")
