"""Step time and traffic of the distributed strategies ("owner", "gather", "tp_gram") on CPU with gloo.

Spawns ``W`` processes for each ``W`` in ``--worlds``. Every rank holds ``Shard(0)``
DTensor shards (FSDP2's layout) of a GPT-shaped set of matrices — per block ``qkv``
(3d × d), ``proj`` (d × d), ``fc`` (4d × d) and ``fc2`` (d × 4d) — and times a full
``muonfn.muon`` step (momentum, Newton–Schulz in fp32, weight decay, learning rate) on
fixed random gradients. The step time of a rank is the slowest rank's. Bytes are counted
by ``CountingCollectives`` and compared with the formulas for ``S`` matrix elements in
all (fp32, shards even):

- owner: each rank receives ``2 (W-1) S / W²`` elements (a ``1/W`` share of the matrices
  arrives from the ``W-1`` other ranks, and its shards of the others' matrices come back);
- gather: each rank receives ``(W-1) S / W`` elements (every other rank's shards);
- tp_gram: matrices cut along their long side (here the tall ``qkv`` and ``fc``) all-reduce
  their ``m × m`` Gram matrix at each of the 5 steps and their squared norm once:
  ``2 (W-1) / W · (5 m² + 1)`` elements each (ring all-reduce); the rest go to owners.

Usage: ``python benchmarks/bench_distributed.py [--width 256 --depth 4 --worlds 2 4 --out PATH]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import pathlib
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STRATEGY_ORDER = ("gather", "owner", "tp_gram")


def gpt_shapes(width: int, depth: int) -> dict[str, tuple[int, int]]:
    per_block = {"qkv": (3 * width, width), "proj": (width, width), "fc": (4 * width, width), "fc2": (width, 4 * width)}
    return {f"h{i}.{name}": shape for i in range(depth) for name, shape in per_block.items()}


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def formula_elements(strategy: str, w: int, shapes: dict[str, tuple[int, int]]) -> float:
    """Elements each rank receives per step (on average over ranks), as the module docstring says."""
    if strategy == "gather":
        return (w - 1) * sum(r * c for r, c in shapes.values()) / w
    owned = [(r, c) for r, c in shapes.values() if strategy == "owner" or r <= c]  # tall ones use Gram sums
    gram = [(r, c) for r, c in shapes.values() if strategy == "tp_gram" and r > c]
    return 2 * (w - 1) * sum(r * c for r, c in owned) / w**2 + 2 * (w - 1) / w * sum(5 * c * c + 1 for _, c in gram)


def worker(rank: int, world: int, port: int, config: dict[str, Any], out_path: str) -> None:
    from tensordict import TensorDict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import muonfn
    from muonfn.distributed import CountingCollectives, sharded_orthogonalizer, torch_collectives

    torch.set_num_threads(config["threads"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    collectives = CountingCollectives(torch_collectives(mesh))
    shapes = gpt_shapes(config["width"], config["depth"])
    g = torch.Generator().manual_seed(0)

    def sharded(shape: tuple[int, int]) -> Any:
        # every rank draws the same full tensor and keeps its shard: no communication
        return distribute_tensor(torch.randn(shape, generator=g), mesh, [Shard(0)], src_data_rank=None)

    params0 = TensorDict({tuple(k.split(".")): sharded(s) for k, s in shapes.items()}, batch_size=[])
    grads = TensorDict({tuple(k.split(".")): sharded(s) for k, s in shapes.items()}, batch_size=[])
    labels = {k: "muon" for k in shapes}
    results = []
    for strategy in STRATEGY_ORDER:
        orthogonalizer = sharded_orthogonalizer(collectives, strategy=strategy)
        ns = muonfn.NewtonSchulz(dtype=torch.float32)
        tx = muonfn.muon(lr=0.02, ns=ns, labels=labels, orthogonalizer=orthogonalizer)
        params, state = params0, tx.init(params0)
        times = []
        for i in range(config["warmup"] + config["steps"]):
            if i == config["warmup"]:
                collectives.reset()
            dist.barrier(group=group)
            start = time.perf_counter()
            updates, state = tx.update(grads, state, params)
            params = muonfn.apply_updates(params, updates)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            if i >= config["warmup"]:
                times.append(float(elapsed))
        counts = (
            torch.tensor([collectives.bytes_received, collectives.bytes_sent], dtype=torch.float64) / config["steps"]
        )
        everyone = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(everyone, counts, group=group)
        results.append(
            {
                "world": world,
                "strategy": strategy,
                "median_step_s": statistics.median(times),
                "step_s": times,
                "bytes_received_per_rank": [float(c[0]) for c in everyone],
                "bytes_sent_per_rank": [float(c[1]) for c in everyone],
                "calls_per_step": {k: v / config["steps"] for k, v in collectives.calls.items()},
            }
        )
    if rank == 0:
        pathlib.Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--out", default="benchmarks/results/distributed.json")
    args = parser.parse_args()
    config = {k: getattr(args, k) for k in ("width", "depth", "steps", "warmup", "threads")}
    shapes = gpt_shapes(args.width, args.depth)
    elements = sum(r * c for r, c in shapes.values())
    total_flops = sum(ns_flops(r, c) for r, c in shapes.values())
    for name, (rows, _) in shapes.items():
        for w in args.worlds:
            if rows % w:
                print(f"note: {name} has {rows} rows, uneven on {w} ranks; the byte formulas assume even shards")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed.tensor", "tensordict", "muonfn.distributed"]
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in args.worlds:
            out = os.path.join(tmp, f"w{w}.json")
            mp.start_processes(
                worker, args=(w, free_port(), config, out), nprocs=w, start_method="forkserver", join=True
            )
            results += json.loads(pathlib.Path(out).read_text())
    for r in results:
        r["formula_bytes_received_per_rank"] = 4 * formula_elements(r["strategy"], r["world"], shapes)
    ratios = {}
    print(
        f"GPT-shaped matrices: width {args.width}, depth {args.depth}, {elements / 1e6:.2f} M elements, "
        f"{total_flops / 1e9:.1f} GFLOP of Newton-Schulz per step; {args.threads} thread(s) per process"
    )
    print(f"{'W':>2} {'strategy':>8} {'median step':>12} {'MB recv/rank (mean)':>20} {'formula':>9} {'calls/step':>28}")
    for r in results:
        mean_received = statistics.mean(r["bytes_received_per_rank"]) / 1e6
        calls = ", ".join(f"{k} {v:g}" for k, v in r["calls_per_step"].items())
        print(
            f"{r['world']:>2} {r['strategy']:>8} {r['median_step_s'] * 1e3:>9.1f} ms {mean_received:>20.2f} "
            f"{r['formula_bytes_received_per_rank'] / 1e6:>9.2f} {calls:>28}"
        )
    for w in args.worlds:
        step = {r["strategy"]: r["median_step_s"] for r in results if r["world"] == w}
        ratios[str(w)] = step["owner"] / step["gather"]
        print(
            f"W={w}: owner / gather step time = {ratios[str(w)]:.2f}"
            + ("  (target <= 0.5)" if w == 4 else "")
            + f"; tp_gram / gather = {step['tp_gram'] / step['gather']:.2f}"
        )
    out_path = pathlib.Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "config": {**config, "worlds": args.worlds, "elements": elements, "ns_gflop_per_step": total_flops / 1e9},
        "results": results,
        "owner_over_gather": ratios,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    out_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
