"""``python -m gpt2kimi.bench hybrid``: decoding speed of the hybrid against full attention.

Three models of the same width, depth and feed-forwards decode side by side in one run, from
caches filled with random numbers to a growing context (the speed of a step does not depend on
what the cache holds): the Kimi-Linear-style hybrid (KDA ×3 + MLA), the same model with MLA in
every layer, and with chapter 2's multi-head softmax attention in every layer. Then the same
tiny hybrid generates with this library and with ``transformers``' ``KimiLinearForCausalLM``
on the same weights (when ``transformers`` is installed).

    python -m gpt2kimi.bench hybrid                          # 1K … 16K tokens, batch 8
    python -m gpt2kimi.bench hybrid --contexts 1024 4096 --batch 4

With ``--train`` it trains instead and writes a results file (chapter 8's, three seeds each):

    python -m gpt2kimi.bench hybrid --train lm --out book/data/hybrid_lm.json
    python -m gpt2kimi.bench hybrid --train mqar --out book/data/hybrid_mqar.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from gpt2kimi.attention import SoftmaxAttention
from gpt2kimi.backbone import LanguageModel, ModelCache
from gpt2kimi.bench.machine import machine_info
from gpt2kimi.bench.timing import fastest_interleaved, timed
from gpt2kimi.data import lm_batches, load_corpus
from gpt2kimi.experiment import training_settings
from gpt2kimi.gpt2 import GPT2, GPT2Config, gpt2_param_count
from gpt2kimi.hybrid import (
    HybridConfig,
    KimiHybrid,
    count_params,
    generate,
    make_ffn,
    to_hf_state_dict,
)
from gpt2kimi.kv_cache import LayerKVCache
from gpt2kimi.mla import LatentCache
from gpt2kimi.moe import AuxLossWrapper
from gpt2kimi.mqar import MQARConfig, MQARTraining, map_jobs
from gpt2kimi.progress import say
from gpt2kimi.train import TrainConfig, train

# The book's tiny hybrid: 4 layers, KDA ×3 then MLA, a dense first feed-forward, then experts.
BENCH_CONFIG = HybridConfig(
    vocab_size=256,
    d_model=128,
    mixers=("kda", "kda", "kda", "mla"),
    ffns=("dense", "moe", "moe", "moe"),
    kda_heads=2,
    kda_head_dim=64,
    mla_heads=2,
    kv_lora_rank=64,
    qk_nope_head_dim=64,
    qk_rope_head_dim=16,
    v_head_dim=64,
    dense_hidden=256,
    n_experts=8,
    top_k=2,
    expert_hidden=64,
    n_shared_experts=1,
)
MODELS = ("hybrid", "all-MLA", "MHA")


def build_models(config: HybridConfig = BENCH_CONFIG, seed: int = 0) -> dict[str, nn.Module]:
    """The hybrid, the same with MLA everywhere, and with softmax attention (MHA) everywhere."""
    torch.manual_seed(seed)
    hybrid = KimiHybrid(config).eval()
    all_mla = KimiHybrid(config.replace(mixers=("mla",) * config.n_layer)).eval()
    mha = LanguageModel(
        config.backbone_config(),
        lambda d, h: SoftmaxAttention(d, config.mla_heads),
        [lambda d, kind=kind: make_ffn(config, kind) for kind in config.ffns],
    ).eval()
    return {"hybrid": hybrid, "all-MLA": all_mla, "MHA": mha}


def fill_cache(cache: ModelCache, n_tokens: int, generator: torch.Generator) -> None:
    """Write ``n_tokens`` random tokens' worth into every growing cache of ``cache``.

    KV and latent caches are filled (their reads cost what real ones do); fixed-size states stay
    as they are (a KDA memory costs the same whatever it holds).
    """
    for layer in cache.layers:
        state = layer.mixer
        if isinstance(state, LatentCache):
            B, rope = state.batch_size, state.rope_dim
            c_kv = torch.randn(B, n_tokens, state.c_kv.size(-1), generator=generator)
            state.update(c_kv.to(state.c_kv.dtype), torch.randn(B, n_tokens, rope).to(c_kv))
        elif isinstance(state, LayerKVCache):
            B, H, _, D = state.k.shape
            k = torch.randn(B, H, n_tokens, D, generator=generator).to(state.k.dtype)
            state.update(k, torch.randn_like(k))
    cache.pos = n_tokens


def rewind(cache: ModelCache, n_tokens: int) -> None:
    """Forget every token after the first ``n_tokens`` (the decode steps a timing added)."""
    for layer in cache.layers:
        state = layer.mixer
        if isinstance(state, LatentCache):
            state.crop(n_tokens)
        elif isinstance(state, LayerKVCache):
            state.pos = n_tokens
    cache.pos = n_tokens


def decode_timer(
    model: nn.Module, context: int, *, batch: int = 8, steps: int = 8
) -> Callable[[], float]:
    """A function that runs ``steps`` greedy decode steps after ``context`` cached tokens and
    returns the seconds they took (it rewinds the cache first, so it can run again)."""
    cache = model.new_cache(batch, context + steps)
    fill_cache(cache, context, torch.Generator().manual_seed(0))
    token = torch.zeros(batch, 1, dtype=torch.long)

    @torch.no_grad()
    def run() -> float:
        rewind(cache, context)
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
    contexts: list[int], *, batch: int = 8, steps: int = 8, repeats: int = 3,
    config: HybridConfig = BENCH_CONFIG,
) -> dict:
    """Tokens/s of the three models at every context length, measured side by side: at each
    context the fastest of ``repeats`` interleaved rounds of the three models."""
    models = build_models(config)
    rates: dict[str, list[float]] = {name: [] for name in models}
    for context in contexts:
        runs = {name: decode_timer(m, context, batch=batch, steps=steps)
                for name, m in models.items()}
        for name, seconds in fastest_interleaved(runs, repeats).items():
            rates[name].append(batch * steps / seconds)
        del runs  # free this context's caches before the next, larger one
    return {
        "contexts": contexts,
        "batch": batch,
        "rounds": repeats,
        "tokens_per_s": rates,
        "hybrid_vs_mla": [h / m for h, m in zip(rates["hybrid"], rates["all-MLA"], strict=True)],
        "hybrid_vs_mha": [h / m for h, m in zip(rates["hybrid"], rates["MHA"], strict=True)],
    }


def format_sweep(sweep: dict) -> str:
    rates = sweep["tokens_per_s"]
    rows = [
        f"decode tokens/s, batch {sweep['batch']}, fastest of {sweep['rounds']} interleaved "
        "rounds (higher is better)",
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
    rounds: int = 3,
) -> dict:
    """Seconds to generate ``new_tokens`` greedy tokens with this library and with
    ``transformers`` (its PyTorch fallbacks) on the same weights, the fastest of ``rounds``
    interleaved rounds; the outputs are checked equal."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(0)
    model = KimiHybrid(config).eval()
    hf_config = KimiLinearConfig(**config.to_hf(), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = KimiLinearForCausalLM(hf_config).eval()
    hf.load_state_dict(to_hf_state_dict(model))
    prompt = torch.randint(3, config.vocab_size, (1, prompt_len),
                           generator=torch.Generator().manual_seed(1))

    def ours() -> torch.Tensor:
        return generate(model, prompt, new_tokens)

    def theirs() -> torch.Tensor:
        return hf.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)

    same = torch.equal(ours(), theirs())

    best = fastest_interleaved({"ours": timed(ours), "theirs": timed(theirs)}, rounds)
    t_ours, t_theirs = best["ours"], best["theirs"]
    return {"ours_s": t_ours, "transformers_s": t_theirs, "same_tokens": same,
            "prompt_len": prompt_len, "new_tokens": new_tokens}


