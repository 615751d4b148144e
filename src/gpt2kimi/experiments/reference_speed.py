"""The library against its references, side by side on the same weights: GPT-2's cached decode
against ``transformers``' ``GPT2LMHeadModel.generate`` and against the decode roofline, and a
GPT-2 training step against ``transformers``' GPT-2 doing the same step.

Every comparison builds both models from one set of weights, checks that they compute the same
thing (the same greedy tokens; the same loss), and times them in interleaved rounds
(:func:`gpt2kimi.timing.fastest_interleaved`), so a slow phase of the machine slows both alike;
the decode step and the roofline it is held against take turns step by step
(:func:`decode_in_turns`).
``python -m gpt2kimi.bench summary`` prints them beside the other benchmarks.

``transformers`` stands in for nanoGPT's ``model.py`` in the training step: both are the GPT-2
of Radford et al. in eager PyTorch with fused attention, and nanoGPT is not a package one can
install.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpt2kimi.attention import GPT2WithCache
from gpt2kimi.backbone import LanguageModel, d_by_vocab, release_decode_layouts
from gpt2kimi.gpt2 import GPT2, GPT2Config
from gpt2kimi.kv_cache import generate
from gpt2kimi.roofline import copy_run, decode_step_cost
from gpt2kimi.timing import fastest_interleaved, median_in_turns, timed
from gpt2kimi.train import TrainConfig, configure_optimizer


def _hf_loss(hf: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of ``GPT2.forward(x, y)`` computed from ``transformers``' logits (its own
    ``labels=`` shifts the inputs instead of taking separate targets)."""
    return F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten())


def _hf_gpt2(config: GPT2Config, seed: int = 0):
    """``transformers``' GPT2LMHeadModel with ``config``'s shape and fresh seeded weights."""
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    hf_config = HFConfig(vocab_size=config.vocab_size, n_positions=config.block_size,
                         n_embd=config.n_embd, n_layer=config.n_layer, n_head=config.n_head,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=config.vocab_size - 1, eos_token_id=config.vocab_size - 1,
                         attn_implementation="sdpa")
    return GPT2LMHeadModel(hf_config)


def greedy_runs(
    ours: torch.nn.Module, hf: torch.nn.Module, prompt: torch.Tensor, new_tokens: int
) -> tuple[bool, dict[str, Callable[[], float]]]:
    """Greedy generation of ``new_tokens`` after ``prompt`` [B, T] with this library's
    :func:`~gpt2kimi.kv_cache.generate` on ``ours`` and with ``transformers``' ``generate`` on
    ``hf`` (the same weights), as runs for :func:`~gpt2kimi.timing.fastest_interleaved`
    (``{"ours", "theirs"}``), and whether they generate the same tokens: a caller times them
    in the same rounds as its other runs."""

    def run_ours() -> torch.Tensor:
        return generate(ours, prompt, new_tokens)

    def run_theirs() -> torch.Tensor:
        return hf.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, eos_token_id=None, pad_token_id=0)

    with torch.no_grad():
        same = torch.equal(run_ours(), run_theirs())
    return same, {"ours": timed(run_ours), "theirs": timed(run_theirs)}


def decode_products_seconds(model: LanguageModel, rounds: int = 5) -> tuple[float, int]:
    """The matrix-vector products of one decode step of ``model`` at batch 1, and nothing else:
    every ``nn.Linear`` of its blocks applied to one token with ``F.linear``, as the step applies
    it, and the output head read in [d, vocab] order, as
    :meth:`~gpt2kimi.backbone.LanguageModel.decode_logits` reads it.

    Returns the fastest of ``rounds`` (seconds) and the bytes of the weights they read: a step
    that reads its weights with these operators on this machine cannot take less time.
    """
    run, nbytes = decode_products_run(model)
    return fastest_interleaved({"products": run}, rounds)["products"], nbytes


