"""Measures every Newton–Schulz coefficient set: singular-value band and error vs the polar factor.

The numbers on the formulas page come from this script (a 256×1024 Gaussian matrix, seed 0);
``tests/test_docs.py`` re-measures them and checks the page.

    python docs/scripts/ns_bands.py
    python docs/scripts/ns_bands.py --summation   # how far fp32 rounding alone moves the fp32 columns

fp32 rounding depends on the CPU: a BLAS sums a matmul's products in an order of its own.
``--summation`` runs the same iteration with its matmuls summed in three orders, from the most
accurate to the least accurate a BLAS uses: in fp64 and rounded once, this machine's BLAS, and
one product after the other in fp32 (the reference BLAS's loop).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import muonfn

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gaussian(rows: int = 256, cols: int = 1024, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def compare(out: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    s = torch.linalg.svdvals(out.double())
    return {
        "sigma_min": s.min().item(),
        "sigma_max": s.max().item(),
        "error": ((out.double() - exact).norm() / exact.norm()).item(),
    }


def measure(name: str, dtype: torch.dtype, rows: int = 256, cols: int = 1024, seed: int = 0) -> dict[str, float]:
    g = gaussian(rows, cols, seed)
    return compare(muonfn.newton_schulz(g, name, dtype=dtype), muonfn.polar(g.double()))


def summed_in_fp64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() @ b.double()).float()


def summed_in_sequence(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(a.shape[0], b.shape[1])
    for k in range(a.shape[1]):
        out.addr_(a[:, k], b[k])
    return out


def iterate(g: torch.Tensor, name: str, matmul: Matmul) -> torch.Tensor:
    """The fp32 iteration of ``muonfn.newton_schulz`` on a wide ``g``, with its matmuls done by ``matmul``."""
    schedule = muonfn.COEFFICIENTS[name]
    x = g / (schedule.norm_factor * torch.linalg.matrix_norm(g))
    eye = torch.eye(x.shape[0])
    for a, b, c in schedule.triples:
        gram = matmul(x, x.mT)
        x = matmul(a * eye + b * gram + c * matmul(gram, gram), x)
    return x


def summation(seed: int = 0) -> None:
    g = gaussian(seed=seed)
    exact = muonfn.polar(g.double())
    orders: dict[str, Matmul] = {"fp64 sums": summed_in_fp64, "this BLAS": torch.mm, "sequential": summed_in_sequence}
    print(f"fp32 error and σ band, matmuls summed in other orders ({'; '.join(orders)})")
    for name in muonfn.COEFFICIENTS:
        cells = []
        for matmul in orders.values():
            r = compare(iterate(g, name, matmul), exact)
            cells.append(f"{r['error']:.2e} [{r['sigma_min']:.7f}, {r['sigma_max']:.7f}]")
        print(f"{name:15s} " + "   ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summation", action="store_true", help="the fp32 columns under other summation orders")
    if parser.parse_args().summation:
        summation()
        return
    print(f"{'set':15s} {'steps':>5s} {'fp32 σ band':>17s} {'fp32 error':>10s} {'bf16 error':>10s}")
    for name, coefficients in muonfn.COEFFICIENTS.items():
        fp32 = measure(name, torch.float32)
        bf16 = measure(name, torch.bfloat16)
        band = f"[{fp32['sigma_min']:.3f}, {fp32['sigma_max']:.3f}]"
        print(f"{name:15s} {len(coefficients.triples):5d} {band:>17s} {fp32['error']:10.2e} {bf16['error']:10.2e}")


if __name__ == "__main__":
    main()
