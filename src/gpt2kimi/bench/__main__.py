"""``python -m gpt2kimi.bench NAME [ARGS]``: run one benchmark and print its table.

Each module ``gpt2kimi/bench/<name>.py`` that defines ``main(argv)`` is a subcommand, spelled with
dashes (``kv_cache.py`` → ``kv-cache``). Benchmarks measure side by side in one run and report
ratios; the unit tests never assert timings.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import gpt2kimi.bench as bench_package


def subcommands() -> dict[str, str]:
    """Map each subcommand name to its module name."""
    names = {}
    for info in pkgutil.iter_modules(bench_package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"gpt2kimi.bench.{info.name}")
        if hasattr(module, "main"):
            names[info.name.replace("_", "-")] = info.name
    return names


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = subcommands()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0])
        print("benchmarks:", ", ".join(sorted(commands)) or "(none)")
        return
    name = argv[0]
    if name not in commands:
        raise SystemExit(f"unknown benchmark {name!r}; expected one of {sorted(commands)}")
    importlib.import_module(f"gpt2kimi.bench.{commands[name]}").main(argv[1:])


if __name__ == "__main__":
    main()
