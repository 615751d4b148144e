"""gpt2kimi: the small, tested PyTorch library behind the book *From GPT-2 to Kimi*.

Each chapter of the book has one module here (``gpt2``, ``kv_cache``, ``linear_attention``,
``deltanet``, ``gated_deltanet``, ``kda``, ...); support modules (``data``, ``train``,
``plotting``, ``show``) serve every chapter.
"""

__version__ = "0.1.0"
