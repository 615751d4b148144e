"""Two recall tasks beyond MQAR, their training and their sweeps: rewritten facts and
sliding-window recall.

**Rewritten facts**: associative recall where a key's value changes over time. MQAR
(:mod:`gpt2kimi.experiments.mqar`) writes every fact once. Here a stream of two-token events
``key value`` keeps **rewriting** facts: a key that was already written comes back either as a
*rewrite* (a new value: the old one is now stale) or as a *query* (its current value, and the
model is scored on predicting that value at the key position). To answer, a memory must return
the **latest** value of the key and ignore the stale ones. Example with two keys (letters for
keys, digits for values, ``_`` an ignored target)::

    x:  A 3 B 7 A 5 B 7 A 5 A 2 A 2
    y:  _ _ _ _ _ _ 7 _ 5 _ _ _ 2 _

(``A 5`` rewrites A; ``B 7`` and ``A 5`` are queries; ``A 2`` rewrites A again, then is queried.)
A memory that sums what it sees (linear attention) answers a mixture of 3, 5 and 2 for A.

Layout (the vocabulary split of MQAR): keys from ``[1, V/2)``, values from ``[V/2, V)``; the
``num_keys`` keys of a sequence are distinct and each is written once, in random order, in the
first ``num_keys`` events; every later event picks one of them uniformly and is a query with
probability ``query_prob``, a rewrite (a value different from the current one) otherwise. An odd
last position holds a random filler with an ignored target. Generation is vectorised over the
batch; the only loop runs over the ``seq_len // 2`` events.

:func:`rewrite_sweep` trains several models on the task, like
:func:`gpt2kimi.experiments.mqar.mqar_sweep` does on MQAR; it takes model constructors.

**Sliding-window recall** (:class:`WindowRecallConfig`, :func:`window_recall_sweep`): a stream
of many more facts than a memory has key directions, whose queries ask only about the latest
few (chapter 5's task that needs forgetting).

The book's results files run one run at a time, :func:`run_rewrite` and
:func:`run_window_recall` as the ``rewrite`` and ``window`` tasks of
:mod:`gpt2kimi.experiments.tasks`, recorded by ``python -m gpt2kimi.experiments run NAME``; no
command calls the two sweeps any more.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpt2kimi.experiments.mqar import IGNORE, MQARResult, MQARTraining
from gpt2kimi.experiments.sweep import map_jobs, rounded, training_settings
from gpt2kimi.train import evaluating, seeded_splits, train


@dataclass(frozen=True)
class RewriteConfig:
    """One rewritten-facts task: vocabulary, sequence length, keys per sequence, query rate."""

    vocab_size: int = 128
    seq_len: int = 64
    num_keys: int = 4
    query_prob: float = 0.5

    def __post_init__(self) -> None:
        if self.vocab_size < 6:
            raise ValueError(f"vocab_size must be at least 6, got {self.vocab_size}")
        if self.num_keys < 1:
            raise ValueError(f"num_keys must be at least 1, got {self.num_keys}")
        if self.num_keys > self.vocab_size // 2 - 1:
            raise ValueError(
                f"vocab_size={self.vocab_size} holds only {self.vocab_size // 2 - 1} key tokens "
                f"([1, {self.vocab_size // 2})), fewer than num_keys={self.num_keys}"
            )
        if self.num_events <= self.num_keys:
            raise ValueError(
                f"seq_len={self.seq_len} gives {self.num_events} events, no room after the "
                f"{self.num_keys} first writes; use seq_len >= {2 * (self.num_keys + 1)}"
            )
        if not 0.0 < self.query_prob <= 1.0:
            raise ValueError(f"query_prob must lie in (0, 1], got {self.query_prob}")

    @property
    def num_events(self) -> int:
        """Two-token events ``key value`` in a sequence."""
        return self.seq_len // 2


def rewrite_batch(
    cfg: RewriteConfig, batch_size: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """A batch of rewritten-facts sequences: inputs ``x`` and targets ``y``, [batch_size, seq_len].

    ``y[b, t]`` is the current value of key ``x[b, t]`` where t is a query's key position, and
    -100 elsewhere (first writes, rewrites, the values themselves).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    B, N, E, V = batch_size, cfg.num_keys, cfg.num_events, cfg.vocab_size
    half = V // 2
    rows = torch.arange(B)
    keys = torch.rand(B, half - 1, generator=generator).argsort(dim=-1)[:, :N] + 1  # distinct
    current = torch.randint(half, V, (B, N), generator=generator)  # each key's current value
    x = torch.randint(0, V, (B, cfg.seq_len), generator=generator)  # fillers (odd last token)
    y = torch.full((B, cfg.seq_len), IGNORE, dtype=torch.long)
    # the first N events write every key once, in random order
    first = torch.rand(B, N, generator=generator).argsort(dim=-1)
    x[:, 0 : 2 * N : 2] = keys.gather(1, first)
    x[:, 1 : 2 * N : 2] = current.gather(1, first)
    for e in range(N, E):
        slot = torch.randint(0, N, (B,), generator=generator)
        is_query = torch.rand(B, generator=generator) < cfg.query_prob
        # a rewrite draws a value different from the current one: shift by 1 … V/2 − 1
        shift = torch.randint(1, V - half, (B,), generator=generator)
        old = current[rows, slot]
        new = torch.where(is_query, old, half + (old - half + shift) % (V - half))
        current[rows, slot] = new
        x[:, 2 * e] = keys[rows, slot]
        x[:, 2 * e + 1] = new
        y[:, 2 * e] = torch.where(is_query, new, torch.full_like(new, IGNORE))
    return x, y


