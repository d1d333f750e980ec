"""Overlap of communication with Newton–Schulz, measured in the thread simulation with a modelled link.

Real processes on a 2-core machine cannot show overlap: the gloo transport of one rank
and the Newton–Schulz of the others compete for the same two cores, so time spent
communicating is time taken from computing. Here ``W`` virtual ranks (threads, one
intra-op thread each) exchange real data through :func:`muonfn.testing.simulate`, and
every exchange additionally takes ``latency + bytes received / bandwidth`` seconds spent
*sleeping* on the rank's communication thread: a network that costs wall time but no CPU.
The GPT set's matrices are ``Shard(0)`` shards (FSDP2's layout, declared with
``ShardSpec``) or whole on every rank (data parallelism), stepped by ``muonfn.muon``
with ``overlap`` on and off; a step's time is the slowest rank's, the figure the median.

Usage: ``PYTHONPATH=. python benchmarks/bench_overlap_sim.py [--world 4 --bandwidth-mb 20 --latency-ms 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
from tensordict import TensorDict

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _sets  # noqa: E402

import muonfn  # noqa: E402
from muonfn.distributed import CountingCollectives, ShardSpec, sharded_orthogonalizer  # noqa: E402
from muonfn.testing import Link, simulate  # noqa: E402


def rank_steps(col: Any, layout: str, options: dict[str, Any], steps: int, warmup: int) -> tuple[list[float], int]:
    torch.set_num_threads(1)
    ps = _sets.gpt(width=256, depth=4)
    w, r = col.world_size, col.rank
    counted = CountingCollectives(col)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return t.tensor_split(w)[r].clone() if layout == "fsdp" else t

    params = TensorDict({tuple(n.split(".")): mine(p.detach()) for n, p in ps.named()}, [])
    grads = TensorDict({tuple(n.split(".")): mine(p.grad) for n, p in ps.named()}, [])
    specs = {n: ShardSpec(0) for n, _ in ps.named()} if layout == "fsdp" else {}
    labels = dict(ps.labels)
    orthogonalizer = sharded_orthogonalizer(counted, shard_specs=specs, **options)
    tx = muonfn.muon(lr=0.02, ns=muonfn.NewtonSchulz(dtype=torch.float32), labels=labels, orthogonalizer=orthogonalizer)
    state = tx.init(params)
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            counted.reset()
        col.all_reduce(torch.zeros(1))  # a barrier
        start = time.perf_counter()
        updates, state = tx.update(grads, state, params)
        muonfn.apply_updates(params, updates)
        times.append(time.perf_counter() - start)
    return times[warmup:], counted.bytes_received // steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--bandwidth-mb", type=float, default=20.0, help="modelled link, MB/s per rank")
    parser.add_argument("--latency-ms", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/overlap_sim.json")
    args = parser.parse_args()
    link = Link(latency_s=args.latency_ms / 1e3, bytes_per_s=args.bandwidth_mb * 1e6)
    cases = [
        ("fsdp owner", "fsdp", {"strategy": "owner"}),
        ("fsdp gather", "fsdp", {"strategy": "gather"}),
        ("ddp split", "ddp", {"replicated": "split"}),
    ]
    results = []
    print(f"{args.world} simulated ranks, link {args.latency_ms} ms + bytes / {args.bandwidth_mb} MB/s, GPT set")
    print(f"{'case':<12} {'overlap':>8} {'median step':>12} {'MB recv/rank':>13}")
    for name, layout, options in cases:
        step = {}
        for overlap in (False, True):
            ranks = simulate(
                args.world, rank_steps, layout, {**options, "overlap": overlap}, args.steps, args.warmup, link=link
            )
            per_step = [max(t[i] for t, _ in ranks) for i in range(args.steps)]
            step[overlap] = statistics.median(per_step)
            received = statistics.mean(b for _, b in ranks)
            results.append({"case": name, "overlap": overlap, "median_step_s": step[overlap], "bytes": received})
            print(f"{name:<12} {overlap!s:>8} {step[overlap] * 1e3:>9.1f} ms {received / 1e6:>13.2f}")
        print(f"{name}: overlap / no overlap = {step[True] / step[False]:.2f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {**vars(args), "cpus": os.cpu_count(), "torch": torch.__version__, "load_average": os.getloadavg()[0]}
    out.write_text(json.dumps({"config": config, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
