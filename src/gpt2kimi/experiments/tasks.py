"""The task interface of the experiment pipeline: one run is ``train_and_score(settings, seed)``.

A :class:`Task` has a ``name``, the settings it takes with their defaults (``defaults``: a flat
dict of JSON values) and :meth:`Task.train_and_score`, which trains one model on one setting
with one seed and returns one flat, JSON-ready record, floats rounded as the results files store
them. :func:`gpt2kimi.experiments.pipeline.sweep` runs a task over a grid of settings and seeds
and appends each record to its results file as it finishes.

The tasks wrap the existing runs, so a record holds the fields today's results files hold for
one run (the chapters read them unchanged):

- :data:`MQAR` (``"mqar"``, chapters 3-6 and 8): :func:`gpt2kimi.experiments.mqar.run_mqar`,
  one mixer (or a mix, one name per layer: ``"kda,kda,kda,mla"``, or one of chapter 8's
  per-layer mixes), one number of pairs, options of each mixer by name in ``mixer_options``
  (e.g. ``{"mla": {"kv_lora_rank": 4}, "kda": {"head_dim": 4}}``); record ``mixer,
  num_pairs, seed, accuracy, seconds, final_loss``;
- :data:`REWRITE` (``"rewrite"``, chapter 5): :func:`gpt2kimi.experiments.recall.run_rewrite`;
  record ``mixer, num_keys, seed, accuracy, stale, seconds, final_loss, half_lives``;
- :data:`WINDOW` (``"window"``, chapter 5's forgetting task):
  :func:`gpt2kimi.experiments.recall.run_window_recall`; record ``mixer, seq_len, window,
  seed, accuracy, seconds, final_loss, by_part, half_lives``;

(``half_lives``: the learned forget gates as half-lives in tokens,
:func:`gpt2kimi.experiments.gates.gate_half_lives`, on a fixed batch of the task's test data;
empty for a mixer without a gate.)
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

import torch

from gpt2kimi.experiments import forget, hybrid_train, lm_ablation, moe_train
from gpt2kimi.experiments.gates import gate_half_lives
from gpt2kimi.experiments.mqar import MQARTraining, run_mqar
from gpt2kimi.experiments.recall import (
    RewriteConfig,
    WindowRecallConfig,
    rewrite_batch,
    run_rewrite,
    run_window_recall,
    window_recall_batch,
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
from gpt2kimi.experiments.sweep import rounded, run_device

BACKBONE = ("d_model", "n_layer", "n_head", "short_conv")
# time per token of a mixer against softmax attention's (a CPU's training steps, roughly)
MIXER_COST = {"kda": 4.0, "gated": 2.5, "deltanet": 2.0, "mla": 1.5}


def _experiments(*names: str) -> tuple[str, ...]:
    return tuple(f"gpt2kimi.experiments.{name}" for name in names)


class Task:
    """One kind of run: a ``name``, its settings with their defaults, and
    :meth:`train_and_score`.

    Subclasses set ``name`` and ``defaults`` and implement :meth:`score`; instances hold no
    state, so a sweep can send them to worker processes.
    """

    name: ClassVar[str]
    defaults: ClassVar[dict[str, Any]]
    # the modules whose imports are the task's code (with this file: what a results file's code
    # hash covers, :func:`gpt2kimi.experiments.pipeline.task_code_hash`)
    modules: ClassVar[tuple[str, ...]]

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

    def cost(self, s: dict) -> float:
        """A rough relative cost of the run with full settings ``s`` (a sweep may start the
        longest runs first); the recall tasks: steps × batch × tokens × layers × the mixer's
        weight, the delta rules and gates being the slowest per token."""
        mixers = str(s.get("mixer", "")).split(",")
        weight = sum(next((w for key, w in MIXER_COST.items() if key in m), 1.0)
                     for m in mixers) / max(len(mixers), 1)
        size = 1.0
        for key in ("train_steps", "train_batch_size", "seq_len", "n_layer"):
            size *= float(s.get(key, 1))
        return weight * size

    def __repr__(self) -> str:
        return f"<task {self.name}>"


def _prefixed(training: Any, prefix: str = "train_") -> dict:
    """A training dataclass's fields (its seed left out: a run's seed is separate)."""
    return {prefix + k: v for k, v in asdict(training).items() if k != "seed"}


def _training(s: dict, **fixed) -> MQARTraining:
    """The :class:`MQARTraining` of the ``train_*`` settings in ``s``."""
    names = [f.name for f in fields(MQARTraining) if f.name != "seed"]
    return MQARTraining(**{n: s["train_" + n] for n in names}, **fixed)


# the fixed batch on which the trained gates are read (the same for every seed and mixer)
PROBE_SEQUENCES, PROBE_SEED = 64, 4321


def _gates(model, x: torch.Tensor) -> dict:
    """The trained model's forget gates as half-lives in tokens, on the batch x."""
    return {"half_lives": gate_half_lives(model, x)}


