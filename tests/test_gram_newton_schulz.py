"""Gram Newton–Schulz: the standard iteration's map, computed through the Gram matrix."""

import re

import pytest
import torch
from _strategies import assert_batched_as_alone, bmm_batch_consistent
from hypothesis import given

import muonfn
from muonfn import gram_newton_schulz, newton_schulz, polar, testing
from muonfn.linalg import (
    NewtonSchulz,
    default_restarts,
    gram_newton_schulz_flops,
    newton_schulz_flops,
)

# the default Newton–Schulz dtype is the input's (at least fp32), whatever rule the run forces
pytestmark = pytest.mark.usefixtures("fp32_newton_schulz")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def with_spectrum(s: torch.Tensor, m: int, n: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    """U·diag(s)·Vᵀ with Haar-random U, V (:func:`muonfn.testing.with_spectrum`), in ``dtype``."""
    return testing.with_spectrum(m, n, s.tolist(), torch.Generator().manual_seed(seed)).g.to(dtype)


SPECTRA = {
    "flat": lambda k: torch.ones(k),
    "linear": lambda k: torch.linspace(1.0, 1e-3, k),
    "geometric": lambda k: torch.logspace(0, -8, k),
    "low_rank": lambda k: torch.cat([torch.ones(max(1, k // 8)), torch.zeros(k - max(1, k // 8))]),
}


@pytest.mark.parametrize("coefficients", ["keller", "cesista", "polar_express"])
@pytest.mark.parametrize("spectrum", sorted(SPECTRA))
def test_matches_standard_iteration_fp64_and_fp32(coefficients, spectrum):
    m, n = 24, 80
    x = with_spectrum(SPECTRA[spectrum](m), m, n, seed=1)
    assert rel(gram_newton_schulz(x, coefficients), newton_schulz(x, coefficients)) < 1e-12
    x32 = x.float()
    reference = newton_schulz(x, coefficients)  # fp64
    standard_error = rel(newton_schulz(x32, coefficients), reference)
    gram_error = rel(gram_newton_schulz(x32, coefficients), reference)
    # fp32 rounding: measured within 3× the standard iteration's error on these spectra
    assert gram_error < max(5 * standard_error, 1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_converges_to_the_polar_factor(dtype, tol):
    """polar_express converges: both iterations land on U Vᵀ."""
    x = with_spectrum(torch.linspace(1.0, 0.05, 16), 16, 64, seed=2, dtype=dtype)
    exact = polar(x.double())
    assert rel(gram_newton_schulz(x, "polar_express"), exact) < tol
    assert rel(newton_schulz(x, "polar_express"), exact) < tol


def test_keller_oracle_equal_singular_values():
    """G = c·Q₁Q₂ᵀ with k equal singular values: f(G) = p⁵(1/√k)·Q₁Q₂ᵀ."""
    k, m, n = 4, 12, 40
    x = with_spectrum(torch.full((k,), 3.0), m, n, seed=3)
    s = 1 / k**0.5
    for a, b, c in muonfn.COEFFICIENTS["keller"].triples:
        s = a * s + b * s**3 + c * s**5
    assert rel(gram_newton_schulz(x), s * polar(x)) < 1e-12


@given(
    testing.matrices(
        shapes=("wide", "tall", "square", "batched"),
        max_side=24,
        condition_number=1e6,
        rank_deficient=False,
        scales=(1e-3, 1.0, 1e3),
    )
)
def test_property_agrees_with_standard_fp64(sp: testing.Spectral) -> None:
    x = sp.g
    out = gram_newton_schulz(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel(out, newton_schulz(x)) < 1e-10


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_exact_properties(dtype):
    g = torch.Generator().manual_seed(4)
    # (MKL computes a few matrices with 5–11 rows differently in a batch than alone)
    x = torch.randn(3, 16, 40, generator=g).to(dtype)
    out = gram_newton_schulz(x)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(gram_newton_schulz(-x), -out)
    assert torch.equal(gram_newton_schulz(torch.zeros_like(x)), torch.zeros_like(x))
    assert torch.equal(gram_newton_schulz(x * 8), out)
    assert torch.equal(gram_newton_schulz(x * 2**-6), out)
    assert torch.equal(gram_newton_schulz(x.mT), out.mT)
    looped = torch.stack([gram_newton_schulz(x[i]) for i in range(3)])
    assert_batched_as_alone(
        out, looped, bitwise=bmm_batch_consistent(16, 40, 3, torch.promote_types(dtype, torch.float32))
    )


def test_does_not_modify_input():
    x = torch.randn(5, 9)
    before = x.clone()
    gram_newton_schulz(x, "polar_express")
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spectrum", ["geometric", "low_rank", "linear"])
def test_half_precision_with_default_restarts(dtype, spectrum):
    """Rounding gives R slightly negative eigenvalues that the iteration amplifies; with the
    default restarts 16-bit Gram NS stays about as accurate as the standard iteration."""
    x = with_spectrum(SPECTRA[spectrum](32), 32, 128, seed=5)
    for coefficients in ("keller", "polar_express"):
        reference = newton_schulz(x, coefficients)
        standard = rel(newton_schulz(x.to(dtype), coefficients, dtype=dtype), reference)
        gram = rel(gram_newton_schulz(x.to(dtype), coefficients, dtype=dtype), reference)
        assert gram < 3 * standard


def test_restarts_argument():
    x = torch.randn(6, 20, dtype=torch.float64)
    reference = newton_schulz(x)
    for restarts in [(), (1,), (1, 2, 3, 4), [4, 2]]:
        assert rel(gram_newton_schulz(x, restarts=restarts), reference) < 1e-12
    for bad in [(0,), (5,), (-1,), (2.0,), (True,), 3, "12"]:
        message = rf"restarts must be step indices in \[1, 4\], got {re.escape(repr(bad))}$"
        with pytest.raises(ValueError, match=message):
            gram_newton_schulz(x, restarts=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=message):
            NewtonSchulz(method="gram", restarts=bad)  # type: ignore[arg-type]
    assert default_restarts(5) == (3,)
    assert default_restarts(8) == (3, 6)
    assert default_restarts(3) == ()
    assert default_restarts(5, torch.bfloat16) == (2, 4)
    assert default_restarts(8, torch.float16) == (2, 4, 6)


def test_bad_input():
    with pytest.raises(ValueError, match="m, n"):
        gram_newton_schulz(torch.randn(4))
    with pytest.raises(TypeError, match="floating"):
        gram_newton_schulz(torch.randn(4, 4, dtype=torch.complex64))
    with pytest.raises(TypeError, match="floating"):
        gram_newton_schulz(torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="dtype"):
        gram_newton_schulz(torch.randn(4, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="eps"):
        gram_newton_schulz(torch.randn(4, 4), eps=0.0)
    with pytest.raises(ValueError, match="coefficient"):
        gram_newton_schulz(torch.randn(4, 4), "nope")


def test_flop_counts():
    m, n = 64, 256
    assert newton_schulz_flops(m, n, 5) == 20 * m * m * n + 10 * m**3
    assert newton_schulz_flops(n, m, 5) == newton_schulz_flops(m, n, 5)
    assert gram_newton_schulz_flops(m, n, 5) == 8 * m * m * n + 28 * m**3
    assert gram_newton_schulz_flops(m, n, 5, restarts=()) == 4 * m * m * n + 34 * m**3
    assert gram_newton_schulz_flops(m, n, 5, dtype=torch.bfloat16) == 12 * m * m * n + 22 * m**3
    # the crossover: cheaper exactly once n > 1.5 m (5 steps)
    assert gram_newton_schulz_flops(m, 97, 5) < newton_schulz_flops(m, 97, 5)
    assert gram_newton_schulz_flops(m, 96, 5) == newton_schulz_flops(m, 96, 5)
    assert gram_newton_schulz_flops(m, 97, 5, dtype=torch.bfloat16) < newton_schulz_flops(m, 97, 5)


def test_ns_method_picks_gram_where_cheaper():
    wide = torch.randn(8, 40, dtype=torch.float64)
    square = torch.randn(8, 8, dtype=torch.float64)
    assert torch.equal(NewtonSchulz(method="standard")(wide), newton_schulz(wide))
    gram = NewtonSchulz(method="gram")
    assert torch.equal(gram(wide), gram_newton_schulz(wide))
    assert torch.equal(gram(square), newton_schulz(square))  # no flops to save
    with pytest.raises(ValueError, match="unknown Newton–Schulz method 'svd'"):
        NewtonSchulz(method="svd")  # type: ignore[arg-type]
