"""Multi-query associative recall (MQAR), the memory test of Zoology (Arora et al. 2023).

A sequence opens with N key-value pairs ``k1 v1 k2 v2 … kN vN``, then a query region in which
every key appears once more. After a query key the model must output that key's value; all other
targets are ignored (-100), so the loss and the accuracy measure recall only. Example with N = 2
(letters for keys, digits for values, ``·`` a filler token, ``_`` an ignored target)::

    x:  A 3 B 7 · · B 7 · A 3 ·
    y:  _ _ _ _ _ _ 7 _ _ 3 _ _

Layout used here (a re-implementation of the task, not Zoology's code):

- keys are drawn from the lower half of the vocabulary ``[1, V/2)``, values from the upper half
  ``[V/2, V)``, token 0 is never a key or a value; keys are distinct within a sequence;
- the query region after the 2N pair tokens is cut into two-token slots; each key is queried in
  one slot (the key, then its value, as a language model would see the continuation). The slot
  is drawn without replacement with probability ∝ ``(s + 1)^(a − 1)`` (a power law with
  exponent ``power_a``), which favours slots close to the pairs; the keys are assigned to the
  drawn slots in random order;
- every other position holds a random filler token (or 0 when ``random_fillers=False``).

Everything is vectorised over the batch: no Python loop over sequences or pairs.

Then the runs by mixer name: :func:`run_mqar` trains one model of the registry
(:mod:`gpt2kimi.experiments.registry`) on the task; it is the ``mqar`` task of
:mod:`gpt2kimi.experiments.tasks`, whose results files (chapters 3-6 and 8) are recorded by
``python -m gpt2kimi.experiments run NAME``. :func:`mqar_sweep` runs every mixer × number of
pairs × seed into one dict and :func:`format_table` prints it; no command calls them any more.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from gpt2kimi.backbone import BackboneConfig
from gpt2kimi.experiments.registry import (
    BACKBONE_FIELDS,
    MQAR_SEQ_LEN,
    MQAR_VOCAB,
    RECORDED_BACKBONE,
    build_model,
    mqar_model_config,
)
from gpt2kimi.experiments.sweep import map_jobs, mean_over_seeds, rounded, training_settings
from gpt2kimi.train import History, TrainConfig, evaluating, seeded_splits, train

IGNORE = -100


@dataclass(frozen=True)
class MQARConfig:
    """One MQAR task: vocabulary, sequence length, number of key-value pairs."""

    vocab_size: int = 128
    seq_len: int = 64
    num_pairs: int = 4
    power_a: float = 0.01
    random_fillers: bool = True

    def __post_init__(self) -> None:
        if self.num_pairs < 1:
            raise ValueError(f"num_pairs must be at least 1, got {self.num_pairs}")
        if self.vocab_size < 4:
            raise ValueError(f"vocab_size must be at least 4, got {self.vocab_size}")
        if self.num_pairs > self.num_keys:
            raise ValueError(
                f"vocab_size={self.vocab_size} is too small for {self.num_pairs} distinct keys: "
                f"keys come from [1, {self.vocab_size // 2}), which holds only {self.num_keys}; "
                f"use vocab_size >= {2 * (self.num_pairs + 1)}"
            )
        if self.seq_len < 4 * self.num_pairs:
            raise ValueError(
                f"seq_len={self.seq_len} is too short for {self.num_pairs} pairs: the pairs take "
                f"2N tokens and the queries 2N more, so seq_len must be >= {4 * self.num_pairs}"
            )
        if not 0.0 < self.power_a <= 1.0:
            raise ValueError(f"power_a must lie in (0, 1], got {self.power_a}")

    @property
    def num_keys(self) -> int:
        """How many distinct key tokens exist: ``[1, V/2)``."""
        return self.vocab_size // 2 - 1

    @property
    def num_slots(self) -> int:
        """Two-token query slots after the pairs."""
        return (self.seq_len - 2 * self.num_pairs) // 2

    def slot_probs(self) -> Tensor:
        """The power law over query slots, ``p(s) ∝ (s + 1)^(a − 1)``, s = 0 … num_slots − 1."""
        s = torch.arange(1, self.num_slots + 1, dtype=torch.float64)
        p = s ** (self.power_a - 1.0)
        return p / p.sum()


def sample_distinct(
    weights: Tensor, batch_size: int, n: int, generator: torch.Generator | None
) -> Tensor:
    """``n`` distinct indices per row, drawn without replacement with probability ∝ ``weights``.

    The Gumbel-top-k trick: perturb the log-weights with Gumbel noise and keep the n largest.
    Returns [batch_size, n] in draw order.
    """
    u = torch.rand(batch_size, len(weights), generator=generator, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
    return (weights.log() + gumbel).topk(n, dim=-1).indices


def mqar_batch(
    cfg: MQARConfig, batch_size: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """A batch of MQAR sequences: inputs ``x`` and targets ``y``, both [batch_size, seq_len].

    ``y[b, t]`` is the value of key ``x[b, t]`` where t is a query position, and -100 elsewhere.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    B, T, N, V = batch_size, cfg.seq_len, cfg.num_pairs, cfg.vocab_size
    half = V // 2
    rows = torch.arange(B)[:, None]
    # distinct keys: the first N of a random permutation of the key tokens 1 … V/2 − 1
    keys = torch.rand(B, cfg.num_keys, generator=generator).argsort(dim=-1)[:, :N] + 1
    values = torch.randint(half, V, (B, N), generator=generator)
    if cfg.random_fillers:
        x = torch.randint(0, V, (B, T), generator=generator)
    else:
        x = torch.zeros(B, T, dtype=torch.long)
    x[:, 0 : 2 * N : 2] = keys
    x[:, 1 : 2 * N : 2] = values
    # query slots by the power law; keys in random order (the draw order is already random)
    slots = sample_distinct(cfg.slot_probs(), B, N, generator)  # [B, N]
    query_pos = 2 * N + 2 * slots
    x[rows, query_pos] = keys
    x[rows, query_pos + 1] = values
    y = torch.full((B, T), IGNORE, dtype=torch.long)
    y[rows, query_pos] = values
    return x, y