# ----------------------------------------------------------------------------------------------
# training on the byte corpus: the hybrid against GPT-2, and the KDA:MLA ratio

# The tiny hybrid the chapter trains: width 64, 4 layers, a dense first layer, then 8 experts
# (2 routed + 1 shared active, as wide as the dense one).
LM_CONFIG = HybridConfig(
    vocab_size=256,
    d_model=64,
    mixers=("kda", "kda", "kda", "mla"),
    ffns=("dense", "moe", "moe", "moe"),
    kda_heads=2,
    kda_head_dim=32,
    mla_heads=2,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    dense_hidden=192,
    n_experts=8,
    top_k=2,
    expert_hidden=64,
    n_shared_experts=1,
)
# KDA:MLA mixes of the same 4 layers (the paper's ratio ablation, at this scale)
RATIOS: dict[str, tuple[str, ...]] = {
    "0:1": ("mla", "mla", "mla", "mla"),
    "1:1": ("kda", "mla", "kda", "mla"),
    "3:1": ("kda", "kda", "kda", "mla"),
    "all-KDA": ("kda", "kda", "kda", "kda"),
}
LM_TRAINING = dict(
    steps=200, batch_size=16, block_size=64, lr=3e-3, warmup_steps=20, eval_interval=25,
    eval_batches=4, bias_gamma=1e-3,
)


