"""The task interface of the experiment pipeline: one run is ``train_and_score(settings, seed)``.

A :class:`Task` has a ``name``, the settings it takes with their defaults (``defaults``: a flat
dict of JSON values) and :meth:`Task.train_and_score`, which trains one model on one setting
with one seed and returns one flat, JSON-ready record, floats rounded as the results files store
them. :func:`gpt2kimi.experiments.pipeline.sweep` runs a task over a grid of settings and seeds
and appends each record to its results file as it finishes.

The tasks wrap the existing runs, so a record holds the fields today's results files hold for
one run (the chapters read them unchanged):

- :data:`MQAR` (``"mqar"``, chapters 3-6 and 8): :func:`gpt2kimi.experiments.mqar.run_mqar`,
  one mixer (or one of chapter 8's per-layer mixes), one number of pairs;
  record ``mixer, num_pairs, seed, accuracy, seconds, final_loss``;
- :data:`REWRITE` (``"rewrite"``, chapter 5): :func:`gpt2kimi.experiments.recall.run_rewrite`;
  record ``mixer, num_keys, seed, accuracy, stale, seconds, final_loss``;
- :data:`WINDOW` (``"window"``, chapter 5's forgetting task):
  :func:`gpt2kimi.experiments.recall.run_window_recall`; record ``mixer, seq_len, window,
  seed, accuracy, seconds, final_loss, by_part``;
- :data:`LM_MOE` (``"lm_moe"``, chapter 7): byte-level language modelling with a dense or MoE
  feed-forward, :func:`gpt2kimi.experiments.moe_train.run_variant`; record ``variant, seed,
  parameters, active_parameters, val_steps, val_loss, final_val_loss, seconds`` and, for the
  MoE variants, ``load_imbalance, final_load, experts_by_byte``;
- :data:`LM_HYBRID` (``"lm_hybrid"``, chapter 8): GPT-2 or the hybrid at a KDA:MLA mix,
  :func:`gpt2kimi.experiments.hybrid_train.run_lm`; record ``model, seed, params,
  active_params, val_steps, val_loss, seconds``.

Settings names follow the results files: the task's and the backbone's fields as they are, the
training's with a ``train_`` prefix for the recall tasks (as
:func:`gpt2kimi.experiments.sweep.training_settings` writes them), plain for the language
models (as chapters 7 and 8's files hold them).
"""

from __future__ import annotations

from dataclasses import asdict, fields
from functools import partial
from typing import Any, ClassVar

from gpt2kimi.experiments import forget, hybrid_train, moe_train
from gpt2kimi.experiments.mqar import MQARTraining, run_mqar
from gpt2kimi.experiments.recall import (
    RewriteConfig,
    WindowRecallConfig,
    run_rewrite,
    run_window_recall,
)
from gpt2kimi.experiments.registry import (
    MIXERS,
    MQAR_D_MODEL,
    MQAR_N_HEAD,
    MQAR_N_LAYER,
    MQAR_SEQ_LEN,
    MQAR_SHORT_CONV,
    MQAR_VOCAB,
    build_model,
    mqar_model_config,
)
from gpt2kimi.experiments.sweep import rounded

BACKBONE = ("d_model", "n_layer", "n_head", "short_conv")


class Task:
    """One kind of run: a ``name``, its settings with their defaults, and
    :meth:`train_and_score`.

    Subclasses set ``name`` and ``defaults`` and implement :meth:`score`; instances hold no
    state, so a sweep can send them to worker processes.
    """

    name: ClassVar[str]
    defaults: ClassVar[dict[str, Any]]

    def settings(self, overrides: dict | None = None) -> dict:
        """The full settings of one run: the defaults with ``overrides`` applied.

        Raises ``KeyError`` on a name the task does not take, so a typo cannot silently run
        the default.
        """
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(self.defaults))
        if unknown:
            raise KeyError(
                f"task {self.name!r} takes no setting {', '.join(map(repr, unknown))}; "
                f"its settings: {', '.join(self.defaults)}"
            )
        return {**self.defaults, **overrides}

    def train_and_score(self, settings: dict, seed: int) -> dict:
        """Train one model with ``settings`` (missing ones at their defaults) and ``seed``;
        return its record: flat, JSON-ready, floats rounded to 4 digits."""
        return rounded(self.score(self.settings(settings), seed))

    def score(self, s: dict, seed: int) -> dict:
        """The run itself, on full settings ``s``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<task {self.name}>"


def _prefixed(training: Any, prefix: str = "train_") -> dict:
    """A training dataclass's fields (its seed left out: a run's seed is separate)."""
    return {prefix + k: v for k, v in asdict(training).items() if k != "seed"}


def _training(s: dict, **fixed) -> MQARTraining:
    """The :class:`MQARTraining` of the ``train_*`` settings in ``s``."""
    names = [f.name for f in fields(MQARTraining) if f.name != "seed"]
    return MQARTraining(**{n: s["train_" + n] for n in names}, **fixed)


class MQARTask(Task):
    """MQAR (:mod:`gpt2kimi.experiments.mqar`): one mixer, one number of pairs, one seed.

    ``mixer`` is a name of :data:`gpt2kimi.experiments.registry.MIXERS` (every layer that
    mixer) or of :data:`gpt2kimi.experiments.hybrid_train.MQAR_MIXES` (chapter 8's per-layer
    mixes, e.g. ``"hybrid"``: KDA then MLA); the record keeps the name.
    """

    name = "mqar"
    defaults = {
        "mixer": "softmax",
        "num_pairs": 4,
        "vocab_size": MQAR_VOCAB,
        "seq_len": MQAR_SEQ_LEN,
        "d_model": MQAR_D_MODEL,
        "n_layer": MQAR_N_LAYER,
        "n_head": MQAR_N_HEAD,
        "short_conv": MQAR_SHORT_CONV,
        **_prefixed(MQARTraining()),
    }

    def score(self, s: dict, seed: int) -> dict:
        kwargs = {k: s[k] for k in ("vocab_size", "seq_len", *BACKBONE)}
        kwargs["training"] = _training(s)
        if s["mixer"] in MIXERS:
            return run_mqar(s["mixer"], s["num_pairs"], seed=seed, **kwargs)
        if s["mixer"] in hybrid_train.MQAR_MIXES:
            return hybrid_train.run_mqar_job((s["mixer"], s["num_pairs"], seed, kwargs))
        known = sorted(MIXERS) + sorted(hybrid_train.MQAR_MIXES)
        raise ValueError(f"unknown mixer {s['mixer']!r}; expected one of {known}")


class RewriteTask(Task):
    """Rewritten facts (:class:`gpt2kimi.experiments.recall.RewriteConfig`): one mixer on the
    MQAR backbone, one number of keys, one seed, under MQAR's training budget."""

    name = "rewrite"
    defaults = {
        "mixer": "softmax",
        "num_keys": 4,
        "vocab_size": MQAR_VOCAB,
        "seq_len": MQAR_SEQ_LEN,
        "query_prob": RewriteConfig.query_prob,
        "d_model": MQAR_D_MODEL,
        "n_layer": MQAR_N_LAYER,
        "n_head": MQAR_N_HEAD,
        "short_conv": MQAR_SHORT_CONV,
        **_prefixed(MQARTraining()),
    }

    def score(self, s: dict, seed: int) -> dict:
        cfg = RewriteConfig(
            vocab_size=s["vocab_size"],
            seq_len=s["seq_len"],
            num_keys=s["num_keys"],
            query_prob=s["query_prob"],
        )
        config = mqar_model_config(s["vocab_size"], **{k: s[k] for k in BACKBONE})
        make_model = partial(build_model, s["mixer"], config)
        return {"mixer": s["mixer"], **run_rewrite(make_model, cfg, _training(s), seed)}


