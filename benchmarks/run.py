"""muonfn benchmark suite: ``python benchmarks/run.py [--device cuda] [--quick]``.

Sections (``--sections``, default ``step,ns,elementwise,overhead,fixed``; ``compile`` on request):

- ``step``: one full optimizer step (Muon on the matrices, AdamW on the rest) on GPT-2
  blocks, a ResNet and an MoE layer (``--sets``; on CUDA GPT-2 small and medium by
  default), for muonfn (functional, unbatched, Gram, shim), torch.optim.Muon +
  torch.optim.AdamW, a hand-written fp32 loop and the installed peers (heavyball, timm,
  pytorch-optimizer: the ``bench`` extra; heavyball compiled with ``--compile-peers``); next
  to the Newton–Schulz flops at the throughput of one large matmul measured in the same run,
  with each contender's ratio to torch.optim.Muon and to the fastest peer.
- ``ns``: standard against Gram Newton–Schulz on wide matrices, with their errors; and the
  throughput of batched Newton–Schulz on large same-shape buckets (64 × 1024×4096 on CUDA)
  as a fraction of the matmul rate of its dtype (bf16 on CUDA).
- ``elementwise``: muonfn's AdamW against torch.optim.AdamW (foreach and for-loop), and
  TensorDict arithmetic against ``TensorDict.apply`` for the same AdamW.
- ``overhead``: the fixed cost of an update (one-element tensors), nested against flat keys.
- ``fixed``: the fixed cost of every contender's step on a 24-layer GPT's structure of tiny
  tensors (292 leaves), one thread: muonfn against torch.optim.Muon + AdamW(foreach) and
  torch.optim.AdamW(foreach), and the peers; interleaved (the targets' figures: each step also
  pays for what the others evicted from the caches), then each contender's steps in a row.
- ``compile``: ``torch.compile(update, fullgraph=True)`` and the shim's ``compile=True`` against
  eager: compile time and step (and heavyball's compiled step where installed).

Every run also times one fp32 and one bf16 matmul and says whether the CPU has bf16 units
(AVX512-BF16 or AMX): every peer, like torch.optim.Muon, runs Newton–Schulz in bf16. It records
muonfn's own CPU rule too (``machine.cpu_ns_rule``): ``MUONFN_CPU_NS_DTYPE`` and the probe that
decides whether muonfn iterates in bf16 (its fp32 and bf16 timings and its answer).

Prints tables and writes everything, with the machine description, as JSON
(``--out``, default ``benchmarks/results/<device>-<date>.json``, e.g. ``cuda-<date>.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # run from a checkout without installing

import _contenders as C  # noqa: E402
import _sets  # noqa: E402
import torch  # noqa: E402
from _harness import (  # noqa: E402
    MB,
    Entry,
    cpu_bf16_units,
    describe_ns_rule,
    machine,
    matmul_entry,
    matmul_flops,
    run_interleaved,
    synchronize,
    time_in_a_row,
)

import muonfn  # noqa: E402
from muonfn.linalg import (  # noqa: E402
    gram_newton_schulz,
    gram_newton_schulz_flops,
    newton_schulz_flops,
)

SECTIONS = ("step", "ns", "elementwise", "overhead", "fixed", "compile")
DEFAULT_SECTIONS = "step,ns,elementwise,overhead,fixed"
DEFAULT_SETS = {"cpu": "gpt,conv,moe", "cuda": "gpt2-small,gpt2-medium,conv,moe"}

# Sizes: default (a few minutes on 2 CPU cores), --quick, --smoke (a few seconds; for the tests).
PROFILES: dict[str, dict[str, Any]] = {
    "default": {
        "gpt": {"width": 256, "depth": 4},
        "conv": {"width": 16},
        "moe": {"width": 128, "experts": 8, "hidden": 256},
        # at their real sizes (only on request on a CPU: one step of GPT-2 small is ~1.5 TFLOP of NS)
        "gpt2-small": {},
        "gpt2-medium": {},
        "repeats": 10,
        "slow_repeats": 2,
        "matmul": 2048,
        "ns_shapes": [(256, 1024), (768, 3072)],
        "ns_batches": [(8, 256, 1024)],
        "fixed_repeats": 50,
        "probe_matmul": 512,
    },
    "quick": {
        "gpt": {"width": 128, "depth": 2},
        "conv": {"width": 8},
        "moe": {"width": 64, "experts": 4, "hidden": 128},
        "gpt2-small": {},
        "gpt2-medium": {},
        "repeats": 5,
        "slow_repeats": 1,
        "matmul": 1024,
        "ns_shapes": [(256, 1024)],
        "ns_batches": [(4, 256, 1024)],
        "fixed_repeats": 30,
        "probe_matmul": 512,
    },
    "smoke": {
        "gpt": {"width": 32, "depth": 1, "vocab": 64, "context": 16},
        "conv": {"width": 4},
        "moe": {"width": 16, "experts": 2, "hidden": 32},
        # GPT-2's shapes shrunk to a few thousand parameters: the code path, not the sizes
        "gpt2-small": {"width": 32, "depth": 1, "vocab": 64, "context": 16},
        "gpt2-medium": {"width": 48, "depth": 2, "vocab": 64, "context": 16},
        "repeats": 2,
        "slow_repeats": 1,
        "matmul": 256,
        "ns_shapes": [(16, 64)],
        "ns_batches": [(3, 16, 64)],
        "fixed_repeats": 3,
        "probe_matmul": 128,
    },
}


# On a GPU the CPU sizes are launch-bound toys: GPT-2 small's blocks (the set of the elementwise,
# overhead and compile sections), wider convs and experts, a matmul big enough to reach the
# tensor cores' throughput, and Newton–Schulz buckets of the size GPT-2 medium's MLPs give.
CUDA_SIZES: dict[str, dict[str, Any]] = {
    "default": {
        "gpt": {"width": 768, "depth": 12, "vocab": 50257, "context": 1024},
        "conv": {"width": 64},
        "moe": {"width": 512, "experts": 8, "hidden": 2048, "depth": 2},
        "matmul": 8192,
        "ns_shapes": [(256, 1024), (768, 3072), (1024, 4096), (4096, 16384)],
        "ns_batches": [(64, 1024, 4096), (16, 1024, 4096), (48, 768, 3072), (24, 1024, 1024)],
    },
    "quick": {"matmul": 4096, "ns_batches": [(64, 1024, 4096)]},
    "smoke": {},
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fmt(v: float, digits: int = 1) -> str:
    return "—" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}f}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def entry_record(e: Entry) -> dict[str, Any]:
    return {
        "median_ms": e.median * 1e3,
        "min_ms": min(e.times) * 1e3 if e.times else float("nan"),
        "times_ms": [t * 1e3 for t in e.times],
        "repeats": len(e.times),
        "warmup": e.warmup,
        "steps_per_sample": e.steps,
        "peak_mb": e.peak_bytes / MB,
        **e.info,
    }


def ns_dtype(device: torch.device) -> torch.dtype:
    from muonfn.linalg import default_ns_dtype

    return default_ns_dtype(device, torch.float32)


def has_shim() -> bool:
    try:
        import muonfn.optim as shim
    except ImportError:
        return False
    return hasattr(shim, "Muon")


def bf16_is_slow(device: torch.device) -> bool:
    """Whether bf16 matmuls crawl here (a CPU without bf16 units: ~100× slower than fp32), so that
    the contenders that compute in bf16 (torch.optim.Muon, every peer) get fewer repetitions."""
    return device.type == "cpu" and not cpu_bf16_units()[0]


TORCH_MUON = "torch Muon+AdamW"
TORCH_ADAMW = "torch AdamW foreach"


def peer_entries(ps: _sets.ParamSet, peers: list[C.Peer], repeats: int, slow: bool) -> list[Entry]:
    entries = []
    for peer in peers:
        # heavyball's compiled step: the first step runs eagerly, the second compiles
        warmup = 3 if peer.compiled else 1 if slow else 2
        entries.append(Entry(peer.name, peer.entry_make(ps), repeats, warmup=warmup))
    return entries


def fastest_peer(entries: list[Entry], peers: list[C.Peer]) -> Entry:
    """The fastest of torch.optim.Muon + AdamW and the peers' eager steps (the compiled ones
    are reported, not taken as the reference that eager muonfn is compared with)."""
    eager = {TORCH_MUON} | {p.name for p in peers if not p.compiled}
    return min((e for e in entries if e.name in eager), key=lambda e: e.median)


def section_step(args: argparse.Namespace, prof: dict[str, Any], device: torch.device) -> dict[str, Any]:
    slow_bf16 = bf16_is_slow(device)  # torch.optim.Muon and the peers compute in bf16
    dtype = ns_dtype(device)
    peers = C.installed_peers(args.compile_peers, log)
    results: dict[str, Any] = {}
    for set_name in args.sets:
        ps = _sets.build(set_name, str(device), **prof[set_name])
        summary = _sets.size_summary(ps)
        log(f"[step] {ps.description}: {summary['params'] / 1e6:.2f} M params, {summary['ns_gflop']:.2f} GFLOP of NS")
        slow = prof["slow_repeats"] if slow_bf16 else args.repeats
        entries = [
            matmul_entry(device, dtype, prof["matmul"], args.repeats),
            Entry("muonfn", lambda: C.make_functional(ps), args.repeats),
            Entry("muonfn donated", lambda: C.make_donated(ps), args.repeats),
            Entry(
                "muonfn unbatched",
                lambda: C.make_functional(ps, orthogonalizer=muonfn.LocalOrthogonalizer(bucket_numel=1)),
                args.repeats,
            ),
            Entry("muonfn gram", lambda: C.make_functional(ps, ns="gram"), args.repeats),
        ]
        if has_shim():
            entries.append(Entry("muonfn shim", lambda: C.make_shim(ps), args.repeats))
            entries.append(Entry("muonfn shim donated", lambda: C.make_shim(ps, donate_state=True), args.repeats))
            if device.type == "cuda":  # host-bound in parts there: the one-part shim beside it
                entries.append(Entry("muonfn shim one part", lambda: C.make_shim(ps, chunk_numel=None), args.repeats))
        entries += [
            Entry(TORCH_MUON, lambda: C.make_torch_muon(ps), slow, warmup=1 if slow_bf16 else 2),
            Entry("plain fp32 loop", lambda: C.make_plain_loop(ps), args.repeats),
            *peer_entries(ps, peers, slow, slow_bf16),
        ]
        for e in entries:
            e.steps = args.steps_per_sample or (5 if device.type == "cuda" else 1)
        run_interleaved(entries, device, log)
        mm, contenders = entries[0], entries[1:]
        rate = matmul_flops(prof["matmul"]) / mm.median
        flops = ps.ns_flops()
        limit = flops / rate
        torch_median = next(e.median for e in contenders if e.name == TORCH_MUON)
        best_peer = fastest_peer(contenders, peers)
        record: dict[str, Any] = {
            "description": ps.description,
            **summary,
            "matmul": {"name": mm.name, **entry_record(mm), "gflops": rate / 1e9},
            "ns_limit_ms": limit * 1e3,
            "fastest_peer": best_peer.name,
            "contenders": {},
        }
        rows = []
        for e in contenders:
            rec = entry_record(e)
            rec["speedup_vs_torch_muon"] = torch_median / e.median
            rec["speedup_vs_fastest_peer"] = best_peer.median / e.median
            rec["ns_gflops"] = flops / e.median / 1e9
            rec["x_limit"] = e.median / limit
            record["contenders"][e.name] = rec
            rows.append(
                [
                    e.name,
                    fmt(e.median * 1e3),
                    fmt(rec["min_ms"]),
                    str(len(e.times)),
                    fmt(rec["speedup_vs_torch_muon"], 2),
                    fmt(rec["speedup_vs_fastest_peer"], 2),
                    fmt(rec["ns_gflops"]),
                    fmt(rec["x_limit"], 2),
                    fmt(rec["peak_mb"]),
                ]
            )
        print(
            f"\n{ps.description} — {summary['params'] / 1e6:.2f} M params, {summary['matrices']} matrices, "
            f"NS {flops / 1e9:.2f} GFLOP; {mm.name}: {rate / 1e9:.1f} GFLOP/s → limit {limit * 1e3:.1f} ms; "
            f"fastest peer: {best_peer.name}"
        )
        headers = ["contender", "median ms", "min ms", "n", "× faster than torch", "× faster than fastest peer"]
        print(table([*headers, "NS GFLOP/s", "× limit", "peak MB"], rows))
        results[ps.name] = record
    return results


def section_ns(args: argparse.Namespace, prof: dict[str, Any], device: torch.device) -> dict[str, Any]:
    dtype = ns_dtype(device)
    g = torch.Generator().manual_seed(0)
    shapes = prof["ns_shapes"]
    entries, inputs = [], {}
    for m, n in shapes:
        x = torch.randn(m, n, generator=g).to(device)
        inputs[(m, n)] = x
        entries.append(
            Entry(f"standard {m}x{n}", lambda x=x: lambda: muonfn.newton_schulz(x, dtype=dtype), args.repeats)
        )
        entries.append(Entry(f"gram {m}x{n}", lambda x=x: lambda: gram_newton_schulz(x, dtype=dtype), args.repeats))
    # large same-shape buckets, as the optimizer batches them: fp32 inputs (momenta of fp32
    # parameters), the iteration in the default dtype (bf16 on CUDA), drawn on the device
    batches, batch_inputs = [], {}
    for count, m, n in prof["ns_batches"]:
        x = torch.randn(count, m, n, generator=torch.Generator(device).manual_seed(count * m + n), device=device)
        batch_inputs[(count, m, n)] = x
        batches.append(Entry(f"batch {count}x{m}x{n}", lambda x=x: lambda: muonfn.newton_schulz(x), args.repeats))
    mm = matmul_entry(device, dtype, prof["matmul"], args.repeats)
    # torch.optim.Muon computes in bf16 whatever the device: its throughput here explains its times
    bf16 = matmul_entry(device, torch.bfloat16, min(prof["matmul"], 512), 3) if dtype != torch.bfloat16 else None
    log(f"[ns] {', '.join(f'{m}x{n}' for m, n in shapes)} and batches {prof['ns_batches']} in {dtype}")
    run_interleaved(entries + batches + [mm] + ([bf16] if bf16 else []), device, log)
    rate = matmul_flops(prof["matmul"]) / mm.median
    out: dict[str, Any] = {"dtype": str(dtype), "matmul_gflops": rate / 1e9, "shapes": {}}
    if bf16 is not None:
        out["bf16_matmul"] = {"name": bf16.name, "gflops": matmul_flops(min(prof["matmul"], 512)) / bf16.median / 1e9}
    rows = []
    for (m, n), (std, gram) in zip(shapes, zip(entries[0::2], entries[1::2])):
        x = inputs[(m, n)]
        # the exact polar factor by an fp64 SVD, skipped where that would dwarf the benchmark
        exact = muonfn.polar(x.double()) if m * n <= 768 * 3072 else None
        err = lambda y: float("nan") if exact is None else ((y.double() - exact).norm() / exact.norm()).item()  # noqa: E731
        ref = muonfn.newton_schulz(x, dtype=dtype)
        rec = {}
        for e, flops, y in (
            (std, newton_schulz_flops(m, n, 5), ref),
            (gram, gram_newton_schulz_flops(m, n, 5, dtype=dtype), gram_newton_schulz(x, dtype=dtype)),
        ):
            rec[e.name.split()[0]] = {
                **entry_record(e),
                "gflop": flops / 1e9,
                "gflops": flops / e.median / 1e9,
                "x_limit": e.median / (flops / rate),
                "rel_error_vs_polar": err(y),
                "rel_diff_vs_standard": ((y.double() - ref.double()).norm() / ref.double().norm()).item(),
            }
        rec["gram_speedup"] = std.median / gram.median
        out["shapes"][f"{m}x{n}"] = rec
        for name in ("standard", "gram"):
            r = rec[name]
            rows.append(
                [
                    f"{m}x{n}",
                    name,
                    fmt(r["median_ms"], 2),
                    fmt(r["gflop"], 3),
                    fmt(r["gflops"]),
                    fmt(r["x_limit"], 2),
                    f"{r['rel_error_vs_polar']:.3g}",
                    f"{r['rel_diff_vs_standard']:.2g}",
                ]
            )
    bf16_note = f"; {bf16.name}: {out['bf16_matmul']['gflops']:.2f} GFLOP/s" if bf16 is not None else ""
    mm_note = f"one {prof['matmul']}² matmul: {rate / 1e9:.1f} GFLOP/s"
    print(f"\nNewton–Schulz, 5 Keller steps in {dtype}; {mm_note}{bf16_note}")
    print(
        table(
            ["shape", "method", "median ms", "GFLOP", "GFLOP/s", "× limit", "error vs polar", "diff vs standard"],
            rows,
        )
    )
    out["matmul"] = {"name": mm.name, **entry_record(mm), "tflops": rate / 1e12}
    out["batches"] = {}
    rows = []
    for (count, m, n), e in zip(prof["ns_batches"], batches):
        flops = count * newton_schulz_flops(m, n, 5)
        y = muonfn.newton_schulz(batch_inputs[(count, m, n)])
        rec = {
            **entry_record(e),
            "input_dtype": "torch.float32",
            "tflop": flops / 1e12,
            "tflops": flops / e.median / 1e12,
            # achieved throughput over the matmul rate: 1 / × limit
            "x_matmul_rate": flops / e.median / rate,
            "finite": bool(torch.isfinite(y).all()),
        }
        out["batches"][f"{count}x{m}x{n}"] = rec
        cells = [rec["median_ms"], rec["tflop"], rec["tflops"], rec["x_matmul_rate"]]
        rows.append([f"{count} × {m}x{n}", *(fmt(v, d) for v, d in zip(cells, (2, 3, 2, 2)))])
    print(f"\nBatched Newton–Schulz, fp32 input, 5 Keller steps in {dtype}; {mm_note} (target ≥ 0.60×)")
    print(table(["batch", "median ms", "TFLOP", "TFLOP/s", "× matmul rate"], rows))
    return out


def section_elementwise(args: argparse.Namespace, prof: dict[str, Any], device: torch.device) -> dict[str, Any]:
    ps = _sets.build("gpt", str(device), **prof["gpt"])
    log(f"[elementwise] AdamW on every parameter of {ps.description}")
    entries = [
        Entry("torch AdamW foreach", lambda: C.make_torch_adamw(ps, foreach=True), args.repeats),
        Entry("muonfn adamw", lambda: C.make_functional_adamw(ps), args.repeats),
        Entry("muonfn adamw donated", lambda: C.make_donated_adamw(ps), args.repeats),
        Entry("torch AdamW for-loop", lambda: C.make_torch_adamw(ps, foreach=False), args.repeats),
        Entry("hand AdamW, TensorDict arithmetic", lambda: C.make_hand_adamw(ps, use_apply=False), args.repeats),
        Entry("hand AdamW, TensorDict.apply", lambda: C.make_hand_adamw(ps, use_apply=True), args.repeats),
    ]
    run_interleaved(entries, device, log)
    base = entries[0].median
    out: dict[str, Any] = {"set": ps.name, "params": ps.numel(), "leaves": len(ps.named()), "contenders": {}}
    rows = []
    for e in entries:
        rec = {**entry_record(e), "x_torch_foreach": e.median / base}
        out["contenders"][e.name] = rec
        rows.append([e.name, fmt(e.median * 1e3, 2), fmt(rec["x_torch_foreach"], 2), fmt(rec["peak_mb"])])
    arith = out["contenders"]["hand AdamW, TensorDict arithmetic"]["median_ms"]
    out["apply_over_arithmetic"] = out["contenders"]["hand AdamW, TensorDict.apply"]["median_ms"] / arith
    print(f"\nAdamW step on {ps.numel() / 1e6:.2f} M params in {len(ps.named())} tensors ({ps.description})")
    print(table(["contender", "median ms", "× torch foreach", "peak MB"], rows))
    return out


def section_overhead(args: argparse.Namespace, prof: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The step's fixed cost: the GPT set's structure with one-element tensors, so that only
    Python, TensorDict and dispatch remain; nested keys (as ``TensorDict.from_module``
    gives) against the same leaves under flat keys."""
    ps = _sets.build("gpt", str(device), **prof["gpt"])
    log(f"[overhead] one-element tensors shaped like {ps.description}")
    params, _ = C.tensordicts(ps)
    nested = params.apply(lambda p: torch.zeros([1] * p.ndim, device=p.device))
    flat = nested.flatten_keys("/")
    tiny_set = _sets.gpt(**prof["gpt"], device=str(device))
    for p in tiny_set.model.parameters():
        p.data, p.grad = torch.zeros([1] * p.ndim, device=p.device), torch.zeros([1] * p.ndim, device=p.device)
    flat_labels = {k.replace(".", "/"): v for k, v in ps.labels.items()}

    def update(td: Any, labels: dict[str, str], preset: str) -> Any:
        def make() -> Any:
            tx = muonfn.adamw() if preset == "adamw" else muonfn.muon(labels=labels)
            state = tx.init(td)
            return lambda: tx.update(td, state, td)

        return make

    def torch_adamw() -> Any:
        tensors = [p.clone() for p in nested.values(True, True)]
        for t in tensors:
            t.grad = torch.zeros_like(t)
        return torch.optim.AdamW(tensors, foreach=True).step

    repeats = max(args.repeats, 20)
    entries = [
        Entry("muonfn muon, nested keys", update(nested, ps.labels, "muon"), repeats),
        Entry("muonfn muon, flat keys", update(flat, flat_labels, "muon"), repeats),
        Entry("muonfn adamw, nested keys", update(nested, ps.labels, "adamw"), repeats),
        Entry("muonfn adamw, flat keys", update(flat, flat_labels, "adamw"), repeats),
        Entry("torch AdamW foreach", torch_adamw, repeats),
        Entry("hand AdamW, TensorDict arithmetic", lambda: C.make_hand_adamw(tiny_set, use_apply=False), repeats),
        Entry("hand AdamW, TensorDict.apply", lambda: C.make_hand_adamw(tiny_set, use_apply=True), repeats),
    ]
    run_interleaved(entries, device, log)
    out: dict[str, Any] = {"set": ps.name, "leaves": len(ps.named()), "contenders": {}}
    rows = []
    for e in entries:
        out["contenders"][e.name] = entry_record(e)
        rows.append([e.name, fmt(e.median * 1e3, 2)])
    print(f"\nFixed cost of one update: {len(ps.named())} one-element leaves shaped like {ps.description}")
    print(table(["update", "median ms"], rows))
    return out


