"""Benchmarks: ``python -m gpt2kimi.bench <name>`` (``--help`` lists them).

Thin command lines (arguments and printing) over the speed measurements of
:mod:`gpt2kimi.experiments`; nothing in the library or the notebooks imports this package.
"""
