"""Measures every Newton–Schulz coefficient set: singular-value band and error vs the polar factor.

The numbers on the formulas page come from this script (a 256×1024 Gaussian matrix, seed 0);
``tests/test_docs.py`` re-measures them and checks the page.

    python docs/scripts/ns_bands.py
"""

from __future__ import annotations

import torch

import muonfn


def measure(name: str, dtype: torch.dtype, rows: int = 256, cols: int = 1024, seed: int = 0) -> dict[str, float]:
    g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    exact = muonfn.polar(g.double())
    out = muonfn.newton_schulz(g, name, dtype=dtype).double()
    s = torch.linalg.svdvals(out)
    return {
        "sigma_min": s.min().item(),
        "sigma_max": s.max().item(),
        "error": ((out - exact).norm() / exact.norm()).item(),
    }


def main() -> None:
    print(f"{'set':15s} {'steps':>5s} {'fp32 σ band':>17s} {'fp32 error':>10s} {'bf16 error':>10s}")
    for name, coefficients in muonfn.COEFFICIENTS.items():
        fp32 = measure(name, torch.float32)
        bf16 = measure(name, torch.bfloat16)
        band = f"[{fp32['sigma_min']:.3f}, {fp32['sigma_max']:.3f}]"
        print(f"{name:15s} {len(coefficients.triples):5d} {band:>17s} {fp32['error']:10.2e} {bf16['error']:10.2e}")


if __name__ == "__main__":
    main()
