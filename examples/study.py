"""The long study: AdamW, Muon, NorMuon and AdaMuon on one model and data, equally tuned, over seeds.

Every method trains the demo's character-level GPT on the demo's data with the demo's training
loop, schedule, checkpoints and timing (``examples/demo.py``). Protocol (``docs/study.md`` says
how to read the results):

1. Tuning, the same budget for every method: a learning-rate sweep of ``--sweep-steps`` steps
   (default ``--steps // 4``) at the first seed, on a grid a factor 3 apart, extended past
   whichever edge wins (at most twice), so that no method is judged at the edge of its grid.
2. Each method's best rate is trained for ``--steps`` steps with each of ``--seeds`` seeds (a seed
   draws the initialisation, the training batches and the validation sample). For each seed the
   methods' steps are interleaved round-robin, so that a change of load falls on all alike.
3. Reported: the mean and spread over the seeds of each method's final validation loss; the steps
   and the seconds its mean validation curve takes to reach AdamW's mean final validation loss;
   its sensitivity to the learning rate (the sweep's loss at the best rate ÷3 and ×3); and a
   check that the data is large enough for the model (epochs, tokens per parameter, the gap
   between validation and training loss, whether the validation curve has turned up).

Outputs under ``--out`` (default ``runs/study``): ``results.json``, ``loss_curves.png`` (the mean
validation curve with a band over the seeds), ``lr_sensitivity.png`` (final loss against lr), a
result file per finished run in ``runs/`` and a checkpoint per unfinished run in ``checkpoints/``,
each written atomically. ``--resume`` keeps every finished run and continues the others from
their checkpoints; the results are the same bit for bit as those of an uninterrupted study on
the same machine with the same ``--threads``.

    python examples/study.py --estimate      # time a few steps of each method, project the study's duration
    python examples/study.py --resume        # the study; after an interruption, the same command continues it
    python examples/study.py --toy           # a seconds-long smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import secrets
import statistics
import tempfile
import time
from typing import Any

import demo
import torch

METHODS = ("adamw", "muon", "normuon", "adamuon")
#: The grids, a factor 3 apart. Their middles are guesses for the default model and data;
#: the sweep moves past whichever edge wins.
GRIDS = {
    "adamw": [1e-3, 3e-3, 9e-3],
    "muon": [1e-2 / 3, 1e-2, 3e-2],
    "normuon": [1e-2 / 3, 1e-2, 3e-2],
    "adamuon": [1e-2 / 3, 1e-2, 3e-2],
}
#: Without a progress bar, the longest silence between two lines (a seed's final runs take minutes).
LINE_SECONDS = 60.0
COLORS = {"adamw": "tab:blue", "muon": "tab:orange", "normuon": "tab:green", "adamuon": "tab:red"}

# ---------------------------------------------------------------------------------------
# Progress over the whole study, with an ETA.


class Progress:
    """The study's steps, planned and done, and an ETA at this session's pace (evaluations,
    checkpoints and set-up included). The plan grows when a sweep extends its grid."""

    def __init__(self, *, enabled: bool) -> None:
        self.planned = self.done = self.trained = 0
        self.runs_planned = self.runs_done = 0
        self.started = self.last_line = time.perf_counter()
        self.bar = _study_bar(enabled)

    def plan(self, runs: int, steps_each: int) -> None:
        self.planned += runs * steps_each
        self.runs_planned += runs
        if self.bar is not None:
            self.bar.total = self.planned
            self.bar.refresh()

    def skip(self, steps: int) -> None:
        """Steps done before this session (a finished run kept, or a run resumed part-way)."""
        self.done += steps
        if self.bar is not None:
            self.bar.update(steps)

    def step(self) -> None:
        self.done += 1
        self.trained += 1
        if self.bar is not None:
            self.bar.update(1)
            if self.trained % 10 == 1:
                self.bar.set_postfix_str(f"ETA {_minutes(self.eta_seconds())}", refresh=False)
        elif time.perf_counter() - self.last_line > LINE_SECONDS:  # no bar: a line now and then
            self.log(f"{self.done:,} of {self.planned:,} steps | ETA {_minutes(self.eta_seconds())}")

    def eta_seconds(self) -> float | None:
        if self.trained == 0:
            return None
        return (self.planned - self.done) * (time.perf_counter() - self.started) / self.trained

    def finished(self, label: str) -> None:
        self.runs_done += 1
        elapsed = time.perf_counter() - self.started
        width = len(str(self.runs_planned))
        self.log(
            f"[{self.runs_done:{width}d}/{self.runs_planned} runs] {label} | "
            f"{_minutes(elapsed)} this session, ETA {_minutes(self.eta_seconds())}"
        )

    def log(self, line: str) -> None:
        self.last_line = time.perf_counter()
        if self.bar is None:
            print(line, flush=True)
        else:
            self.bar.write(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _study_bar(enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the demo extra is optional; the per-run lines carry the ETA
        return None
    # tqdm's own rate would count the steps of resumed runs as this session's: the ETA is ours
    fmt = "{desc}: {percentage:3.0f}%|{bar}| {n}/{total} steps [{elapsed}{postfix}]"
    return tqdm(total=0, desc="study", bar_format=fmt, dynamic_ncols=True)


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


# ---------------------------------------------------------------------------------------
# Runs: trained in turns, recorded one file each, kept on --resume.


def write_atomically(path: pathlib.Path, text: str) -> None:
    """Writes ``text`` to a temporary file beside ``path``, flushed to disk, then renamed over ``path``:
    an interruption leaves either the old file or the new one, never half of one."""
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    # os.open rather than mkstemp: the file gets the permissions the umask gives any new file
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if os.name == "posix":  # the rename itself made durable
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


class Study:
    """Trains runs of the demo's model, each under its own seed, and keeps their records."""

    def __init__(
        self,
        cfg: demo.Config,
        data: tuple[torch.Tensor, torch.Tensor, int],
        device: torch.device,
        out: pathlib.Path,
        *,
        resume: bool,
        stop_after: int | None,
        keep_checkpoints: bool,
        progress: Progress,
    ) -> None:
        self.cfg, self.data, self.device, self.progress = cfg, data, device, progress
        self.resume, self.keep_checkpoints = resume, keep_checkpoints
        self.steps_left = stop_after  # None: no limit
        self.runs_dir, self.ckpt_dir = out / "runs", out / "checkpoints"
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)

    def config(self, seed: int) -> demo.Config:
        return dataclasses.replace(self.cfg, seed=seed)

    def new_run(self, phase: str, kind: str, lr: float, steps: int, seed: int) -> tuple[demo.Run, int]:
        """A run to train, and its seed. Sweep runs are judged by their final validation loss only."""
        eval_every = self.cfg.eval_every if phase == "final" else steps
        name = f"{phase}-{kind}-lr{lr:.3e}-seed{seed}-{steps}"
        return demo.Run(name=name, kind=kind, lr=lr, steps=steps, eval_every=eval_every, history={}), seed

    @property
    def stopped(self) -> bool:
        return self.steps_left is not None and self.steps_left <= 0

    def train(self, runs: list[tuple[demo.Run, int]]) -> list[demo.Run]:
        """Each run's record: kept from an earlier session under ``--resume``, else trained; the runs to
        train take turns, one step each per round. A run stopped by ``--stop-after`` is left unfinished."""
        kept = {run.name: self.recorded(run, seed) for run, seed in runs} if self.resume else {}
        for record in kept.values():
            if record is not None:
                self.progress.skip(record.steps)
                self.progress.finished(f"{record.name}: kept from an earlier session")
        pending = [(run, seed) for run, seed in runs if kept.get(run.name) is None]
        if self.stopped:
            trained = [run for run, _ in pending]
        else:
            trainings = [
                demo.Training(run, self.config(seed), self.data, self.device, self.ckpt_dir, self.resume, None, False)
                for run, seed in pending
            ]
            for t in trainings:
                self.progress.skip(t.next_step)
            trained = demo.train_round_robin(trainings, lambda _: self.after_step(trainings))
            for run, (_, seed) in zip(trained, pending):
                if run.done:
                    self.record(run, seed)
                    self.progress.finished(f"{run.name}: validation loss {run.final_val:.4f}")
        by_name = {**{r.name: r for r in trained}, **{k: r for k, r in kept.items() if r is not None}}
        return [by_name[run.name] for run, _ in runs]

    def after_step(self, group: list[demo.Training]) -> None:
        self.progress.step()
        if self.steps_left is None:
            return
        self.steps_left -= 1
        if self.steps_left <= 0:
            for t in group:
                t.stop()

    def record(self, run: demo.Run, seed: int) -> None:
        """The finished run's result file; its checkpoint is then only needed with ``--keep-checkpoints``."""
        payload = {"config": int(demo.fingerprint(self.config(seed))), "seed": seed, "run": dataclasses.asdict(run)}
        # Python's json writes and reads back inf and nan (a diverged run's losses) exactly
        write_atomically(self.runs_dir / f"{run.name}.json", json.dumps(payload))
        if not self.keep_checkpoints:
            (self.ckpt_dir / f"{run.name}.pt").unlink(missing_ok=True)

    def recorded(self, run: demo.Run, seed: int) -> demo.Run | None:
        path = self.runs_dir / f"{run.name}.json"
        if not path.exists():
            return None
        payload = json.loads(path.read_text(encoding="utf-8"))
        if payload["config"] != int(demo.fingerprint(self.config(seed))):
            raise SystemExit(f"{path} was written with other settings (model, data or budget); use another --out")
        saved = demo.Run(**payload["run"])
        if (saved.kind, saved.lr, saved.steps) != (run.kind, run.lr, run.steps):
            raise SystemExit(f"{path} holds a different run ({saved.kind}, lr {saved.lr}, {saved.steps} steps)")
        return saved