def gpt2_baseline_config(
    active_params: int, config: HybridConfig = LM_CONFIG, block_size: int = 64
) -> GPT2Config:
    """GPT-2 of the hybrid's depth whose width makes its parameters closest to
    ``active_params`` (widths in steps of the head count, 2)."""
    def gpt2(width: int) -> GPT2Config:
        return GPT2Config(vocab_size=config.vocab_size, block_size=block_size,
                          n_layer=config.n_layer, n_head=2, n_embd=width)

    widths = range(8, 4 * config.d_model, 2)
    return gpt2(min(widths, key=lambda w: abs(gpt2_param_count(gpt2(w)) - active_params)))


def lm_model(name: str, config: HybridConfig = LM_CONFIG, block_size: int = 64) -> nn.Module:
    """``"gpt2"`` (the baseline of equal active parameters) or a ratio name of :data:`RATIOS`."""
    if name == "gpt2":
        touched = count_params(config).active_with_embedding  # as GPT-2's count has its table
        return GPT2(gpt2_baseline_config(touched, config, block_size))
    return KimiHybrid(config.replace(mixers=RATIOS[name]))


def run_lm(job: tuple[str, int, dict]) -> dict:
    """Train one model on the byte corpus; its validation curve in nats per byte."""
    name, seed, settings = job
    s = settings
    torch.manual_seed(seed)
    model = lm_model(name, block_size=s["block_size"])
    total = sum(p.numel() for p in model.parameters())
    # parameters one token uses, the embedding row included (GPT-2's embedding is its head)
    active = total if name == "gpt2" else count_params(model.hybrid_config).active_with_embedding
    trained = model if name == "gpt2" else AuxLossWrapper(model, bias_gamma=s["bias_gamma"])
    cfg = TrainConfig(steps=s["steps"], lr=s["lr"], warmup_steps=min(s["warmup_steps"], s["steps"]),
                      eval_interval=s["eval_interval"], eval_batches=s["eval_batches"], seed=seed)
    batches = lm_batches(load_corpus(), s["batch_size"], s["block_size"], seed=seed)
    history = train(trained, batches, cfg)
    return {
        "model": name, "seed": seed, "params": total, "active_params": active,
        "val_steps": history.val_steps,
        "val_loss": [round(v, 4) for v in history.val_loss],
        "seconds": round(history.seconds, 1),
    }


def lm_sweep(names: list[str], seeds: list[int], jobs: int = 2, **overrides) -> dict:
    settings = {**LM_TRAINING, **overrides}
    start = time.perf_counter()
    results = map_jobs(run_lm, [(n, s, settings) for n in names for s in seeds], jobs,
                       log=lambda r: say(f"{r['model']:<8} seed {r['seed']}: val "
                                         f"{r['val_loss'][-1]:.3f} ({r['seconds']:.0f} s)"))
    return {"settings": {**settings, "config": asdict(LM_CONFIG),
                         "models": names, "seeds": seeds, "jobs": jobs,
                         "seconds": round(time.perf_counter() - start, 1),
                         "machine": machine_info(jobs)},
            "results": results}


