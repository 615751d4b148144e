"""Chapter 8's closing accounts: what a decoding sequence keeps, what a decode step reads, and
what every mixer of the book stores, updates and reads, with its costs.

One definition of a sequence's decoding memory serves the whole chapter: the growing cache
(:meth:`HybridConfig.cache_bytes_per_token` per token) plus the fixed state
(:meth:`HybridConfig.state_bytes`: each KDA layer's memory **and** its convolution's last
inputs), the same count a :class:`~gpt2kimi.backbone.ModelCache` reports as ``growing_bytes`` and
``fixed_bytes`` (:func:`cache_profile` reads them from a model).

A decode step of a batch reads every weight its tokens use once, and each sequence's cache and
state. In a Mixture-of-Experts layer a batch of ``B`` tokens touches the **union** of their
experts: with top-``k`` of ``E`` experts chosen uniformly, ``E · (1 − (1 − k/E)^B)`` of them on
average (:func:`experts_touched`), not ``k``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gpt2kimi.accounting import format_bytes, kda_param_count, moe_param_count, param_count
from gpt2kimi.configs import HybridConfig
from gpt2kimi.experiments.evidence import Tuned, load, select, tuned
from gpt2kimi.experiments.hybrid_speed import decode_timer
from gpt2kimi.experiments.hybrid_train import MQAR_MIXES
from gpt2kimi.experiments.registry import RECORDED_BACKBONE, build_model, mqar_model_config
from gpt2kimi.moe import MoE
from gpt2kimi.timing import fastest_interleaved

# ----------------------------------------------------------------------------------------------
# one sequence's decoding memory, and the bytes of a decode step


def sequence_bytes(
    config: HybridConfig, context_len: int, cache_bytes: int = 2, state_bytes: int = 4
) -> int:
    """Bytes one decoding sequence of ``context_len`` tokens keeps: the MLA layers' latent cache
    (``cache_bytes`` per number, bf16 by default) and the KDA layers' fixed state, memory and
    convolution tail (``state_bytes`` per number, fp32 by default, as implementations keep it)."""
    return context_len * config.cache_bytes_per_token(cache_bytes) + config.state_bytes(
        state_bytes
    )


def all_mla(config: HybridConfig) -> HybridConfig:
    """The same model with MLA in every layer (the hybrid's full-attention baseline)."""
    return config.replace(mixers=("mla",) * config.n_layer)


def mha_bytes_per_token(config: HybridConfig, bytes_per_element: int = 2) -> int:
    """What multi-head attention with the MLA layers' heads (``n_head`` heads of ``v_head_dim``;
    Kimi-Linear-48B: 32 of 128) in every layer caches per token: a key and a value per head."""
    return 2 * config.n_layer * config.mla.n_head * config.mla.v_head_dim * bytes_per_element


def experts_touched(n_experts: int, top_k: int, batch: int) -> float:
    """Expected number of distinct routed experts a batch of ``batch`` tokens uses in one MoE
    layer, each token choosing ``top_k`` of ``n_experts`` uniformly: ``E · (1 − (1 − k/E)^B)``.
    (An expert is missed by one token with probability ``1 − k/E``.)"""
    return n_experts * (1 - (1 - top_k / n_experts) ** batch)


def weights_read(model: nn.Module, batch: int) -> float:
    """Parameters one decode step of ``batch`` sequences reads: every parameter but the input
    table (a token reads one row), and in each MoE layer only the routed experts its tokens
    touch (:func:`experts_touched`), not all of them."""
    table = model.embed.weight.numel()
    total = sum(p.numel() for p in model.parameters()) - table
    for module in model.modules():
        if isinstance(module, MoE):
            c = module.config
            per_expert = sum(p[0].numel() for p in module.experts.parameters())
            unused = c.n_experts - experts_touched(c.n_experts, c.top_k, batch)
            total -= unused * per_expert
    return total


def cache_profile(model: nn.Module) -> tuple[int, int]:
    """``(bytes per token, fixed bytes)`` of one decoding sequence, as the model's
    :class:`~gpt2kimi.backbone.ModelCache` counts them (in the model's dtype): one token goes
    through a fresh cache, so the fixed states exist."""
    cache = model.new_cache(1, 1)
    with torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    return cache.bytes_per_token, cache.fixed_bytes


def step_bytes(model: nn.Module, context_len: int, batch: int, element: int = 4) -> float:
    """Bytes one decode step reads: the weights (:func:`weights_read`) and each sequence's
    cache of ``context_len`` tokens and fixed state (:func:`cache_profile`), in the model's
    dtype (``element`` bytes per weight)."""
    per_token, fixed = cache_profile(model)
    return weights_read(model, batch) * element + batch * (context_len * per_token + fixed)


def released_step_bytes(
    config: HybridConfig, context_len: int, batch: int, weight_bytes: int = 2
) -> float:
    """:func:`step_bytes` of a released model from its config alone (bf16 weights and cache, fp32
    state): the active weights with the union of routed experts, plus ``batch`` sequences."""
    counts = param_count(config)
    n_moe, moe = config.ffns.count("moe"), config.moe
    per_expert = moe_param_count(moe).routed // moe.n_experts
    weights = counts.active - counts.routed_active + n_moe * per_expert * experts_touched(
        moe.n_experts, moe.top_k, batch
    )
    return weights * weight_bytes + batch * sequence_bytes(config, context_len)


# ----------------------------------------------------------------------------------------------
# every mixer of the book on MQAR: recall at a hard setting against the memory a sequence keeps


@dataclass(frozen=True)
class Mixer:
    """One mixer of the book as a registered MQAR results file trained it.

    ``mixer`` is the file's ``mixer`` setting (a name of the mixer registry, a mix of
    :data:`~gpt2kimi.experiments.hybrid_train.MQAR_MIXES`, or one name per layer joined by
    commas), ``head_dim`` the fixed memory's width per head where the file sets it (``None``:
    the layer's default, e.g. MLA's, or softmax attention's cache).
    """

    label: str
    chapter: int
    file: str  # a registered results file: python -m gpt2kimi.experiments list
    mixer: str
    head_dim: int | None = None

    @property
    def options(self) -> dict:
        """The ``mixer_options`` of the runs: the width given to every fixed-memory layer."""
        if self.head_dim is None:
            return {}
        names = MQAR_MIXES.get(self.mixer, self.mixer.split(","))
        return {n: {"head_dim": self.head_dim} for n in names if n != "mla"}

    def runs(self, num_pairs: int = 8, data_dir: Path | None = None) -> list[dict]:
        """Its runs at ``num_pairs`` pairs, every rate and seed (the file must be current)."""
        rows = select(load(self.file, data_dir), mixer=self.mixer, num_pairs=num_pairs,
                      mixer_options=self.options)
        if not rows:
            raise ValueError(f"{self.file} has no {self.mixer!r} run with {self.options} at "
                             f"{num_pairs} pairs")
        return rows

    def build(self, data_dir: Path | None = None) -> nn.Module:
        """The model its runs trained (untrained weights), from the settings they record."""
        row = self.runs(data_dir=data_dir)[0]
        config = mqar_model_config(row["vocab_size"], **{k: row[k] for k in RECORDED_BACKBONE})
        layers = MQAR_MIXES.get(self.mixer, self.mixer.split(","))
        return build_model(layers[0] if len(layers) == 1 else layers, config,
                           per_mixer=row["mixer_options"]).eval()


# every mixer of the book at full width (chapter 3's two layers of width 64, 32-wide heads),
# then the fixed memories shrunk to 4 x 4 per head, where 8 pairs overflow them
BOOK_MIXERS: tuple[Mixer, ...] = (
    Mixer("softmax (MHA)", 2, "capacity_linear", "softmax"),
    Mixer("linear attention", 3, "capacity_linear", "linear"),
    Mixer("DeltaNet", 4, "capacity_delta", "deltanet", 32),
    Mixer("Gated DeltaNet", 5, "capacity_delta_gated", "gated_deltanet", 32),
    Mixer("KDA", 5, "capacity_delta_gated", "kda", 32),
    Mixer("MLA", 6, "capacity_mla", "mla"),
    Mixer("hybrid (KDA, MLA)", 8, "capacity_hybrid_full", "hybrid"),
)
SHRUNK_MIXERS: tuple[Mixer, ...] = (
    Mixer("linear attention", 4, "capacity_narrow", "linear", 4),
    Mixer("DeltaNet", 4, "capacity_narrow", "deltanet", 4),
    Mixer("Gated DeltaNet", 5, "capacity_narrow_gated", "gated_deltanet", 4),
    Mixer("KDA", 5, "capacity_narrow_kda", "kda", 4),
    Mixer("KDA, 4 layers", 8, "capacity_hybrid", "kda,kda,kda,kda", 4),
    Mixer("hybrid (3 KDA, MLA)", 8, "capacity_hybrid", "kda,kda,kda,mla", 4),
)


def recall(mixer: Mixer, num_pairs: int = 8, data_dir: Path | None = None) -> Tuned:
    """``mixer``'s MQAR accuracy at ``num_pairs`` pairs at its best learning rate of the file's
    grid (:func:`~gpt2kimi.experiments.evidence.tuned`): every seed's value at that rate."""
    (best,) = tuned(mixer.runs(num_pairs, data_dir), ["mixer"]).values()
    return best


def decode_rates(
    models: dict[str, nn.Module], context: int, *, batch: int = 1, steps: int = 4,
    rounds: int = 3,
) -> dict[str, float]:
    """Decoded tokens per second of each model after ``context`` cached tokens, the fastest of
    ``rounds`` rounds in which the models take turns (a busy moment slows them alike)."""
    runs = {name: decode_timer(m, context, batch=batch, steps=steps) for name, m in models.items()}
    best = fastest_interleaved(runs, rounds)
    return {name: batch * steps / seconds for name, seconds in best.items()}


# ----------------------------------------------------------------------------------------------
# the thesis table: what each layer stores, how it updates it, how it reads it, and the costs


@dataclass(frozen=True)
class LayerCost:
    """One row: a layer of the book at one model's widths, and its decoding costs per sequence.

    ``flops``: per decoded token at ``context`` cached tokens, 2 per multiply-add, counting the
    weights the token goes through and the work on the cache or state (norms, activations and
    the softmax's exponentials left out). ``weights``: the layer's parameters, ``active``: those
    one token uses.
    """

    chapter: str
    layer: str
    stores: str
    updates: str
    reads: str
    bytes_per_token: int
    fixed_bytes: int
    flops: int
    weights: int
    active: int


def thesis_rows(
    config: HybridConfig, context: int = 2**20, cache_bytes: int = 2, state_bytes: int = 4
) -> list[LayerCost]:
    """One layer of each kind at ``config``'s widths (Kimi-Linear-48B's: d 2304, heads of 128,
    the latent of 512 + 64, 256 experts), and the whole hybrid.

    Softmax layers get the MLA layers' heads (``n_head`` of ``v_head_dim``); the linear layers
    the KDA layers' (``n_head`` of ``head_dim``). Their weights: q, k, v and the output
    projection, plus DeltaNet's β and short convolution, Gated DeltaNet's gate and output gate;
    KDA, MLA and MoE from their configs (:func:`~gpt2kimi.accounting.kda_param_count`,
    ``MLAConfig.param_count``, :func:`~gpt2kimi.accounting.moe_param_count`).
    """
    d, kda, mla, moe = config.d_model, config.kda, config.mla, config.moe
    S, Hm, Dv = context, mla.n_head, mla.v_head_dim
    H, D = kda.n_head, kda.head_dim
    state = H * D * D  # one layer's memory
    conv = 3 * H * D * (kda.conv_size - 1)  # its convolution's last inputs of q|k|v
    softmax_read = 4 * Hm * Dv * S  # scores and weighted sum over every cached token

    def attention(kv_heads: int) -> int:
        return 2 * d * Hm * Dv + 2 * d * kv_heads * Dv

    linear_w = 4 * d * H * D
    delta_w = linear_w + d * H + 3 * H * D * kda.conv_size
    gated_w = delta_w + d * H + 2 * H + d * H * D
    kda_w = kda_param_count(kda, d)
    mla_w = mla.param_count
    mla_read = 2 * Hm * S * mla.cache_dim + 2 * Hm * S * mla.kv_lora_rank  # absorbed
    moe_c = moe_param_count(moe)
    moe_active = moe_c.router + moe_c.routed_active + moe_c.shared
    whole = param_count(config)
    whole_flops = 2 * whole.active + config.n_mla * mla_read + config.n_kda * 7 * state
    n_gqa = 8
    return [
        LayerCost("2", "MHA", "every token's keys and values", "append", "softmax over the cache",
                  2 * Hm * Dv * cache_bytes, 0, 2 * attention(Hm) + softmax_read,
                  attention(Hm), attention(Hm)),
        LayerCost("2", f"GQA, {n_gqa} KV heads", "keys and values of a few heads", "append",
                  "softmax over the cache", 2 * n_gqa * Dv * cache_bytes, 0,
                  2 * attention(n_gqa) + softmax_read, attention(n_gqa), attention(n_gqa)),
        LayerCost("3", "linear attention", "a d_k × d_v matrix per head", "add k vᵀ", "Sᵀq",
                  0, state * state_bytes, 2 * linear_w + 4 * state, linear_w, linear_w),
        LayerCost("4", "DeltaNet", "the same matrix", "overwrite at k by β", "Sᵀq",
                  0, (state + conv) * state_bytes, 2 * delta_w + 6 * state, delta_w, delta_w),
        LayerCost("5", "Gated DeltaNet", "the same matrix", "decay per head, then overwrite",
                  "Sᵀq", 0, (state + conv) * state_bytes, 2 * gated_w + 7 * state, gated_w,
                  gated_w),
        LayerCost("5", "KDA", "the same matrix", "decay per key channel, then overwrite", "Sᵀq",
                  0, (state + conv) * state_bytes, 2 * kda_w + 7 * state, kda_w, kda_w),
        LayerCost("6", "MLA (absorbed)", "one latent and one shared key per token", "append",
                  "softmax over the latents", mla.cache_dim * cache_bytes, 0,
                  2 * mla_w + mla_read, mla_w, mla_w),
        LayerCost("7", f"MoE ({moe.top_k} of {moe.n_experts} + {moe.n_shared_experts})",
                  "nothing per sequence: capacity in the weights", "", "a few experts per token",
                  0, 0, 2 * moe_active, moe_c.router + moe_c.routed + moe_c.shared, moe_active),
        LayerCost("8", f"Kimi Linear, {config.n_layer} layers", "KDA states + latent cache",
                  "both", "both", config.cache_bytes_per_token(cache_bytes),
                  config.state_bytes(state_bytes), whole_flops, whole.total, whole.active),
    ]


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def thesis_markdown(rows: Sequence[LayerCost]) -> str:
    """The rows as a Markdown table (bytes in binary units, counts in K, M, G, T)."""
    head = ("| ch. | layer | stores per sequence | updates | reads | bytes per token | fixed "
            "bytes | FLOPs per token | weights (active) |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        weights = _count(r.weights) + (f" ({_count(r.active)})" if r.active != r.weights else "")
        lines.append(
            f"| {r.chapter} | {r.layer} | {r.stores} | {r.updates} | {r.reads} | "
            f"{format_bytes(r.bytes_per_token) if r.bytes_per_token else '0'} | "
            f"{format_bytes(r.fixed_bytes) if r.fixed_bytes else '0'} | {_count(r.flops)} | "
            f"{weights} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the trained tiny hybrid whose weights the chapter generates with


TALKER_FILE = "lm_hybrid_ffn"  # the recorded runs the chapter's generating weights come from


def talker_run(data_dir: Path | None = None, seed: int = 0) -> dict:
    """The run of :data:`TALKER_FILE` whose weights chapter 8 generates with: the 3:1 hybrid
    with ``seed`` at the learning rate of its best mean final loss over the seeds, as one row
    (its settings, seed and record)."""
    rows = select(load(TALKER_FILE, data_dir), model="3:1")
    best = tuned(rows, ["model"], metric="final_val_loss", rate="lr", higher_is_better=False)
    (run,) = select(rows, lr=best["3:1",].rate, seed=seed)
    return run


def save_trained_hybrid(path: str | Path, seed: int = 0, data_dir: Path | None = None) -> dict:
    """Train the run :func:`talker_run` names again and save its weights (fp32) to ``path``.

    It repeats the steps of :func:`~gpt2kimi.experiments.lm_ablation.run_lm_fixed` (same
    model, seed, batches and settings, on one thread as the sweep ran it), keeping the model
    that function lets go. Returns ``{"lr", "final_val_loss": this run's, "recorded": the
    file's}``: equal where the machine reproduces the file, and the check that these weights
    are the recorded run's.
    """
    from gpt2kimi.data import fixed_val_batches, lm_batches, load_corpus
    from gpt2kimi.experiments.lm_ablation import LM_ABLATION_TRAINING, build_lm
    from gpt2kimi.moe import AuxLossWrapper
    from gpt2kimi.train import TrainConfig, train

    run = talker_run(data_dir, seed)
    s = {key: run[key] for key in LM_ABLATION_TRAINING}
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model, _ = build_lm("3:1", s["block_size"])
    cfg = TrainConfig(steps=s["steps"], lr=s["lr"], warmup_steps=min(s["warmup_steps"], s["steps"]),
                      eval_interval=s["eval_interval"], seed=seed)
    corpus = load_corpus()
    history = train(AuxLossWrapper(model, bias_gamma=s["bias_gamma"]),
                    lm_batches(corpus, s["batch_size"], s["block_size"], seed=seed), cfg,
                    val_set=fixed_val_batches(corpus, s["block_size"], s["val_batch_size"]))
    torch.save(model.state_dict(), path)
    return {"lr": s["lr"], "final_val_loss": round(history.val_loss[-1], 4),
            "recorded": run["final_val_loss"]}