def decode_products_run(model: LanguageModel) -> tuple[Callable[[], float], int]:
    """:func:`decode_products_seconds` as a run for :mod:`gpt2kimi.timing`'s side-by-side timings
    (it returns the seconds of one pass over the products), and the bytes one pass reads."""
    linears = [m for m in model.blocks.modules() if isinstance(m, nn.Linear)]
    inputs = {m.in_features: torch.randn(1, m.in_features) for m in linears}
    head = d_by_vocab(model.lm_head.weight)  # read [d, vocab], as decode_logits reads it
    h = torch.randn(1, head.shape[0])

    @torch.inference_mode()
    def run() -> None:
        for m in linears:
            F.linear(inputs[m.in_features], m.weight, m.bias)
        h @ head

    return timed(run), sum(m.weight.nbytes for m in linears) + head.nbytes


@torch.inference_mode()  # as generate decodes
def decode_in_turns(
    model: nn.Module, prompt: torch.Tensor, steps: int, runs: dict[str, Callable[[], float]]
) -> dict[str, float]:
    """Median seconds of one greedy decode step of ``model`` after ``prompt`` [B, T] (its
    prefill untimed), as ``"step"``, and of each of ``runs`` (functions that return their own
    seconds): one step, then one call of each run, in turn, ``steps`` times
    (:func:`~gpt2kimi.timing.median_in_turns`). Every median is taken over the same phases of
    the machine, and none includes the prefill."""
    cache = model.new_cache(len(prompt), prompt.size(1) + steps + 1)
    token = model(prompt, cache=cache)[:, -1:].argmax(dim=-1)

    def step() -> float:
        nonlocal token
        start = time.perf_counter()
        token = model(token, cache=cache)[:, -1:].argmax(dim=-1)
        return time.perf_counter() - start

    median = median_in_turns({"step": step} | runs, steps)
    release_decode_layouts(model)  # as generate does, once its tokens are out
    return median


@torch.no_grad()
def gpt2_decode(
    config: GPT2Config | None = None, prompt_len: int = 8, new_tokens: int = 64,
    rounds: int = 3,
) -> dict:
    """Greedy generation of ``new_tokens`` after a ``prompt_len``-token prompt, batch 1, with
    this library's cache (:func:`gpt2kimi.kv_cache.generate` on :class:`GPT2WithCache`) and with
    ``transformers``' ``generate`` (its KV cache), on the same GPT-2 weights (small by default),
    and the library's decode step against the decode roofline.

    Returns ``{"ours_s", "transformers_s", "same_tokens", "tokens_per_s", "roof_tokens_per_s",
    "roof_fraction", "bandwidth", "products_tokens_per_s", "products_fraction",
    "products_bandwidth", "bf16_s", "bf16_agree"}``. The two generations (the prompt's prefill
    included) are timed in interleaved rounds, the fastest of ``rounds`` each. The roof is the
    decode roofline, a step that only moves the weights and the cache it reads at the machine's
    copy bandwidth (:func:`gpt2kimi.roofline.copy_run`); ``products`` is a step that only runs
    its matrix-vector products (:func:`decode_products_run`), and ``products_bandwidth`` the
    bytes per second they draw. The decode step, the copy that measures the bandwidth and the
    products take turns, ``new_tokens`` times (:func:`decode_in_turns`), and each ratio to the
    roof or the products is between their medians: the same statistic of timings taken in the
    same phases of the machine. ``tokens_per_s`` is one over the median step (the prefill
    apart). ``bf16_s`` times the same generation with bf16 weights in the generations' rounds (a
    precision lever, apart from the fp32 comparison), and ``bf16_agree`` counts its greedy
    tokens that equal fp32's before the first that differs.
    """
    config = GPT2Config() if config is None else config
    hf = _hf_gpt2(config).eval()
    gpt2 = GPT2.from_hf_state_dict(hf.state_dict(), config)
    ours = GPT2WithCache.from_gpt2(gpt2).eval()
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len),
                           generator=torch.Generator().manual_seed(1))

    # the two generations in the same rounds: their ratio is between timings of one phase
    same, runs = greedy_runs(ours, hf, prompt, new_tokens)
    # a precision lever, reported apart from the fp32 rows: the same decode with bf16 weights
    # (half the bytes), and how many of its greedy tokens, from the first, are fp32's
    half = GPT2WithCache.from_gpt2(gpt2).to(torch.bfloat16).eval()
    fp32_tokens, bf16_tokens = (generate(m, prompt, new_tokens)[0, prompt_len:]
                                for m in (ours, half))
    differ = (fp32_tokens != bf16_tokens).nonzero()
    bf16_agree = int(differ[0, 0]) if len(differ) else new_tokens
    best = fastest_interleaved(
        runs | {"bf16": timed(lambda: generate(half, prompt, new_tokens))}, rounds)
    # the decode step beside a pass over its products and a copy of memory, in turn
    products, products_bytes = decode_products_run(ours)
    copy, copy_bytes = copy_run()
    median = decode_in_turns(ours, prompt, new_tokens, {"products": products, "copy": copy})
    # the bytes of the average step: the weights and the cache it reads, cached tokens on
    # average over the steps (the count chapter 2's roofline uses)
    n_params = sum(p.numel() for p in ours.parameters())
    step_bytes = decode_step_cost(n_params, config.n_layer, config.n_embd, config.n_embd,
                                  context=round(prompt_len + (new_tokens - 1) / 2)).bytes
    bandwidth = copy_bytes / median["copy"]
    products_s = median["products"]
    rate = 1 / median["step"]
    return {"ours_s": best["ours"], "transformers_s": best["theirs"], "same_tokens": same,
            "tokens_per_s": rate, "roof_tokens_per_s": bandwidth / step_bytes,
            "roof_fraction": rate * step_bytes / bandwidth, "bandwidth": bandwidth,
            "products_tokens_per_s": 1 / products_s, "products_fraction": rate * products_s,
            "products_bandwidth": products_bytes / products_s, "bf16_s": best["bf16"],
            "bf16_agree": bf16_agree, "prompt_len": prompt_len, "new_tokens": new_tokens}


