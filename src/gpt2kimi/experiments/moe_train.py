"""Chapter 7's training runs: dense FFN vs MoE on the byte corpus, and balancing.

Trains the same small language model (softmax attention, NoPE, the built-in byte corpus) with
four feed-forward variants at equal **active** parameters::

    dense     a SwiGLU of hidden width (top_k + shared) · expert_hidden
    moe       an MoE, no balancing
    moe_aux   the same with Switch Transformer's auxiliary loss (weight aux_alpha)
    moe_bias  the same with DeepSeek-V3's auxiliary-loss-free bias update (step bias_gamma)

For each run the record holds the validation losses, the load of every MoE layer over training
(max / mean tokens per expert, per step) and, after training, which experts each kind of byte
is sent to. :func:`run_variant` is one run (the ``lm_moe`` and ``lm_moe_fixed`` tasks,
:mod:`gpt2kimi.experiments.tasks`); chapter 7's results files are recorded by ``python -m
gpt2kimi.experiments run lm_moe`` (and ``lm_moe_live``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from gpt2kimi.attention import SoftmaxAttention
from gpt2kimi.backbone import BackboneConfig, LanguageModel, count_parameters
from gpt2kimi.configs import MoEConfig
from gpt2kimi.data import fixed_val_batches, lm_batches, load_corpus
from gpt2kimi.moe import AuxLossWrapper, MoE, dense_equivalent, moe_layers
from gpt2kimi.train import TrainConfig, train

VARIANTS = ("dense", "moe", "moe_aux", "moe_bias")

# Byte classes for the "what each expert learned" heatmap: (name, test on the byte value).
BYTE_CLASSES = (
    ("space", lambda b: b == 32),
    ("newline", lambda b: b == 10),
    ("lowercase", lambda b: 97 <= b <= 122),
    ("uppercase", lambda b: 65 <= b <= 90),
    ("digit", lambda b: 48 <= b <= 57),
    ("punctuation", lambda b: 33 <= b <= 126 and not chr(b).isalnum()),
    ("other", lambda b: b < 32 and b != 10 or b > 126),
)


@dataclass
class MoETrainSettings:
    """Everything a run depends on besides its variant (recorded in the results file)."""

    d_model: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 1
    expert_hidden: int = 64
    block_size: int = 64
    batch_size: int = 16
    steps: int = 1500
    lr: float = 3e-3
    warmup_steps: int = 50
    eval_interval: int = 100
    eval_batches: int = 10
    aux_alpha: float = 0.01
    bias_gamma: float = 0.01
    seed: int = 0

    def moe_config(self) -> MoEConfig:
        return MoEConfig(
            d_model=self.d_model,
            n_experts=self.n_experts,
            top_k=self.top_k,
            expert_hidden=self.expert_hidden,
            n_shared_experts=self.n_shared_experts,
        )


def byte_class(byte: int) -> str:
    """The name of the class in :data:`BYTE_CLASSES` that ``byte`` belongs to."""
    return next(name for name, test in BYTE_CLASSES if test(byte))


def build_model(variant: str, settings: MoETrainSettings) -> AuxLossWrapper | LanguageModel:
    """The language model of ``variant``; MoE variants come wrapped for balancing."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    torch.manual_seed(settings.seed)
    config = BackboneConfig(
        vocab_size=256, d_model=settings.d_model, n_layer=settings.n_layer, n_head=settings.n_head
    )
    moe_config = settings.moe_config()
    if variant == "dense":
        return LanguageModel(config, SoftmaxAttention, lambda d: dense_equivalent(moe_config))
    model = LanguageModel(config, SoftmaxAttention, lambda d: MoE(moe_config))
    alpha = settings.aux_alpha if variant == "moe_aux" else 0.0
    gamma = settings.bias_gamma if variant == "moe_bias" else 0.0
    return AuxLossWrapper(model, aux_alpha=alpha, bias_gamma=gamma)