def mqar_batches(
    cfg: MQARConfig, batch_size: int, seed: int = 0
) -> Callable[[str], tuple[Tensor, Tensor]]:
    """A batch source for :func:`gpt2kimi.train.train`: ``batches("train")``, ``batches("val")``.

    Each split draws from its own seeded generator, so a run is reproducible and the two splits
    are different streams of sequences.
    """
    return seeded_splits(lambda generator: mqar_batch(cfg, batch_size, generator), seed)


@torch.no_grad()
def recall_accuracy(logits: Tensor, y: Tensor) -> tuple[int, int]:
    """(correct, total) over the queried positions: argmax of logits [B, T, V] equals y [B, T]."""
    mask = y != IGNORE
    correct = (logits.argmax(dim=-1) == y) & mask
    return int(correct.sum()), int(mask.sum())


@torch.no_grad()
def mqar_accuracy(
    model: nn.Module,
    cfg: MQARConfig,
    n_sequences: int = 512,
    batch_size: int = 128,
    seed: int = 1234,
) -> float:
    """Fraction of queried values the model predicts (argmax) on fresh sequences.

    ``model(x)`` must return logits [B, T, vocab]. The sequences come from their own generator
    (``seed``), so every model is scored on the same test set.
    """
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    correct = total = 0
    remaining = n_sequences
    with evaluating(model):
        while remaining > 0:
            x, y = mqar_batch(cfg, min(batch_size, remaining), generator)
            c, n = recall_accuracy(model(x.to(device)), y.to(device))
            correct, total = correct + c, total + n
            remaining -= len(x)
    return correct / total


@dataclass(frozen=True)
class MQARTraining:
    """How :func:`train_mqar` trains: the defaults solve MQAR with softmax attention on a CPU."""

    steps: int = 600
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 60
    weight_decay: float = 0.1
    eval_sequences: int = 512
    seed: int = 0

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            steps=self.steps,
            lr=self.lr,
            warmup_steps=min(self.warmup_steps, self.steps),
            weight_decay=self.weight_decay,
            eval_interval=self.steps,  # validate once, at the end
            eval_batches=2,
            seed=self.seed,
        )


@dataclass
class MQARResult:
    """What :func:`train_mqar` returns: test accuracy, the loss history, wall-clock seconds."""

    accuracy: float
    history: History
    seconds: float

    def as_dict(self) -> dict:
        return {
            "accuracy": self.accuracy,
            "seconds": self.seconds,
            "final_loss": self.history.train_loss[-1],
        }


def train_mqar(
    model: nn.Module, cfg: MQARConfig, training: MQARTraining | None = None
) -> MQARResult:
    """Train ``model`` (``model(x, y)`` → ``(logits, loss)``) on MQAR, then measure recall.

    Training sequences come from seed ``training.seed``; the accuracy is measured on a fixed test
    set shared by every model (:func:`mqar_accuracy`).
    """
    training = MQARTraining() if training is None else training
    start = time.perf_counter()
    batches = mqar_batches(cfg, training.batch_size, seed=training.seed)
    history = train(model, batches, training.train_config())
    accuracy = mqar_accuracy(model, cfg, n_sequences=training.eval_sequences)
    return MQARResult(accuracy, history, time.perf_counter() - start)


