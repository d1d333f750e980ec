"""Where the time of one optimizer step goes: ``python benchmarks/profile_step.py [--device cuda]``.

Steps muonfn (functional and donated), torch.optim.Muon + AdamW, the installed peers and the
hand-written fp32 loop on the GPT set, first unprofiled and round-robin (the medians), then each
under torch.profiler, whose per-op times split a step into matmuls, elementwise kernels, copies
and the rest (Python, TensorDict, dispatch: wall time not spent inside an op).

The summary puts each contender's matmul time next to everything else in its step, and says
for each muonfn contender how long the step may take to be ``--target`` times faster than the
fastest eager rival, and so how much time that leaves beside its own matmuls. ``--out`` writes
the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import _contenders as C  # noqa: E402
import _sets  # noqa: E402
import torch  # noqa: E402
from _harness import Entry, machine, run_interleaved, synchronize  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

MATMUL = {"aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm", "aten::matmul"}
COPY = {"aten::copy_", "aten::cat", "aten::clone", "aten::_to_copy", "aten::contiguous", "aten::empty_strided"}
TORCH_MUON = "torch Muon+AdamW"
PLAIN_LOOP = "plain fp32 loop"


def split(prof: profile, wall: float, steps: int) -> dict[str, float]:
    """Milliseconds a step in matmuls, elementwise kernels and copies (the ops' own time), and
    the rest of ``wall`` (seconds)."""
    groups = {"matmul": 0.0, "elementwise": 0.0, "copy": 0.0}
    attr = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    for e in prof.key_averages():
        if not e.key.startswith("aten::"):
            continue
        t = getattr(e, attr) / 1e3 / steps
        if e.key in MATMUL:
            groups["matmul"] += t
        elif e.key in COPY:
            groups["copy"] += t
        else:
            groups["elementwise"] += t
    groups["rest (python, tensordict, dispatch)"] = wall * 1e3 - sum(groups.values())
    return groups


def profiled(entry: Entry, device: torch.device, steps: int, top: int) -> dict[str, float]:
    """``entry``'s step under torch.profiler: its split, printed with the ``top`` ops."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    assert entry.step is not None
    times = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            synchronize(device)
            start = time.perf_counter()
            entry.step()
            synchronize(device)
            times.append(time.perf_counter() - start)
    wall = statistics.median(times)
    groups = split(prof, wall, steps)
    unprofiled = entry.median * 1e3
    print(f"\n{entry.name}: {wall * 1e3:.1f} ms a step profiled (median of {steps}), {unprofiled:.1f} unprofiled")
    for group, ms in groups.items():
        print(f"  {group:38s} {ms:7.1f} ms")
    if top:
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=top))
    return groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--repeats", type=int, default=15, help="unprofiled round-robin steps per contender")
    p.add_argument("--steps", type=int, default=5, help="profiled steps per contender")
    p.add_argument("--top", type=int, default=0, help="rows of each contender's per-op table (0: none)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    p.add_argument("--target", type=float, default=1.1, help="the speed-up over the fastest rival to budget for")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ps = _sets.gpt(args.width, args.depth, device=str(device))
    peers = [peer for peer in C.installed_peers(False, print) if not peer.compiled]
    entries = [
        Entry("muonfn", lambda: C.make_functional(ps), args.repeats),
        Entry("muonfn donated", lambda: C.make_donated(ps), args.repeats),
        Entry(TORCH_MUON, lambda: C.make_torch_muon(ps), args.repeats),
        *(Entry(peer.name, peer.entry_make(ps), args.repeats) for peer in peers),
        Entry(PLAIN_LOOP, lambda: C.make_plain_loop(ps), args.repeats),
    ]
    run_interleaved(entries, device)
    splits = {e.name: profiled(e, device, args.steps, args.top) for e in entries}

    rows = {}
    print(f"\n{ps.description}; medians of {args.repeats} unprofiled round-robin steps, matmul time profiled")
    print(f"| {'contender':24s} | step ms | matmul ms | everything else ms |")
    print(f"|{'-' * 26}|---------|-----------|--------------------|")
    for e in entries:
        step_ms, matmul_ms = e.median * 1e3, splits[e.name]["matmul"]
        rows[e.name] = {"step_ms": step_ms, "matmul_ms": matmul_ms, "other_ms": step_ms - matmul_ms}
        print(f"| {e.name:24s} | {step_ms:7.1f} | {matmul_ms:9.1f} | {step_ms - matmul_ms:18.1f} |")
    rivals = [e for e in entries if not e.name.startswith("muonfn")]
    fastest = min(rivals, key=lambda e: e.median)
    budget_ms = fastest.median * 1e3 / args.target
    print(f"\nfastest rival: {fastest.name}, {fastest.median * 1e3:.1f} ms; {args.target}x faster: {budget_ms:.1f} ms")
    budgets = {}
    for name in ("muonfn", "muonfn donated"):
        row = rows[name]
        left = budget_ms - row["matmul_ms"]
        budgets[name] = {"budget_ms": budget_ms, "other_allowed_ms": left, "other_ms": row["other_ms"]}
        print(
            f"  {name}: its matmuls take {row['matmul_ms']:.1f} ms, which leaves {left:.1f} ms for everything "
            f"else (it takes {row['other_ms']:.1f}; {fastest.name} takes {rows[fastest.name]['other_ms']:.1f})"
        )
    if args.out:
        record: dict[str, Any] = {
            "machine": machine(device),
            "set": ps.description,
            "repeats": args.repeats,
            "profiled_steps": args.steps,
            "contenders": {name: {**rows[name], "split_ms": splits[name]} for name in rows},
            "fastest_rival": fastest.name,
            "target": args.target,
            "budgets": budgets,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