def rewrite_batches(
    cfg: RewriteConfig, batch_size: int, seed: int = 0
) -> Callable[[str], tuple[Tensor, Tensor]]:
    """A batch source for :func:`gpt2kimi.train.train`: ``batches("train")``, ``batches("val")``,
    each split from its own seeded generator (as :func:`gpt2kimi.experiments.mqar.mqar_batches`)."""
    return seeded_splits(lambda generator: rewrite_batch(cfg, batch_size, generator), seed)


def stale_values(x: Tensor, vocab_size: int) -> Tensor:
    """Which value tokens are stale at each event: [B, E, vocab_size] boolean.

    True for a value that an earlier event wrote for the same key and that the key no longer
    holds (it differs from the value shown at this event). x [B, T] holds events ``key value``
    at even and odd positions, as :func:`rewrite_batch` makes them.
    """
    E = x.shape[1] // 2
    keys, values = x[:, 0 : 2 * E : 2], x[:, 1 : 2 * E : 2]  # [B, E]
    earlier = torch.ones(E, E, dtype=torch.bool, device=x.device).tril(-1)  # e' < e
    same_key_before = (keys[:, :, None] == keys[:, None, :]) & earlier  # [B, e, e']
    shown = F.one_hot(values, vocab_size).to(torch.float32)  # [B, E, vocab]
    written_before = (same_key_before.to(torch.float32) @ shown) > 0  # [B, e, vocab]
    return written_before & ~shown.bool()


@torch.no_grad()
def rewrite_scores(
    model: nn.Module,
    cfg: RewriteConfig,
    n_sequences: int = 512,
    batch_size: int = 128,
    seed: int = 1234,
) -> dict:
    """Score ``model`` (``model(x)`` → logits [B, T, vocab]) on fresh sequences.

    Returns ``{"accuracy": fraction of queries answered with the current value, "stale":
    fraction answered with a value the key held before (old facts that linger)}``; the test
    sequences come from their own generator (``seed``), the same for every model.
    """
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    correct = stale = total = 0
    remaining = n_sequences
    while remaining > 0:
        x, y = rewrite_batch(cfg, min(batch_size, remaining), generator)
        remaining -= len(x)
        with evaluating(model):
            pred = model(x.to(device)).argmax(dim=-1).cpu()
        E = cfg.num_events
        queried = y[:, 0 : 2 * E : 2] != IGNORE  # [B, E]
        guess = pred[:, 0 : 2 * E : 2]  # the prediction at each event's key position
        correct += int(((guess == y[:, 0 : 2 * E : 2]) & queried).sum())
        old = stale_values(x, cfg.vocab_size).gather(2, guess[..., None])[..., 0]
        stale += int((old & queried).sum())
        total += int(queried.sum())
    return {"accuracy": correct / total, "stale": stale / total}


@dataclass
class RewriteResult(MQARResult):
    """MQAR's result plus ``stale``: the fraction of queries answered with an old value."""

    stale: float = 0.0

    def as_dict(self) -> dict:
        return {**super().as_dict(), "stale": self.stale}


def train_rewrite(
    model: nn.Module, cfg: RewriteConfig, training: MQARTraining | None = None
) -> RewriteResult:
    """Train ``model`` (``model(x, y)`` → ``(logits, loss)``) on the task, then score it.

    The same training settings as MQAR (:class:`gpt2kimi.experiments.mqar.MQARTraining`), so
    the two tasks share one budget; the test set is fixed and shared by every model.
    """
    training = MQARTraining() if training is None else training
    start = time.perf_counter()
    batches = rewrite_batches(cfg, training.batch_size, seed=training.seed)
    history = train(model, batches, training.train_config())
    scores = rewrite_scores(model, cfg, n_sequences=training.eval_sequences)
    seconds = time.perf_counter() - start
    return RewriteResult(scores["accuracy"], history, seconds, stale=scores["stale"])


