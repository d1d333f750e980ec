"""muonfn's Triton kernels against the eager ops they replace, one by one, on a model's Muon
matrices: ``python benchmarks/kernels.py [--device cuda] [--set gpt2-small] [--out F.json]``.

For each kernel of ``muonfn/_kernels.py`` (opt-in with ``MUONFN_TRITON=1``), on the matrices
of GPT-2 small (or medium), grouped as muonfn's Newton–Schulz calls group them (one wide shape,
tall matrices transposed), this times the kernel and the eager ops, interleaved, and says
whether their results are the same bits:

- ``ema_nesterov_``: ``torch._foreach_lerp_`` (the momentum) and ``torch._foreach_lerp`` (the
  Nesterov look-ahead), 24 → 16 bytes an fp32 entry;
- ``scaled_stack``: ``torch.stack``, the reciprocals of the norms and the product into bf16,
  14 → 6 bytes an entry (and two ops over the norms fewer);
- ``widened_decayed_``: the widening copy of the bf16 results and ``torch._foreach_add_`` of
  the decay, 18 → 10, into a new batch and into the matrices themselves (the look-ahead's
  memory, where the presets store them: the eager ops copy the wide ones there, the tall ones
  into a batch).

The bytes are the counter's (``benchmarks/traffic.py``); GB/s is them over the median time.
On a CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set here), slowly:
``--smoke`` shrinks the model for that (the suite's smoke test), and its times say nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import _sets  # noqa: E402
import torch  # noqa: E402

from muonfn import _kernels  # noqa: E402
from muonfn.linalg._newton_schulz import Decay, _stored  # noqa: E402

MU, ALPHA, EPS = 0.95, -0.02 * 0.1, 1e-7


def groups(shapes: list[tuple[int, int]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """The matrices' shapes by the wide shape of the Newton–Schulz call they join."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for rows, cols in shapes:
        out.setdefault((min(rows, cols), max(rows, cols)), []).append((rows, cols))
    return out


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


Results = Callable[[], list[torch.Tensor]]


def compare(
    name: str,
    eager: Results,
    kernel: Results,
    entries: int,
    *,
    eager_bytes: int,
    kernel_bytes: int,
    timing: tuple[Results, Results] | None = None,
) -> Callable[[torch.device, int], dict[str, Any]]:
    """A row maker: both sides run once for their results (compared bit for bit), then
    ``repeats`` interleaved timings of ``timing`` (default: the same two)."""

    def row(device: torch.device, repeats: int) -> dict[str, Any]:
        a, b = eager(), kernel()
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        worst = max(((x.double() - y.double()).abs().max().item() for x, y in zip(a, b) if x.numel()), default=0.0)
        runs = timing or (eager, kernel)
        times: dict[str, list[float]] = {"eager": [], "kernel": []}
        for _ in range(repeats):
            times["eager"].append(timed(runs[0], device))
            times["kernel"].append(timed(runs[1], device))
        eager_ms, kernel_ms = statistics.median(times["eager"]), statistics.median(times["kernel"])
        return {
            "kernel": name,
            "entries": entries,
            "eager_ms": eager_ms,
            "kernel_ms": kernel_ms,
            "speedup": eager_ms / kernel_ms,
            "eager_gbps": eager_bytes * entries / eager_ms / 1e6,
            "kernel_gbps": kernel_bytes * entries / kernel_ms / 1e6,
            "eager_bytes_per_entry": eager_bytes,
            "kernel_bytes_per_entry": kernel_bytes,
            "same_bits": same,
            "largest_difference": worst,
        }

    return row


