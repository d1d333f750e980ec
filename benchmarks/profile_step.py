"""Where the time of one optimizer step goes: ``python benchmarks/profile_step.py [--device cuda]``.

Profiles (torch.profiler) the muonfn step, its donated variant and the hand-written fp32
loop on the GPT set, and splits each step's wall time into matmuls, elementwise kernels,
copies and the rest (Python, TensorDict, dispatch: wall time not spent inside an op).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import _contenders as C  # noqa: E402
import _sets  # noqa: E402
import torch  # noqa: E402
from _harness import synchronize  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

MATMUL = {"aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm", "aten::matmul"}
COPY = {"aten::copy_", "aten::cat", "aten::clone", "aten::_to_copy", "aten::contiguous", "aten::empty_strided"}


def split(prof: profile, wall: float, steps: int) -> dict[str, float]:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=12, help="rows of the per-op table (0: none)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ps = _sets.gpt(args.width, args.depth, device=str(device))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, make in (
        ("muonfn", lambda: C.make_functional(ps)),
        ("muonfn donated", lambda: C.make_donated(ps)),
        ("plain fp32 loop", lambda: C.make_plain_loop(ps)),
    ):
        step = make()
        for _ in range(2):
            step()
        times = []
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                synchronize(device)
                t0 = time.perf_counter()
                step()
                synchronize(device)
                times.append(time.perf_counter() - t0)
        wall = statistics.median(times)
        print(f"\n{name}: {wall * 1e3:.1f} ms a step (median of {args.steps}, profiled), {ps.description}")
        for group, ms in split(prof, wall, args.steps).items():
            print(f"  {group:38s} {ms:7.1f} ms")
        if args.top:
            sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=sort, row_limit=args.top))


if __name__ == "__main__":
    main()