# ----------------------------------------------------------------------------------------------
# a sweep over models, task sizes and seeds

ModelFactory = Callable[[], nn.Module]
Probe = Callable[[nn.Module], dict]  # a trained model -> more fields of its record


def run_rewrite(
    make_model: ModelFactory,
    cfg: RewriteConfig,
    training: MQARTraining | None = None,
    seed: int = 0,
    probe: Probe | None = None,
) -> dict:
    """Seed, build ``make_model()``, train it on ``cfg`` with ``training`` (its seed replaced by
    ``seed``); return ``{"num_keys", "seed", "accuracy", "stale", "seconds", "final_loss"}``
    with floats rounded to 4 digits (as :func:`gpt2kimi.experiments.mqar.run_mqar` records MQAR
    runs), and what ``probe(trained model)`` measures besides."""
    training = MQARTraining(seed=seed) if training is None else replace(training, seed=seed)
    torch.manual_seed(seed)
    model = make_model()
    result = train_rewrite(model, cfg, training)
    record = {"num_keys": cfg.num_keys, "seed": seed, **result.as_dict()}
    return rounded({**record, **(probe(model) if probe else {})})


def _run_rewrite_job(job: tuple[str, ModelFactory, RewriteConfig, MQARTraining, int]) -> dict:
    """One sweep run (a module-level function, so that worker processes can run it)."""
    name, make_model, cfg, training, seed = job
    return {"mixer": name, **run_rewrite(make_model, cfg, training, seed)}


def rewrite_sweep(
    models: Mapping[str, ModelFactory],
    num_keys: Iterable[int],
    seeds: Iterable[int] = (0,),
    *,
    training: MQARTraining | None = None,
    jobs: int = 1,
    log: Callable[[dict], None] | None = None,
    **task_kwargs,
) -> dict:
    """Train every named model × number of keys × seed on the rewritten-facts task.

    ``models`` maps a name to a constructor taking no arguments (picklable, e.g. a
    ``functools.partial`` of a module-level function, when ``jobs > 1``); ``task_kwargs``
    (``vocab_size``, ``seq_len``, ``query_prob``) go to every :class:`RewriteConfig`;
    ``jobs > 1`` runs that many single-threaded worker processes at once; ``log`` sees each
    record. Returns ``{"settings": {...}, "results": [record, ...]}``, JSON-ready, the results
    in model, keys, seed order, each record starting with ``"mixer"`` (the model's name).
    """
    names, num_keys, seeds = list(models), list(num_keys), list(seeds)
    training = MQARTraining() if training is None else training
    job_list = [
        (name, models[name], RewriteConfig(num_keys=n, **task_kwargs), training, seed)
        for name in names
        for n in num_keys
        for seed in seeds
    ]
    start = time.perf_counter()
    results = map_jobs(_run_rewrite_job, job_list, jobs, log)
    task = asdict(RewriteConfig(num_keys=min(num_keys), **task_kwargs))
    task.pop("num_keys")
    settings = {
        **task,
        **training_settings(training),
        "mixers": names,
        "num_keys": num_keys,
        "seeds": seeds,
        "jobs": jobs,
        "seconds": round(time.perf_counter() - start, 1),
    }
    return {"settings": settings, "results": results}


# ==============================================================================================
# Sliding-window recall: a stream of many more facts than a memory has key directions, whose
# queries ask only about the latest few. A memory that cannot let go fills up with old facts.


