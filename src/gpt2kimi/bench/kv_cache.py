"""Tokens per second with and without the KV cache, as the number of generated tokens grows.

``python -m gpt2kimi.bench kv-cache [--config gpt2] [--new-tokens 16 32 64 128] [--threads N]``

GPT-2 small's configuration with untrained weights, batch 1, a short prompt, greedy decoding,
measured by :func:`gpt2kimi.experiments.kv_cache_speed.measure` (both ways in the same run) and
printed as its table with both rates and their ratio.
"""

from __future__ import annotations

import argparse

import torch

from gpt2kimi.accounting import PRESETS
from gpt2kimi.experiments.kv_cache_speed import build_model, format_table, measure


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gpt2kimi.bench kv-cache", description=__doc__.strip().splitlines()[0]
    )
    parser.add_argument("--config", default="gpt2", choices=sorted(PRESETS))
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads", type=int, default=0, help="CPU threads for PyTorch (0: PyTorch's default)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.config, device=args.device)
    print(
        f"{args.config} (untrained, {sum(p.numel() for p in model.parameters()):,} parameters), "
        f"batch 1, prompt of {args.prompt_len} tokens, greedy, {args.device}, "
        f"{torch.get_num_threads()} threads"
    )
    rows = measure(model, tuple(args.new_tokens), args.prompt_len, args.repeats)
    print(format_table(rows))
