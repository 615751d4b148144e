"""``python -m gpt2kimi.experiments NAME [ARGS]``: run one of the book's training sweeps.

The pipeline (:mod:`gpt2kimi.experiments.results`): ``list`` (every results file the book
reads, what it is, its estimated time and whether it is current), ``run NAME`` (runs or resumes
that file's sweep, each run appended as it finishes), ``check`` (every file under ``book/data``
against the registry and today's code; exit status 1 on a stale or unregistered file),
``verify NAME`` (re-runs a few runs of a complete file recorded by earlier code; if today's code
reproduces them, the file is current again without being recorded anew).

The older per-experiment commands, which wrote today's files, each train models and write the
JSON results file a chapter plots (``--out -``: print only): ``mqar`` (chapters 3-6),
``forget`` and ``rewrite`` (chapter 5), ``moe-train`` (chapter 7), ``hybrid --train lm|mqar``
(chapter 8). Runs are single-threaded, ``--jobs`` of them at once.
The timing benchmarks are ``python -m gpt2kimi.bench``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from gpt2kimi.experiments import forget, moe_train, results, rewrite
from gpt2kimi.experiments.hybrid_train import lm_sweep, mqar_runs
from gpt2kimi.experiments.mqar import MQARTraining, format_table, mqar_sweep
from gpt2kimi.experiments.pipeline import (
    ResultsFileError,
    VerificationFailed,
    sweep_files,
    verify,
)
from gpt2kimi.experiments.recall import WindowRecallConfig, rewrite_sweep, window_recall_sweep
from gpt2kimi.experiments.registry import (
    MIXERS,
    MQAR_D_MODEL,
    MQAR_SEQ_LEN,
    MQAR_VOCAB,
    mqar_model_config,
)
from gpt2kimi.experiments.sweep import machine_info
from gpt2kimi.experiments.tasks import get_task
from gpt2kimi.progress import say

MQAR_DOC = """``python -m gpt2kimi.experiments mqar``: the MQAR sweep behind chapter 3's recall
figure.

Trains the shared backbone with each named mixer on MQAR at several numbers of key-value pairs
and seeds (single-threaded runs, ``--jobs`` of them at once) and writes the records to a JSON
file that the notebook plots. Chapters 4 and 5 run the same sweep with their mixers::

    python -m gpt2kimi.experiments mqar                                  # chapter 3's file
    python -m gpt2kimi.experiments mqar --mixers softmax linear deltanet \\
        --out book/data/mqar_deltanet.json
"""


def write_json(text: str, out: str) -> None:
    """Write ``text`` to the file ``out`` (its folder made if needed); ``-``: write nothing."""
    if out != "-":
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        print(f"wrote {path}")


def mqar_main(argv: list[str]) -> None:
    defaults = MQARTraining()
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.experiments mqar", description=MQAR_DOC)
    p.add_argument(
        "--mixers", nargs="+", default=["softmax", "linear", "linear_elu"], choices=sorted(MIXERS)
    )
    p.add_argument("--pairs", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--vocab-size", type=int, default=MQAR_VOCAB)
    p.add_argument("--seq-len", type=int, default=MQAR_SEQ_LEN)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    p.add_argument("--jobs", type=int, default=2, help="parallel single-threaded runs")
    p.add_argument(
        "--out",
        default="book/data/mqar_linear_attention.json",
        help="JSON results file ('-': do not write)",
    )
    args = p.parse_args(argv)
    training = MQARTraining(steps=args.steps, lr=args.lr)
    sweep = mqar_sweep(
        args.mixers,
        args.pairs,
        args.seeds,
        training=training,
        jobs=args.jobs,
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        log=lambda r: say(
            f"{r['mixer']:<16} N={r['num_pairs']:<3} seed {r['seed']}: "
            f"accuracy {r['accuracy']:.3f} ({r['seconds']:.0f} s)"
        ),
    )
    sweep["settings"]["machine"] = machine_info(args.jobs)
    print(format_table(sweep))
    write_json(json.dumps(sweep, indent=1), args.out)


FORGET_DOC = """``python -m gpt2kimi.experiments forget``: sliding-window recall, a task that needs
forgetting.

