"""Chapter 5's forgetting runs: sliding-window recall, a task that needs forgetting.

The shared MQAR backbone, here with eight heads of 8 dimensions (an 8 × 8 memory per head),
trained with each named mixer on sliding-window recall
(:class:`gpt2kimi.experiments.recall.WindowRecallConfig`): a stream of 24 facts, three times as
many as a head has key directions, whose 8 queries ask only about the 4 latest, so a memory that
keeps everything fills up with facts that are never asked for again. This module holds the
settings of the runs (:data:`N_HEAD`, :data:`STEPS`, :data:`BATCH_SIZE`, :data:`WARMUP`), which
the ``window`` task of :mod:`gpt2kimi.experiments.tasks` takes as its defaults; a results file
of that task would be registered in :mod:`gpt2kimi.experiments.results` and recorded by
``python -m gpt2kimi.experiments run NAME`` (the book holds none today).
"""

from __future__ import annotations

# The budget: sequences twice MQAR's length, so half as many per step, and 400 steps (MQAR: 600).
STEPS, BATCH_SIZE, WARMUP = 400, 32, 30
N_HEAD = 8  # eight heads of 8 dims: a small memory that a short stream overflows