def run_mqar_job(job: tuple[str, int, int, dict]) -> dict:
    """One MQAR run of the book's setting with a named mix of mixers (zoo names per layer)."""
    from gpt2kimi.zoo import run_mqar  # the zoo imports every chapter, this module included

    name, num_pairs, seed, kwargs = job
    record = run_mqar(MQAR_MIXES[name], num_pairs, seed=seed, **kwargs)
    return {**record, "mixer": name}


MQAR_MIXES: dict[str, list[str]] = {"hybrid": ["kda", "mla"], "KDA": ["kda", "kda"],
                                    "MLA": ["mla", "mla"]}


def mqar_runs(pairs: list[int], seeds: list[int], steps: int, jobs: int = 2) -> dict:
    """The hybrid (KDA then MLA), pure KDA and pure MLA on MQAR at chapter 3's settings (2
    layers), ``steps`` training steps; the settings recorded are the task's, the backbone's and
    the training's, as in chapters 3-6's MQAR files."""
    from gpt2kimi.zoo import RECORDED_BACKBONE, mqar_setup

    training = MQARTraining(steps=steps)
    grid = [(m, n, s, {"training": training}) for m in MQAR_MIXES for n in pairs for s in seeds]
    start = time.perf_counter()
    results = map_jobs(run_mqar_job, grid, jobs,
                       log=lambda r: say(f"{r['mixer']:<7} N={r['num_pairs']} seed {r['seed']}: "
                                         f"{r['accuracy']:.3f}"))
    task, config, _ = mqar_setup()
    return {"settings": {**task, "power_a": MQARConfig.power_a,
                         **{k: getattr(config, k) for k in RECORDED_BACKBONE},
                         **training_settings(training), "mixes": MQAR_MIXES,
                         "pairs": pairs, "seeds": seeds, "jobs": jobs,
                         "seconds": round(time.perf_counter() - start, 1),
                         "machine": machine_info(jobs)},
            "results": results}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.bench hybrid", description=__doc__)
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--prompts", nargs="+", type=int, default=[32, 1024],
                   help="prompt lengths of the comparison with transformers' generate")
    p.add_argument("--train", choices=["lm", "mqar"], help="train instead (results file)")
    p.add_argument("--models", nargs="+", default=["gpt2", "3:1", "0:1", "1:1", "all-KDA"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--train-steps", type=int, default=None)
    p.add_argument("--pairs", nargs="+", type=int, default=[1, 2, 4, 8])  # chapters 3-6
    p.add_argument("--jobs", type=int, default=2, help="parallel single-threaded runs")
    p.add_argument("--out", default="-", help="JSON results file ('-': do not write)")
    return p.parse_args(argv)


def write(result: dict, out: str) -> None:
    if out != "-":
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if args.train == "lm":
        steps = {} if args.train_steps is None else {"steps": args.train_steps}
        write(lm_sweep(args.models, args.seeds, args.jobs, **steps), args.out)
        return
    if args.train == "mqar":
        steps = MQARTraining().steps if args.train_steps is None else args.train_steps
        write(mqar_runs(args.pairs, args.seeds, steps, args.jobs), args.out)
        return
    print(format_sweep(decode_sweep(args.contexts, batch=args.batch, steps=args.steps)))
    if not args.no_transformers:
        try:
            for prompt_len in args.prompts:
                r = against_transformers(prompt_len=prompt_len)
                print(
                    f"generate {r['new_tokens']} tokens after {r['prompt_len']}: this library "
                    f"{r['ours_s']:.3f} s, transformers {r['transformers_s']:.3f} s "
                    f"({r['transformers_s'] / r['ours_s']:.1f}x), same tokens: "
                    f"{r['same_tokens']}"
                )
        except ImportError:
            print("transformers is not installed: skipped the comparison with it")
    print(f"({time.perf_counter() - start:.0f} s)")