@dataclass(frozen=True)
class WindowRecallConfig:
    """One sliding-window recall task: vocabulary, length, queries per sequence, window.

    A sequence is a stream of ``seq_len // 2`` two-token events ``key value``. Every event is
    either a new *fact* (a key not seen before in the sequence, a random value) or a *query*
    that restates one of the ``window`` most recent facts; the model is scored on predicting
    the value at the query's key position. Keys come from ``[1, V/2)``, values from
    ``[V/2, V)`` (as in MQAR), and a sequence writes ``num_events − num_queries`` facts, many
    more than a head's memory has key directions when the stream is long. Example, window 2
    (letters for keys, digits for values, ``_`` an ignored target)::

        x:  A 3 B 7 C 1 B 7 D 4 D 4 E 9 ...
        y:  _ _ _ _ _ _ 7 _ _ _ 4 _ _ _ ...

    (``B 7`` and ``D 4`` are queries, each about one of the two latest facts; once C is
    written, A is never asked about again, so a memory may let it go.)
    """

    vocab_size: int = 64
    seq_len: int = 64
    num_queries: int = 8
    window: int = 4

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")
        if self.num_queries < 1:
            raise ValueError(f"num_queries must be at least 1, got {self.num_queries}")
        if self.num_queries > self.num_events - self.window:
            raise ValueError(
                f"seq_len={self.seq_len} gives {self.num_events} events; the first "
                f"window={self.window} are facts, so at most {self.num_events - self.window} "
                f"can be queries, fewer than num_queries={self.num_queries}"
            )
        if self.num_facts > self.vocab_size // 2 - 1:
            raise ValueError(
                f"{self.num_facts} facts need as many distinct keys, but vocab_size="
                f"{self.vocab_size} holds only {self.vocab_size // 2 - 1} ([1, "
                f"{self.vocab_size // 2})); use vocab_size >= {2 * (self.num_facts + 1)}"
            )

    @property
    def num_events(self) -> int:
        """Two-token events ``key value`` in a sequence (an odd last token is a filler)."""
        return self.seq_len // 2

    @property
    def num_facts(self) -> int:
        """Facts written per sequence: every event that is not a query."""
        return self.num_events - self.num_queries