@torch.no_grad()
def expert_choice_by_byte(model, ids: torch.Tensor, block_size: int) -> list[list[list[int]]]:
    """For each MoE layer, ``counts[byte][e]``: how often input byte ``byte`` was sent to expert e.

    Runs the model (in eval mode) over ``ids`` (1-D bytes) cut into windows of ``block_size``.
    """
    model.eval()
    n_windows = len(ids) // block_size
    x = ids[: n_windows * block_size].view(n_windows, block_size)
    model(x.to(next(model.parameters()).device))
    tables = []
    for layer in moe_layers(model):
        experts = layer.last_routing.experts.cpu()  # [N, k]
        rows = x.flatten()[:, None].expand_as(experts)
        count = torch.zeros(256, layer.config.n_experts, dtype=torch.long)
        count.index_put_((rows.flatten(), experts.flatten()), torch.ones_like(rows.flatten()), True)
        tables.append(count.tolist())
    return tables


def shares_by_class(counts: list[list[int]]) -> dict[str, list[float]]:
    """``{class: [share of that class's token copies sent to expert e]}`` from a byte table."""
    table = torch.tensor(counts, dtype=torch.float64)
    shares = {}
    for name, _ in BYTE_CLASSES:
        rows = [b for b in range(256) if byte_class(b) == name]
        total = table[rows].sum(dim=0)
        shares[name] = (total / total.sum().clamp_min(1)).tolist()
    return shares


def run_variant(
    variant: str,
    settings: MoETrainSettings,
    *,
    val_batch_size: int | None = None,
    device: torch.device | str = "cpu",
) -> dict:
    """Train one variant; return its record (losses, load over training, expert choice).

    ``val_batch_size=None`` validates on ``settings.eval_batches`` random batches of the seed's
    own stream (chapter 7's recorded runs); a number validates on the whole validation split in
    fixed windows (:func:`gpt2kimi.data.fixed_val_batches`, batches of that many windows), the
    same for every seed, and adds ``tokens_per_s`` and ``device`` to the record. The model
    trains on ``device``.
    """
    model = build_model(variant, settings).to(device)
    corpus = load_corpus()
    batches = lm_batches(corpus, settings.batch_size, settings.block_size, seed=settings.seed)
    cfg = TrainConfig(
        steps=settings.steps,
        lr=settings.lr,
        warmup_steps=settings.warmup_steps,
        eval_interval=settings.eval_interval,
        eval_batches=settings.eval_batches,
        seed=settings.seed,
    )
    val_set = None
    if val_batch_size is not None:
        val_set = fixed_val_batches(corpus, settings.block_size, val_batch_size)
    start = time.perf_counter()
    history = train(model, batches, cfg, val_set=val_set)
    seconds = time.perf_counter() - start
    record = {
        "variant": variant,
        "parameters": count_parameters(model),
        "val_steps": history.val_steps,
        "val_loss": [round(v, 4) for v in history.val_loss],
        "final_val_loss": round(history.val_loss[-1], 4),
        "seconds": round(seconds, 1),
    }
    if val_set is not None:
        tokens = settings.steps * settings.batch_size * settings.block_size
        record.update(tokens_per_s=round(tokens / seconds), device=str(torch.device(device)))
    if variant != "dense":
        # load of each step: max / mean tokens per expert, averaged over the MoE layers
        imbalance = [
            sum(max(layer) / (sum(layer) / len(layer)) for layer in step) / len(step)
            for step in model.load_history
        ]
        record["load_imbalance"] = [round(v, 3) for v in imbalance]
        record["final_load"] = [list(layer) for layer in model.load_history[-1]]
        record["experts_by_byte"] = expert_choice_by_byte(
            model, corpus.val[: 64 * settings.block_size], settings.block_size
        )
        record["active_parameters"] = active_parameters(model, settings)
    else:
        record["active_parameters"] = record["parameters"]
    return record


def active_parameters(model, settings: MoETrainSettings) -> int:
    """Parameters a token uses: all but the routed experts it was not sent to."""
    unused = settings.n_experts - settings.top_k
    per_expert = 3 * settings.d_model * settings.expert_hidden
    return count_parameters(model) - len(moe_layers(model)) * unused * per_expert
