"""What the two forms of a Newton–Schulz step cost and how accurate each is, in bf16:
``python benchmarks/ns_step_forms.py [--device cuda] [--out F.json]``.

muonfn computes a 16-bit step as :math:`aX + BX` in the matmul's fp32 epilogue
(``baddbmm``), which copies ``X`` into the output and reads it again; fp32 steps as
:math:`(aI + B)X`, the factor formed on the small side and one plain matmul. This times both
forms, five ``keller`` steps on GPT-2 small's and medium's stacked matrix shapes, and
measures each one's rounding: the relative Frobenius distance of its result from the same
iteration in fp64, on well-conditioned Gaussian stacks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import muonfn

SHAPES = {"cuda": [(12, 768, 2304), (24, 768, 3072), (12, 768, 768), (48, 1024, 4096), (24, 1024, 3072)]}
SHAPES["cpu"] = [(4, 128, 384), (8, 128, 512)]


def epilogue_form(X: torch.Tensor, steps: list[tuple[float, float, float]]) -> torch.Tensor:
    for a, b, c in steps:
        A = torch.bmm(X, X.mT)
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)
    return X


def factor_form(X: torch.Tensor, steps: list[tuple[float, float, float]]) -> torch.Tensor:
    for a, b, c in steps:
        A = torch.bmm(X, X.mT)
        P = torch.baddbmm(A, A, A, beta=b, alpha=c)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        X = torch.bmm(P, X)
    return X


def timed_ms(fn: object, X: torch.Tensor, steps: list[tuple[float, float, float]], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if X.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(X, steps)  # type: ignore[operator]
        if X.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device(args.device)
    steps = list(muonfn.COEFFICIENTS["keller"].triples)
    rows = []
    for count, m, n in SHAPES[device.type]:
        g = torch.randn(count, m, n, generator=torch.Generator().manual_seed(0)).to(device)
        X = (g / torch.linalg.matrix_norm(g, keepdim=True)).bfloat16()
        exact = epilogue_form(X.double(), steps)
        row = {"shape": [count, m, n]}
        for name, fn in (("epilogue", epilogue_form), ("factor", factor_form)):
            fn(X, steps)  # warm-up
            row[f"{name}_ms"] = timed_ms(fn, X, steps, args.repeats)
            row[f"{name}_error"] = (
                (torch.linalg.matrix_norm(fn(X, steps).double() - exact) / torch.linalg.matrix_norm(exact)).max().item()
            )
        rows.append(row)
        print(
            f"{count}×{m}×{n}: aX + BX {row['epilogue_ms']:.3f} ms (error {row['epilogue_error']:.2e}), "
            f"(aI + B)X {row['factor_ms']:.3f} ms (error {row['factor_error']:.2e}), "
            f"{row['epilogue_ms'] / row['factor_ms']:.2f}× faster"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