def gpt2_train_step(
    config: GPT2Config | None = None, batch_size: int = 32, rounds: int = 3, steps: int = 2,
) -> dict:
    """``steps`` training steps (forward, backward, AdamW) of the same byte-level GPT-2 (4
    layers, 128 wide, 256 tokens by default) in this library and in ``transformers``, from the
    same weights on the same batch; returns ``{"ours_s", "transformers_s", "loss_diff"}``, the
    seconds per step and the difference of the two models' losses before the first step."""
    config = config or GPT2Config(block_size=256, vocab_size=256, n_layer=4, n_head=4,
                                  n_embd=128, dropout=0.0)
    hf = _hf_gpt2(config).train()
    ours = GPT2.from_hf_state_dict(hf.state_dict(), config).train()
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, config.vocab_size, (batch_size, config.block_size), generator=generator)
    y = torch.randint(0, config.vocab_size, (batch_size, config.block_size), generator=generator)
    cfg = TrainConfig(steps=1, warmup_steps=0)
    opt_ours, opt_theirs = configure_optimizer(ours, cfg), configure_optimizer(hf, cfg)
    with torch.no_grad():
        loss_diff = abs(ours(x, y)[1].item() - _hf_loss(hf, x, y).item())

    def train_steps(model: torch.nn.Module, loss_of, optimizer) -> None:
        for _ in range(steps):
            loss_of(model, x, y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def step_ours() -> None:
        train_steps(ours, lambda m, a, b: m(a, b)[1], opt_ours)

    def step_theirs() -> None:
        train_steps(hf, _hf_loss, opt_theirs)

    best = fastest_interleaved({"ours": timed(step_ours), "theirs": timed(step_theirs)}, rounds)
    return {"ours_s": best["ours"] / steps, "transformers_s": best["theirs"] / steps,
            "loss_diff": loss_diff, "batch_size": batch_size, "block_size": config.block_size}