class MQARTask(Task):
    """MQAR (:mod:`gpt2kimi.experiments.mqar`): one mixer, one number of pairs, one seed.

    ``mixer`` is a name of :data:`gpt2kimi.experiments.registry.MIXERS` (every layer that
    mixer) or of :data:`gpt2kimi.experiments.hybrid_train.MQAR_MIXES` (chapter 8's per-layer
    mixes, e.g. ``"hybrid"``: KDA then MLA); the record keeps the name.
    """

    name = "mqar"
    modules = _experiments("mqar", "hybrid_train", "registry")
    defaults = {
        "mixer": "softmax",
        "num_pairs": 4,
        "vocab_size": MQAR_VOCAB,
        "seq_len": MQAR_SEQ_LEN,
        "d_model": MQAR_D_MODEL,
        "n_layer": MQAR_N_LAYER,
        "n_head": MQAR_N_HEAD,
        "short_conv": MQAR_SHORT_CONV,
        "mixer_options": {},
        **_prefixed(MQARTraining()),
    }

    def score(self, s: dict, seed: int) -> dict:
        kwargs = {k: s[k] for k in ("vocab_size", "seq_len", *BACKBONE)}
        kwargs["training"] = _training(s)
        kwargs["per_mixer"] = s["mixer_options"]
        name = s["mixer"]
        if name in hybrid_train.MQAR_MIXES:
            return hybrid_train.run_mqar_job((name, s["num_pairs"], seed, kwargs))
        layers = name.split(",")  # one name: every layer; several: one per layer
        unknown = [n for n in layers if n not in MIXERS]
        if unknown or ("," in name and len(layers) != s["n_layer"]):
            known = sorted(MIXERS) + sorted(hybrid_train.MQAR_MIXES)
            raise ValueError(
                f"unknown mixer {name!r}; expected one of {known}, or n_layer={s['n_layer']} "
                "of them joined by commas (one per layer)"
            )
        mixer = layers[0] if len(layers) == 1 else layers
        return {**run_mqar(mixer, s["num_pairs"], seed=seed, **kwargs), "mixer": name}


class RewriteTask(Task):
    """Rewritten facts (:class:`gpt2kimi.experiments.recall.RewriteConfig`): one mixer on the
    MQAR backbone, one number of keys, one seed, under MQAR's training budget."""

    name = "rewrite"
    modules = _experiments("recall", "registry", "gates")
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
        "mixer_options": {},
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
        make_model = partial(build_model, s["mixer"], config, per_mixer=s["mixer_options"])
        x, _ = rewrite_batch(cfg, PROBE_SEQUENCES, torch.Generator().manual_seed(PROBE_SEED))
        record = run_rewrite(make_model, cfg, _training(s), seed, probe=partial(_gates, x=x))
        return {"mixer": s["mixer"], **record}


class WindowTask(Task):
    """Sliding-window recall (:class:`gpt2kimi.experiments.recall.WindowRecallConfig`), the
    task that needs forgetting: one mixer, one seed, at chapter 5's settings by default (eight
    heads of 8 dimensions, 400 steps of 32 sequences, :mod:`gpt2kimi.experiments.forget`)."""

    name = "window"
    modules = _experiments("recall", "registry", "gates", "forget")
    defaults = {
        "mixer": "softmax",
        **asdict(WindowRecallConfig()),
        "d_model": MQAR_D_MODEL,
        "n_layer": MQAR_N_LAYER,
        "n_head": forget.N_HEAD,
        "short_conv": MQAR_SHORT_CONV,
        "mixer_options": {},
        **_prefixed(
            MQARTraining(
                steps=forget.STEPS, batch_size=forget.BATCH_SIZE, warmup_steps=forget.WARMUP
            )
        ),
    }

    def score(self, s: dict, seed: int) -> dict:
        cfg = WindowRecallConfig(**{f.name: s[f.name] for f in fields(WindowRecallConfig)})
        config = mqar_model_config(s["vocab_size"], **{k: s[k] for k in BACKBONE})
        make_model = partial(build_model, s["mixer"], config, per_mixer=s["mixer_options"])
        training = _training(s)
        x, _ = window_recall_batch(cfg, PROBE_SEQUENCES, torch.Generator().manual_seed(PROBE_SEED))
        record = run_window_recall(make_model, cfg, training, seed, probe=partial(_gates, x=x))
        return {"mixer": s["mixer"], **record}