# ---------------------------------------------------------------------------------------
# The protocol.


def run_sweeps(study: Study, grids: dict[str, list[float]], steps: int) -> dict[str, list[demo.Run]]:
    """demo.sweep for every method at the first seed; a rate beyond the grid joins the plan when tried."""
    study.progress.plan(sum(map(len, grids.values())), steps)

    def run_one(kind: str, lr: float, run_steps: int) -> demo.Run:
        if lr not in grids[kind]:
            study.progress.plan(1, run_steps)
        (run,) = study.train([study.new_run("sweep", kind, lr, run_steps, study.cfg.seed)])
        return run

    return {kind: demo.sweep(kind, sorted(grid), run_one, steps) for kind, grid in grids.items()}


def run_finals(study: Study, best_lr: dict[str, float], seeds: list[int]) -> dict[str, list[demo.Run]]:
    """Every method at its best rate, seed after seed; within a seed the methods take turns."""
    finals: dict[str, list[demo.Run]] = {kind: [] for kind in best_lr}
    for seed in seeds:
        group = [study.new_run("final", kind, lr, study.cfg.steps, seed) for kind, lr in best_lr.items()]
        for kind, run in zip(best_lr, study.train(group)):
            finals[kind].append(run)
    return finals


def aligned(history: dict[str, list[float]], curve: str, steps: list[float]) -> list[float]:
    """``curve`` at each of ``steps``; a run that diverged and stopped keeps its last (infinite) value."""
    values = dict(zip(history["step"], history[curve]))
    last = history[curve][-1]
    return [values.get(s, last) for s in steps]


