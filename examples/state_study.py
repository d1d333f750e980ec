"""The optimizer state's dtype: fp32 against bf16 (stochastically rounded) state, over seeds.

Muon and AdamW train the demo's character-level GPT on the demo's data with the demo's training
loop (``examples/demo.py``), at the rates the long study tuned (``docs/study.md``: AdamW 9e-3,
Muon 3e-2, both the best of a factor-3 sweep at 300 and at 1000 steps), each with
``state_dtype=None`` (the parameters' fp32) and ``state_dtype=torch.bfloat16`` (Muon: the momentum
and the AdamW moments of the non-matrix leaves; AdamW: its two moments). For each seed every
setting starts from the same weights and sees the same batches, the settings' steps interleaved
round-robin (``examples/study.py``'s machinery: result files, checkpoints, ``--resume``).

Reported per setting: the mean, standard deviation, lowest and highest final validation loss over
the seeds, and whether each narrowed setting's mean lies within the range of its fp32 runs.
Outputs under ``--out`` (default ``runs/state-study``): ``results.json`` and ``loss_curves.png``.

    python examples/state_study.py --resume     # the study (make state-study); continues after an interruption
    python examples/state_study.py --toy        # a seconds-long smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
from typing import Any

import demo
import study
import torch

#: (optimizer, state dtype by name): the settings, each narrowed one after its fp32 reference
SETTINGS = (("adamw", None), ("adamw", "bfloat16"), ("muon", None), ("muon", "bfloat16"))
#: the long study's best rates at 300 steps and at 1000 (docs/data/study-*.json)
TUNED_LR = {"adamw": 9e-3, "muon": 3e-2}
COLORS = {"adamw": "tab:blue", "muon": "tab:orange"}


def label(kind: str, state_dtype: str | None) -> str:
    return f"{kind} {'fp32' if state_dtype is None else 'bf16'} state"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/state-study", help="output folder")
    parser.add_argument("--steps", type=int, default=300, help="training steps of every run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds: --seed, --seed + 1, ...")
    parser.add_argument("--adamw-lr", type=float, default=TUNED_LR["adamw"])
    parser.add_argument("--muon-lr", type=float, default=TUNED_LR["muon"])
    demo.add_setup_arguments(parser)
    parser.set_defaults(eval_every=25, eval_batches=16, threads=1)  # the long study's, curves at twice the points
    parser.add_argument("--resume", action="store_true", help="keep finished runs and continue the others")
    parser.add_argument("--toy", action="store_true", help="a tiny model and budget for a smoke test")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.toy:
        args.steps, args.width, args.depth, args.ctx, args.batch = 9, 32, 1, 16, 8
        args.eval_every, args.eval_batches, args.max_chars, args.seeds = 3, 2, 200_000, 2
        args.adamw_lr, args.muon_lr = 9 * args.adamw_lr, 9 * args.muon_lr  # as study.py's toy: larger rates
    for option, value in {"--steps": args.steps, "--seeds": args.seeds, "--eval-every": args.eval_every}.items():
        if value < 1:
            parser.error(f"{option} must be at least 1, got {value}")
    for option, value in {"--adamw-lr": args.adamw_lr, "--muon-lr": args.muon_lr}.items():
        if value <= 0:
            parser.error(f"{option} must be positive, got {value}")
    args.sweep_steps = None  # no sweep: demo.config_from's default
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    cfg, device, data, n_params, ns_rule = demo.set_up(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lrs = {"adamw": args.adamw_lr, "muon": args.muon_lr}
    seeds = [cfg.seed + i for i in range(args.seeds)]

    progress = study.Progress(enabled=not args.no_progress)
    runner = study.Study(
        cfg, data, device, out, resume=args.resume, stop_after=None, keep_checkpoints=False, progress=progress
    )
    progress.plan(len(SETTINGS) * len(seeds), cfg.steps)
    finals: dict[str, list[demo.Run]] = {label(*setting): [] for setting in SETTINGS}
    for seed in seeds:  # within a seed the settings take turns, one step each per round
        group = []
        for kind, state_dtype in SETTINGS:
            name = f"state-{kind}-{state_dtype or 'fp32'}-lr{lrs[kind]:.3e}-seed{seed}-{cfg.steps}"
            run = demo.Run(name, kind, lrs[kind], cfg.steps, cfg.eval_every, {}, state_dtype=state_dtype)
            group.append((run, seed))
        for setting, run in zip(SETTINGS, runner.train(group)):
            finals[label(*setting)].append(run)
    progress.close()

    results = {
        "config": dataclasses.asdict(cfg),
        "seeds": seeds,
        "lr": lrs,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "ns_rule": ns_rule,
        "parameters": n_params,
        "settings": {
            name: summarize(kind, state_dtype, finals[name], finals[label(kind, None)], seeds)
            for (kind, state_dtype), name in zip(SETTINGS, finals)
        },
    }
    study.write_atomically(out / "results.json", json.dumps(results, indent=2))
    print_table(results)
    print("\n" + markdown_table(results))
    plot_curves(results, out / "loss_curves.png")
    print(f"wrote {out / 'results.json'}, {out / 'loss_curves.png'} and runs/ in {out}")
    return results


def summarize(
    kind: str, state_dtype: str | None, runs: list[demo.Run], fp32: list[demo.Run], seeds: list[int]
) -> dict[str, Any]:
    """One setting's figures (``runs`` and its fp32 reference's ``fp32``, seed by seed): ``within_fp32_range``,
    its mean final loss inside the fp32 runs' lowest to highest; ``minus_fp32_by_seed``, its final loss minus
    the fp32 run's of the same seed (the same initialisation and batches)."""
    val = study.spread([r.final_val for r in runs])
    reference = study.spread([r.final_val for r in fp32])
    within = None
    if state_dtype is not None and None not in (val["mean"], reference["min"], reference["max"]):
        within = reference["min"] <= val["mean"] <= reference["max"]  # type: ignore[operator]
    return {
        "kind": kind,
        "state_dtype": state_dtype,
        "lr": runs[0].lr,
        "val_loss": val,
        "mean_minus_fp32_mean": None
        if val["mean"] is None or reference["mean"] is None
        else val["mean"] - reference["mean"],
        "within_fp32_range": within,
        "minus_fp32_by_seed": [study._finite(r.final_val - f.final_val) for r, f in zip(runs, fp32)],
        "median_step_seconds": study._finite(statistics.median(s for r in runs for s in r.step_seconds)),
        "mean_curve": study.mean_curves(runs),
        "runs": [
            {"seed": seed, "val_loss": study._finite(r.final_val), "history": r.history} for seed, r in zip(seeds, runs)
        ],
    }


