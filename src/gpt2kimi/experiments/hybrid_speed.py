"""Chapter 8's decoding speed: the hybrid against full attention, and against ``transformers``.

Three models of the same width, depth and feed-forwards decode side by side, from caches filled
with random numbers to a growing context (the speed of a step does not depend on what the cache
holds): the Kimi-Linear-style hybrid (KDA ×3 + MLA, :data:`BENCH_CONFIG`), the same model with
MLA in every layer, and with chapter 2's multi-head softmax attention in every layer
(:func:`decode_sweep`). :func:`against_transformers` times the same tiny hybrid generating with
this library and with ``transformers``' ``KimiLinearForCausalLM`` on the same weights, and
:func:`step_operations` counts the PyTorch operations one decode step runs
(:func:`transformers_step_operations` those of ``transformers``' step) and
:func:`dispatch_floor` times as many calls of an operator that does next to nothing;
:func:`at_width` shrinks every width of a config, keeping its layers, heads and experts, so
that its model makes the same calls with next to no arithmetic in them
(:func:`step_against_floor` times a step beside both floors, side by side, and
:func:`against_transformers` a generation beside its narrow twin's).
Within :func:`without_c_steps`, KDA and MoE layers and norms decode with their PyTorch code, as
they do where there is no C compiler. ``python -m gpt2kimi.bench hybrid`` prints both timings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gpt2kimi import native
from gpt2kimi.attention import SoftmaxAttention
from gpt2kimi.backbone import LanguageModel
from gpt2kimi.configs import HybridConfig, KDAConfig, MLAConfig, MoEConfig
from gpt2kimi.experiments.decoding import fill_cache
from gpt2kimi.experiments.reference_speed import greedy_runs
from gpt2kimi.kimi_linear import KimiHybrid, make_ffn, to_hf_state_dict
from gpt2kimi.kv_cache import generate
from gpt2kimi.timing import fastest_interleaved, median_in_turns, timed

# The book's tiny hybrid: 4 layers, KDA ×3 then MLA, a dense first feed-forward, then experts.
BENCH_CONFIG = HybridConfig(
    vocab_size=256,
    d_model=128,
    mixers=("kda", "kda", "kda", "mla"),
    ffns=("dense", "moe", "moe", "moe"),
    kda=KDAConfig(n_head=2, head_dim=64, output_gate_bias=False),
    mla=MLAConfig(d_model=128, n_head=2, kv_lora_rank=64, qk_nope_head_dim=64,
                  qk_rope_head_dim=16, v_head_dim=64, rope=False),
    moe=MoEConfig(d_model=128, n_experts=8, top_k=2, expert_hidden=64, n_shared_experts=1),
    dense_hidden=256,
)
MODELS = ("hybrid", "all-MLA", "MHA")


def build_models(config: HybridConfig = BENCH_CONFIG, seed: int = 0) -> dict[str, nn.Module]:
    """The hybrid, the same with MLA everywhere, and with softmax attention (MHA) everywhere."""
    torch.manual_seed(seed)
    hybrid = KimiHybrid(config).eval()
    all_mla = KimiHybrid(config.replace(mixers=("mla",) * config.n_layer)).eval()
    mha = LanguageModel(
        config.backbone_config(),
        lambda d, h: SoftmaxAttention(d, config.mla.n_head),
        [lambda d, kind=kind: make_ffn(config, kind) for kind in config.ffns],
    ).eval()
    return {"hybrid": hybrid, "all-MLA": all_mla, "MHA": mha}


def decode_timer(
    model: nn.Module, context: int, *, batch: int = 8, steps: int = 8
) -> Callable[[], float]:
    """A function that runs ``steps`` greedy decode steps after ``context`` cached tokens and
    returns the seconds they took. Before the clock starts it empties the cache and fills it
    again (KDA's memory cannot rewind), so it can run again."""
    cache = model.new_cache(batch, context + steps)
    token = torch.zeros(batch, 1, dtype=torch.long)

    @torch.inference_mode()  # as generate decodes
    def run() -> float:
        cache.reset()
        fill_cache(cache, context, torch.Generator().manual_seed(0))
        start = time.perf_counter()
        nxt = token
        for _ in range(steps):
            nxt = model(nxt, cache=cache)[:, -1:].argmax(dim=-1)
        return time.perf_counter() - start

    return run


def decode_tokens_per_second(
    model: nn.Module, context: int, *, batch: int = 8, steps: int = 8, repeats: int = 3
) -> float:
    """Tokens per second of ``steps`` greedy decode steps after ``context`` cached tokens."""
    run = decode_timer(model, context, batch=batch, steps=steps)
    return batch * steps / fastest_interleaved({"model": run}, repeats)["model"]


def decode_sweep(
    contexts: list[int], *, batch: int = 8, steps: int = 24, config: HybridConfig = BENCH_CONFIG,
) -> dict:
    """Tokens/s of the three models at every context length, measured side by side
    (:func:`step_in_turns`: ``steps`` steps of each, the models in turn one step at a time,
    each model's median step)."""
    models = build_models(config)
    rates: dict[str, list[float]] = {name: [] for name in models}
    for context in contexts:
        for name, seconds in step_in_turns(models, context, batch=batch, steps=steps).items():
            rates[name].append(batch / seconds)
    return {
        "contexts": contexts,
        "batch": batch,
        "steps": steps,
        "tokens_per_s": rates,
        "hybrid_vs_mla": [h / m for h, m in zip(rates["hybrid"], rates["all-MLA"], strict=True)],
        "hybrid_vs_mha": [h / m for h, m in zip(rates["hybrid"], rates["MHA"], strict=True)],
    }


@torch.inference_mode()  # as generate decodes
def step_in_turns(
    models: dict[str, nn.Module], context: int, *, batch: int = 8, steps: int = 24
) -> dict[str, float]:
    """Median seconds of one greedy decode step of each model after ``context`` cached tokens.

    Every model's cache is filled first (random numbers: a step costs the same whatever the
    cache holds) and each takes one untimed step; then the models step in turn, one step each,
    ``steps`` times (:func:`~gpt2kimi.timing.median_in_turns`). At long context a step of an
    attention model reads tens of megabytes, and this machine's memory bandwidth drifts over
    seconds: taken in turn, step by step, a step of each model meets the same phase of the
    machine, where whole rounds of several steps (a second apart, with a cache fill between
    them) met different ones.
    """

    def one_step(model: nn.Module) -> Callable[[], float]:
        cache = model.new_cache(batch, context + steps + 1)
        fill_cache(cache, context, torch.Generator().manual_seed(0))
        token = model(torch.zeros(batch, 1, dtype=torch.long), cache=cache)[:, -1:].argmax(-1)

        def run() -> float:
            nonlocal token
            start = time.perf_counter()
            token = model(token, cache=cache)[:, -1:].argmax(dim=-1)
            return time.perf_counter() - start

        return run

    return median_in_turns({name: one_step(model) for name, model in models.items()}, steps)


def format_sweep(sweep: dict) -> str:
    rates = sweep["tokens_per_s"]
    rows = [
        f"decode tokens/s, batch {sweep['batch']}, the median of {sweep['steps']} steps taken in "
        "turns (higher is better)",
        f"{'context':>8}" + "".join(f"{m:>10}" for m in MODELS) + f"{'hyb/MLA':>10}{'hyb/MHA':>10}",
    ]
    for i, context in enumerate(sweep["contexts"]):
        cells = "".join(f"{rates[m][i]:>10.0f}" for m in MODELS)
        rows.append(
            f"{context:>8}{cells}{sweep['hybrid_vs_mla'][i]:>9.1f}x{sweep['hybrid_vs_mha'][i]:>9.1f}x"
        )
    return "\n".join(rows)


@torch.no_grad()
def against_transformers(
    config: HybridConfig = BENCH_CONFIG, prompt_len: int = 32, new_tokens: int = 32,
    rounds: int = 3, *, floor_width: int | None = None,
) -> dict:
    """Seconds to generate ``new_tokens`` greedy tokens with this library and with
    ``transformers`` (its PyTorch fallbacks) on the same weights, the fastest of ``rounds``
    interleaved rounds; the outputs are checked equal.

    With ``floor_width``, the same rounds also time the library's generation with the model
    :func:`at_width` ``floor_width`` (``floor_s``): the same operator calls with next to no
    arithmetic, the least this generation can take while it makes them.
    """
    model, hf = _both_hybrids(config)
    prompt = _prompt(config, prompt_len)
    same, runs = greedy_runs(model, hf, prompt, new_tokens)
    if floor_width is not None:
        torch.manual_seed(0)
        narrow = KimiHybrid(at_width(config, floor_width)).eval()
        runs["floor"] = timed(partial(generate, narrow, prompt, new_tokens))
    best = fastest_interleaved(runs, rounds)
    out = {"ours_s": best["ours"], "transformers_s": best["theirs"], "same_tokens": same,
           "prompt_len": prompt_len, "new_tokens": new_tokens}
    return out if floor_width is None else out | {"floor_s": best["floor"]}


@torch.no_grad()
def prefill_and_step(
    config: HybridConfig = BENCH_CONFIG, prompt_len: int = 256, steps: int = 16, rounds: int = 3,
) -> dict:
    """Where :func:`against_transformers`' time goes: the prompt's prefill, and one greedy
    decode step after it (the mean of ``steps``), for this library and for ``transformers``'
    ``KimiLinearForCausalLM`` on the same weights; the four timed side by side, each the fastest
    of ``rounds`` interleaved rounds. Returns ``{"ours": {"prefill_s", "step_s"},
    "transformers": {...}, "same_tokens"}`` (whether the two decoded the same tokens): a
    generation of n tokens takes about ``prefill_s + (n − 1) · step_s``.
    """
    model, hf = _both_hybrids(config)
    prompt = _prompt(config, prompt_len)
    decoded: dict[str, list[int]] = {}  # each side's tokens, from its last timed steps

    @torch.inference_mode()  # as generate runs
    def ours(part: str) -> float:
        cache = model.new_cache(1, prompt_len + steps)
        start = time.perf_counter()
        token = model(prompt, cache=cache)[:, -1:].argmax(dim=-1)
        if part == "prefill":
            return time.perf_counter() - start
        start = time.perf_counter()  # the steps' clock: the prefill is left out
        tokens = [token]
        for _ in range(steps):
            token = model(token, cache=cache)[:, -1:].argmax(dim=-1)
            tokens.append(token)
        seconds = (time.perf_counter() - start) / steps
        decoded["ours"] = torch.cat(tokens, dim=1).tolist()
        return seconds

    def theirs(part: str) -> float:
        start = time.perf_counter()
        out = hf(prompt, use_cache=True)
        if part == "prefill":
            return time.perf_counter() - start
        start = time.perf_counter()
        tokens = [out.logits[:, -1:].argmax(dim=-1)]
        for _ in range(steps):
            out = hf(tokens[-1], past_key_values=out.past_key_values, use_cache=True)
            tokens.append(out.logits[:, -1:].argmax(dim=-1))
        seconds = (time.perf_counter() - start) / steps
        decoded["transformers"] = torch.cat(tokens, dim=1).tolist()
        return seconds

    parts = ("prefill", "step")
    models = {"ours": ours, "transformers": theirs}
    best = fastest_interleaved({f"{name} {part}": partial(fn, part)
                                for name, fn in models.items() for part in parts}, rounds)
    result: dict = {name: {f"{part}_s": best[f"{name} {part}"] for part in parts}
                    for name in models}
    return result | {"same_tokens": decoded["ours"] == decoded["transformers"]}


def _both_hybrids(config: HybridConfig) -> tuple[nn.Module, nn.Module]:
    """The seeded hybrid of ``config`` and ``transformers``' model with the same weights, both
    for inference."""
    torch.manual_seed(0)
    model = KimiHybrid(config).eval()
    hf = _transformers_hybrid(config)
    hf.load_state_dict(to_hf_state_dict(model))
    return model, hf


def _transformers_hybrid(config: HybridConfig) -> nn.Module:
    """``transformers``' ``KimiLinearForCausalLM`` of ``config`` (fresh weights), for inference."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    hf_config = KimiLinearConfig(**config.to_hf(), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return KimiLinearForCausalLM(hf_config).eval()


@contextmanager
def without_c_steps() -> Iterator[None]:
    """Within it, every KDA and MoE layer and every RMSNorm decodes with its PyTorch code
    (fifty-odd calls in :meth:`~gpt2kimi.kda.KimiDeltaAttention.step`, forty in an MoE layer,
    half a dozen in a norm) instead of the compiled C steps (:mod:`gpt2kimi.native`), as where
    there is no C compiler: what the C steps save."""
    compiled = native._kernel
    native._kernel = lambda: None  # as where nothing could be compiled
    try:
        yield
    finally:
        native._kernel = compiled  # the compiled steps again, still loaded


def _prompt(config: HybridConfig, length: int) -> torch.Tensor:
    """The benchmarks' seeded prompt of ``length`` tokens, batch 1 (no special token ids)."""
    return torch.randint(3, config.vocab_size, (1, length),
                         generator=torch.Generator().manual_seed(1))


class _CountOperations(TorchDispatchMode):
    """Counts every operator call dispatched while active (views and reshapes included)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@torch.inference_mode()  # as generate decodes
def step_operations(model: nn.Module, context: int = 32, batch: int = 1) -> int:
    """How many PyTorch operator calls one greedy decode step of ``model`` runs after
    ``context`` cached tokens (a first step before the count makes what a step makes once):
    each is dispatched, checked and launched on its own, however little arithmetic it does, so
    at batch 1 their number sets a floor under the step's time."""
    cache = model.new_cache(batch, context + 2)
    fill_cache(cache, context, torch.Generator().manual_seed(0))
    token = torch.zeros(batch, 1, dtype=torch.long)
    model(token, cache=cache)
    with _CountOperations() as counter:
        model(token, cache=cache)
    return counter.calls


@torch.inference_mode()  # as generate decodes
def generation_operations(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> int:
    """The operator calls of :func:`~gpt2kimi.kv_cache.generate`'s greedy generation of
    ``new_tokens`` tokens after ``prompt`` [B, T]: the prompt's prefill and every decode step
    (a model :func:`at_width` makes as many as the model it shrinks)."""
    with _CountOperations() as counter:
        generate(model, prompt, new_tokens)
    return counter.calls


@torch.no_grad()  # as its generate decodes
def transformers_step_operations(
    config: HybridConfig = BENCH_CONFIG, prompt_len: int = 32
) -> int:
    """:func:`step_operations` for ``transformers``' ``KimiLinearForCausalLM`` of ``config``:
    the operator calls of one decode step after a ``prompt_len``-token prompt (its PyTorch
    fallbacks, counted as :func:`step_operations` counts the library's)."""
    torch.manual_seed(0)
    hf = _transformers_hybrid(config)
    out = hf(_prompt(config, prompt_len), use_cache=True)
    token = out.logits[:, -1:].argmax(dim=-1)
    hf(token, past_key_values=out.past_key_values, use_cache=True)
    with _CountOperations() as counter:
        hf(token, past_key_values=out.past_key_values, use_cache=True)
    return counter.calls


def dispatch_floor(calls: int, rounds: int = 5) -> float:
    """Seconds that ``calls`` calls of an operator doing next to nothing (adding 0 to a single
    number) take, the fastest of ``rounds``: what a step's operator calls cost before any of
    them computes."""
    return fastest_interleaved({"floor": timed(_no_op_calls(calls))}, rounds)["floor"]


def step_against_floor(
    model: nn.Module, context: int = 1024, *, narrow: nn.Module | None = None, batch: int = 1,
    steps: int = 8, rounds: int = 5,
) -> dict:
    """One greedy decode step of ``model`` after ``context`` cached tokens beside what its
    operator calls cost without their arithmetic, all timed in the same interleaved rounds so
    that a busy moment of the machine slows them alike. Returns a dict of

    - ``calls``: the step's operator calls (:func:`step_operations`), and ``step_s``, its seconds;
    - ``no_op_s``: as many calls of :func:`dispatch_floor`'s no-op (adding 0 to one number);
    - with ``narrow`` (the same layers at a tiny width, :func:`at_width`), ``narrow_s``: its
      step after as many cached tokens, the same calls with next to no arithmetic in them, each
      allocating and writing its output as the step's do (``narrow_calls``: their number).
    """
    calls = step_operations(model, context, batch)
    runs = {"step": decode_timer(model, context, batch=batch, steps=steps),
            "no_op": timed(_no_op_calls(calls * steps))}
    if narrow is not None:
        runs["narrow"] = decode_timer(narrow, context, batch=batch, steps=steps)
    best = fastest_interleaved(runs, rounds)
    out = {"calls": calls} | {f"{name}_s": seconds / steps for name, seconds in best.items()}
    if narrow is not None:
        out["narrow_calls"] = step_operations(narrow, context, batch)
    return out


def at_width(config: HybridConfig = BENCH_CONFIG, width: int = 8) -> HybridConfig:
    """``config`` with its model width cut to ``width`` and every other width (heads, latents,
    hidden layers) by the same factor, none below 2: the same layers, heads, experts and
    routing, so a step or a generation makes the same operator calls, with next to no
    arithmetic in them. What such a model's decoding costs is the calls' own cost."""
    if config.d_model % width:
        raise ValueError(f"width={width} must divide d_model={config.d_model}")
    factor = config.d_model // width

    def cut(n: int) -> int:
        return max(2, n // factor)

    kda, mla, moe = config.kda, config.mla, config.moe
    if kda is not None and kda.head_dim is not None:
        kda = replace(kda, head_dim=cut(kda.head_dim))
    if mla is not None:
        mla = replace(
            mla, d_model=width, kv_lora_rank=cut(mla.kv_lora_rank),
            qk_nope_head_dim=cut(mla.qk_nope_head_dim), v_head_dim=cut(mla.v_head_dim),
            qk_rope_head_dim=cut(mla.qk_rope_head_dim) // 2 * 2 if mla.qk_rope_head_dim else 0,
            q_lora_rank=None if mla.q_lora_rank is None else cut(mla.q_lora_rank))
    if moe is not None:
        moe = replace(moe, d_model=width, expert_hidden=cut(moe.expert_hidden))
    return config.replace(d_model=width, dense_hidden=cut(config.dense_hidden), kda=kda,
                          mla=mla, moe=moe)


def _no_op_calls(calls: int) -> Callable[[], None]:
    """A function that calls an operator doing next to nothing ``calls`` times."""
    x = torch.zeros(1)

    def run() -> None:
        for _ in range(calls):
            torch.add(x, 0)

    return run