def mean_curves(runs: list[demo.Run]) -> dict[str, list[float]]:
    """The seeds' curves averaged at each evaluation."""
    steps = max((r.history["step"] for r in runs), key=len)
    curves = {"step": list(steps)}
    for curve in ("seconds", "train_loss", "val_loss"):
        columns = zip(*(aligned(r.history, curve, steps) for r in runs))
        curves[curve] = [statistics.fmean(column) for column in columns]
    return curves


def spread(values: list[float]) -> dict[str, float | None]:
    finite = all(math.isfinite(v) for v in values)
    return {
        "mean": _finite(statistics.fmean(values)),
        "std": statistics.stdev(values) if finite and len(values) > 1 else None,
        "min": _finite(min(values)),
        "max": _finite(max(values)),
    }


def sensitivity(runs: list[demo.Run]) -> dict[str, Any]:
    """The sweep's loss at the best rate and at the best ÷3 and ×3 (None: not swept there), and the
    increase over the best (None: not swept there, or diverged)."""
    best = min(runs, key=lambda r: r.final_val)
    result: dict[str, Any] = {"best_lr": best.lr, "best_val_loss": _finite(best.final_val)}
    for side, lr in (("over_3", best.lr / 3), ("times_3", best.lr * 3)):
        near = next((r for r in runs if math.isclose(r.lr, lr, rel_tol=1e-6)), None)
        result[f"lr_{side}"] = None if near is None else {"lr": near.lr, "val_loss": _finite(near.final_val)}
        increase = None if near is None else near.final_val - best.final_val
        result[f"increase_{side}"] = None if increase is None else _finite(increase)
    return result