def rows_for(
    shapes: list[tuple[int, int]], device: torch.device
) -> list[Callable[[torch.device, int], dict[str, Any]]]:
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device)

    makers = []
    grads = [randn(*s) for s in shapes]
    momentum = [randn(*s) for s in shapes]
    entries = sum(m.numel() for m in grads)

    def eager_momentum(buf: list[torch.Tensor]) -> list[torch.Tensor]:
        torch._foreach_lerp_(buf, grads, 1.0 - MU)
        return [*buf, *torch._foreach_lerp(grads, buf, MU)]

    def kernel_momentum(buf: list[torch.Tensor]) -> list[torch.Tensor]:
        return [*buf, *_kernels.ema_nesterov_(buf, grads, MU)]

    states = ([b.clone() for b in momentum], [b.clone() for b in momentum])  # (timed: each side steps its own)
    makers.append(
        compare(
            "ema_nesterov_",
            lambda: eager_momentum([b.clone() for b in momentum]),
            lambda: kernel_momentum([b.clone() for b in momentum]),
            entries,
            eager_bytes=24,
            kernel_bytes=16,
            timing=(lambda: eager_momentum(states[0]), lambda: kernel_momentum(states[1])),
        )
    )
    for (rows, cols), members in groups(shapes).items():
        pieces = [randn(r, c) if r <= c else randn(r, c).mT for r, c in members]
        pieces.sort(key=lambda m: m.is_contiguous(), reverse=True)  # wide first, then the tall ones
        turned = sum(not m.is_contiguous() for m in pieces)
        norms = torch.rand(len(pieces), dtype=torch.float64, generator=g).to(device) + 0.5
        count = len(pieces)
        entries = count * rows * cols

        def eager_stack(pieces: list[torch.Tensor] = pieces, norms: torch.Tensor = norms) -> list[torch.Tensor]:
            reciprocal = norms.view(-1, 1, 1).clamp_min(EPS).reciprocal()
            stack = torch.stack(pieces)
            out = torch.empty(stack.shape, dtype=torch.bfloat16, device=device)
            return [torch.mul(stack, reciprocal, out=out)]

        def kernel_stack(pieces: list[torch.Tensor] = pieces, norms: torch.Tensor = norms) -> list[torch.Tensor]:
            return [_kernels.scaled_stack(pieces, norms, torch.bfloat16, EPS, 1.0, False)]

        label = f"scaled_stack {count}×{rows}×{cols} ({turned} tall)"
        makers.append(compare(label, eager_stack, kernel_stack, entries, eager_bytes=14, kernel_bytes=6))
        results = randn(count, rows, cols).to(torch.bfloat16)
        params = [randn(rows, cols) if k < count - turned else randn(cols, rows).mT for k in range(count)]

        def eager_widen(
            results: torch.Tensor = results, params: list[torch.Tensor] = params, turned: int = turned
        ) -> list[torch.Tensor]:
            rows, cols = results.shape[-2:]
            buffer = torch.empty(results.shape, dtype=torch.float32, device=device)
            kept = results.size(0) - turned
            buffer[:kept].copy_(results[:kept])
            tall = buffer[kept:].view(turned, cols, rows)
            tall.mT.copy_(results[kept:])
            out = [*buffer[:kept].unbind(0), *tall.unbind(0)]
            torch._foreach_add_(out, [p if k < kept else p.mT for k, p in enumerate(params)], alpha=ALPHA)
            return [buffer]

        def kernel_widen(
            results: torch.Tensor = results, params: list[torch.Tensor] = params, turned: int = turned
        ) -> list[torch.Tensor]:
            rows, cols = results.shape[-2:]
            kept = results.size(0) - turned
            buffer = torch.empty(results.shape, dtype=torch.float32, device=device)
            tall = buffer[kept:].view(turned, cols, rows)
            outputs = [*buffer[:kept].unbind(0), *(t.mT for t in tall.unbind(0))]
            _kernels.widened_decayed_(outputs, results, turned, list(params), ALPHA)
            return [buffer]

        label = f"widened_decayed_ {count}×{rows}×{cols} ({turned} tall)"
        makers.append(compare(label, eager_widen, kernel_widen, entries, eager_bytes=18, kernel_bytes=10))
        looks = [randn(rows, cols) if k < count - turned else randn(cols, rows) for k in range(count)]
        targets = ([m.clone() for m in looks], [m.clone() for m in looks])  # (each side writes its own)

        def into(
            mine: list[torch.Tensor], kernel: bool, results: torch.Tensor = results, params: list[torch.Tensor] = params
        ) -> list[torch.Tensor]:
            """Newton–Schulz's own store into the matrices (``_stored``), with the kernel or eagerly."""
            kept = len(mine) - sum(m.size(0) > m.size(1) for m in mine)
            pieces = [*mine[:kept], *(m.mT for m in mine[kept:])]
            before = os.environ.get(_kernels.TRITON_VARIABLE)
            os.environ[_kernels.TRITON_VARIABLE] = "1" if kernel else "0"  # (read at the call; a patch costs 80 µs)
            try:
                return _stored(results, pieces, len(mine) - kept, Decay(params, ALPHA), True)
            finally:
                if before is None:
                    del os.environ[_kernels.TRITON_VARIABLE]
                else:
                    os.environ[_kernels.TRITON_VARIABLE] = before

        # (the look-ahead's memory holding the results, as the presets store them: each tall one too)
        label = f"widened_decayed_ into the matrices {count}×{rows}×{cols} ({turned} tall)"
        eager_into = functools.partial(into, targets[0], False)
        kernel_into = functools.partial(into, targets[1], True)
        makers.append(compare(label, eager_into, kernel_into, entries, eager_bytes=18, kernel_bytes=10))
    return makers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--set", default="gpt2-small", choices=sorted(_sets.GPT2_SIZES))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="a shrunk model (the CPU's interpreter)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    sizes = {"width": 32, "depth": 1, "vocab": 64, "context": 16} if args.smoke else {}
    ps = _sets.gpt2(args.set, device="meta", **sizes)
    shapes = ps.matrix_shapes()
    rows = [make(device, args.repeats) for make in rows_for(shapes, device)]
    for r in rows:
        print(
            f"{r['kernel']:45s} eager {r['eager_ms']:8.3f} ms  kernel {r['kernel_ms']:8.3f} ms  "
            f"{r['speedup']:5.2f}x  same bits: {r['same_bits']}"
        )
    record = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton's interpreter)",
        "torch": torch.__version__,
        "set": ps.description,
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
