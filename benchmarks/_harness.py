"""Timing, peak memory and machine description, the same code on CPU and CUDA.

Timing: contenders run interleaved (round ``r`` times every contender once), so a
noisy neighbour slows all of them alike; each timed call is bracketed by a device
synchronisation, and the median over repetitions is reported.

Peak memory: bytes allocated by PyTorch above what was live when the contender was
built, over its construction and warm-up steps. On CUDA that is
``torch.cuda.max_memory_allocated() - memory_allocated()`` at the start; on CPU the
running sum of the allocation events of ``torch.profiler(profile_memory=True)`` (frees
of tensors allocated before the window are not credited; buffers a BLAS library
allocates by itself are not seen).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

MB = 2**20


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    """Runs ``fn`` and returns its result and the peak bytes it allocated above the start."""
    if device.type == "cuda":
        synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        synchronize(device)
        return out, float(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    live = peak = 0.0
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        if e["args"].get("Device Type", 0) == 0:
            live += e["args"]["Bytes"]
            peak = max(peak, live)
    return out, peak


@dataclass
class Entry:
    """A contender: ``make()`` builds it and returns its step function."""

    name: str
    make: Callable[[], Callable[[], Any]]
    repeats: int
    warmup: int = 2
    #: steps per timed sample (a sample's time is divided by it): on a GPU, steps between two
    #: synchronisations overlap the host's issue of one with the device's work of another
    steps: int = 1
    times: list[float] = field(default_factory=list)
    peak_bytes: float = float("nan")
    step: Callable[[], Any] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


def run_interleaved(entries: list[Entry], device: torch.device, log: Callable[[str], None] = print) -> None:
    """Builds and warms up every entry (measuring its peak memory), then times them round-robin."""
    for e in entries:

        def build_and_warm(e: Entry = e) -> Callable[[], Any]:
            step = e.make()
            for _ in range(e.warmup):
                step()
            return step

        t0 = time.perf_counter()
        e.step, e.peak_bytes = measure_peak(device, build_and_warm)
        synchronize(device)
        e.info["build_and_warmup_s"] = time.perf_counter() - t0
        log(f"  {e.name}: built and warmed up in {e.info['build_and_warmup_s']:.1f} s")
    for r in range(max(e.repeats for e in entries)):
        for e in entries:
            if r >= e.repeats:
                continue
            assert e.step is not None
            e.times.append(timed(e.step, device, e.steps))


def timed(step: Callable[[], Any], device: torch.device, steps: int = 1) -> float:
    """Seconds one call of ``step`` takes: ``steps`` calls bracketed by device synchronisations, averaged."""
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - t0) / steps


def time_in_a_row(entries: list[Entry], steps: int, device: torch.device) -> None:
    """After :func:`run_interleaved`: each entry's median over ``steps`` steps taken one after
    another (``info["in_a_row_ms"]``). Interleaved, a step also pays for the data the other
    contenders' steps evicted, as a training step does after the forward and backward passes;
    in a row, its data stays in the caches: the two bracket what a step costs."""
    for e in entries:
        step = e.step
        assert step is not None
        e.info["in_a_row_ms"] = statistics.median(timed(step, device) for _ in range(steps)) * 1e3


def matmul_entry(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> Entry:
    """One ``size×size`` matmul: the hardware's throughput for this dtype."""

    def make() -> Callable[[], Any]:
        g = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(size, size, generator=g).to(device, dtype)
        b = torch.randn(size, size, generator=g).to(device, dtype)
        return lambda: a @ b

    return Entry(f"matmul {size}x{size} {str(dtype).removeprefix('torch.')}", make, repeats, warmup=1)


def matmul_flops(size: int) -> float:
    return 2.0 * size**3


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_bf16_units() -> tuple[bool, str]:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), and how that was found: torch's
    CPU capability queries (the instruction set; muonfn's own rule measures instead, :func:`cpu_ns_rule`)."""
    found = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return bool(found), "torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()"


def cpu_ns_rule() -> dict[str, Any]:
    """muonfn's CPU precision rule in this run: ``MUONFN_CPU_NS_DTYPE`` (``auto`` unset) and the probe that
    decides it (``muonfn.linalg.cpu_bf16_probe``): its fp32 and bf16 timings, their ratio and its answer
    (whether the rule would iterate in bf16)."""
    from muonfn.linalg import cpu_bf16_probe

    return {"variable": os.environ.get("MUONFN_CPU_NS_DTYPE", "auto"), "probe": cpu_bf16_probe().as_dict()}


def describe_ns_rule(rule: dict[str, Any]) -> str:
    """One line on what :func:`cpu_ns_rule` found: the dtype muonfn's Newton–Schulz takes on this
    CPU by default, and why."""
    probe = rule["probe"]
    measured = (
        f"the probe measured bf16 products at {probe['speedup']:.2f}× fp32's speed "
        f"({probe['bf16_seconds'] * 1e3:.3f} against {probe['fp32_seconds'] * 1e3:.3f} ms on one thread; "
        f"bf16 needs {probe['min_speedup']}×)"
    )
    if rule["variable"] != "auto":
        chosen = f"{rule['variable']}, pinned by MUONFN_CPU_NS_DTYPE"
    else:
        chosen = "bf16 for matrices of m²n ≥ 2¹⁸" if probe["bf16_faster"] else "fp32"
    return f"muonfn's Newton–Schulz on the CPU: {chosen}; {measured}"


def cpu_isa_features() -> list[str]:
    """The CPU's bf16-related instruction sets that torch reports."""
    checks = {"avx512_bf16": torch.cpu._is_avx512_bf16_supported, "amx_tile": torch.cpu._is_amx_tile_supported}
    return [name for name, check in checks.items() if check()]


def machine(device: torch.device) -> dict[str, Any]:
    import tensordict

    bf16_units, bf16_source = cpu_bf16_units()

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensordict": tensordict.__version__,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_units": bf16_units,
        "cpu_bf16_units_from": bf16_source,
        "cpu_bf16_isa": cpu_isa_features(),
        "cpu_ns_rule": cpu_ns_rule(),
        "device": str(device),
    }
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = list(os.getloadavg())
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gb"] = round(props.total_memory / 1e9, 1)
        info["cuda"] = torch.version.cuda
    return info
