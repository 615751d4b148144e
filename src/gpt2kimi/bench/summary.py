"""Every speed claim of the book against its reference, in one run: the library's figure, the
reference's, their ratio and the target the library aims for.

``python -m gpt2kimi.bench summary [--rounds 3] [--quick]``

Rows (each measured side by side in interleaved rounds, on the same weights):

- MoE forward against ``transformers``' eager ``KimiLinearMoE`` (4,096 tokens, d 256, 64
  experts of 128, top-8, one shared), :func:`gpt2kimi.experiments.moe_speed.moe_speed`, and
  both against a dense SwiGLU of the same active size: a dispatch cannot beat one dense matrix
  product of the same arithmetic, so ``transformers``' time over the dense layer's is the most
  the library's lead can be;
- the tiny hybrid's greedy generation against ``transformers``' ``KimiLinearForCausalLM``
  (a 256-token prompt included), :func:`gpt2kimi.experiments.hybrid_speed.against_transformers`,
  again with KDA's and MoE's PyTorch decode code instead of their compiled C steps
  (:func:`~gpt2kimi.experiments.hybrid_speed.without_c_steps`), beside the same generation
  with every width cut to 8
  (:func:`~gpt2kimi.experiments.hybrid_speed.at_width`: the same operator calls, next to no
  arithmetic), the floor these calls set, then its two parts, the prompt's prefill and one
  decode step, timed apart (:func:`~gpt2kimi.experiments.hybrid_speed.prefill_and_step`), and
  the two decode steps' operator calls (at batch 1 a step's time follows their number);
- GPT-2 small's cached greedy decode against ``transformers``' ``generate``, and its tokens
  per second against the decode roofline and against its own matrix-vector products run alone
  (which on a CPU draw about a copy's bandwidth, a little less or more by the CPU), the decode
  step, the copy that measures the bandwidth and the products taking turns, each its median,
  :func:`gpt2kimi.experiments.reference_speed.gpt2_decode`, and beside it, apart from the
  fp32 rows, the same decode with bf16 weights (a precision lever: half the bytes);
- the hybrid's decode against the same model with MLA in every layer (batch 8, caches filled
  to 1K and 16K tokens), :func:`gpt2kimi.experiments.hybrid_speed.decode_sweep` (the
  models step in turn, one step each; each model's median step), each beside the ratio of the
  bytes the two models' steps read (:func:`gpt2kimi.experiments.synthesis.step_bytes`): the
  lead a step that only read its weights, cache and state would have; and the time a step adds
  between the two contexts, which goes as the bytes it adds, where the fixed costs of a step
  do not;
- a training step of a 4-layer, 128-wide byte GPT-2 (batch 32, 256 tokens) against
  ``transformers``' GPT-2, :func:`gpt2kimi.experiments.reference_speed.gpt2_train_step`.

``--quick`` shrinks every row (fewer tokens, shorter contexts) to check that the command runs;
its figures are not the table's. Timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from gpt2kimi.experiments.hybrid_speed import (
    BENCH_CONFIG,
    against_transformers,
    build_models,
    decode_sweep,
    prefill_and_step,
    step_operations,
    transformers_step_operations,
    without_c_steps,
)
from gpt2kimi.experiments.moe_speed import moe_speed
from gpt2kimi.experiments.reference_speed import gpt2_decode, gpt2_train_step
from gpt2kimi.experiments.synthesis import step_bytes
from gpt2kimi.kimi_linear import KimiHybrid


@dataclass(frozen=True)
class Row:
    """One benchmark: the library's figure against the reference's (``ratio``: how many times
    better the library is, above 1 when ahead) and the target ratio (None: a row that explains
    the one above it, with no target of its own)."""

    name: str
    ours: str
    reference: str
    ratio: float
    target: float | None

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.ratio >= self.target


def _ms(seconds: float, digits: int = 0) -> str:
    """A time for a table cell, in milliseconds."""
    return f"{seconds * 1e3:.{digits}f} ms"


def rows(rounds: int = 3, quick: bool = False) -> list[Row]:
    """Measure every row (``quick``: small sizes that only check the plumbing)."""
    out = []
    moe = moe_speed(tokens=256 if quick else 4096, d_model=256, rounds=rounds)
    if "transformers" in moe["seconds"]:
        s = moe["seconds"]
        out.append(Row("MoE forward vs transformers KimiLinearMoE (eager)",
                       _ms(s["moe"], 1), _ms(s["transformers"], 1),
                       s["transformers"] / s["moe"], 2.0))
        # the roof: no dispatch beats one dense product of the same arithmetic, so the lead
        # over transformers is bounded by its time over the dense layer's
        out.append(Row("  the same vs a dense SwiGLU of equal active size (its roof)",
                       _ms(s["moe"], 1), _ms(s["dense"], 1),
                       s["dense"] / s["moe"], 0.85))
        out.append(Row("  transformers' MoE vs that dense layer (the most a lead can be)",
                       _ms(s["transformers"], 1), _ms(s["dense"], 1),
                       s["transformers"] / s["dense"], 2.0))
    gen = against_transformers(prompt_len=32 if quick else 256, new_tokens=8 if quick else 32,
                               rounds=rounds, floor_width=8)
    out.append(Row("hybrid generate vs transformers KimiLinearForCausalLM",
                   _ms(gen["ours_s"]), _ms(gen["transformers_s"]),
                   gen["transformers_s"] / gen["ours_s"], 3.0))
    # what the compiled C steps save: the same generation with KDA's and MoE's PyTorch code
    with without_c_steps():
        eager = against_transformers(prompt_len=32 if quick else 256,
                                     new_tokens=8 if quick else 32, rounds=rounds)
    out.append(Row("  the same with the PyTorch steps (as without a C compiler)",
                   _ms(eager["ours_s"]), _ms(eager["transformers_s"]),
                   eager["transformers_s"] / eager["ours_s"], None))
    # its calls' own cost: the same model at width 8 makes the same operator calls with next to
    # no arithmetic, so its generation is the least these calls take
    out.append(Row("  the same calls at width 8 (next to no arithmetic): their time over ours",
                   _ms(gen["floor_s"]), _ms(gen["ours_s"]),
                   gen["floor_s"] / gen["ours_s"], None))
    out.append(Row("  transformers over that floor (the most a lead can be with these calls)",
                   _ms(gen["floor_s"]), _ms(gen["transformers_s"]),
                   gen["transformers_s"] / gen["floor_s"], None))
    # the generation split in two: the prompt read at once, then one token at a time
    parts = prefill_and_step(prompt_len=32 if quick else 256, steps=4 if quick else 16,
                             rounds=rounds)
    ours, theirs = parts["ours"], parts["transformers"]
    out.append(Row("  its prompt's prefill: transformers over ours",
                   _ms(ours["prefill_s"], 1), _ms(theirs["prefill_s"], 1),
                   theirs["prefill_s"] / ours["prefill_s"], None))
    out.append(Row("  one decode step after it: transformers over ours",
                   _ms(ours["step_s"], 2), _ms(theirs["step_s"], 2),
                   theirs["step_s"] / ours["step_s"], None))
    # at batch 1 a decode step's time follows its number of operator calls (chapter 8)
    calls = step_operations(KimiHybrid(BENCH_CONFIG).eval(), context=32)
    hf_calls = transformers_step_operations(BENCH_CONFIG, prompt_len=32)
    out.append(Row("  operator calls per decode step: transformers over ours",
                   f"{calls} calls", f"{hf_calls} calls", hf_calls / calls, None))
    dec = gpt2_decode(new_tokens=8 if quick else 64, rounds=rounds)
    if not (gen["same_tokens"] and parts["same_tokens"] and dec["same_tokens"]):
        raise RuntimeError("the library and transformers generated different tokens")
    out.append(Row("GPT-2 small cached greedy decode vs transformers generate",
                   _ms(dec["ours_s"]), _ms(dec["transformers_s"]),
                   dec["transformers_s"] / dec["ours_s"], 1.1))
    # precision, labelled apart: the rows above and below compare fp32 with fp32
    out.append(Row(f"  with bf16 weights ({dec['bf16_agree']} of {dec['new_tokens']} tokens "
                   "as fp32's): fp32 over bf16", _ms(dec["bf16_s"]),
                   _ms(dec["ours_s"]), dec["ours_s"] / dec["bf16_s"], None))
    out.append(Row("GPT-2 small decode vs its roofline (weights + cache at copy bandwidth)",
                   f"{dec['tokens_per_s']:.1f} tok/s", f"{dec['roof_tokens_per_s']:.1f} tok/s",
                   dec["roof_fraction"], 0.85))
    # the roof a step built on matrix-vector products can reach on this machine: its products
    # alone draw about a copy's bandwidth, and the decode runs close under them
    out.append(Row("  its matrix-vector products alone vs that roofline",
                   f"{dec['products_tokens_per_s']:.1f} tok/s",
                   f"{dec['roof_tokens_per_s']:.1f} tok/s",
                   dec["products_tokens_per_s"] / dec["roof_tokens_per_s"], None))
    out.append(Row("  the decode vs its matrix-vector products alone",
                   f"{dec['tokens_per_s']:.1f} tok/s", f"{dec['products_tokens_per_s']:.1f} tok/s",
                   dec["products_fraction"], 0.85))
    contexts = [256, 1024] if quick else [1024, 16384]
    # each model's median of 16 steps per round asked for, the models stepping in turn
    sweep = decode_sweep(contexts, batch=8, steps=16 * rounds)
    rates = sweep["tokens_per_s"]
    models = build_models()
    for i, (context, target) in enumerate(zip(contexts, (1.0, 3.0), strict=True)):
        out.append(Row(f"hybrid decode vs all-MLA, batch 8, {context} cached tokens",
                       f"{rates['hybrid'][i]:.0f} tok/s", f"{rates['all-MLA'][i]:.0f} tok/s",
                       sweep["hybrid_vs_mla"][i], target))
        # the most the bytes allow: a step that did nothing but read its weights and caches
        read = {name: step_bytes(models[name], context, batch=8) for name in ("hybrid", "all-MLA")}
        out.append(Row("  bytes one step reads: all-MLA over the hybrid",
                       f"{read['hybrid'] / 1e6:.1f} MB", f"{read['all-MLA'] / 1e6:.1f} MB",
                       read["all-MLA"] / read["hybrid"], None))
    # why the whole step's ratio stays under the bytes': the time the longer cache adds goes
    # as the bytes it adds (four latent caches against one), the rest of a step, fixed costs
    # common to both models, does not
    added = {name: 8 / rates[name][1] - 8 / rates[name][0] for name in ("hybrid", "all-MLA")}
    out.append(Row(f"  time a step adds from {contexts[0]} to {contexts[1]} cached tokens "
                   "(bytes: 4x)", _ms(added["hybrid"], 1), _ms(added["all-MLA"], 1),
                   added["all-MLA"] / added["hybrid"], None))
    step = gpt2_train_step(batch_size=4 if quick else 32, rounds=rounds)
    if step["loss_diff"] > 1e-4:
        raise RuntimeError(f"the two GPT-2s' losses differ by {step['loss_diff']:.1e}")
    out.append(Row("training step, 4-layer 128-wide byte GPT-2 vs transformers GPT-2",
                   _ms(step["ours_s"]), _ms(step["transformers_s"]),
                   step["transformers_s"] / step["ours_s"], 1.2))
    return out


def median_rows(tables: list[list[Row]]) -> list[tuple[Row, float, float]]:
    """The same table measured several times: each row as the run with its median ratio
    measured it (the lower of the two middle ones for an even count), with the lowest and the
    highest ratio of all the runs. On a machine whose speed drifts, one run can put a row on
    either side of its target; the median and the range say where it stands."""
    out = []
    for measured in zip(*tables, strict=True):
        names = sorted({r.name for r in measured})
        if len(names) != 1:
            raise ValueError(f"the runs' tables do not line up: {names}")
        ranked = sorted(measured, key=lambda r: r.ratio)
        out.append((ranked[(len(ranked) - 1) // 2], ranked[0].ratio, ranked[-1].ratio))
    return out


def format_rows(table: list[Row], ranges: list[tuple[float, float]] | None = None) -> str:
    """The table as text; with ``ranges`` (each row's lowest and highest ratio over several
    runs), a column that shows them."""
    width = max(len(r.name) for r in table)
    lines = [f"{'benchmark':<{width}}  {'ours':>12}  {'reference':>12}  {'ratio':>6}  "
             f"{'target':>6}  met" + ("  range of the runs" if ranges else "")]
    for i, r in enumerate(table):
        target, met = ("     -", "-") if r.met is None else (f"{r.target:>5.2f}x",
                                                               "yes" if r.met else "no")
        spread = f"  {ranges[i][0]:.2f}x-{ranges[i][1]:.2f}x" if ranges else ""
        lines.append(f"{r.name:<{width}}  {r.ours:>12}  {r.reference:>12}  {r.ratio:>5.2f}x  "
                     f"{target}  {met:<3}{spread}".rstrip())
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.bench summary",
                                description=__doc__.strip().splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=1,
                   help="measure the whole table this many times; print each row's median run "
                        "and the range of its ratio")
    p.add_argument("--quick", action="store_true", help="small sizes: check that it runs")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    print(f"fp32, {torch.get_num_threads()} thread(s), fastest of {args.rounds} interleaved "
          "rounds; ratio: the reference's time over ours (ours / roof for the roofline row)"
          + (f"; each row the median of {args.runs} runs" if args.runs > 1 else ""))
    tables = [rows(args.rounds, args.quick) for _ in range(args.runs)]
    if args.runs == 1:
        print(format_rows(tables[0]))
        return
    medians = median_rows(tables)
    print(format_rows([row for row, _, _ in medians], [(lo, hi) for _, lo, hi in medians]))