class MoELMTask(Task):
    """Chapter 7's byte-level language modelling: one feed-forward ``variant`` (``dense``,
    ``moe``, ``moe_aux``, ``moe_bias``) of :mod:`gpt2kimi.experiments.moe_train`, one seed."""

    name = "lm_moe"
    modules = _experiments("moe_train")
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
    modules = _experiments("hybrid_train")
    defaults = {"model": "3:1", **hybrid_train.LM_TRAINING}

    def score(self, s: dict, seed: int) -> dict:
        training = {k: v for k, v in s.items() if k != "model"}
        return hybrid_train.run_lm((s["model"], seed, training))


class MoELMFixedValTask(Task):
    """Chapter 7's dense-vs-MoE runs (:class:`MoELMTask`'s variants and settings, ``eval_batches``
    aside) scored on the whole validation split in fixed windows of ``val_batch_size``
    (:func:`gpt2kimi.data.fixed_val_batches`), the same for every seed; trained on
    :func:`~gpt2kimi.experiments.sweep.run_device`. The record is :class:`MoELMTask`'s with
    ``tokens_per_s`` and ``device``."""

    name = "lm_moe_fixed"
    modules = _experiments("moe_train")
    defaults = {
        "variant": "dense",
        **{
            k: v
            for k, v in asdict(moe_train.MoETrainSettings()).items()
            if k not in ("seed", "eval_batches")
        },
        "val_batch_size": 64,
    }

    def score(self, s: dict, seed: int) -> dict:
        variant = s["variant"]
        if variant not in moe_train.VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; expected one of {moe_train.VARIANTS}")
        kept = {k: v for k, v in s.items() if k not in ("variant", "val_batch_size")}
        settings = moe_train.MoETrainSettings(**kept, seed=seed)
        record = moe_train.run_variant(
            variant, settings, val_batch_size=s["val_batch_size"], device=run_device()
        )
        return {"variant": variant, "seed": seed, **record}


class HybridLMAblationTask(Task):
    """Chapter 8's byte-level language modelling with the baselines that attribute the hybrid's
    gain: ``model`` is a name of :data:`gpt2kimi.experiments.lm_ablation.LM_MODELS` (``gpt2``,
    ``gpt2_conv``, ``3:1``, ``3:1_dense``, ``0:1``, ``1:1``, ``all-KDA``), trained for 1,500 steps
    and scored on the whole validation split in fixed windows, on
    :func:`~gpt2kimi.experiments.sweep.run_device`; one seed. Record: ``model, seed, params,
    active_params, val_steps, val_loss, final_val_loss, seconds, tokens_per_s, device``."""

    name = "lm_hybrid_ablation"
    modules = _experiments("lm_ablation")
    defaults = {"model": "3:1", **lm_ablation.LM_ABLATION_TRAINING}

    def score(self, s: dict, seed: int) -> dict:
        training = {k: v for k, v in s.items() if k != "model"}
        return lm_ablation.run_lm_fixed(s["model"], seed, training)


MQAR = MQARTask()
REWRITE = RewriteTask()
WINDOW = WindowTask()
LM_MOE = MoELMTask()
LM_HYBRID = HybridLMTask()
LM_MOE_FIXED = MoELMFixedValTask()
LM_HYBRID_ABLATION = HybridLMAblationTask()
TASKS: dict[str, Task] = {
    t.name: t
    for t in (MQAR, REWRITE, WINDOW, LM_MOE, LM_HYBRID, LM_MOE_FIXED, LM_HYBRID_ABLATION)
}


def get_task(name: str) -> Task:
    """The task registered as ``name`` in :data:`TASKS`."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; expected one of {sorted(TASKS)}")
    return TASKS[name]