# ----------------------------------------------------------------------------------------------
# the runs, by mixer name


def mqar_setup(**kwargs) -> tuple[dict, BackboneConfig, dict]:
    """Sort :func:`run_mqar`'s keyword arguments: the task's (``vocab_size``, ``seq_len``), the
    backbone (:func:`mqar_model_config` with the :class:`BackboneConfig` fields given) and the
    rest, which go to the mixer."""
    task = {"vocab_size": kwargs.pop("vocab_size", MQAR_VOCAB)}
    task["seq_len"] = kwargs.pop("seq_len", MQAR_SEQ_LEN)
    backbone = {k: kwargs.pop(k) for k in list(kwargs) if k in BACKBONE_FIELDS}
    return task, mqar_model_config(task["vocab_size"], **backbone), kwargs


def run_mqar(
    mixer: str,
    num_pairs: int,
    *,
    training: MQARTraining | None = None,
    seed: int = 0,
    **kwargs,
) -> dict:
    """Train the named mixer's model on MQAR with ``num_pairs`` pairs; return a result record.

    ``kwargs``: the task's ``vocab_size`` and ``seq_len``, the backbone's fields (``d_model``,
    ``n_layer``, ``n_head``, ``short_conv``, ...) and the mixer's keyword arguments
    (:func:`mqar_setup`); every default is the chapter-3 setting. The record holds ``mixer``,
    ``num_pairs``, ``seed``, ``accuracy`` (fraction of queried values recalled on the shared
    test set), ``seconds`` and ``final_loss``. The model's initialisation and the training data
    both follow ``seed``; everything else is held equal across mixers.
    """
    training = MQARTraining(seed=seed) if training is None else replace(training, seed=seed)
    task, config, mixer_kwargs = mqar_setup(**kwargs)
    task = MQARConfig(num_pairs=num_pairs, **task)
    torch.manual_seed(seed)
    model = build_model(mixer, config, **mixer_kwargs)
    result = train_mqar(model, task, training)
    return rounded({"mixer": mixer, "num_pairs": num_pairs, "seed": seed, **result.as_dict()})


def _run_mqar_job(job: tuple[str, int, int, dict]) -> dict:
    """One sweep run (a module-level function, so that worker processes can run it)."""
    mixer, num_pairs, seed, kwargs = job
    return run_mqar(mixer, num_pairs, seed=seed, **kwargs)


def mqar_sweep(
    mixers: Iterable[str],
    pairs: Iterable[int],
    seeds: Iterable[int] = (0,),
    *,
    training: MQARTraining | None = None,
    jobs: int = 1,
    log: Callable[[dict], None] | None = None,
    **kwargs,
) -> dict:
    """Run :func:`run_mqar` for every mixer × number of pairs × seed.

    ``training`` gives the shared settings (its ``seed`` is replaced by each run's seed);
    ``kwargs`` (``vocab_size``, ``seq_len``, ``d_model``, ...) go to every run; ``jobs > 1``
    runs that many single-threaded worker processes at once; ``log`` (e.g. ``print``) sees each
    record as it finishes. Returns ``{"settings": {...}, "results": [record, ...]}``, JSON-ready,
    with the results in mixer, pairs, seed order.
    """
    mixers, pairs, seeds = list(mixers), list(pairs), list(seeds)
    training = MQARTraining() if training is None else training
    grid = [(m, n, s) for m in mixers for n in pairs for s in seeds]
    job_list = [(m, n, s, {**kwargs, "training": replace(training, seed=s)}) for m, n, s in grid]
    start = time.perf_counter()
    results = map_jobs(_run_mqar_job, job_list, jobs, log)
    task, config, _ = mqar_setup(**kwargs)
    settings = {
        **task,
        "power_a": MQARConfig.power_a,
        **{name: getattr(config, name) for name in RECORDED_BACKBONE},
        **training_settings(training),
        "mixers": mixers,
        "pairs": pairs,
        "seeds": seeds,
        "jobs": jobs,
        "seconds": round(time.perf_counter() - start, 1),
    }
    return {"settings": settings, "results": results}


def format_table(sweep: dict) -> str:
    """Mean accuracy over seeds: one row per mixer, one column per number of pairs."""
    settings, results = sweep["settings"], sweep["results"]
    width = max(16, *(len(m) + 2 for m in settings["mixers"]))
    header = f"{'mixer':<{width}}" + "".join(f"{f'N={n}':>8}" for n in settings["pairs"])
    rows = [header]
    for mixer in settings["mixers"]:
        cells = "".join(
            f"{mean_over_seeds(results, mixer=mixer, num_pairs=n):>8.3f}" for n in settings["pairs"]
        )
        rows.append(f"{mixer:<{width}}{cells}")
    return "\n".join(rows)