def window_recall_batch(
    cfg: WindowRecallConfig, batch_size: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """A batch of sliding-window recall sequences: ``x`` and ``y``, [batch_size, seq_len].

    ``y[b, t]`` is the value of the fact that the query at key position t restates, -100
    everywhere else. Vectorised over the batch and the events: no Python loop.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    B, E, W, V = batch_size, cfg.num_events, cfg.window, cfg.vocab_size
    half = V // 2
    rows = torch.arange(B)[:, None]
    # which events are queries: num_queries of the events after the first W (always facts)
    later = torch.rand(B, E - W, generator=generator).argsort(dim=-1)[:, : cfg.num_queries]
    is_query = torch.zeros(B, E, dtype=torch.bool)
    is_query[rows, W + later] = True
    # fact f of a sequence: its key (distinct within the sequence) and value
    keys = torch.rand(B, half - 1, generator=generator).argsort(dim=-1)[:, : cfg.num_facts] + 1
    values = torch.randint(half, V, (B, cfg.num_facts), generator=generator)
    # facts written before each event; a fact event writes fact number `written`, a query
    # restates fact number written − 1 − j with j uniform in [0, W): one of the W latest
    written = (~is_query).long().cumsum(dim=-1) - (~is_query).long()  # [B, E]
    back = torch.randint(0, W, (B, E), generator=generator)
    fact = torch.where(is_query, written - 1 - back, written)
    x = torch.randint(0, V, (B, cfg.seq_len), generator=generator)  # fillers (odd last token)
    x[:, 0 : 2 * E : 2] = keys.gather(1, fact)
    x[:, 1 : 2 * E : 2] = values.gather(1, fact)
    y = torch.full((B, cfg.seq_len), IGNORE, dtype=torch.long)
    y[:, 0 : 2 * E : 2] = torch.where(is_query, values.gather(1, fact), IGNORE)
    return x, y


def window_recall_batches(
    cfg: WindowRecallConfig, batch_size: int, seed: int = 0
) -> Callable[[str], tuple[Tensor, Tensor]]:
    """A batch source for :func:`gpt2kimi.train.train`: ``batches("train")``, ``batches("val")``,
    each split from its own seeded generator (as :func:`gpt2kimi.experiments.mqar.mqar_batches`)."""
    return seeded_splits(lambda generator: window_recall_batch(cfg, batch_size, generator), seed)


WINDOW_PARTS = 4  # window_recall_scores splits the stream into this many parts


@torch.no_grad()
def window_recall_scores(
    model: nn.Module,
    cfg: WindowRecallConfig,
    n_sequences: int = 512,
    batch_size: int = 128,
    seed: int = 1234,
) -> dict:
    """Score ``model`` (``model(x)`` → logits [B, T, vocab]) on fresh sequences.

    Returns ``{"accuracy": fraction of queries answered with the right value, "by_part":
    [accuracy of the queries in each quarter of the stream]}``. The quarters show the memory
    filling up: a query in the last quarter comes after about three quarters of the facts. The
    test sequences come from their own generator (``seed``), the same for every model.
    """
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    E = cfg.num_events
    part = torch.arange(E) * WINDOW_PARTS // E  # [E]: the quarter of each event
    correct, total = torch.zeros(WINDOW_PARTS), torch.zeros(WINDOW_PARTS)
    remaining = n_sequences
    while remaining > 0:
        x, y = window_recall_batch(cfg, min(batch_size, remaining), generator)
        remaining -= len(x)
        with evaluating(model):
            pred = model(x.to(device)).argmax(dim=-1).cpu()[:, 0 : 2 * E : 2]  # at key positions
        target = y[:, 0 : 2 * E : 2]
        queried = (target != IGNORE).float()
        right = (pred == target).float() * queried
        correct += torch.zeros(WINDOW_PARTS).index_add_(0, part, right.sum(dim=0))
        total += torch.zeros(WINDOW_PARTS).index_add_(0, part, queried.sum(dim=0))
    by_part = (correct / total.clamp_min(1)).tolist()
    return {"accuracy": float(correct.sum() / total.sum()), "by_part": by_part}


@dataclass
class WindowRecallResult(MQARResult):
    """MQAR's result plus ``by_part``: the accuracy in each quarter of the stream."""

    by_part: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {**super().as_dict(), "by_part": [round(a, 4) for a in self.by_part]}


def train_window_recall(
    model: nn.Module, cfg: WindowRecallConfig, training: MQARTraining | None = None
) -> WindowRecallResult:
    """Train ``model`` (``model(x, y)`` → ``(logits, loss)``) on the task, then score it on
    the fixed test set shared by every model (:func:`window_recall_scores`)."""
    training = MQARTraining() if training is None else training
    start = time.perf_counter()
    batches = window_recall_batches(cfg, training.batch_size, seed=training.seed)
    history = train(model, batches, training.train_config())
    scores = window_recall_scores(model, cfg, n_sequences=training.eval_sequences)
    seconds = time.perf_counter() - start
    return WindowRecallResult(scores["accuracy"], history, seconds, by_part=scores["by_part"])


def run_window_recall(
    make_model: ModelFactory,
    cfg: WindowRecallConfig,
    training: MQARTraining | None = None,
    seed: int = 0,
    probe: Probe | None = None,
) -> dict:
    """Seed, build ``make_model()``, train it on ``cfg`` with ``training`` (its seed replaced by
    ``seed``); return ``{"seq_len", "window", "seed", "accuracy", "seconds", "final_loss",
    "by_part"}`` with floats rounded to 4 digits, and what ``probe(trained model)`` measures."""
    training = MQARTraining(seed=seed) if training is None else replace(training, seed=seed)
    torch.manual_seed(seed)
    model = make_model()
    result = train_window_recall(model, cfg, training)
    record = {"seq_len": cfg.seq_len, "window": cfg.window, "seed": seed, **result.as_dict()}
    return rounded({**record, **(probe(model) if probe else {})})


def _run_window_recall_job(
    job: tuple[str, ModelFactory, WindowRecallConfig, MQARTraining, int],
) -> dict:
    """One sweep run (a module-level function, so that worker processes can run it)."""
    name, make_model, cfg, training, seed = job
    return {"mixer": name, **run_window_recall(make_model, cfg, training, seed)}


def window_recall_sweep(
    models: Mapping[str, ModelFactory],
    seeds: Iterable[int] = (0,),
    *,
    training: MQARTraining | None = None,
    jobs: int = 1,
    log: Callable[[dict], None] | None = None,
    **task_kwargs,
) -> dict:
    """Train every named model × seed on one sliding-window recall task.

    ``models`` maps a name to a constructor taking no arguments (picklable when ``jobs > 1``);
    ``task_kwargs`` (``vocab_size``, ``seq_len``, ``num_queries``, ``window``) make the
    :class:`WindowRecallConfig`; ``jobs > 1`` runs that many single-threaded worker processes;
    ``log`` sees each record. Returns ``{"settings": {...}, "results": [record, ...]}``,
    JSON-ready, the results in model, seed order, each record starting with ``"mixer"``.
    """
    names, seeds = list(models), list(seeds)
    training = MQARTraining() if training is None else training
    cfg = WindowRecallConfig(**task_kwargs)
    job_list = [(name, models[name], cfg, training, seed) for name in names for seed in seeds]
    start = time.perf_counter()
    results = map_jobs(_run_window_recall_job, job_list, jobs, log)
    settings = {
        **asdict(cfg),
        "num_facts": cfg.num_facts,
        **training_settings(training),
        "mixers": names,
        "seeds": seeds,
        "jobs": jobs,
        "seconds": round(time.perf_counter() - start, 1),
    }
    return {"settings": settings, "results": results}