Trains the shared MQAR backbone, here with eight heads of 8 dimensions (an 8 × 8 memory per
head), with each named mixer on sliding-window recall
(:class:`gpt2kimi.experiments.recall.WindowRecallConfig`): a stream of 24 facts, three times as
many as a head has key directions, whose 8 queries ask only about the 4 latest, so a memory that
keeps everything fills up with facts that are never asked for again. Single-threaded runs,
``--jobs`` of them at once, then a short *live* subset (two models, one seed, fewer steps) that a
notebook can re-run to check the file against the code. Both go to one JSON file, with the
model's settings and the machine it ran on::

    python -m gpt2kimi.experiments forget              # book/data/forget_window.json
"""


def forget_main(argv: list[str]) -> None:
    task_defaults = WindowRecallConfig()
    p = argparse.ArgumentParser(
        prog="python -m gpt2kimi.experiments forget", description=FORGET_DOC
    )
    p.add_argument("--mixers", nargs="+", default=forget.COMPARED, choices=sorted(MIXERS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--vocab-size", type=int, default=task_defaults.vocab_size)
    p.add_argument("--seq-len", type=int, default=task_defaults.seq_len)
    p.add_argument("--num-queries", type=int, default=task_defaults.num_queries)
    p.add_argument("--window", type=int, default=task_defaults.window)
    p.add_argument("--d-model", type=int, default=MQAR_D_MODEL)
    p.add_argument(
        "--n-head", type=int, default=forget.N_HEAD, help="heads: d_model / n_head = d_k"
    )
    p.add_argument("--steps", type=int, default=forget.STEPS)
    p.add_argument("--batch-size", type=int, default=forget.BATCH_SIZE)
    p.add_argument("--lr", type=float, default=MQARTraining.lr)
    p.add_argument("--live-mixers", nargs="*", default=forget.LIVE, choices=sorted(MIXERS))
    p.add_argument("--live-steps", type=int, default=150)
    p.add_argument("--jobs", type=int, default=2, help="parallel single-threaded runs")
    p.add_argument(
        "--out",
        default="book/data/forget_window.json",
        help="JSON results file ('-': do not write)",
    )
    args = p.parse_args(argv)
    task = dict(
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        num_queries=args.num_queries,
        window=args.window,
    )
    training = MQARTraining(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=forget.WARMUP
    )
    config = mqar_model_config(vocab_size=args.vocab_size, d_model=args.d_model, n_head=args.n_head)

    def log(r: dict) -> None:
        parts = " ".join(f"{a:.2f}" for a in r["by_part"])
        say(
            f"{r['mixer']:<16} seed {r['seed']}: accuracy {r['accuracy']:.3f} "
            f"(quarters {parts}) ({r['seconds']:.0f} s)"
        )

    full = window_recall_sweep(
        forget.model_factories(args.mixers, config),
        args.seeds,
        training=training,
        jobs=args.jobs,
        log=log,
        **task,
    )
    full["settings"]["model"] = asdict(config)
    full["settings"]["machine"] = machine_info(args.jobs)
    print(forget.format_table(full))
    record = dict(full)
    if args.live_mixers:
        record["live"] = window_recall_sweep(
            forget.model_factories(args.live_mixers, config),
            [args.seeds[0]],
            training=MQARTraining(
                steps=args.live_steps,
                batch_size=args.batch_size,
                lr=args.lr,
                warmup_steps=min(forget.WARMUP, args.live_steps),
            ),
            jobs=args.jobs,
            log=log,
            **task,
        )
    write_json(json.dumps(record, indent=1), args.out)


REWRITE_DOC = """``python -m gpt2kimi.experiments rewrite``: the rewritten-facts sweep behind
chapter 5's figure.

Trains the shared MQAR backbone with each named mixer on the rewritten-facts task
(:mod:`gpt2kimi.experiments.recall`) at several numbers of keys and seeds, under MQAR's training
budget (single-threaded runs, ``--jobs`` of them at once), then a short *live* subset (a few
models, one size, one seed, fewer steps) that the notebook re-runs to check the file against the
code. Both go to one JSON file::

    python -m gpt2kimi.experiments rewrite             # book/data/rewrite_gating.json