#: The structure of the fixed-cost table: a 24-layer GPT with tiny tensors (292 leaves),
#: so that only Python, dispatch and the optimizers' bookkeeping remain.
FIXED_GPT = {"width": 8, "depth": 24, "vocab": 16, "context": 8}


def section_fixed(args: argparse.Namespace, prof: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Every contender's step on a structure where the math is negligible: the host cost a GPU
    would sit idle through. One thread, so that no OpenMP pool hides or adds to it."""
    ps = _sets.gpt(**FIXED_GPT, device=str(device))
    leaves = len(ps.named())
    repeats = prof["fixed_repeats"]
    peers = C.installed_peers(args.compile_peers, log)
    log(f"[fixed] {leaves} tiny leaves shaped like {ps.description}, one thread, {repeats} repetitions")
    entries = [
        Entry("muonfn", lambda: C.make_functional(ps), repeats),
        Entry("muonfn donated", lambda: C.make_donated(ps), repeats),
    ]
    if has_shim():
        entries.append(Entry("muonfn shim", lambda: C.make_shim(ps), repeats))
    entries += [
        Entry(TORCH_MUON, lambda: C.make_torch_muon(ps), repeats),
        Entry("muonfn adamw", lambda: C.make_functional_adamw(ps), repeats),
        Entry("muonfn adamw donated", lambda: C.make_donated_adamw(ps), repeats),
        Entry(TORCH_ADAMW, lambda: C.make_torch_adamw(ps, foreach=True), repeats),
        *peer_entries(ps, peers, repeats, slow=False),  # the matrices are 8 wide: bf16 costs nothing here
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_interleaved(entries, device, log)
        time_in_a_row(entries, repeats, device)
    finally:
        torch.set_num_threads(threads)
    by_name = {e.name: e for e in entries}
    adamw_steps = {"muonfn adamw", "muonfn adamw donated", TORCH_ADAMW}
    out: dict[str, Any] = {
        "set": ps.name,
        "description": ps.description,
        "leaves": leaves,
        "threads": 1,
        "contenders": {},
    }
    rows = []
    for e in entries:
        # AdamW steps against torch's AdamW, the Muon steps against torch's Muon + AdamW
        reference = TORCH_ADAMW if e.name in adamw_steps else TORCH_MUON
        in_a_row = e.info["in_a_row_ms"] / by_name[reference].info["in_a_row_ms"]
        rec = {
            **entry_record(e),
            "reference": reference,
            "x_reference": e.median / by_name[reference].median,
            "x_reference_in_a_row": in_a_row,
        }
        out["contenders"][e.name] = rec
        rows.append(
            [
                e.name,
                fmt(e.median * 1e3, 2),
                fmt(rec["min_ms"], 2),
                fmt(e.info["in_a_row_ms"], 2),
                reference,
                fmt(rec["x_reference"], 2),
                fmt(in_a_row, 2),
            ]
        )
    ratios = {
        "functional_over_torch_muon": ("muonfn", TORCH_MUON),
        "shim_over_torch_muon": ("muonfn shim", TORCH_MUON),
        "adamw_over_torch_adamw": ("muonfn adamw", TORCH_ADAMW),
    }
    present = {key: (a, b) for key, (a, b) in ratios.items() if a in by_name and b in by_name}
    out["ratios"] = {key: by_name[a].median / by_name[b].median for key, (a, b) in present.items()}
    out["ratios_in_a_row"] = {
        key: by_name[a].info["in_a_row_ms"] / by_name[b].info["in_a_row_ms"] for key, (a, b) in present.items()
    }
    print(
        f"\nFixed cost of one step: {leaves} tiny leaves shaped like {ps.description}; one thread, {repeats} "
        f"interleaved rounds, then {repeats} steps in a row per contender"
    )
    headers = ["contender", "median ms", "min ms", "in a row ms", "reference", "× reference", "× in a row"]
    print(table(headers, rows))
    print("  " + ", ".join(f"{key.replace('_', ' ')}: {value:.2f}×" for key, value in out["ratios"].items()))
    print("  in a row: " + ", ".join(f"{key.replace('_', ' ')}: {v:.2f}×" for key, v in out["ratios_in_a_row"].items()))
    return out


#: the compile section's contenders that step AdamW alone (compared with torch's foreach AdamW)
ADAMW_ALONE = ("torch AdamW foreach", "muonfn adamw", "muonfn adamw compiled")


def section_compile(args: argparse.Namespace, prof: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Eager against ``torch.compile(update + apply_updates, fullgraph=True)`` and the shim's
    ``compile=True``, with the comparisons of the step and elementwise sections timed in the same rounds."""
    ps = _sets.build("gpt", str(device), **prof["gpt"])
    log(f"[compile] torch.compile(fullgraph=True) of the muonfn step on {ps.description}")
    compile_s: dict[str, float] = {}

    def compiled(name: str, make: Any) -> Any:
        t0 = time.perf_counter()
        step = make()
        step()
        synchronize(device)
        compile_s[name] = time.perf_counter() - t0
        log(f"  {name}: compiled in {compile_s[name]:.0f} s")
        return lambda: step

    entries = [
        matmul_entry(device, ns_dtype(device), prof["matmul"], args.repeats),
        Entry("muonfn", lambda: C.make_functional(ps), args.repeats),
        Entry(
            "muonfn compiled", compiled("muonfn compiled", lambda: C.make_functional(ps, compile=True)), args.repeats
        ),
        Entry(
            "muonfn gram compiled",
            compiled("muonfn gram compiled", lambda: C.make_functional(ps, compile=True, ns="gram")),
            args.repeats,
        ),
        Entry("muonfn shim", lambda: C.make_shim(ps), args.repeats),
        Entry(
            "muonfn shim compiled",
            compiled("muonfn shim compiled", lambda: C.make_shim(ps, compile=True)),
            args.repeats,
        ),
        Entry(TORCH_MUON, lambda: C.make_torch_muon(ps), args.repeats),
        Entry("plain fp32 loop", lambda: C.make_plain_loop(ps), args.repeats),
        Entry("torch AdamW foreach", lambda: C.make_torch_adamw(ps, foreach=True), args.repeats),
        Entry("muonfn adamw", lambda: C.make_functional_adamw(ps), args.repeats),
        Entry(
            "muonfn adamw compiled",
            compiled("muonfn adamw compiled", lambda: C.make_functional_adamw(ps, compile=True)),
            args.repeats,
        ),
    ]
    # heavyball is compile-first: its compiled step, and its eager one next to it
    for peer in C.installed_peers(compiled=True, log=log):
        if peer.package == "heavyball":
            entries.append(Entry(peer.name, peer.entry_make(ps), args.repeats, warmup=3 if peer.compiled else 2))
    run_interleaved(entries, device, log)
    for e in entries:
        if e.name == "heavyball Muon compiled":
            # its compilation happens in its warm-up steps (the first runs eagerly, the second
            # compiles): their time, measured with the build, stands for its compile time
            compile_s[e.name] = e.info["build_and_warmup_s"]
    mm = entries[0]
    rate = matmul_flops(prof["matmul"]) / mm.median
    limit = ps.ns_flops() / rate
    out: dict[str, Any] = {
        "set": ps.name,
        "matmul": {"name": mm.name, **entry_record(mm), "gflops": rate / 1e9},
        "ns_limit_ms": limit * 1e3,
        "contenders": {},
    }
    by_name = {e.name: e for e in entries[1:]}
    rows = []
    for e in entries[1:]:
        rec = {**entry_record(e), "compile_s": compile_s.get(e.name)}
        if e.name in ADAMW_ALONE:
            rec["x_torch_foreach"] = e.median / by_name["torch AdamW foreach"].median
        else:
            rec["x_limit"] = e.median / limit
        out["contenders"][e.name] = rec
        ratio = rec.get("x_limit", rec.get("x_torch_foreach"))
        rows.append([e.name, fmt(compile_s.get(e.name, float("nan"))), fmt(e.median * 1e3, 2), fmt(ratio, 2)])
    print(
        f"\ntorch.compile(fullgraph=True) of update + apply_updates, {ps.description}; "
        f"{mm.name}: {rate / 1e9:.1f} GFLOP/s → limit {limit * 1e3:.1f} ms"
    )
    print(table(["contender", "compile s", "median ms", "× limit / × torch foreach"], rows))
    return out


def matmul_probe(prof: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """One fp32 and one bf16 matmul of the same size, interleaved: how much faster (or slower)
    this machine multiplies in bf16, the precision torch.optim.Muon and every peer compute in."""
    size = prof["probe_matmul"]
    entries = [matmul_entry(device, dtype, size, 5) for dtype in (torch.float32, torch.bfloat16)]
    run_interleaved(entries, device, lambda _: None)
    fp32, bf16 = (matmul_flops(size) / e.median / 1e9 for e in entries)
    return {"size": size, "fp32_gflops": fp32, "bf16_gflops": bf16, "bf16_over_fp32": bf16 / fp32}


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets on the first GPT set of the step section (GPT-2 small on CUDA), for
    every muonfn variant measured, and on the first (largest) batch of the ns section."""
    out: dict[str, Any] = {}

    def add(name: str, value: float, target: str, on: str) -> None:
        bound = float(target.split()[-1])
        met = value <= bound if target.startswith("<=") else value >= bound
        out[name] = {"value": value, "target": target, "met": met, "on": on}

    for section in ("step", "compile"):
        records = results.get(section, {})
        on = records.get("set", "")
        if section == "step":
            on, records = next(((k, v) for k, v in records.items() if k.startswith("gpt")), ("", {}))
        c = records.get("contenders", {})
        if "plain fp32 loop" not in c:
            continue
        for name in ("muonfn", "muonfn donated", "muonfn gram", "muonfn compiled", "muonfn gram compiled"):
            if name in c and not (section == "compile" and name == "muonfn"):
                key = name.replace(" ", "_")
                add(f"{key}_x_limit", c[name]["x_limit"], "<= 1.3", on)
                plain = c["plain fp32 loop"]["median_ms"] / c[name]["median_ms"]
                add(f"plain_loop_over_{key}", plain, ">= 1.2", on)
        if section == "step":
            add("torch_muon_over_muonfn", c["muonfn"]["speedup_vs_torch_muon"], ">= 1.0", on)
            # eager muonfn against the fastest of torch.optim.Muon, the plain loop and the eager peers
            fastest = min(c[TORCH_MUON]["median_ms"], c["plain fp32 loop"]["median_ms"])
            fastest = min(fastest, c[records["fastest_peer"]]["median_ms"])
            add("fastest_eager_rival_over_muonfn", fastest / c["muonfn"]["median_ms"], ">= 1.1", on)
            # peak memory above parameters and gradients (construction + warm-up steps)
            torch_peak = c["torch Muon+AdamW"]["peak_mb"]
            for name in ("muonfn shim", "muonfn shim donated"):
                if name in c:
                    over = c[name]["peak_mb"] / torch_peak - 1.0
                    add(f"{name.replace(' ', '_')}_peak_over_torch", over, "<= 0.10", on)
    fixed = results.get("fixed", {})
    bounds = {
        "functional_over_torch_muon": "<= 1.0",
        "shim_over_torch_muon": "<= 1.1",
        "adamw_over_torch_adamw": "<= 1.3",
    }
    for key, value in fixed.get("ratios", {}).items():
        add(f"fixed_{key}", value, bounds[key], f"fixed cost, {fixed['leaves']} leaves")
    batches = results.get("ns", {}).get("batches", {})
    if batches:
        shape, record = next(iter(batches.items()))
        add("ns_batch_x_matmul_rate", record["x_matmul_rate"], ">= 0.6", f"ns batch {shape}")
    adamw_variants = {"elementwise": ("muonfn adamw", "muonfn adamw donated"), "compile": ("muonfn adamw compiled",)}
    for section, names in adamw_variants.items():
        c = results.get(section, {}).get("contenders", {})
        for name in names:
            if name in c:
                overhead = c[name]["x_torch_foreach"] - 1.0
                add(f"{name.replace(' ', '_')}_overhead", overhead, "<= 0.10", results[section].get("set", ""))
    return out


def configure(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, Any], list[str]]:
    """The parsed arguments, the sizes of this run and its sections (checks nothing about the device)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller sets and fewer repeats")
    size.add_argument("--smoke", action="store_true", help="the smallest configuration (a few seconds)")
    p.add_argument("--sections", default=DEFAULT_SECTIONS, help=f"comma-separated, of {','.join(SECTIONS)}")
    p.add_argument(
        "--sets",
        help=f"parameter sets for the step section, of {','.join(_sets.SETS)} "
        f"(default {DEFAULT_SETS['cpu']}; on CUDA {DEFAULT_SETS['cuda']})",
    )
    p.add_argument("--width", type=int, help="GPT width")
    p.add_argument("--depth", type=int, help="GPT depth")
    p.add_argument("--repeats", type=int, help="timed repetitions per contender")
    p.add_argument("--slow-repeats", type=int, help="repetitions of torch.optim.Muon on CPU (bf16 there)")
    p.add_argument(
        "--steps-per-sample",
        type=int,
        help="step section: steps between two synchronisations, a sample's time divided by them (default 5 on CUDA, "
        "where they overlap the host's issue with the device's work, else 1)",
    )
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    p.add_argument(
        "--compile-peers",
        action="store_true",
        help="also step the peers that offer a compiled step (heavyball) compiled, in the step and fixed sections "
        "(tens of seconds of compilation per set)",
    )
    p.add_argument("--out", help="JSON path (default benchmarks/results/<device>-<timestamp>.json)")
    args = p.parse_args(argv)

    profile_name = "smoke" if args.smoke else "quick" if args.quick else "default"
    prof = json.loads(json.dumps(PROFILES[profile_name]))  # a copy
    if args.device.startswith("cuda"):
        prof.update(json.loads(json.dumps(CUDA_SIZES[profile_name])))
    if args.width:
        prof["gpt"]["width"] = args.width
    if args.depth:
        prof["gpt"]["depth"] = args.depth
    if args.slow_repeats:
        prof["slow_repeats"] = args.slow_repeats
    args.repeats = args.repeats or prof["repeats"]
    default_sets = DEFAULT_SETS["cuda" if args.device.startswith("cuda") else "cpu"]
    args.sets = [s for s in (args.sets or default_sets).split(",") if s]
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS) | set(args.sets) - set(_sets.SETS)
    if unknown:
        p.error(f"unknown sections or sets: {sorted(unknown)}")
    return args, prof, sections


def default_out(device: torch.device) -> Path:
    """``benchmarks/results/<device type>-<timestamp>.json``: ``cuda-…`` for a GPU run."""
    return HERE / "results" / f"{device.type}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, prof, sections = configure(argv)
    profile_name = "smoke" if args.smoke else "quick" if args.quick else "default"
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("run.py: error: --device cuda but CUDA is not available")

    started = time.perf_counter()
    results: dict[str, Any] = {
        "machine": machine(device),
        "profile": profile_name,
        "config": {"sizes": prof, "repeats": args.repeats, "sections": sections, "sets": args.sets},
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    run = {
        "step": section_step,
        "ns": section_ns,
        "elementwise": section_elementwise,
        "overhead": section_overhead,
        "fixed": section_fixed,
        "compile": section_compile,
    }
    probe = results["machine"]["matmul_probe"] = matmul_probe(prof, device)
    bf16_units = results["machine"]["cpu_bf16_units"]
    print(
        f"{results['machine']['cpu']}, torch threads: {results['machine']['torch_threads']}; CPU bf16 units: "
        f"{'yes' if bf16_units else 'no'} ({', '.join(results['machine']['cpu_bf16_isa']) or 'no AVX512-BF16/AMX'}); "
        f"one {probe['size']}² matmul on {device.type}: fp32 {probe['fp32_gflops']:.1f} GFLOP/s, "
        f"bf16 {probe['bf16_gflops']:.1f} GFLOP/s ({probe['bf16_over_fp32']:.2g}× fp32)"
    )
    print(describe_ns_rule(results["machine"]["cpu_ns_rule"]))
    for name in sections:
        results[name] = run[name](args, prof, device)
    results["targets"] = targets(results)
    if hasattr(os, "getloadavg"):
        results["machine"]["load_average_at_end"] = list(os.getloadavg())
    results["wall_s"] = time.perf_counter() - started
    if results["targets"]:
        print("\nTargets:")
        for k, v in results["targets"].items():
            print(f"  {k}: {v['value']:.3f} (target {v['target']}, {v['on']}) {'met' if v['met'] else 'MISSED'}")
    out = Path(args.out) if args.out else default_out(device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out} ({results['wall_s']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
