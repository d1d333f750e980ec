"""Distributed Muon in real processes under ``torchrun``: data parallel and FSDP2 on the GPT set.

Run without ``torchrun`` it is the driver: it launches
``python -m torch.distributed.run --nproc_per_node W benchmarks/bench_torchrun.py`` for each
``W`` of ``--worlds`` (and ``W = 1``, the one-process baseline), collects what rank 0 writes
and prints the table. Under ``torchrun`` every rank steps the GPT set of
``benchmarks/_sets.py`` (fixed random gradients, no forward pass) with ``muonfn.muon`` in
these cases:

- ``ddp none``: plain tensors, whole on every rank, no collectives (every rank computes
  every Newton–Schulz: what a data-parallel run does without muonfn's split);
- ``ddp split`` / ``ddp split, no overlap``: the same tensors under a sharded orthogonalizer: each
  matrix is orthogonalized by one owner and sent to the others (``replicated="split"``);
- ``fsdp owner`` / ``fsdp gather``, each with and without ``overlap``: ``Shard(0)``
  DTensors (FSDP2's layout) of the same parameters and gradients.

A step is ``tx.update`` + ``muonfn.apply_updates``, timed between two barriers; a step's
time is the slowest rank's, and the figure is the median over ``--steps`` steps after
``--warmup``. Bytes are those ``CountingCollectives`` sees one rank receive per step
(mean over ranks). Every rank runs one intra-op thread. The backend is gloo on CPU, NCCL
with ``--device cuda`` (one GPU per rank; not run on the machine these figures come from).

Usage::

    PYTHONPATH=. python benchmarks/bench_torchrun.py [--worlds 2 4] [--out benchmarks/results/torchrun.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASES = (
    ("ddp none", {}),
    ("ddp split", {"replicated": "split", "overlap": True}),
    ("ddp split, no overlap", {"replicated": "split", "overlap": False}),
    ("fsdp owner", {"strategy": "owner", "overlap": True}),
    ("fsdp owner, no overlap", {"strategy": "owner", "overlap": False}),
    ("fsdp gather", {"strategy": "gather", "overlap": True}),
    ("fsdp gather, no overlap", {"strategy": "gather", "overlap": False}),
)


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from tensordict import TensorDict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _sets

    import muonfn
    from muonfn.distributed import CountingCollectives, sharded_orthogonalizer, torch_collectives

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=600))
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device.type, (world,))
    group = mesh.get_group()
    collectives = CountingCollectives(torch_collectives(mesh))

    ps = _sets.gpt(width=args.width, depth=args.depth, device=device.type)  # the same seed on every rank
    labels = {name: label for name, label in ps.labels.items()}
    plain_params = TensorDict({tuple(n.split(".")): p.detach() for n, p in ps.named()}, [])
    plain_grads = TensorDict({tuple(n.split(".")): p.grad for n, p in ps.named()}, [])

    def shards(td: TensorDict) -> TensorDict:
        return td.apply(lambda t: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None))

    sharded = (shards(plain_params), shards(plain_grads))
    results = []
    for name, options in CASES:
        if world == 1 and name != "ddp none":
            continue
        params, grads = sharded if name.startswith("fsdp") else (plain_params, plain_grads)
        distributed = {"orthogonalizer": sharded_orthogonalizer(collectives, **options)} if options else {}
        tx = muonfn.muon(lr=0.02, ns=muonfn.NewtonSchulz(dtype=torch.float32), labels=labels, **distributed)
        state = tx.init(params)
        times = []
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                collectives.reset()
            dist.barrier(group=group)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            updates, state = tx.update(grads, state, params)
            stepped = muonfn.apply_updates(params, updates)
            if cuda:
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            if i >= args.warmup:
                times.append(float(elapsed))
            del stepped  # the same params every step: every step does the same work
        received = torch.tensor([collectives.bytes_received / args.steps], dtype=torch.float64, device=device)
        dist.all_reduce(received, group=group)
        results.append(
            {
                "world": world,
                "case": name,
                "median_step_s": statistics.median(times),
                "step_s": times,
                "mean_bytes_received_per_rank": float(received) / world,
                "calls_per_step": {k: v / args.steps for k, v in collectives.calls.items()},
            }
        )
    if rank == 0:
        pathlib.Path(args.rank_out).write_text(json.dumps(results))
    dist.barrier(group=group)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def drive(args: argparse.Namespace) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    passed = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("width", "depth", "steps", "warmup", "device")]
    results: list[dict[str, Any]] = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for w in [1, *args.worlds]:
            out = os.path.join(tmp, f"w{w}.json")
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(w)]
            command += ["--master_port", str(free_port()), __file__, *passed, f"--rank-out={out}"]
            subprocess.run(command, env=env, check=True, timeout=1800)
            results += json.loads(pathlib.Path(out).read_text())
    load_after = os.getloadavg()[0]
    one = next(r["median_step_s"] for r in results if r["world"] == 1)
    step = {(r["world"], r["case"]): r["median_step_s"] for r in results}
    print(f"GPT set, width {args.width}, depth {args.depth}; {args.device}; 1 thread per rank; {os.cpu_count()} CPUs")
    print(f"load average {load_before:.1f} before, {load_after:.1f} after")
    print(f"{'W':>2} {'case':<24} {'median step':>12} {'/ one process':>14} {'MB recv/rank':>13}  calls/step")
    for r in results:
        calls = ", ".join(f"{k} {v:g}" for k, v in r["calls_per_step"].items())
        print(
            f"{r['world']:>2} {r['case']:<24} {r['median_step_s'] * 1e3:>9.1f} ms {r['median_step_s'] / one:>14.2f} "
            f"{r['mean_bytes_received_per_rank'] / 1e6:>13.2f}  {calls}"
        )
    ratios: dict[str, dict[str, float]] = {}
    for w in args.worlds:
        ratios[str(w)] = {
            "ddp split / ddp none": step[w, "ddp split"] / step[w, "ddp none"],
            "ddp split, no overlap / ddp none": step[w, "ddp split, no overlap"] / step[w, "ddp none"],
            "fsdp owner / fsdp owner, no overlap": step[w, "fsdp owner"] / step[w, "fsdp owner, no overlap"],
            "fsdp gather / fsdp gather, no overlap": step[w, "fsdp gather"] / step[w, "fsdp gather, no overlap"],
            "fsdp owner / fsdp gather": step[w, "fsdp owner"] / step[w, "fsdp gather"],
        }
        print(f"W={w}: " + "; ".join(f"{k} = {v:.2f}" for k, v in ratios[str(w)].items()))
    summary = {
        "config": {k: getattr(args, k) for k in ("width", "depth", "steps", "warmup", "device", "worlds")},
        "results": results,
        "ratios": ratios,
        "load_average": {"before": load_before, "after": load_after},
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    out_path = pathlib.Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default="benchmarks/results/torchrun.json")
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        rank_main(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