"""


def rewrite_main(argv: list[str]) -> None:
    defaults = MQARTraining()
    p = argparse.ArgumentParser(
        prog="python -m gpt2kimi.experiments rewrite", description=REWRITE_DOC
    )
    p.add_argument("--mixers", nargs="+", default=rewrite.COMPARED, choices=sorted(MIXERS))
    p.add_argument("--keys", nargs="+", type=int, default=[2, 4, 8], help="keys per sequence")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--vocab-size", type=int, default=MQAR_VOCAB)
    p.add_argument("--seq-len", type=int, default=MQAR_SEQ_LEN)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--live-mixers", nargs="*", default=rewrite.LIVE, choices=sorted(MIXERS))
    p.add_argument("--live-keys", type=int, default=2)
    p.add_argument("--live-steps", type=int, default=100)
    p.add_argument("--jobs", type=int, default=2, help="parallel single-threaded runs")
    p.add_argument(
        "--out",
        default="book/data/rewrite_gating.json",
        help="JSON results file ('-': do not write)",
    )
    args = p.parse_args(argv)
    task = dict(vocab_size=args.vocab_size, seq_len=args.seq_len)

    def log(r: dict) -> None:
        say(
            f"{r['mixer']:<16} keys={r['num_keys']:<3} seed {r['seed']}: accuracy "
            f"{r['accuracy']:.3f}, stale {r['stale']:.3f} ({r['seconds']:.0f} s)"
        )

    full = rewrite_sweep(
        rewrite.model_factories(args.mixers),
        args.keys,
        args.seeds,
        training=MQARTraining(steps=args.steps),
        jobs=args.jobs,
        log=log,
        **task,
    )
    print(rewrite.format_table(full))
    record = dict(full)
    if args.live_mixers:
        record["live"] = rewrite_sweep(
            rewrite.model_factories(args.live_mixers),
            [args.live_keys],
            [args.seeds[0]],
            training=MQARTraining(steps=args.live_steps),
            jobs=args.jobs,
            log=log,
            **task,
        )
    write_json(json.dumps(record, indent=1), args.out)


MOE_TRAIN_DOC = """``python -m gpt2kimi.experiments moe-train``: dense FFN vs MoE on the byte
corpus, and balancing.

Trains the same small language model (softmax attention, NoPE, the built-in byte corpus) with
four feed-forward variants at equal **active** parameters, one seed at one learning rate, for a
quick look (chapter 7 reads ``run lm_moe``: every variant at four rates and three seeds)::

    dense     a SwiGLU of hidden width (top_k + shared) · expert_hidden
    moe       an MoE, no balancing
    moe_aux   the same with Switch Transformer's auxiliary loss (weight --aux-alpha)
    moe_bias  the same with DeepSeek-V3's auxiliary-loss-free bias update (step --bias-gamma)

For each run the file holds the validation losses, the load of every MoE layer over training
(max / mean tokens per expert, per step) and, after training, which experts each kind of byte
is sent to. Runs are single-threaded, ``--jobs`` of them at once::

    python -m gpt2kimi.experiments moe-train --out moe_train.json
    python -m gpt2kimi.experiments moe-train --steps 150 --variants dense moe_bias --out -
"""


def moe_train_main(argv: list[str]) -> None:
    defaults = moe_train.MoETrainSettings()
    p = argparse.ArgumentParser(
        prog="python -m gpt2kimi.experiments moe-train", description=MOE_TRAIN_DOC
    )
    p.add_argument(
        "--variants", nargs="+", default=list(moe_train.VARIANTS), choices=moe_train.VARIANTS
    )
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--aux-alpha", type=float, default=defaults.aux_alpha)
    p.add_argument("--bias-gamma", type=float, default=defaults.bias_gamma)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--jobs", type=int, default=2, help="parallel single-threaded runs")
    p.add_argument(
        "--out", default="-", help="JSON results file (default '-': print, do not write)"
    )
    args = p.parse_args(argv)
    settings = replace(
        defaults,
        steps=args.steps,
        aux_alpha=args.aux_alpha,
        bias_gamma=args.bias_gamma,
        seed=args.seed,
    )
    sweep = moe_train.moe_train_sweep(
        args.variants,
        settings,
        args.jobs,
        log=lambda r: say(f"{r['variant']:<10} val {r['final_val_loss']:.4f} ({r['seconds']} s)"),
    )
    sweep["settings"]["machine"] = machine_info(args.jobs)
    print(moe_train.format_table(sweep))
    write_json(moe_train.dumps(sweep), args.out)


HYBRID_DOC = """``python -m gpt2kimi.experiments hybrid --train lm|mqar``: chapter 8's training
runs.