def summarize(
    swept: dict[str, list[demo.Run]],
    finals: dict[str, list[demo.Run]],
    seeds: list[int],
    *,
    n_params: int,
    train_chars: int,
    cfg: demo.Config,
) -> dict[str, Any]:
    """Everything results.json reports, from the runs' records (``finals``: each method's runs, seed by seed)."""
    curves = {kind: mean_curves(runs) for kind, runs in finals.items()}
    target = curves["adamw"]["val_loss"][-1]  # AdamW's mean final validation loss
    reachable = math.isfinite(target)
    to_target = {
        name: {kind: demo.steps_to_reach(curve, target, axis) if reachable else None for kind, curve in curves.items()}
        for name, axis in (("steps", "step"), ("seconds", "seconds"))
    }
    ratios = {
        axis: {kind: _ratio(v, values["adamw"]) for kind, v in values.items()} for axis, values in to_target.items()
    }
    tokens = cfg.steps * cfg.batch * cfg.ctx
    return {
        "sweep": {
            kind: [{"lr": r.lr, "steps": r.steps, "val_loss": _finite(r.final_val)} for r in runs]
            for kind, runs in swept.items()
        },
        "sensitivity": {kind: sensitivity(runs) for kind, runs in swept.items()},
        "final": {kind: final_record(runs, seeds, curves[kind]) for kind, runs in finals.items()},
        "target_val_loss": _finite(target),
        "steps_to_target": to_target["steps"],
        "steps_ratio": ratios["steps"],
        "seconds_to_target": to_target["seconds"],
        "seconds_ratio": ratios["seconds"],
        "steps_ratio_by_seed": ratios_by_seed(finals),
        "overfitting_check": {
            "train_characters": train_chars,
            "tokens_per_final_run": tokens,
            "epochs": tokens / train_chars,
            "tokens_per_parameter": tokens / n_params,
            "by_method": {kind: overfitting(curve) for kind, curve in curves.items()},
        },
    }


def final_record(runs: list[demo.Run], seeds: list[int], curve: dict[str, list[float]]) -> dict[str, Any]:
    step_seconds = [s for r in runs for s in r.step_seconds]
    return {
        "lr": runs[0].lr,
        "steps": runs[0].steps,
        "val_loss": spread([r.final_val for r in runs]),
        "train_loss": spread([r.history["train_loss"][-1] for r in runs]),
        "diverged": sum(not math.isfinite(r.final_val) for r in runs),
        "median_step_seconds": statistics.median(step_seconds) if step_seconds else None,
        "mean_curve": {k: [_finite(v) for v in values] for k, values in curve.items()},
        "runs": [
            {
                "seed": seed,
                "val_loss": _finite(r.final_val),
                "train_loss": _finite(r.history["train_loss"][-1]),
                "seconds": r.seconds,
                "median_step_seconds": _finite(r.median_step_seconds),
                "history": {k: [_finite(v) for v in values] for k, values in r.history.items()},
            }
            for seed, r in zip(seeds, runs)
        ],
    }


def ratios_by_seed(finals: dict[str, list[demo.Run]]) -> dict[str, list[float | None]]:
    """Per seed: the steps to that seed's AdamW final validation loss, over AdamW's own."""
    result: dict[str, list[float | None]] = {kind: [] for kind in finals}
    for i, adamw in enumerate(finals["adamw"]):
        target = adamw.final_val
        adamw_steps = demo.steps_to_reach(adamw.history, target) if math.isfinite(target) else None
        for kind, runs in finals.items():
            steps = demo.steps_to_reach(runs[i].history, target) if math.isfinite(target) else None
            result[kind].append(_ratio(steps, adamw_steps))
    return result


def overfitting(curve: dict[str, list[float]]) -> dict[str, float | None]:
    """Where the mean validation curve is lowest, how far above that it ends, and its gap to training."""
    val = curve["val_loss"]
    lowest = min(range(len(val)), key=lambda i: val[i])
    return {
        "val_minus_train": _finite(val[-1] - curve["train_loss"][-1]),
        "lowest_val_step": curve["step"][lowest],
        "val_above_lowest": _finite(val[-1] - val[lowest]),
    }