def print_table(results: dict[str, Any]) -> None:
    n = len(results["seeds"])
    print(f"\n{'setting':20s} {'lr':>8s} {f'final val loss, mean ± sd ({n} seeds)':>36s} {'min–max':>16s} "
          f"{'vs fp32 mean':>13s} {'in fp32 range':>14s} {'ms/step':>8s}")  # fmt: skip
    for name, s in results["settings"].items():
        val = s["val_loss"]
        loss = f"{study._cell(val['mean'], '.4f', 'diverged')} ± {study._cell(val['std'], '.4f')}"
        span = f"{study._cell(val['min'], '.4f')}–{study._cell(val['max'], '.4f')}"
        within = "-" if s["within_fp32_range"] is None else "yes" if s["within_fp32_range"] else "no"
        print(
            f"{name:20s} {s['lr']:8.1e} {loss:>36s} {span:>16s} {study._cell(s['mean_minus_fp32_mean'], '+.4f'):>13s} "
            f"{within:>14s} {study._cell(s['median_step_seconds'] and s['median_step_seconds'] * 1e3, '.1f'):>8s}"
        )


def markdown_table(results: dict[str, Any]) -> str:
    """The table docs/study.md quotes: per setting, the final validation loss over the seeds and against fp32's."""
    n = len(results["seeds"])
    lines = [
        f"| setting | lr | final val loss, mean ± sd ({n} seeds) | min–max | minus fp32, mean (by seed) "
        "| mean within fp32's min–max |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in results["settings"].items():
        val = s["val_loss"]
        loss = f"{study._cell(val['mean'], '.4f', 'diverged')} ± {study._cell(val['std'], '.4f')}"
        span = f"{study._cell(val['min'], '.4f')}–{study._cell(val['max'], '.4f')}"
        if s["state_dtype"] is None:
            minus, within = "-", "-"
        else:
            seeds = ", ".join(study._cell(d, "+.4f") for d in s["minus_fp32_by_seed"])
            minus = f"{study._cell(s['mean_minus_fp32_mean'], '+.4f')} ({seeds})"
            within = "-" if s["within_fp32_range"] is None else "yes" if s["within_fp32_range"] else "**no**"
        lines.append(f"| {name} | {s['lr']:.0e} | {loss} | {span} | {minus} | {within} |")
    return "\n".join(lines)


def plot_curves(results: dict[str, Any], path: pathlib.Path) -> None:
    """Each setting's mean validation curve with a band from its lowest to its highest seed:
    fp32 solid, bf16 dashed."""
    plt = study._pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lows = []
    for name, s in results["settings"].items():
        curve = s["mean_curve"]
        histories = [r["history"]["val_loss"] for r in s["runs"]]
        points = [
            (step, mean, [h[i] for h in histories])
            for i, (step, mean) in enumerate(zip(curve["step"], curve["val_loss"]))
            if mean is not None and all(i < len(h) and h[i] is not None for h in histories)
        ]
        if not points:
            continue
        x, mean, seeds = zip(*points)
        style = "-" if s["state_dtype"] is None else "--"
        ax.plot(x, mean, style, color=COLORS[s["kind"]], label=f"{name} (lr {s['lr']:.0e})")
        ax.fill_between(x, [min(v) for v in seeds], [max(v) for v in seeds], color=COLORS[s["kind"]], alpha=0.15)
        lows.append(min(mean))
    if lows:
        ax.set_ylim(min(lows) - 0.05, min(lows) + 1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("validation cross-entropy (nats / character)")
    ax.set_title(f"fp32 against bf16 optimizer state: mean and range over {len(results['seeds'])} seeds")
    demo.save_figure(fig, ax, path)


if __name__ == "__main__":
    main()