``--train lm``: GPT-2 of equal active parameters and the tiny hybrid at several KDA:MLA mixes on
the byte corpus; ``--train mqar``: the hybrid (KDA then MLA), pure KDA and pure MLA on MQAR at
chapter 3's settings. Three seeds each, one results file each::

    python -m gpt2kimi.experiments hybrid --train lm --out book/data/hybrid_lm.json
    python -m gpt2kimi.experiments hybrid --train mqar --out book/data/hybrid_mqar.json

The hybrid's decoding speed is ``python -m gpt2kimi.bench hybrid``.
"""


def hybrid_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(
        prog="python -m gpt2kimi.experiments hybrid", description=HYBRID_DOC
    )
    p.add_argument("--train", choices=["lm", "mqar"], required=True, help="which runs to train")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models", nargs="+", default=["gpt2", "3:1", "0:1", "1:1", "all-KDA"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--train-steps", type=int, default=None)
    p.add_argument("--pairs", nargs="+", type=int, default=[1, 2, 4, 8])  # chapters 3-6
    p.add_argument("--jobs", type=int, default=2, help="parallel single-threaded runs")
    p.add_argument("--out", default="-", help="JSON results file ('-': do not write)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.train == "lm":
        steps = {} if args.train_steps is None else {"steps": args.train_steps}
        result = lm_sweep(args.models, args.seeds, args.jobs, **steps)
    else:
        steps = MQARTraining().steps if args.train_steps is None else args.train_steps
        result = mqar_runs(args.pairs, args.seeds, steps, args.jobs)
    write_json(json.dumps(result, indent=1), args.out)


def _data_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=Path, default=None,
                   help="the results folder (default: book/data of this repository)")


def list_main(argv: list[str]) -> None:
    """``list``: every registered results file, what it is, its estimated time and status."""
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.experiments list",
                                description=list_main.__doc__)
    _data_arg(p)
    args = p.parse_args(argv)
    data = args.data or results.default_data_dir()
    width = max(len(name) for name in results.REGISTRY)
    for entry in results.REGISTRY.values():
        runs = len(entry.runs())
        print(f"{entry.name:<{width}}  ch {entry.chapters:<5} {entry.task:<9} {runs:>3} runs "
              f"~{entry.minutes:g} min  {results.entry_status(entry, data)}")
        print(f"{'':<{width}}  {entry.description}")
        print(f"{'':<{width}}  {entry.command}")
    total = sum(entry.minutes for entry in results.REGISTRY.values())
    print(f"{len(results.REGISTRY)} files, ~{total:g} min in all on 2 cores (two runs at a time)")


def run_main(argv: list[str]) -> None:
    """``run NAME [NAME ...]``: run or resume the sweeps of the registered results files, all
    through one pool of ``--jobs`` single-threaded runs (their runs interleaved). The runs train
    on ``$GPT2KIMI_DEVICE`` (default: the CPU)."""
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.experiments run",
                                description=run_main.__doc__)
    p.add_argument("names", nargs="+", choices=sorted(results.REGISTRY), metavar="NAME",
                   help="a results file of the registry (see list)")
    p.add_argument("--jobs", type=int, default=2, help="parallel single-threaded runs")
    p.add_argument("--restart", action="store_true",
                   help="start the files afresh (drops the runs they hold)")
    p.add_argument("--longest-first", action="store_true",
                   help="start the longest runs first (all files together)")
    _data_arg(p)
    args = p.parse_args(argv)
    entries = [results.REGISTRY[name] for name in dict.fromkeys(args.names)]
    for entry in entries:
        if entry.legacy:
            raise SystemExit(f"{entry.name} is not in the pipeline yet; its command: "
                             f"{entry.command}")
    data = args.data or results.default_data_dir()
    for entry in entries:
        say(f"{entry.name}: {len(entry.runs())} runs of {entry.task} into {data / entry.path} "
            f"(~{entry.minutes:g} min on 2 cores)")
    sweeps = [(get_task(e.task), e.grid, e.seeds, data / e.path) for e in entries]
    try:
        done = sweep_files(sweeps, args.jobs, restart=args.restart,
                           log=lambda r: say(_one_line(r)), longest_first=args.longest_first)
    except ResultsFileError as error:
        raise SystemExit(str(error)) from None
    for entry, (_, records) in zip(entries, done, strict=True):
        print(f"{data / entry.path}: {len(records)} of {len(entry.runs())} runs")


def _one_line(record: dict) -> str:
    """A record in one line: its strings and ints, then its scalar floats."""
    words = [f"{v}" for v in record.values() if isinstance(v, str)]
    words += [f"{k}={v}" for k, v in record.items() if isinstance(v, (int, float))
              and not isinstance(v, bool) and k not in ("parameters", "params")]
    return " ".join(words)


def check_main(argv: list[str]) -> None:
    """``check``: every results file against the registry and today's code; exit 1 on any
    stale, incomplete, missing or unregistered file."""
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.experiments check",
                                description=check_main.__doc__)
    _data_arg(p)
    args = p.parse_args(argv)
    rows = results.check_files(args.data or results.default_data_dir())
    width = max((len(name) for name, _ in rows), default=0)
    for name, status in rows:
        print(f"{name:<{width}}  {status}")
    bad = sum(status != "current" for _, status in rows)
    print(f"{len(rows) - bad} current, {bad} not")
    if bad:
        raise SystemExit(1)


def verify_main(argv: list[str]) -> None:
    """``verify NAME [NAME ...]``: re-run ``--runs`` runs of each complete registered file with
    today's code and compare them with the recorded ones (timings aside, numbers within
    ``--tolerance``); where all agree, the file records the verification and is current again.
    Exit 1 if any file is not reproduced (it stays stale: record it again with ``run``)."""
    p = argparse.ArgumentParser(prog="python -m gpt2kimi.experiments verify",
                                description=verify_main.__doc__)
    p.add_argument("names", nargs="+", choices=sorted(results.REGISTRY), metavar="NAME")
    p.add_argument("--runs", type=int, default=2, help="runs re-run per file (default 2)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest difference allowed in any recorded number (default 1e-4)")
    p.add_argument("--jobs", type=int, default=2, help="parallel single-threaded runs")
    _data_arg(p)
    args = p.parse_args(argv)
    data = args.data or results.default_data_dir()
    failed = []
    for name in dict.fromkeys(args.names):
        entry = results.REGISTRY[name]
        path = data / entry.path
        if not path.exists():
            raise SystemExit(f"{path}: no such file; record it with: {entry.command}")
        try:
            done = verify(get_task(entry.task), path, args.runs, args.tolerance, args.jobs)
        except (ResultsFileError, VerificationFailed) as error:
            print(error)
            failed.append(name)
            continue
        print(f"{name}: {len(done['runs'])} runs reproduced by code {done['code']['hash'][:12]}; "
              f"{results.entry_status(entry, data)}")
    if failed:
        raise SystemExit(f"not reproduced: {' '.join(failed)}")


COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "list": list_main,
    "run": run_main,
    "check": check_main,
    "verify": verify_main,
    "mqar": mqar_main,
    "forget": forget_main,
    "rewrite": rewrite_main,
    "moe-train": moe_train_main,
    "hybrid": hybrid_main,
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0])
        print("experiments:", ", ".join(COMMANDS))
        return
    name = argv[0]
    if name not in COMMANDS:
        raise SystemExit(f"unknown experiment {name!r}; expected one of {sorted(COMMANDS)}")
    COMMANDS[name](argv[1:])


if __name__ == "__main__":
    main()