def _ratio(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def _finite(value: float) -> float | None:
    """JSON has no infinity: a diverged run's loss is written as null."""
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------------------------------
# The duration, projected from a short timed run.


def estimate(
    cfg: demo.Config,
    data: tuple[torch.Tensor, torch.Tensor, int],
    device: torch.device,
    grids: dict[str, list[float]],
    seeds: int,
    probe_steps: int,
) -> dict[str, Any]:
    """Times ``probe_steps`` steps of each method (interleaved, as the study runs them) and one
    evaluation, and projects the study: its fewest steps (no sweep extended) and its most (every
    sweep extended twice)."""
    with tempfile.TemporaryDirectory() as tmp:
        trainings = []
        for kind, grid in grids.items():
            lr = sorted(grid)[len(grid) // 2]
            name, steps = f"probe-{kind}", probe_steps
            run = demo.Run(name=name, kind=kind, lr=lr, steps=steps, eval_every=steps, history={})
            trainings.append(demo.Training(run, cfg, data, device, pathlib.Path(tmp), False, None, False))
        eval_seconds = []
        for t in trainings:
            tick = time.perf_counter()
            t.evaluate(t.params)
            eval_seconds.append(time.perf_counter() - tick)
        runs = demo.train_round_robin(trainings)
    step_seconds = {r.kind: r.median_step_seconds for r in runs}
    evaluation = statistics.median(eval_seconds)
    finals_steps = seeds * cfg.steps
    finals_evals = seeds * (math.ceil(cfg.steps / cfg.eval_every) + 1)
    projection = {}
    for extensions in (0, 2):
        seconds = 0.0
        for kind, grid in grids.items():
            sweep_runs = len(grid) + extensions
            steps = sweep_runs * cfg.sweep_steps + finals_steps
            seconds += steps * step_seconds[kind] + (2 * sweep_runs + finals_evals) * evaluation
        projection["fewest" if extensions == 0 else "most"] = seconds
    return {
        "probe_steps": probe_steps,
        "median_step_seconds": step_seconds,
        "evaluation_seconds": evaluation,
        "projected_seconds": projection,
        "device": str(device),
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------
# The command line.


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/study", help="output folder")
    parser.add_argument("--steps", type=int, default=1000, help="training steps of the final runs")
    parser.add_argument("--sweep-steps", type=int, help="steps of each sweep run (default: steps // 4)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the final runs: --seed, --seed + 1, ...")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="adamw is required")
    for kind, grid in GRIDS.items():
        parser.add_argument(f"--{kind}-lrs", type=float, nargs="+", default=grid, help=f"{kind}'s lr grid")
    demo.add_setup_arguments(parser)
    # One thread unless told: while another process keeps a core busy, a second thread made each step
    # 7-11x slower on a 2-core machine (docs/study.md); on an idle machine try --threads 2 with --estimate.
    parser.set_defaults(eval_every=50, eval_batches=16, threads=1)
    parser.add_argument("--resume", action="store_true", help="keep finished runs and continue the others")
    parser.add_argument("--stop-after", type=int, help="stop the study after this many training steps (then --resume)")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep the finished runs' checkpoints")
    parser.add_argument("--estimate", action="store_true", help="time a short run and project the study's duration")
    parser.add_argument("--probe-steps", type=int, default=20, help="steps per method that --estimate times")
    parser.add_argument("--toy", action="store_true", help="a tiny model and budget for a smoke test")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.toy:
        args.steps, args.width, args.depth, args.ctx, args.batch = 9, 32, 1, 16, 8
        args.eval_every, args.eval_batches, args.max_chars, args.seeds = 3, 2, 200_000, 2
        args.sweep_steps = 3
        for kind, grid in GRIDS.items():  # such a short run wants larger rates: start the grids 9x higher
            setattr(args, f"{kind}_lrs", [9 * lr for lr in grid])
    positive = {"--steps": args.steps, "--seeds": args.seeds, "--eval-every": args.eval_every}
    positive |= {"--sweep-steps": args.sweep_steps, "--stop-after": args.stop_after, "--probe-steps": args.probe_steps}
    for option, value in positive.items():
        if value is not None and value < 1:
            parser.error(f"{option} must be at least 1, got {value}")
    if "adamw" not in args.methods or len(set(args.methods)) != len(args.methods):
        parser.error(f"--methods must name each method once and include adamw (the target), got {args.methods}")
    for kind in args.methods:
        grid = getattr(args, f"{kind}_lrs")
        if min(grid) <= 0 or len(set(grid)) != len(grid):
            parser.error(f"--{kind}-lrs must be distinct positive rates, got {grid}")
    if args.sweep_steps is None:  # a quarter, not the demo's third: the hour has room for 4 methods x 3 seeds
        args.sweep_steps = max(1, args.steps // 4)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    cfg, device, data, n_params, ns_rule = demo.set_up(args)
    grids = {kind: getattr(args, f"{kind}_lrs") for kind in args.methods}
    seeds = [cfg.seed + i for i in range(args.seeds)]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.estimate:
        projected = estimate(cfg, data, device, grids, args.seeds, args.probe_steps)
        print_estimate(projected)
        write_atomically(out / "estimate.json", json.dumps(projected, indent=2))
        return projected

    progress = Progress(enabled=not args.no_progress)
    study = Study(
        cfg,
        data,
        device,
        out,
        resume=args.resume,
        stop_after=args.stop_after,
        keep_checkpoints=args.keep_checkpoints,
        progress=progress,
    )
    progress.plan(len(grids) * len(seeds), cfg.steps)
    swept = run_sweeps(study, grids, cfg.sweep_steps)
    finished = all(r.done for runs in swept.values() for r in runs)
    if finished:
        best_lr = {kind: min(runs, key=lambda r: r.final_val).lr for kind, runs in swept.items()}
        finals = run_finals(study, best_lr, seeds)
        finished = all(r.done for runs in finals.values() for r in runs)
    progress.close()
    if not finished:
        print(f"stopped after {args.stop_after} steps; continue with --resume")
        return {}

    results = {
        "config": dataclasses.asdict(cfg),
        "methods": list(grids),
        "seeds": seeds,
        "grids": grids,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        # on a CPU, Muon's Newton–Schulz runs in bf16 where bf16 matmuls measured faster (unless pinned)
        "ns_rule": ns_rule,
        "parameters": n_params,
        "timing": "final runs of a seed interleaved round-robin; seconds: each run's own steps, evaluations excluded",
        **summarize(swept, finals, seeds, n_params=n_params, train_chars=len(data[0]), cfg=cfg),
    }
    write_atomically(out / "results.json", json.dumps(results, indent=2))
    print_table(results)
    plot_curves(results, out / "loss_curves.png")
    plot_sensitivity(results, out / "lr_sensitivity.png")
    print(f"wrote {out / 'results.json'}, the plots loss_curves.png and lr_sensitivity.png, and runs/ in {out}")
    return results


# ---------------------------------------------------------------------------------------
# The report.


def print_estimate(projected: dict[str, Any]) -> None:
    cells = ", ".join(f"{kind} {s * 1e3:.1f} ms" for kind, s in projected["median_step_seconds"].items())
    low, high = projected["projected_seconds"]["fewest"], projected["projected_seconds"]["most"]
    print(f"median step ({projected['probe_steps']} steps each, {projected['threads']} threads): {cells}")
    print(f"one evaluation: {projected['evaluation_seconds'] * 1e3:.1f} ms")
    print(f"the study: {low / 60:.0f} to {high / 60:.0f} minutes (no sweep extended / every sweep extended twice)")


def _cell(value: float | None, fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def print_table(results: dict[str, Any]) -> None:
    for kind, runs in results["sweep"].items():
        cells = ", ".join(f"{r['lr']:.2e}: {_cell(r['val_loss'], '.4f', 'diverged')}" for r in runs)
        print(f"sweep {kind:8s} ({runs[0]['steps']} steps, val loss by lr)  {cells}")
    n = len(results["seeds"])
    print(
        f"\n{'method':8s} {'lr':>8s} {f'val loss, mean ± sd ({n} seeds)':>28s} {'steps to target':>16s} "
        f"{'time to target':>15s} {'ms/step':>8s} {'lr÷3':>7s} {'lr×3':>7s}"
    )
    for kind, final in results["final"].items():
        val = final["val_loss"]
        loss = f"{_cell(val['mean'], '.4f', 'diverged')} ± {_cell(val['std'], '.4f')}"
        steps = results["steps_to_target"][kind]
        reach = "never" if steps is None else f"{steps:.0f} ({results['steps_ratio'][kind]:.2f}x)"
        seconds = results["seconds_to_target"][kind]
        time_cell = "never" if seconds is None else f"{results['seconds_ratio'][kind]:.2f}x"
        median = final["median_step_seconds"]
        per_step = "-" if median is None else f"{median * 1e3:8.1f}"
        sens = results["sensitivity"][kind]
        print(
            f"{kind:8s} {final['lr']:8.2e} {loss:>28s} {reach:>16s} {time_cell:>15s} "
            f"{per_step:>8s} {_cell(sens['increase_over_3'], '+7.3f')} "
            f"{_cell(sens['increase_times_3'], '+7.3f')}"
        )
    check = results["overfitting_check"]
    print(
        f"(target: AdamW's mean final validation loss {_cell(results['target_val_loss'], '.4f')}; "
        f"lr÷3, lr×3: the sweep's loss there minus at the best lr)\n"
        f"data: {check['epochs']:.2f} epochs of {check['train_characters']:,} training characters, "
        f"{check['tokens_per_parameter']:.1f} tokens per parameter"
    )
    for kind, c in check["by_method"].items():
        print(
            f"  {kind:8s} val - train {_cell(c['val_minus_train'], '+.3f')}, lowest val at step "
            f"{c['lowest_val_step']:.0f}, final val {_cell(c['val_above_lowest'], '.3f')} above it"
        )


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the demo extra is optional
        print("matplotlib is not installed: no plots (pip install -e '.[demo]')")
        return None
    return plt


def plot_curves(results: dict[str, Any], path: pathlib.Path) -> None:
    """The mean validation curve of each method, with a band from the lowest to the highest seed."""
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lows = []
    for kind, final in results["final"].items():
        curves = [r["history"] for r in final["runs"]]
        steps = final["mean_curve"]["step"]
        points = [
            (s, v, [c["val_loss"][i] for c in curves if i < len(c["val_loss"])])
            for i, (s, v) in enumerate(zip(steps, final["mean_curve"]["val_loss"]))
        ]
        points = [(s, v, seeds) for s, v, seeds in points if v is not None and None not in seeds]
        if not points:
            continue
        x, mean, seeds = zip(*points)
        label = f"{kind} (lr {final['lr']:.1e})"
        ax.plot(x, mean, color=COLORS[kind], label=label)
        ax.fill_between(x, [min(s) for s in seeds], [max(s) for s in seeds], color=COLORS[kind], alpha=0.2)
        lows.append(min(mean))
    if results["target_val_loss"] is not None:
        ax.axhline(results["target_val_loss"], color="gray", linestyle=":", label="AdamW final (mean)")
    if lows:  # from the lowest loss to a little above it: the first evaluations would flatten the rest
        ax.set_ylim(min(lows) - 0.05, min(lows) + 1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("validation cross-entropy (nats / character)")
    ax.set_title(f"validation loss, mean and range over {len(results['seeds'])} seeds")
    demo.save_figure(fig, ax, path)


def plot_sensitivity(results: dict[str, Any], path: pathlib.Path) -> None:
    """The sweep's final validation loss against the learning rate; diverged runs at the top, as x."""
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    finite = [r["val_loss"] for runs in results["sweep"].values() for r in runs if r["val_loss"] is not None]
    ceiling = max(finite, default=1.0) + 0.1
    for kind, runs in results["sweep"].items():
        lrs = [r["lr"] for r in runs]
        losses = [ceiling if r["val_loss"] is None else r["val_loss"] for r in runs]
        ax.plot(lrs, losses, "o-", color=COLORS[kind], label=kind)
        diverged = [(r["lr"], ceiling) for r in runs if r["val_loss"] is None]
        if diverged:
            ax.plot(*zip(*diverged), "x", color=COLORS[kind], markersize=10)
        best = results["sensitivity"][kind]
        if best["best_val_loss"] is not None:
            ax.plot(best["best_lr"], best["best_val_loss"], "*", color=COLORS[kind], markersize=14)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("validation cross-entropy after the sweep")
    steps = next(iter(results["sweep"].values()))[0]["steps"]
    ax.set_title(f"learning-rate sweep ({steps} steps, seed {results['seeds'][0]}); * best, x diverged")
    demo.save_figure(fig, ax, path, grid="both")


if __name__ == "__main__":
    main()
