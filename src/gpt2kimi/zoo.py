"""The zoo: one table from names to token mixers, and experiments that take mixers by name.

This is the only module allowed to import every chapter (the chapters and the support modules
never import it). Adding a chapter's mixer is one line in :data:`MIXERS`; every constructor is
called as ``constructor(d_model, n_head)`` and returns a module mapping ``[B, T, C] → [B, T, C]``.

``build_model("linear", config)`` builds the shared :class:`~gpt2kimi.backbone.LanguageModel`
with that mixer in every layer; ``build_model(["kda", "kda", "kda", "mla"], config)`` builds a
hybrid. :func:`run_mqar` and :func:`mqar_sweep` train such models on the recall task.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields, replace
from functools import partial

import torch

from gpt2kimi.ablations import AdditiveDeltaNet, KDAWithoutForgetting
from gpt2kimi.attention import SoftmaxAttention
from gpt2kimi.backbone import BackboneConfig, FFNFactory, LanguageModel, MixerFactory, SwiGLU
from gpt2kimi.deltanet import DeltaNet
from gpt2kimi.experiment import cell_mean, rounded, training_settings
from gpt2kimi.gated_deltanet import GatedDeltaNet
from gpt2kimi.kda import KimiDeltaAttention
from gpt2kimi.linear_attention import LinearAttention
from gpt2kimi.mla import mla_mixer
from gpt2kimi.moe import moe_ffn
from gpt2kimi.mqar import MQARConfig, MQARTraining, map_jobs, train_mqar

MIXERS: dict[str, MixerFactory] = {
    # chapter 2: the exact memory, a KV cache that grows with every token
    "softmax": SoftmaxAttention,
    # chapter 3: a fixed [K, V] memory per head, S += k vᵀ
    "linear": partial(LinearAttention, feature_map="identity"),
    # chapter 3: Katharopoulos et al.'s positive feature map elu(x)+1 with its normaliser
    "linear_elu": partial(LinearAttention, feature_map="elu1", normalize=True),
    # chapter 4: the delta rule
    "deltanet": DeltaNet,
    # chapter 4's ablation: DeltaNet's layer with linear attention's additive update
    "deltanet_additive": AdditiveDeltaNet,
    # chapter 5: forgetting, one gate per head
    "gated_deltanet": GatedDeltaNet,
    # chapter 5: the same with a sigmoid output gate instead of swish (a small-budget ablation)
    "gated_deltanet_sigmoid": partial(GatedDeltaNet, output_gate="sigmoid"),
    # chapter 5: forgetting, one gate per key channel (Kimi Delta Attention)
    "kda": KimiDeltaAttention,
    # chapter 5's ablation: KDA with its forget gate off (every decay exactly 1)
    "kda_no_forget": KDAWithoutForgetting,
    # chapter 6: exact memory, compressed: Multi-head Latent Attention (NoPE, as in Kimi Linear)
    "mla": mla_mixer,
}

FFNS: dict[str, FFNFactory] = {
    "swiglu": SwiGLU,
    # chapter 7: 8 SwiGLU experts of width d, top-2, one shared expert
    "moe": moe_ffn,
}


def mixer_factory(name: str, **kwargs) -> MixerFactory:
    """The constructor registered as ``name``, with keyword arguments bound (``chunk_size=...``)."""
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; expected one of {sorted(MIXERS)}")
    return partial(MIXERS[name], **kwargs) if kwargs else MIXERS[name]


def ffn_factory(ffn: str | FFNFactory | None) -> FFNFactory | None:
    """A feed-forward constructor from a name in :data:`FFNS`, a constructor, or None (SwiGLU)."""
    if ffn is None or callable(ffn):
        return ffn
    if ffn not in FFNS:
        raise ValueError(f"unknown feed-forward {ffn!r}; expected one of {sorted(FFNS)}")
    return FFNS[ffn]


def build_model(
    mixer: str | Sequence[str],
    config: BackboneConfig,
    ffn: str | FFNFactory | Sequence[FFNFactory] | None = None,
    **mixer_kwargs,
) -> LanguageModel:
    """The shared backbone with the named mixer in every layer (or one name per layer).

    ``mixer_kwargs`` go to every mixer's constructor; ``ffn`` is a name, a constructor, a list of
    constructors (one per layer), or None for the default SwiGLU.
    """
    if isinstance(mixer, str):
        mixers: MixerFactory | list[MixerFactory] = mixer_factory(mixer, **mixer_kwargs)
    else:
        names = list(mixer)
        if len(names) != config.n_layer:
            raise ValueError(f"got {len(names)} mixer names for n_layer={config.n_layer} layers")
        mixers = [mixer_factory(name, **mixer_kwargs) for name in names]
    per_layer_ffns = isinstance(ffn, Sequence) and not isinstance(ffn, str)
    return LanguageModel(config, mixers, ffn if per_layer_ffns else ffn_factory(ffn))


# ----------------------------------------------------------------------------------------------
# the recall benchmark, by mixer name

# The chapter-3 setting: small enough for two CPU cores, large enough for memory to matter.
MQAR_VOCAB = 64
MQAR_SEQ_LEN = 32
MQAR_D_MODEL = 64
MQAR_N_LAYER = 2
MQAR_N_HEAD = 2
MQAR_SHORT_CONV = 2
# what a results file records of the backbone
RECORDED_BACKBONE = ("d_model", "n_layer", "n_head", "short_conv")
BACKBONE_FIELDS = {f.name for f in fields(BackboneConfig)}


def mqar_model_config(vocab_size: int = MQAR_VOCAB, **backbone) -> BackboneConfig:
    """The backbone used for MQAR: no positions (NoPE), a short convolution before each mixer.

    ``backbone`` overrides its other fields (``d_model``, ``n_layer``, ``n_head``, ...).
    """
    defaults = dict(
        d_model=MQAR_D_MODEL, n_layer=MQAR_N_LAYER, n_head=MQAR_N_HEAD, short_conv=MQAR_SHORT_CONV
    )
    return BackboneConfig(vocab_size=vocab_size, **{**defaults, **backbone})


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


def mean_accuracy(results: Sequence[dict], mixer: str, num_pairs: int) -> float:
    """Mean accuracy over seeds of one (mixer, pairs) cell of a sweep's results."""
    return cell_mean(results, mixer=mixer, num_pairs=num_pairs)
