"""gpt2kimi: the small, tested PyTorch library behind the book *From GPT-2 to Kimi*.

The folders show the layers, and imports point one way (import-linter contracts in
``pyproject.toml``):

- ``gpt2kimi.bench``: thin command lines for the timing benchmarks (``python -m gpt2kimi.bench``);
- ``gpt2kimi.experiments``: tasks, the mixer registry, sweeps, speed measurements and the
  training command line (``python -m gpt2kimi.experiments``); the only package that imports
  every chapter;
- one module per chapter, in book order (``gpt2``, ``kv_cache``, ``attention``,
  ``linear_attention``, ``deltanet``, ``gated_deltanet``, ``kda``, ``mla``, ``moe``,
  ``hybrid``): each may import earlier chapters, the operators and support, never a later one;
- ``gpt2kimi.ops``: the linear-memory operators, named and ordered as fla names them;
- support modules (``data``, ``train``, ``plotting``, ``show``, ``progress``, ``accounting``,
  ``backbone``, ``configs``, ``timing``): import no chapter, and no cycle among them
  (``configs``: one config dataclass per layer type, and chapter 8's, which nests them).
"""

__version__ = "0.1.0"
