"""The experiments of the book: tasks, the mixer registry, sweeps and their results files.

The top layer of the package, and the only one that imports every chapter (the chapters and
the support modules never import it):

- :mod:`~gpt2kimi.experiments.registry`: mixers and feed-forwards by name, ``build_model``;
- :mod:`~gpt2kimi.experiments.ablations`: chapters 4 and 5's layers with one part taken out;
- the tasks and their sweeps: :mod:`~gpt2kimi.experiments.mqar` (chapters 3-6),
  :mod:`~gpt2kimi.experiments.recall` (rewritten facts, sliding-window recall),
  :mod:`~gpt2kimi.experiments.forget` (the settings of chapter 5's sliding-window runs),
  :mod:`~gpt2kimi.experiments.moe_train` (chapter 7),
  :mod:`~gpt2kimi.experiments.hybrid_train` (chapter 8);
- speed measured side by side: :mod:`~gpt2kimi.experiments.ops_speed` (chapters 3-5),
  :mod:`~gpt2kimi.experiments.kv_cache_speed` (chapter 2), :mod:`~gpt2kimi.experiments.mla_decode`
  (chapter 6), :mod:`~gpt2kimi.experiments.moe_speed` (chapter 7),
  :mod:`~gpt2kimi.experiments.hybrid_speed` (chapter 8);
- :mod:`~gpt2kimi.experiments.sweep`: the process pool and the results helpers they share;
- the pipeline: :mod:`~gpt2kimi.experiments.tasks` (one interface,
  ``train_and_score(settings, seed) -> record``, for MQAR, rewritten facts, sliding-window
  recall and the two byte-level language models), :mod:`~gpt2kimi.experiments.pipeline` (one
  resumable ``sweep`` appending each run to its results file, ``read_results``, ``code_hash``
  and ``code_ast_hash``) and :mod:`~gpt2kimi.experiments.results` (the registry of the book's
  results files).

``python -m gpt2kimi.experiments list | run NAME | check | verify NAME | rehash`` lists,
(re-)records, checks, verifies and rehashes the book's results files; ``python -m
gpt2kimi.bench NAME ...`` prints the timing benchmarks.
"""