class WindowTask(Task):
    """Sliding-window recall (:class:`gpt2kimi.experiments.recall.WindowRecallConfig`), the
    task that needs forgetting: one mixer, one seed, at chapter 5's settings by default (eight
    heads of 8 dimensions, 400 steps of 32 sequences, :mod:`gpt2kimi.experiments.forget`)."""

    name = "window"
    defaults = {
        "mixer": "softmax",
        **asdict(WindowRecallConfig()),
        "d_model": MQAR_D_MODEL,
        "n_layer": MQAR_N_LAYER,
        "n_head": forget.N_HEAD,
        "short_conv": MQAR_SHORT_CONV,
        **_prefixed(
            MQARTraining(
                steps=forget.STEPS, batch_size=forget.BATCH_SIZE, warmup_steps=forget.WARMUP
            )
        ),
    }

    def score(self, s: dict, seed: int) -> dict:
        cfg = WindowRecallConfig(**{f.name: s[f.name] for f in fields(WindowRecallConfig)})
        config = mqar_model_config(s["vocab_size"], **{k: s[k] for k in BACKBONE})
        make_model = forget.model_factories([s["mixer"]], config)[s["mixer"]]
        training = _training(s)
        return {"mixer": s["mixer"], **run_window_recall(make_model, cfg, training, seed)}


class MoELMTask(Task):
    """Chapter 7's byte-level language modelling: one feed-forward ``variant`` (``dense``,
    ``moe``, ``moe_aux``, ``moe_bias``) of :mod:`gpt2kimi.experiments.moe_train`, one seed."""

    name = "lm_moe"
    defaults = {
        "variant": "dense",
        **{k: v for k, v in asdict(moe_train.MoETrainSettings()).items() if k != "seed"},
    }

    def score(self, s: dict, seed: int) -> dict:
        variant = s["variant"]
        settings = moe_train.MoETrainSettings(
            **{k: v for k, v in s.items() if k != "variant"}, seed=seed
        )
        record = moe_train.run_variant(variant, settings)
        return {"variant": variant, "seed": seed, **record}


class HybridLMTask(Task):
    """Chapter 8's byte-level language modelling: ``model`` is ``"gpt2"`` (equal active
    parameters) or a KDA:MLA mix of :data:`gpt2kimi.experiments.hybrid_train.RATIOS`, the tiny
    hybrid :data:`~gpt2kimi.experiments.hybrid_train.LM_CONFIG`; one seed."""

    name = "lm_hybrid"
    defaults = {"model": "3:1", **hybrid_train.LM_TRAINING}

    def score(self, s: dict, seed: int) -> dict:
        training = {k: v for k, v in s.items() if k != "model"}
        return hybrid_train.run_lm((s["model"], seed, training))


MQAR = MQARTask()
REWRITE = RewriteTask()
WINDOW = WindowTask()
LM_MOE = MoELMTask()
LM_HYBRID = HybridLMTask()
TASKS: dict[str, Task] = {t.name: t for t in (MQAR, REWRITE, WINDOW, LM_MOE, LM_HYBRID)}


def get_task(name: str) -> Task:
    """The task registered as ``name`` in :data:`TASKS`."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; expected one of {sorted(TASKS)}")
    return TASKS[name]
