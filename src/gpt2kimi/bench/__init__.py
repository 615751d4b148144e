"""Benchmarks: ``python -m gpt2kimi.bench <name>`` (``--help`` lists them)."""
