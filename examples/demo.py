"""Muon against a tuned AdamW on a small character-level GPT.

Both optimizers train the same model from the same initialisation on the same batches for
the same number of steps. The corpus needs no download: the Python standard library's own
source files (``--data PATH`` for any text file). Protocol:

1. Learning-rate sweep, for each optimizer, at a third of the budget: a grid of three
   rates a factor ~3 apart, extended past whichever edge wins (at most twice), so that
   neither optimizer is judged at a learning rate that is merely the edge of its grid.
2. Each optimizer's best rate is trained for the full budget, the two runs' steps interleaved
   round-robin (one AdamW step, one Muon step, ...) so that a busy neighbour slows both alike;
   each step's own time is recorded, and the table reports the median per optimizer.
3. Muon's validation curve is compared against AdamW's final validation loss: the first
   step at which Muon gets there (linear interpolation between evaluations), and the time that
   takes: those steps times the run's median step, both medians taken from the interleaved
   steps, so that a load that changes during the runs weighs on both alike. The wall time to the
   target (each run's own steps summed up to there) is the second figure.

Outputs under ``--out`` (default ``runs/demo``): ``results.json``, ``loss_curves.png`` and one
checkpoint per run in ``checkpoints/`` (parameters and the optimizer state TensorDict).
``--resume`` continues interrupted runs from their checkpoints and skips finished ones.

    python examples/demo.py              # the full protocol, a few minutes on 2 CPU cores
    python examples/demo.py --quick      # a seconds-long smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import statistics
import sysconfig
import time
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn
from torch.nn import functional as F

import muonfn

# ---------------------------------------------------------------------------------------
# Data: characters of a text corpus, split by file into train and validation.


def stdlib_sources() -> list[pathlib.Path]:
    """The top-level ``*.py`` files of the running interpreter's standard library."""
    return sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def load_corpus(data: str | None, max_chars: int) -> tuple[str, str]:
    """(train text, validation text): every 10th file (or 10th chunk of a single file) is validation."""
    if data is None:
        pieces = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_sources()]
    else:
        text = pathlib.Path(data).read_text(encoding="utf-8", errors="replace")
        chunk = max(1, len(text) // 100)
        pieces = [text[i : i + chunk] for i in range(0, len(text), chunk)]
    if len(pieces) < 10:
        raise SystemExit(f"corpus too small: {sum(map(len, pieces))} characters")
    train = "".join(p for i, p in enumerate(pieces) if i % 10 != 9)
    val = "".join(p for i, p in enumerate(pieces) if i % 10 == 9)
    return train[:max_chars], val[: max_chars // 9]


def encode(train: str, val: str) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Integer ids over the characters of both splits, and the vocabulary."""
    codes = torch.frombuffer(bytearray((train + val).encode("utf-32-le")), dtype=torch.int32)
    vocab, ids = torch.unique(codes, return_inverse=True)
    chars = [chr(int(c)) for c in vocab]
    return ids[: len(train)], ids[len(train) :], chars


def batch(data: torch.Tensor, ctx: int, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, len(data) - ctx - 1, (size,), generator=generator)
    rows = start[:, None] + torch.arange(ctx + 1)
    window = data[rows]
    return window[:, :-1], window[:, 1:]


# ---------------------------------------------------------------------------------------
# Model: a pre-norm GPT.


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, width, bias=False)
        self.v = nn.Linear(width, width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width, bias=False)
        self.fc_out = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, self.heads, c // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos_embed = nn.Embedding(ctx, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos_embed(torch.arange(idx.shape[1], device=idx.device))
        return self.lm_head(self.ln_f(self.blocks(x)))


# ---------------------------------------------------------------------------------------
# Optimizers.


def schedule(lr: float, steps: int, warmup: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Linear warm-up over ``warmup`` steps, then cosine decay to lr/10 at ``steps``."""

    def at(count: torch.Tensor) -> torch.Tensor:
        t = count.to(torch.float32)
        warm = ((t + 1) / warmup).clamp(max=1.0)
        progress = ((t - warmup) / max(1, steps - warmup)).clamp(0.0, 1.0)
        return lr * warm * (0.1 + 0.45 * (1 + torch.cos(math.pi * progress)))

    return at


#: The Muon family: linear weights get the variant's update, embeddings, head and norms AdamW's;
#: one lr serves both (the match_rms_adamw scale gives every update AdamW's RMS).
MUON_FAMILY: dict[str, Callable[..., muonfn.Transform]] = {
    "muon": muonfn.muon,
    "normuon": muonfn.normuon,
    "adamuon": muonfn.adamuon,
}


def make_optimizer(
    kind: str, lr: float, steps: int, warmup: int, model: nn.Module, state_dtype: torch.dtype | None = None
) -> muonfn.Transform:
    """``state_dtype``: the dtype of the momentum and of AdamW's moments (None: the parameters')."""
    lr_at = schedule(lr, steps, warmup)
    if kind in MUON_FAMILY:
        labels = muonfn.labels_from_module(model)
        return MUON_FAMILY[kind](lr=lr_at, weight_decay=0.1, labels=labels, state_dtype=state_dtype)
    if kind != "adamw":
        raise ValueError(f"unknown optimizer {kind!r}: expected 'adamw' or one of {sorted(MUON_FAMILY)}")
    # muonfn.adamw computes exactly torch.optim.AdamW's update.
    return muonfn.adamw(lr=lr_at, betas=(0.9, 0.95), weight_decay=0.1, state_dtype=state_dtype)


# ---------------------------------------------------------------------------------------
# Training one run, checkpointed and resumable.


@dataclasses.dataclass
class Config:
    steps: int
    sweep_steps: int
    ctx: int
    width: int
    depth: int
    heads: int
    batch: int
    eval_every: int
    eval_batches: int
    warmup: int
    seed: int
    data: str | None
    max_chars: int


@dataclasses.dataclass
class Run:
    name: str
    kind: str
    lr: float
    steps: int
    eval_every: int
    history: dict[str, list[float]]  # step, seconds, train_loss (smoothed), val_loss at evaluations
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    smooth_loss: float = 0.0
    done: bool = False
    step_seconds: list[float] = dataclasses.field(default_factory=list)  # every step's own time
    state_dtype: str | None = None  # the optimizer state's dtype by name ("bfloat16"); None: the parameters'

    @property
    def median_step_seconds(self) -> float:
        return statistics.median(self.step_seconds) if self.step_seconds else math.nan

    @property
    def final_val(self) -> float:
        return self.history["val_loss"][-1]


def fingerprint(cfg: Config) -> torch.Tensor:
    """A number that changes with any setting of the run, so a checkpoint is never resumed under others."""
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode()).digest()
    return torch.tensor(int.from_bytes(digest[:7], "little"))


def save_checkpoint(
    path: pathlib.Path, params: TensorDict, state: TensorDict, step: int, run: Run, cfg: Config
) -> None:
    """One file holding the parameters, the optimizer state and the run's record, written atomically."""
    f64 = functools.partial(torch.tensor, dtype=torch.float64)
    record = {
        "config": fingerprint(cfg),
        "step": torch.tensor(step),
        "history": {k: f64(v) for k, v in run.history.items()},
        "run": {
            "lr": f64(run.lr),
            "steps": torch.tensor(run.steps),
            "eval_every": torch.tensor(run.eval_every),
            "seconds": f64(run.seconds),
            "tokens_per_second": f64(run.tokens_per_second),
            "smooth_loss": f64(run.smooth_loss),
            "done": torch.tensor(run.done),
            "step_seconds": f64(run.step_seconds),
        },
    }
    muonfn.save({"params": params, "state": state, **record}, path)


def load_checkpoint(path: pathlib.Path, run: Run, cfg: Config) -> tuple[TensorDict, TensorDict, int, Run]:
    """The parameters, optimizer state and step saved at ``path``, and ``run`` as it was then."""
    ckpt = muonfn.load(path)
    if not torch.equal(ckpt["config"], fingerprint(cfg)):
        raise SystemExit(f"{path} was written with other settings (model, data or budget); use another --out")
    saved = ckpt["run"]
    if (saved["lr"].item(), saved["steps"].item()) != (run.lr, run.steps):
        raise SystemExit(f"{path} holds a different run (lr {saved['lr'].item()}, {saved['steps'].item()} steps)")
    step_seconds = saved.get("step_seconds", None)  # absent from checkpoints of older versions of the demo
    restored = dataclasses.replace(
        run,
        eval_every=int(saved["eval_every"]),
        history={k: v.tolist() for k, v in ckpt["history"].items()},
        seconds=saved["seconds"].item(),
        tokens_per_second=saved["tokens_per_second"].item(),
        smooth_loss=saved["smooth_loss"].item(),
        done=bool(saved["done"]),
        step_seconds=[] if step_seconds is None else step_seconds.tolist(),
    )
    return ckpt["params"], ckpt["state"], int(ckpt["step"]), restored


class Training:
    """One run, trained a step at a time (``step()`` until ``finished``, then ``close()``), so
    that two runs can take turns. Resumes from the run's checkpoint when ``resume``."""

    def __init__(
        self,
        run: Run,
        cfg: Config,
        data: tuple[torch.Tensor, torch.Tensor, int],
        device: torch.device,
        ckpt_dir: pathlib.Path,
        resume: bool,
        stop_after: int | None,
        progress: bool,
        bar_position: int = 0,
    ) -> None:
        train_ids, val_ids, vocab = data
        self.run, self.cfg, self.device, self.train_ids = run, cfg, device, train_ids
        self.path = ckpt_dir / f"{run.name}.pt"
        torch.manual_seed(cfg.seed)
        self.model = GPT(vocab, cfg.ctx, cfg.width, cfg.depth, cfg.heads).to(device)
        state_dtype = None if run.state_dtype is None else getattr(torch, run.state_dtype)
        self.tx = make_optimizer(run.kind, run.lr, run.steps, cfg.warmup, self.model, state_dtype)
        self.params = TensorDict.from_module(self.model).detach().clone()
        self.state = self.tx.init(self.params)
        start = 0
        self.already_done = False
        if resume and self.path.exists():
            saved_params, saved_state, start, self.run = load_checkpoint(self.path, run, cfg)
            self.params, self.state = saved_params.to(device), saved_state.to(device)
            self.already_done = self.run.done
        val_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.val_batches = [batch(val_ids, cfg.ctx, cfg.batch, val_gen) for _ in range(cfg.eval_batches)]
        self.grad_fn = torch.func.grad_and_value(self.loss_fn)
        self.tokens = cfg.batch * cfg.ctx
        self.next_step = start
        self.end = self.run.steps if stop_after is None else min(self.run.steps, stop_after)
        if self.already_done:
            self.end = start
            return
        if start == 0:
            with torch.no_grad():
                self.run.smooth_loss = self.loss_fn(self.params, *self.train_batch(0)).item()
            loss, val = self.run.smooth_loss, self.evaluate(self.params)
            self.run.history = {"step": [0], "seconds": [0.0], "train_loss": [loss], "val_loss": [val]}
        self.bar = _progress(self.run.steps, start, f"{self.run.name:>14}", progress, bar_position)

    def loss_fn(self, p: TensorDict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with p.to_module(self.model):
            return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(self, p: TensorDict) -> float:
        batches = self.val_batches
        return sum(self.loss_fn(p, x.to(self.device), y.to(self.device)).item() for x, y in batches) / len(batches)

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Depends only on (seed, step): every run sees the same batches, resumed or not.
        cfg = self.cfg
        x, y = batch(self.train_ids, cfg.ctx, cfg.batch, torch.Generator().manual_seed(cfg.seed * 1_000_003 + step))
        return x.to(self.device), y.to(self.device)

    @property
    def finished(self) -> bool:
        return self.next_step >= self.end

    def stop(self) -> None:
        """Ends the run at the current step; ``close()`` checkpoints it there, unfinished, for ``--resume``."""
        self.end = self.next_step

    def step(self) -> None:
        run, step = self.run, self.next_step
        tick = time.perf_counter()
        grads, loss = self.grad_fn(self.params, *self.train_batch(step))
        updates, self.state = self.tx.update(grads, self.state, self.params)
        self.params = muonfn.apply_updates(self.params, updates)
        loss_value = loss.item()
        seconds = time.perf_counter() - tick
        run.seconds += seconds
        run.step_seconds.append(seconds)
        run.smooth_loss = 0.9 * run.smooth_loss + 0.1 * loss_value
        done_steps = self.next_step = step + 1
        run.tokens_per_second = done_steps * self.tokens / run.seconds
        if not math.isfinite(loss_value):  # diverged: a sweep point that lost, not an error
            print(f"{run.name}: loss is {loss_value} at step {done_steps}; stopping this run")
            for curve, value in (("step", done_steps), ("seconds", run.seconds), ("train_loss", math.inf)):
                run.history[curve].append(value)
            run.history["val_loss"].append(math.inf)
            self.next_step = self.end = run.steps
            return
        if done_steps % run.eval_every == 0 or done_steps == run.steps:
            run.history["step"].append(done_steps)
            run.history["seconds"].append(run.seconds)
            run.history["train_loss"].append(run.smooth_loss)
            run.history["val_loss"].append(self.evaluate(self.params))
            save_checkpoint(self.path, self.params, self.state, done_steps, run, self.cfg)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{run.smooth_loss:.3f}", tok_s=f"{run.tokens_per_second:,.0f}")

    def close(self) -> Run:
        """Saves the final checkpoint and returns the run's record."""
        if self.already_done:
            return self.run
        self.bar.close()
        self.run.done = self.end == self.run.steps
        save_checkpoint(self.path, self.params, self.state, self.end, self.run, self.cfg)
        return self.run


def train_round_robin(trainings: list[Training], after_step: Callable[[Training], None] | None = None) -> list[Run]:
    """Steps every unfinished run once per round until all are finished: a slow patch of the
    machine falls on all of them alike, not on whichever happened to run then. ``after_step``
    sees each run after each of its steps (progress, or ``stop()`` to interrupt)."""
    while not all(t.finished for t in trainings):
        for t in trainings:
            if not t.finished:
                t.step()
                if after_step is not None:
                    after_step(t)
    return [t.close() for t in trainings]


class _NoBar:
    """What a progress bar is asked to do, doing nothing: no bar wanted, or tqdm missing."""

    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **values: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, initial: int, desc: str, enabled: bool, position: int) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # the demo extra is optional; train without a bar
        return _NoBar()
    return tqdm(total=total, initial=initial, desc=desc, leave=True, dynamic_ncols=True, position=position)


# ---------------------------------------------------------------------------------------
# The protocol.


def steps_to_reach(history: dict[str, list[float]], target: float, axis: str = "step") -> float | None:
    """First step (or second, ``axis="seconds"``) at which the validation curve reaches ``target``,
    interpolated linearly between evaluations."""
    steps, losses = history[axis], history["val_loss"]
    for i in range(1, len(steps)):
        if losses[i] <= target:
            s0, s1, l0, l1 = steps[i - 1], steps[i], losses[i - 1], losses[i]
            return s1 if l0 == l1 else s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return None


def to_target(runs: dict[str, Run], target: float) -> dict[str, Any]:
    """Steps and time for the ``adamw`` and ``muon`` runs to reach ``target``, AdamW's final
    validation loss (by its last step at the latest), and Muon's ratios to AdamW's.

    ``seconds_to_target``: the steps to the target times the run's median step. The two runs'
    steps are interleaved, so each median is measured under the load both saw, where the sum of a
    run's steps up to the target also counts whichever load happened to fall on them (on a busy
    machine 0.84× against 0.39× from the medians: 66 × 98.0 ms against 200 × 82.8 ms); that sum is
    the second figure, ``wall_seconds_to_target``. ``None`` where a run never gets there."""
    reachable = math.isfinite(target)
    steps: dict[str, float | None] = {}
    seconds: dict[str, float | None] = {}
    wall: dict[str, float | None] = {}
    for kind, run in runs.items():
        reach = steps_to_reach(run.history, target) if reachable else None
        reach_wall = steps_to_reach(run.history, target, "seconds") if reachable else None
        if kind == "adamw" and reachable:  # the target is its own final loss
            reach, reach_wall = reach or float(run.steps), reach_wall or run.seconds
        median = run.median_step_seconds
        steps[kind] = reach
        seconds[kind] = None if reach is None or not math.isfinite(median) else reach * median
        wall[kind] = reach_wall

    def ratio(table: dict[str, float | None]) -> float | None:
        muon, adamw = table["muon"], table["adamw"]
        return None if muon is None or adamw is None else muon / adamw

    return {
        "steps_to_target": steps,
        "steps_ratio": ratio(steps),
        "seconds_to_target": seconds,
        "seconds_ratio": ratio(seconds),
        "wall_seconds_to_target": wall,
        "wall_seconds_ratio": ratio(wall),
    }


def sweep(kind: str, grid: list[float], run_one: Callable[[str, float, int], Run], steps: int) -> list[Run]:
    """Trains ``grid``; while the best rate is at an edge, extends that edge by ×3 (at most twice)."""
    runs = {lr: run_one(kind, lr, steps) for lr in grid}
    for _ in range(2):
        if not all(r.done for r in runs.values()):  # stopped early (--stop-after): decide after --resume
            break
        best = min(runs, key=lambda lr: runs[lr].final_val)
        ordered = sorted(runs)
        if best == ordered[0]:
            new = best / 3
        elif best == ordered[-1]:
            new = best * 3
        else:
            break
        runs[new] = run_one(kind, new, steps)
    return [runs[lr] for lr in sorted(runs)]


def add_setup_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the model, the data, the evaluation, the seed and the device (shared with study.py)."""
    parser.add_argument("--data", help="a text file to train on (default: the standard library's source)")
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-chars", type=int, default=5_000_000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's; 1 is faster on a busy machine)")


def config_from(args: argparse.Namespace) -> Config:
    """The Config of parsed options: ``add_setup_arguments``'s, ``--steps`` and ``--sweep-steps``."""
    return Config(
        steps=args.steps,
        sweep_steps=args.sweep_steps or max(1, args.steps // 3),
        ctx=args.ctx,
        width=args.width,
        depth=args.depth,
        heads=args.heads,
        batch=args.batch,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        warmup=max(1, args.steps // 30),
        seed=args.seed,
        data=args.data,
        max_chars=args.max_chars,
    )


def ns_rule_of(device: torch.device) -> dict[str, Any]:
    """Which precision Muon's Newton–Schulz takes here by default, and why: on a CPU,
    ``MUONFN_CPU_NS_DTYPE`` when it pins the rule, else the probe that measures whether bf16
    matmuls run faster than fp32 ones (muonfn takes it once per process)."""
    if device.type != "cpu":
        return {"device": device.type, "ns_dtype": str(muonfn.linalg.default_ns_dtype(device, torch.float32))}
    variable = os.environ.get("MUONFN_CPU_NS_DTYPE", "auto")
    if variable != "auto":
        return {"device": "cpu", "variable": variable, "ns_dtype": variable}
    probe = muonfn.linalg.cpu_bf16_probe()
    dtype = "bfloat16" if probe.bf16_faster else "float32"
    return {"device": "cpu", "variable": variable, "ns_dtype": dtype, "probe": probe.as_dict()}


def describe_ns_rule(rule: dict[str, Any]) -> str:
    if "probe" in rule:
        probe = rule["probe"]
        why = (
            f"bf16 products measured at {probe['speedup']:.2f}x fp32's speed "
            f"(bf16 from {probe['min_speedup']}x; MUONFN_CPU_NS_DTYPE=float32 or bfloat16 pins it)"
        )
        if probe["bf16_faster"]:
            return f"Newton-Schulz: bf16 for matrices of m^2*n >= 2^18, fp32 below; {why}"
        return f"Newton-Schulz: fp32; {why}"
    if "variable" in rule:
        return f"Newton-Schulz: {rule['ns_dtype']}, pinned by MUONFN_CPU_NS_DTYPE"
    return f"Newton-Schulz: {rule['ns_dtype'].removeprefix('torch.')} on {rule['device']}"


def set_up(args: argparse.Namespace) -> tuple[Config, torch.device, Any, int, dict[str, Any]]:
    """What every run of the demo and the studies starts from: the thread count (``--threads``), the
    configuration, the device, the data and the model's parameter count, and the Newton–Schulz
    dtype rule, printed."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = config_from(args)
    device = torch.device(args.device)
    data, n_params = prepare_data(cfg, device)
    ns_rule = ns_rule_of(device)
    print(describe_ns_rule(ns_rule))
    return cfg, device, data, n_params, ns_rule


def prepare_data(cfg: Config, device: torch.device) -> tuple[tuple[torch.Tensor, torch.Tensor, int], int]:
    """((train ids, validation ids, vocabulary size), the model's parameter count), announced in one line."""
    train_text, val_text = load_corpus(cfg.data, cfg.max_chars)
    train_ids, val_ids, vocab = encode(train_text, val_text)
    n_params = sum(p.numel() for p in GPT(len(vocab), cfg.ctx, cfg.width, cfg.depth, cfg.heads).parameters())
    print(
        f"corpus: {len(train_ids):,} train / {len(val_ids):,} val characters, vocabulary {len(vocab)}; "
        f"model: {n_params:,} parameters; device: {device}; threads: {torch.get_num_threads()}"
    )
    return (train_ids, val_ids, len(vocab)), n_params


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo", help="output folder")
    parser.add_argument("--steps", type=int, default=200, help="training steps of the final runs")
    parser.add_argument("--sweep-steps", type=int, help="steps of each sweep run (default: steps // 3)")
    # The first rate of each grid is the one the sweep picks for the default model and data.
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=[1e-2, 3e-3, 1e-3])
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=[3e-2, 1e-2, 3e-3])
    parser.add_argument("--no-sweep", action="store_true", help="train the first rate of each grid only")
    add_setup_arguments(parser)
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out")
    parser.add_argument("--stop-after", type=int, help="stop every run after this many steps (resume later)")
    parser.add_argument("--quick", action="store_true", help="a tiny budget for a smoke test")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.width, args.depth, args.ctx, args.batch = 12, 32, 1, 16, 8
        args.eval_every, args.eval_batches, args.max_chars = 4, 2, 200_000
        args.adamw_lrs, args.muon_lrs = args.adamw_lrs[:1], args.muon_lrs[:1]
        args.no_sweep = True
    cfg, device, data, n_params, ns_rule = set_up(args)
    out = pathlib.Path(args.out)
    ckpt_dir = out / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    def training(kind: str, lr: float, steps: int, bar_position: int = 0) -> Training:
        name = f"{kind}-lr{lr:.0e}-{steps}"
        # Sweep runs are judged by their final validation loss only.
        eval_every = cfg.eval_every if steps == cfg.steps else steps
        run = Run(name=name, kind=kind, lr=lr, steps=steps, eval_every=eval_every, history={})
        progress = not args.no_progress
        return Training(run, cfg, data, device, ckpt_dir, args.resume, args.stop_after, progress, bar_position)

    def run_one(kind: str, lr: float, steps: int) -> Run:
        (run,) = train_round_robin([training(kind, lr, steps)])
        return run

    grids = {"adamw": args.adamw_lrs, "muon": args.muon_lrs}
    swept: dict[str, list[Run]] = {}
    best_lr: dict[str, float] = {}
    for kind, grid in grids.items():
        if args.no_sweep:
            best_lr[kind] = grid[0]
            continue
        swept[kind] = sweep(kind, sorted(grid), run_one, cfg.sweep_steps)
        if not all(r.done for r in swept[kind]):
            print(f"stopped after {args.stop_after} steps; continue with --resume")
            return {}
        best_lr[kind] = min(swept[kind], key=lambda r: r.final_val).lr
    # The timed comparison: both final runs in turns, one step each per round.
    finals = [training(kind, best_lr[kind], cfg.steps, bar_position=i) for i, kind in enumerate(grids)]
    final = dict(zip(grids, train_round_robin(finals)))
    if not all(r.done for r in final.values()):
        print(f"stopped after {args.stop_after} steps; continue with --resume")
        return {}

    adamw = final["adamw"]
    target = adamw.final_val
    if not math.isfinite(target):
        print(f"AdamW diverged at lr {adamw.lr:.0e}: no target to compare with; use smaller --adamw-lrs")
    results = {
        "config": dataclasses.asdict(cfg),
        "timing": (
            "final runs interleaved round-robin, one step each per round; seconds_to_target: steps to the target "
            "times the run's median step; wall_seconds_to_target: the run's own steps summed up to the target"
        ),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "ns_rule": ns_rule,
        "parameters": n_params,
        "sweep": {
            kind: [{"lr": r.lr, "steps": r.steps, "val_loss": _finite(r.final_val)} for r in runs]
            for kind, runs in swept.items()
        },
        "final": {
            kind: {
                "lr": r.lr,
                "steps": r.steps,
                "train_loss": _finite(r.history["train_loss"][-1]),
                "val_loss": _finite(r.final_val),
                "seconds": r.seconds,
                "tokens_per_second": r.tokens_per_second,
                "median_step_seconds": _finite(r.median_step_seconds),
                "step_seconds": r.step_seconds,
                "history": {k: [_finite(v) for v in curve] for k, curve in r.history.items()},
            }
            for kind, r in final.items()
        },
        "target_val_loss": _finite(target),
        **to_target(final, target),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print_table(results)
    plot(results, out / "loss_curves.png")
    print(f"wrote {out / 'results.json'}, {out / 'loss_curves.png'} and checkpoints in {ckpt_dir}")
    return results


def _finite(value: float) -> float | None:
    """JSON has no infinity: a diverged run's loss is written as null."""
    return value if math.isfinite(value) else None


def _loss_cell(value: float | None, width: int) -> str:
    return f"{'diverged':>{width}s}" if value is None else f"{value:{width}.4f}"


def print_table(results: dict[str, Any]) -> None:
    for kind, runs in results["sweep"].items():
        cells = ", ".join(f"{r['lr']:.0e}: {_loss_cell(r['val_loss'], 0)}" for r in runs)
        print(f"sweep {kind:5s} ({runs[0]['steps']} steps, val loss by lr)  {cells}")
    header = f"{'optimizer':9s} {'lr':>7s} {'train loss':>10s} {'val loss':>9s} {'steps to target':>15s} "
    print("\n" + header + f"{'wall time':>9s} {'ms/step':>8s} {'tokens/s':>9s}")
    tokens = results["config"]["batch"] * results["config"]["ctx"]
    for kind, r in results["final"].items():
        reach = results["steps_to_target"][kind]
        reach_cell = "-" if results["target_val_loss"] is None else "never" if reach is None else f"{reach:.0f}"
        losses = f"{_loss_cell(r['train_loss'], 10)} {_loss_cell(r['val_loss'], 9)}"
        median = r["median_step_seconds"]
        per_step = "-" if median is None else f"{median * 1e3:8.1f} {tokens / median:9,.0f}"
        print(f"{kind:9s} {r['lr']:7.0e} {losses} {reach_cell:>15s} {r['seconds']:8.1f}s {per_step}")
    print(
        "(the two runs' steps interleaved round-robin; wall time: each run's own steps; "
        "ms/step: the median step, tokens/s at that median)"
    )
    ratio = results["steps_ratio"]
    target = results["target_val_loss"]
    if target is None:
        return
    if ratio is None:
        print(f"\nMuon did not reach AdamW's final validation loss {target:.4f}.")
        return
    print(f"\nMuon reached AdamW's final validation loss {target:.4f} in {ratio:.2f}x the steps", end="")
    seconds, wall = results["seconds_to_target"], results["wall_seconds_to_target"]
    if results["seconds_ratio"] is None:  # no step times (a checkpoint of an older demo)
        print(f" and {results['wall_seconds_ratio']:.2f}x the wall time.")
        return
    print(
        f" and {results['seconds_ratio']:.2f}x the training time: {_duration(seconds['muon'])} against "
        f"{_duration(seconds['adamw'])} (steps to target x median step). Wall time to it: {_duration(wall['muon'])} "
        f"against {_duration(wall['adamw'])}, {results['wall_seconds_ratio']:.2f}x (the load each run's own steps met)."
    )


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1e3:.0f} ms"


def plot(results: dict[str, Any], path: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the demo extra is optional
        print("matplotlib is not installed: no plot (pip install -e '.[demo]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"adamw": "tab:blue", "muon": "tab:orange"}
    for kind, r in results["final"].items():
        h = r["history"]
        label = f"{kind} (lr {r['lr']:.0e})"
        for curve, style in (("train_loss", {"alpha": 0.35}), ("val_loss", {})):
            points = [(s, v) for s, v in zip(h["step"][1:], h[curve][1:]) if v is not None]
            if curve == "val_loss":
                points = [(0, h[curve][0]), *points]
            ax.plot(*zip(*points), color=colors[kind], label=f"{label} {curve[:-5]}", **style)
    if results["target_val_loss"] is not None:
        ax.axhline(results["target_val_loss"], color="gray", linestyle=":", label="AdamW final val")
    finite = [v for r in results["final"].values() for v in r["history"]["val_loss"][1:] if v is not None]
    if finite:  # from the first evaluation after step 0 down to the lowest loss
        first = [r["history"]["val_loss"][1] for r in results["final"].values() if len(r["history"]["step"]) > 1]
        ax.set_ylim(min(finite) - 0.1, max(v for v in first if v is not None) + 0.1)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / character)")
    ratio = results["steps_ratio"]
    ax.set_title("Muon vs AdamW" + ("" if ratio is None else f": {ratio:.2f}x the steps to AdamW's final val loss"))
    save_figure(fig, ax, path)


def save_figure(fig: Any, ax: Any, path: pathlib.Path, *, grid: str = "major") -> None:
    """The plots' common finish: a legend, a light ``grid`` (``"major"`` or ``"both"``), a tight layout,
    written to ``path`` at 120 dpi and closed."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which=grid)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
