"""Newton–Schulz: exact symmetries, spectral mapping against the scalar polynomial, bands, oracles."""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from _strategies import (
    Spectral,
    bmm_batch_consistent,
    composed_polynomial,
    gaussian,
    generator,
    orthogonal,
    orthonormal_columns,
    rel_err,
    spectral_matrices,
    with_spectrum,
)
from hypothesis import assume, given
from hypothesis import strategies as st
from tensordict import TensorDict

import muonfn
from muonfn import COEFFICIENTS, Coefficients, gram_newton_schulz, newton_schulz, polar
from muonfn.linalg import CPU_BF16_MIN_SPEEDUP, CpuBf16Probe, _newton_schulz, default_ns_dtype
from muonfn.linalg._newton_schulz import CPU_NS_DTYPE_VARIABLE

# the default Newton–Schulz dtype is the input's (at least fp32), whatever rule the run forces;
# the tests of the rule set their own
pytestmark = pytest.mark.usefixtures("fp32_newton_schulz")

ROOT = pathlib.Path(__file__).resolve().parents[1]

SETS = sorted(COEFFICIENTS)
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]

# Spectral mapping, max abs error on the singular values (which are ~1). fp64/fp32 as REFERENCE.md;
# bf16 measured here up to 0.054 (keller), 0.026 (cesista), 0.005 (polar_express) on ≤12×12 inputs.
# fp32 at σ/‖G‖ = 1e-3: the input's rounding times the map's slope there (~480), up to ~5e-5.
SPECTRAL_TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
SPECTRAL_TOL_BF16 = {"keller": 0.08, "cesista": 0.05, "polar_express": 0.02}


def ns(x: torch.Tensor, coefficients: object = "keller", **kw: object) -> torch.Tensor:
    return newton_schulz(x, coefficients, **kw)  # type: ignore[arg-type]


def expected_svdvals(sp: Spectral, coefficients: str | Coefficients) -> torch.Tensor:
    """sorted p(σᵢ / (c‖G‖_F)), zeros for the null space, from the coefficients alone."""
    c = COEFFICIENTS[coefficients] if isinstance(coefficients, str) else coefficients
    full = torch.zeros(min(sp.g.shape), dtype=torch.float64)
    full[: len(sp.s)] = sp.s
    return composed_polynomial(c, full / (c.norm_factor * sp.s.norm())).sort().values


def svdvals(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.to("cpu", torch.float64)).sort().values


# --- exact (bitwise) symmetries -------------------------------------------------------------------


@given(spectral_matrices(), st.sampled_from(SETS), st.sampled_from(DTYPES))
def test_odd_and_zero_at_zero(device: torch.device, sp: Spectral, name: str, dtype: torch.dtype) -> None:
    g = sp.g.to(device, dtype)
    assert torch.equal(ns(-g, name), -ns(g, name))
    zero = ns(torch.zeros_like(g), name)
    assert torch.equal(zero, torch.zeros_like(g))
    assert not zero.signbit().any()


@given(spectral_matrices(), st.sampled_from(SETS), st.sampled_from(DTYPES), st.integers(-6, 6))
def test_power_of_two_scale_invariance(
    device: torch.device, sp: Spectral, name: str, dtype: torch.dtype, k: int
) -> None:
    g = sp.g.to(device, dtype)
    scaled = g * 2.0**k
    # the property needs the input itself to scale exactly (no fp16 overflow or subnormals)
    # and both norms above eps, where the clamp makes the map linear instead
    assume(bool(torch.isfinite(scaled).all()) and torch.equal(scaled / 2.0**k, g))
    assume(min(g.double().norm(), scaled.double().norm()) > 1e-7)
    assert torch.equal(ns(scaled, name), ns(g, name))


@given(
    spectral_matrices(),
    st.sampled_from(SETS),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    st.integers(-120, 120),
    st.sampled_from(["standard", "gram"]),
)
def test_scale_invariance_across_the_whole_exponent_range(
    sp: Spectral, name: str, dtype: torch.dtype, k: int, method: str
) -> None:
    """f(2ᵏG) = f(G) bitwise for |k| up to 120: entries near fp32's maximum (2¹²⁰ ≈ 1.3e36) square
    to infinity, so the norm is taken after an exact power-of-two rescaling by the largest entry."""
    base = 0 if k >= 0 else 100  # keep ‖2ᵏG‖ above eps, where the map is scale invariant
    g = (sp.g * 2.0**base).to(dtype)
    # both norms above eps (where the map is scale invariant), and 2ᵏG finite
    assume(float(sp.g.norm()) * 2.0 ** min(0, base + k) > 1e-6 and bool(torch.isfinite(g * 2.0**k).all()))
    f = muonfn.NewtonSchulz(name, method=method)  # type: ignore[arg-type]
    reference = f(sp.g.to(dtype))
    assert torch.equal(f(g), reference)
    assert torch.equal(f(g * 2.0**k), reference)


def test_large_finite_gradients_are_orthogonalized_not_zeroed() -> None:
    """‖G‖_F of 1e18-scale fp32 entries overflows when squared directly; the result must not be zero."""
    g = gaussian(16, 32, seed=11)
    expected = ns(g, "polar_express")
    for scale in (1e18, 1e30, 3e37):
        out = ns(g * scale, "polar_express")
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(muonfn.gram_newton_schulz(g * scale, "polar_express"), expected, rtol=0, atol=1e-4)


@given(spectral_matrices(), st.sampled_from(SETS), st.sampled_from(DTYPES))
def test_transpose_equivariance(sp: Spectral, name: str, dtype: torch.dtype) -> None:
    g = sp.g.to(dtype)
    if g.size(-2) != g.size(-1):
        # the orientation follows the shape, so both sides iterate on the same wide matrix
        assert torch.equal(ns(g.mT, name), ns(g, name).mT)
    else:
        # square: Gᵀ iterates on GᵀG where G iterates on GGᵀ, equal up to rounding
        tol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 5e-2)
        torch.testing.assert_close(ns(g.mT, name), ns(g, name).mT, atol=tol, rtol=tol)


@given(st.integers(2, 5), st.integers(1, 24), st.integers(1, 24), st.sampled_from(SETS), st.integers(0, 2**31 - 1))
def test_batched_equals_looped(batch: int, m: int, n: int, name: str, seed: int) -> None:
    x = gaussian(batch, 2, m, n, seed=seed)
    x[0, 1] = 0.0  # a zero matrix in the batch must not disturb the others
    out = ns(x, name)
    assert out.shape == x.shape
    looped = torch.stack([torch.stack([ns(x[i, j], name) for j in range(2)]) for i in range(batch)])
    if bmm_batch_consistent(m, n, 2 * batch):
        assert torch.equal(out, looped)
    else:
        torch.testing.assert_close(out, looped, atol=1e-5, rtol=0)
    assert torch.equal(out[0, 1], torch.zeros(m, n))


def test_batched_equals_looped_on_consistent_shapes() -> None:
    x = gaussian(6, 16, 40, seed=1)
    if not bmm_batch_consistent(16, 40, 6):  # the hypothesis test above holds it to rounding then
        pytest.skip("this BLAS computes a 16×40 matrix differently in a batch of 6 than alone")
    for name in SETS:
        assert torch.equal(ns(x, name), torch.stack([ns(m, name) for m in x]))


# --- equivariance and spectral mapping, to tolerance ----------------------------------------------


@given(spectral_matrices(), st.sampled_from(SETS), st.integers(0, 2**31 - 1))
def test_orthogonal_equivariance(sp: Spectral, name: str, seed: int) -> None:
    m, n = sp.g.shape
    gen = generator(seed)
    u, v = orthogonal(m, gen), orthogonal(n, gen)
    rotated = u @ sp.g @ v.T
    assert rel_err(ns(rotated, name), u @ ns(sp.g, name) @ v.T) < 1e-12
    f32 = ns(rotated.float(), name)
    assert rel_err(f32, u @ ns(sp.g.float(), name).double() @ v.T) < 1e-4


@given(spectral_matrices(rank_deficient=False), st.sampled_from(SETS), st.sampled_from([torch.float64, torch.float32]))
def test_spectral_mapping(sp: Spectral, name: str, dtype: torch.dtype) -> None:
    got = svdvals(ns(sp.g.to(dtype), name))
    assert (got - expected_svdvals(sp, name)).abs().max() < SPECTRAL_TOL[dtype]


@given(spectral_matrices(min_sigma=0.1), st.sampled_from(SETS))
def test_spectral_mapping_bf16(device: torch.device, sp: Spectral, name: str) -> None:
    """Well-conditioned spectra only: bf16 cannot resolve σ below ~1% of ‖G‖ (REFERENCE.md)."""
    got = svdvals(ns(sp.g.to(device, torch.bfloat16), name, dtype=torch.bfloat16))
    assert (got - expected_svdvals(sp, name)).abs().max() < SPECTRAL_TOL_BF16[name]


@given(spectral_matrices(rank_deficient=True), st.sampled_from(SETS))
def test_spectral_mapping_rank_deficient_fp64(sp: Spectral, name: str) -> None:
    got = svdvals(ns(sp.g, name))
    assert (got - expected_svdvals(sp, name)).abs().max() < SPECTRAL_TOL[torch.float64]


@given(spectral_matrices(rank_deficient=True), st.sampled_from(SETS), st.sampled_from([torch.float64, torch.float32]))
def test_null_space_preserved(sp: Spectral, name: str, dtype: torch.dtype) -> None:
    """f(G) = U p(Σ) Vᵀ with p(0) = 0: G's left and right null spaces stay null."""
    out = ns(sp.g.to(dtype), name).double()
    r = sp.rank
    tol = 1e-10 if dtype == torch.float64 else 1e-3
    assert (out @ sp.v[:, r:]).abs().max() < tol
    assert (sp.u[:, r:].T @ out).abs().max() < tol
    assert svdvals(out).max() > 0.5  # not trivially zero


@pytest.mark.parametrize(
    ("name", "band", "error"),
    [("keller", (0.68, 1.14), 0.153), ("cesista", (0.97, 1.04), 0.017), ("polar_express", (0.99, 1.01), 0.0)],
)
def test_band_and_error_on_gaussian(name: str, band: tuple[float, float], error: float, device: torch.device) -> None:
    """σ band and relative Frobenius error vs UVᵀ on a 256×1024 Gaussian in fp32 (REFERENCE.md's table)."""
    g = gaussian(256, 1024, seed=0)
    out = ns(g.to(device), name, dtype=torch.float32).cpu()
    s = svdvals(out)
    assert band[0] <= s.min() and s.max() <= band[1]
    assert abs(rel_err(out, polar(g.double())) - error) < 0.005


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize(("m", "n", "k"), [(6, 9, 1), (6, 9, 4), (9, 6, 6), (8, 8, 8)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_equal_singular_values_oracle(name: str, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    """G = c·Q₁Q₂ᵀ with k equal singular values: every σ/‖G‖ is 1/√k, so f(G) = p(1/(f·√k))·Q₁Q₂ᵀ."""
    gen = generator(m * n * k)
    q = orthonormal_columns(m, k, gen) @ orthonormal_columns(n, k, gen).T
    factor = composed_polynomial(name, torch.tensor(1 / (COEFFICIENTS[name].norm_factor * k**0.5), dtype=torch.float64))
    expected = factor * q
    # fp32: rounding noise in the null space (k < min(m, n)) is amplified by p'(0) (~6300 for polar_express)
    tol = 1e-12 if dtype == torch.float64 else 1e-5 if k == min(m, n) else 1e-3
    assert (ns((3.7 * q).to(dtype), name).double() - expected).abs().max() < tol


def test_polar_matches_svd_factor() -> None:
    gen = generator(0)
    full = with_spectrum(7, 11, [3.0, 2.0, 1.0, 0.5, 0.1, 0.01, 0.001], gen)
    assert rel_err(polar(full.g), full.u[:, :7] @ full.v[:, :7].T) < 1e-12
    deficient = with_spectrum(7, 11, [3.0, 1.0, 0.5], gen)
    expected = deficient.u[:, :3] @ deficient.v[:, :3].T
    assert rel_err(polar(deficient.g), expected) < 1e-12
    assert polar(deficient.g.float()).dtype == torch.float32
    assert torch.equal(polar(torch.zeros(3, 4)), torch.zeros(3, 4))
    batch = torch.stack([full.g[:, :7], deficient.g[:, 4:]])
    assert torch.allclose(polar(batch)[1], polar(deficient.g[:, 4:]), atol=1e-12)


# --- schedules --------------------------------------------------------------------------------------


def stretched(name: str, steps: int) -> Coefficients:
    triples = list(COEFFICIENTS[name].triples)
    while len(triples) < steps:
        triples.append(triples[-1])
    return Coefficients(tuple(triples[:steps]), COEFFICIENTS[name].norm_factor)


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("steps", [1, 3, 12])
def test_steps_truncate_or_repeat_the_last_triple(name: str, steps: int) -> None:
    sp = with_spectrum(5, 8, [1.0, 0.7, 0.2, 0.05, 0.01], generator(steps))
    got = svdvals(ns(sp.g, name, steps=steps))
    assert (got - expected_svdvals(sp, stretched(name, steps))).abs().max() < 1e-10
    default = svdvals(ns(sp.g, name))
    if steps < len(COEFFICIENTS[name].triples):
        assert (got - default).abs().max() > 1e-6  # the step count matters


def test_custom_triples() -> None:
    sp = with_spectrum(6, 4, [1.0, 0.6, 0.3, 0.1], generator(1))
    triples = [[3.0, -3.2, 1.2], (2.0, -1.5, 0.5)]
    got = svdvals(ns(sp.g, triples))
    assert (got - expected_svdvals(sp, Coefficients(((3.0, -3.2, 1.2), (2.0, -1.5, 0.5))))).abs().max() < 1e-10
    longer = svdvals(ns(sp.g, triples, steps=4))
    expected = expected_svdvals(sp, Coefficients(((3.0, -3.2, 1.2),) + ((2.0, -1.5, 0.5),) * 3))
    assert (longer - expected).abs().max() < 1e-10
    custom = Coefficients(((3.0, -3.2, 1.2),), norm_factor=1.5)
    assert (svdvals(ns(sp.g, custom)) - expected_svdvals(sp, custom)).abs().max() < 1e-10


def test_one_triple_with_steps_is_torchs_iteration() -> None:
    """torch.optim.Muon's ns_coefficients=(a, b, c), ns_steps=5 is [(a, b, c)] with steps=5."""
    g = gaussian(5, 7, seed=2, dtype=torch.float64)
    assert torch.equal(ns(g, [(3.4445, -4.7750, 2.0315)], steps=5), ns(g, "keller"))
    assert torch.equal(ns(g, [(3.4445, -4.7750, 2.0315)], steps=2), ns(g, "keller", steps=2))


# --- dtypes, precision, purity --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_returns_input_dtype_and_never_mutates(dtype: torch.dtype, device: torch.device) -> None:
    for shape in [(5, 8), (8, 5), (3, 5, 8), (2, 3, 8, 5)]:
        x = gaussian(*shape, seed=len(shape), dtype=dtype).to(device)
        before = x.clone()
        for ns_dtype in (None, torch.float32, torch.bfloat16, dtype):
            out = ns(x, "polar_express", dtype=ns_dtype)
            assert out.dtype == dtype and out.shape == x.shape and out.device == x.device
            assert torch.equal(x, before)
            out.add_(1.0)  # the result never aliases the input
            assert torch.equal(x, before)


@pytest.mark.parametrize("shape", [(40, 24), (3, 40, 24), (2, 512, 256)])
def test_a_contiguous_tall_input_gives_a_contiguous_result(shape: tuple[int, ...]) -> None:
    """The result of a tall matrix is written out in the input's layout (the largest by
    tiled 2-D copies), with the values of the transposed wide iteration."""
    x = gaussian(*shape, seed=9)
    out = newton_schulz(x, dtype=torch.float32)
    assert out.is_contiguous()
    assert torch.equal(out, newton_schulz(x.mT.contiguous(), dtype=torch.float32).mT)
    as_view = x.mT.contiguous().mT  # the same tall matrix stored transposed keeps that layout
    assert as_view.mT.is_contiguous() and newton_schulz(as_view, dtype=torch.float32).mT.is_contiguous()


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overwriting_the_input_gives_the_same_bits(method: str, dtype: torch.dtype) -> None:
    ns_map = muonfn.NewtonSchulz(method=method, dtype=dtype)
    x = gaussian(4, 16, 64, seed=4)
    kept = ns_map(x)
    assert torch.equal(kept, ns_map.orthogonalize(x.clone(), overwrite_input=True))
    assert torch.equal(kept, ns_map(x.mT.contiguous().mT))  # copied to be made contiguous, then reused


def test_fp16_does_not_overflow() -> None:
    """fp16 inputs near fp16's max: ‖G‖² would overflow in fp16, so the norm is taken in fp32."""
    x = (gaussian(32, 48, seed=3) * 2e4).clamp(-6e4, 6e4).half()
    reference = ns(x.float(), "cesista")
    for ns_dtype in (None, torch.float16):
        out = ns(x, "cesista", dtype=ns_dtype)
        assert out.dtype == torch.float16 and torch.isfinite(out).all()
        assert rel_err(out, reference) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_and_zero_matrices_give_no_nan(dtype: torch.dtype, device: torch.device) -> None:
    tiny = torch.full((4, 6), torch.finfo(dtype).tiny, dtype=dtype, device=device)
    zeros = torch.zeros(3, 4, 6, dtype=dtype, device=device)
    for x in (zeros, tiny, -tiny):
        out = ns(x, "polar_express")
        assert torch.isfinite(out).all()
    assert torch.equal(ns(zeros), zeros)


def test_below_eps_the_map_is_linear_and_continuous() -> None:
    """‖G‖ < eps: X₀ = G/eps, so halving G halves X₀ (no longer scale invariant), and f → 0 as G → 0."""
    g = gaussian(4, 6, seed=4, dtype=torch.float64)
    g = g / g.norm() * 1e-12
    small, smaller = ns(g, steps=1), ns(g / 2, steps=1)
    torch.testing.assert_close(smaller, small / 2, rtol=1e-8, atol=0)
    assert not torch.allclose(smaller, small)
    assert small.abs().max() < 1e-2


#: What the probe measured on the two CPUs with AVX512-BF16 (1 ms of fp32 products): bf16 2.2× faster
#: on an AMD EPYC, 0.55× as fast on an Intel Xeon without AMX
FAST_BF16 = CpuBf16Probe(fp32_seconds=1e-3, bf16_seconds=1e-3 / 2.2)
SLOW_BF16 = CpuBf16Probe(fp32_seconds=1e-3, bf16_seconds=1e-3 / 0.55)


def measured(monkeypatch, probe: CpuBf16Probe) -> list[None]:
    """Makes the CPU rule read ``probe``; the list grows by one for each time the rule asks."""
    calls: list[None] = []
    monkeypatch.setattr(_newton_schulz, "cpu_bf16_probe", lambda: calls.append(None) or probe)
    return calls


@pytest.mark.parametrize("probe", [FAST_BF16, SLOW_BF16], ids=["bf16-faster", "bf16-slower"])
def test_default_ns_dtype_on_cpu_follows_the_measured_speed(monkeypatch, probe: CpuBf16Probe) -> None:
    """``auto``: bf16 on a CPU whose bf16 matmuls were measured faster, for matrices of at least
    ``CPU_BF16_MIN_WORK`` (``m²n``), else fp32; fp64 inputs keep fp64 on either."""
    monkeypatch.setenv(CPU_NS_DTYPE_VARIABLE, "auto")
    measured(monkeypatch, probe)
    x = gaussian(64, 96, seed=5, dtype=torch.float32)  # m²n = 393,216
    expected = torch.bfloat16 if probe is FAST_BF16 else torch.float32
    for matrices in (x, x.mT, x.expand(3, 64, 96)):
        assert torch.equal(ns(matrices), ns(matrices, dtype=expected))
    assert not torch.equal(ns(x, dtype=torch.float32), ns(x, dtype=torch.bfloat16))
    small = gaussian(32, 96, seed=5, dtype=torch.float32)  # 98,304: the bf16 kernels' fixed cost outweighs their speed
    assert torch.equal(ns(small), ns(small, dtype=torch.float32))
    assert not torch.equal(ns(small, dtype=torch.float32), ns(small, dtype=torch.bfloat16))
    y = gaussian(64, 96, seed=5, dtype=torch.float64)
    assert torch.equal(ns(y), ns(y, dtype=torch.float64))


def test_a_cpu_with_bf16_instructions_but_slower_bf16_matmuls_keeps_fp32(monkeypatch) -> None:
    """The instruction set does not decide: an Intel Xeon with AVX512-BF16 and no AMX multiplies
    bf16 at about half fp32's speed, so the default step stays in fp32 there."""
    monkeypatch.setenv(CPU_NS_DTYPE_VARIABLE, "auto")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    measured(monkeypatch, SLOW_BF16)
    cpu = torch.device("cpu")
    assert default_ns_dtype(cpu, torch.float32, (768, 3072)) == torch.float32
    x = gaussian(64, 96, seed=5, dtype=torch.float32)
    assert torch.equal(ns(x), ns(x, dtype=torch.float32))
    params = TensorDict({"w": x}, batch_size=[])
    tx, pinned = muonfn.muon(lr=0.02), muonfn.muon(lr=0.02, ns_dtype=torch.float32)
    updates, _ = tx.update(params, tx.init(params), params)
    assert torch.equal(updates["w"], pinned.update(params, pinned.init(params), params)[0]["w"])


def test_the_speed_margin_decides() -> None:
    """bf16 counts as faster from ``CPU_BF16_MIN_SPEEDUP`` times fp32's speed on (1.3)."""
    assert CPU_BF16_MIN_SPEEDUP == 1.3
    assert FAST_BF16.bf16_faster and not SLOW_BF16.bf16_faster
    assert CpuBf16Probe(fp32_seconds=1.3, bf16_seconds=1.0).bf16_faster
    assert not CpuBf16Probe(fp32_seconds=1.2, bf16_seconds=1.0).bf16_faster  # faster, but not clearly
    record = SLOW_BF16.as_dict()
    assert record == {**record, "fp32_seconds": 1e-3, "min_speedup": 1.3, "bf16_faster": False}
    assert record["speedup"] == pytest.approx(0.55)


@pytest.mark.parametrize(("shape", "bf16"), [((8, 24), False), ((24, 8), False), ((64, 64), True), ((48, 144), True)])
def test_the_cpu_rule_reads_one_matrix_work(monkeypatch, shape: tuple[int, int], bf16: bool) -> None:
    monkeypatch.setenv(CPU_NS_DTYPE_VARIABLE, "auto")
    calls = measured(monkeypatch, FAST_BF16)
    cpu = torch.device("cpu")
    assert (default_ns_dtype(cpu, torch.float32, shape) == torch.bfloat16) == bf16
    assert len(calls) == bf16  # small matrices never ask the probe
    assert default_ns_dtype(cpu, torch.float32, (100, *shape)) == default_ns_dtype(cpu, torch.float32, shape)
    assert default_ns_dtype(cpu, torch.float32) == torch.bfloat16  # no shape: any size
    monkeypatch.setenv(CPU_NS_DTYPE_VARIABLE, "bfloat16")
    assert default_ns_dtype(cpu, torch.float32, shape) == torch.bfloat16


@pytest.mark.parametrize(("choice", "expected"), [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_the_environment_pins_the_cpu_ns_dtype_without_a_probe(monkeypatch, choice: str, expected: torch.dtype) -> None:
    for probe in (FAST_BF16, SLOW_BF16):
        calls = measured(monkeypatch, probe)
        monkeypatch.setenv(CPU_NS_DTYPE_VARIABLE, choice)
        assert default_ns_dtype(torch.device("cpu"), torch.float32, (768, 3072)) == expected
        assert default_ns_dtype(torch.device("cpu"), torch.bfloat16) == expected
        assert calls == []
    monkeypatch.setenv(CPU_NS_DTYPE_VARIABLE, "fp8")
    with pytest.raises(ValueError, match="MUONFN_CPU_NS_DTYPE='fp8'; choose one of"):
        default_ns_dtype(torch.device("cpu"), torch.float32)


def test_the_probe_runs_once_per_process_when_the_rule_first_needs_it() -> None:
    """Not at import, not for small matrices, not while the environment pins the rule; then once,
    however many steps follow, and the default dtype is its answer (whichever way it goes)."""
    code = """
import json, os
import torch
import muonfn
from muonfn.linalg import cpu_bf16_probe
calls = [cpu_bf16_probe.cache_info().misses]
os.environ["MUONFN_CPU_NS_DTYPE"] = "float32"
big = torch.randn(64, 96)
muonfn.newton_schulz(big)
os.environ["MUONFN_CPU_NS_DTYPE"] = "auto"
muonfn.newton_schulz(torch.randn(32, 96))
calls.append(cpu_bf16_probe.cache_info().misses)
model = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.Linear(64, 96))
opt = muonfn.optim.Muon(model.named_parameters(), lr=1e-3, adamw_lr=1e-3)
for _ in range(3):
    model(torch.randn(4, 96)).square().mean().backward()
    opt.step()
    muonfn.newton_schulz(big)
info = cpu_bf16_probe.cache_info()
probe = cpu_bf16_probe()
answer = torch.bfloat16 if probe.bf16_faster else torch.float32
same = torch.equal(muonfn.newton_schulz(big), muonfn.newton_schulz(big, dtype=answer))
print(json.dumps({"calls": [*calls, info.misses], "hits": info.hits, "probe": probe.as_dict(), "same": same}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "-c", code]
    done = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["calls"] == [0, 0, 1]
    assert out["hits"] >= 3 and out["same"]
    probe = out["probe"]
    assert isinstance(probe["bf16_faster"], bool)
    assert probe["fp32_seconds"] > 0 and probe["bf16_seconds"] > 0
    assert probe["bf16_faster"] == (probe["fp32_seconds"] >= CPU_BF16_MIN_SPEEDUP * probe["bf16_seconds"])


def test_the_probe_times_real_cpu_matmuls_whatever_is_active() -> None:
    """Under autocast, a meta device context and a dispatch mode (a tracer, an op counter) the probe
    still multiplies real fp32 and bf16 CPU matrices, leaves nothing for the mode to see, draws no
    numbers from torch's generator and leaves the thread count as it was."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[object] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.device("meta"), Ops() as ops:
            probe = _newton_schulz.cpu_bf16_probe.__wrapped__()  # a fresh measurement, the cache left alone
        assert torch.get_num_threads() == 2  # it times one thread, then gives the process its own back
    finally:
        torch.set_num_threads(threads)
    assert ops.seen == []
    assert torch.equal(torch.get_rng_state(), rng)
    assert 0 < probe.fp32_seconds < math.inf and 0 < probe.bf16_seconds < math.inf


@pytest.mark.parametrize("choice", ["auto", "bfloat16"])
@pytest.mark.parametrize("shape", [(8, 12), (64, 96)], ids=["small", "probed"])
def test_the_default_dtype_compiles_without_a_graph_break(monkeypatch, choice: str, shape: tuple[int, int]) -> None:
    """The probe and the environment are read while tracing: a full graph, the eager bits. The
    probe's first measurement is taken there (a cache of its own here), outside the trace."""
    probe = functools.cache(_newton_schulz.cpu_bf16_probe.__wrapped__)
    monkeypatch.setattr(_newton_schulz, "cpu_bf16_probe", probe)
    monkeypatch.setenv(CPU_NS_DTYPE_VARIABLE, choice)
    torch._dynamo.reset()
    x = gaussian(*shape, seed=6, dtype=torch.float32)
    compiled = torch.compile(lambda g: ns(g), fullgraph=True, backend="aot_eager")
    out = compiled(x)
    assert probe.cache_info().misses == (choice == "auto" and shape == (64, 96))
    assert torch.equal(out, ns(x))
    assert out.dtype == torch.float32


def test_rectangular_and_degenerate_shapes() -> None:
    for shape in [(1, 1), (1, 7), (7, 1), (0, 4), (2, 0, 3), (3, 1, 5)]:
        x = torch.randn(shape, dtype=torch.float64)
        out = ns(x, "polar_express")
        assert out.shape == x.shape
        if x.numel() and min(shape[-2:]) == 1:  # a vector's polar factor is its direction
            torch.testing.assert_close(out, x / torch.linalg.matrix_norm(x, keepdim=True), atol=1e-6, rtol=0)


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (3, 0, 5), (0, 4, 4)])
def test_an_empty_matrix_maps_to_an_empty_result(shape: tuple[int, ...]) -> None:
    x = torch.zeros(shape)
    for out in (newton_schulz(x), gram_newton_schulz(x), muonfn.polar(x), muonfn.qr_orthogonal(x)):
        assert out.shape == shape and out.dtype == x.dtype


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_exact_maps_give_nan_for_a_matrix_that_is_not_finite(bad: float) -> None:
    """The SVD would raise on it; as Newton–Schulz does, polar and QR give that matrix NaN and
    the others their own results, so that apply_if_finite can skip the step."""
    x = gaussian(3, 6, 4, seed=2)
    x[1, 2, 3] = bad
    for f in (muonfn.polar, muonfn.qr_orthogonal):
        out = f(x)
        assert out[1].isnan().all() if f is muonfn.polar else out[1].isnan().any()
        assert torch.equal(out[0::2], f(x[0::2]))


def _normalised_by_formula(x: torch.Tensor, f: muonfn.NewtonSchulz, dtype: torch.dtype) -> torch.Tensor:
    """``G · (1 / max(c‖G‖, ε))`` in fp64, rounded once to ``dtype``."""
    G = x.double()
    norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True) * f.schedule.norm_factor
    denominator = norm + f.eps if f.eps_mode == "add" else norm.clamp_min(f.eps)
    return (G * denominator.reciprocal()).to(dtype)


@pytest.mark.parametrize("ns_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eps_mode", ["clamp", "add"])
def test_off_the_cpu_an_fp32_input_is_normalised_in_two_passes(monkeypatch, ns_dtype, eps_mode: str) -> None:
    """Off the CPU, into a narrower dtype, an fp32 G's norm is accumulated in fp64 and G times the
    fp64 reciprocal of the denominator is rounded into the narrow dtype as it is stored. Forced
    here on the CPU: the formula's bits, for huge, tiny, zero and ordinary matrices, overwritten
    or not; the CPU's bits where nothing is narrowed; the same map within bf16's rounding
    elsewhere; and still f(2ᵏG) = f(G) (``"clamp"``) and f(-G) = -f(G) bit for bit."""
    g = gaussian(3, 12, 20, seed=5)
    cases = [g, g * 3e37, g * 1e-40, torch.zeros_like(g)]
    f = muonfn.NewtonSchulz("polar_express", dtype=ns_dtype, eps_mode=eps_mode)  # type: ignore[arg-type]
    dtype = f.dtype or torch.float32
    cpu = [f(x) for x in cases]
    monkeypatch.setattr(_newton_schulz, "cpu_passes", lambda t: False)
    for x in cases if ns_dtype is not None else ():
        got = _newton_schulz._normalized(x.clone(), f.schedule, f.eps, dtype, None, eps_mode)
        assert torch.equal(got, _normalised_by_formula(x, f, dtype))
    narrow = [f(x) for x in cases]
    assert torch.equal(f.orthogonalize(g.clone(), overwrite_input=True), narrow[0])
    assert torch.equal(f(g.mT), narrow[0].mT)
    assert torch.equal(f(-g), -narrow[0]) and torch.equal(narrow[3], torch.zeros_like(g))
    for k in (-10, 40) if eps_mode == "clamp" else ():  # (‖2ᵏG‖ above eps; "add" is not scale invariant)
        assert torch.equal(f(g * 2.0**k), narrow[0])
    for a, b in zip(cpu, narrow):
        if ns_dtype is None:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, atol=0.05, rtol=0)


def test_the_fp64_norms_are_each_matrixs_own_batched_vmapped_or_alone() -> None:
    """The GPU form's norms (one multi-tensor norm, squares added in fp64): a matrix's norm is
    the same bits alone, in any batch, and under ``vmap`` whichever dimension it maps; they are
    finite for entries near fp32's maximum and nonzero for subnormal ones."""
    x = gaussian(3, 4, 12, 20, seed=9)
    norms = _newton_schulz._fp64_norms(x)
    assert norms.shape == (3, 4, 1, 1) and norms.dtype == torch.float64
    alone = torch.stack([_newton_schulz._fp64_norms(m[None]).view(()) for m in x.reshape(12, 12, 20)])
    assert torch.equal(norms.view(12), alone)
    assert torch.equal(torch.vmap(_newton_schulz._fp64_norms)(x), norms)
    turned = torch.vmap(_newton_schulz._fp64_norms, in_dims=1, out_dims=1)(
        x.transpose(0, 1).contiguous().transpose(0, 1)
    )
    assert torch.equal(turned, norms)
    torch.testing.assert_close(
        norms, torch.linalg.vector_norm(x.double(), dim=(-2, -1), keepdim=True), atol=0, rtol=1e-14
    )
    huge = _newton_schulz._fp64_norms(torch.full((1, 8, 8), 3e38))
    assert torch.isfinite(huge).all() and huge.item() == pytest.approx(8 * 3e38, rel=1e-6)
    assert _newton_schulz._fp64_norms(torch.full((1, 8, 8), 1e-44)).item() > 0
    assert _newton_schulz._fp64_norms(torch.zeros(0, 3, 4)).shape == (0, 1, 1)


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float16])
def test_vmap_over_a_call_with_a_matrix_the_members_share_runs_in_the_gpu_form(monkeypatch, ns_dtype) -> None:
    """Under ``vmap`` one Newton–Schulz call may hold a mapped matrix and an unmapped one of the
    same shape (a matrix every member shares): the GPU form (forced here) norms that call as the
    stack, where each matrix's own norm would need members to unwrap, and gives the CPU form's
    results within the narrow dtype's rounding; the shared matrix's result is the same in every
    member."""
    mapped, shared = gaussian(3, 12, 20, seed=41), gaussian(20, 12, seed=42)
    tx = muonfn.orthogonalize(dtype=ns_dtype)
    state = tx.init(TensorDict({"mapped": mapped[0], "shared": shared}, []))

    def step(member: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        updates, _ = tx.update(TensorDict({"mapped": member, "shared": shared}, []), state, None)
        return updates["mapped"], updates["shared"]

    cpu = torch.vmap(step)(mapped)
    monkeypatch.setattr(_newton_schulz, "cpu_passes", lambda t: False)
    gpu = torch.vmap(step)(mapped)
    assert gpu[0].shape == (3, 12, 20) and gpu[1].shape == (3, 20, 12)
    for got, expected in zip(gpu, cpu):
        torch.testing.assert_close(got, expected, atol=0.05, rtol=0)
    assert all(torch.equal(result, gpu[1][0]) for result in gpu[1])


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("gpu_form", [False, True])
@pytest.mark.parametrize("ns_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_scale_is_taken_by_the_last_steps_matmul(monkeypatch, dtype, ns_dtype, gpu_form, method) -> None:
    """``orthogonalize(x, scale=s)`` multiplies the last step's product by ``s`` and rounds once
    (no pass of its own): exactly ``s·f(x)`` for a power of two, within a rounding of it
    otherwise; the same for a transposed input and an overwritten one, on either form."""
    if gpu_form:
        monkeypatch.setattr(_newton_schulz, "cpu_passes", lambda t: False)
    x = gaussian(3, 12, 40, seed=6).to(dtype)
    f = muonfn.NewtonSchulz("keller", dtype=ns_dtype, method=method)  # type: ignore[arg-type]
    if method == "gram":
        assert f._gram_is_cheaper(x)
    assert torch.equal(f.orthogonalize(x, scale=4.0), f(x).mul(4.0))
    s = 0.2 * 40**0.5
    got = f.orthogonalize(x, scale=s)
    assert got.dtype == dtype
    narrowest = min(torch.finfo(dtype).eps, torch.finfo(ns_dtype or torch.float32).eps, key=lambda e: -e)
    torch.testing.assert_close(got, f(x).mul(s), atol=2 * s * narrowest, rtol=0)
    assert torch.equal(f.orthogonalize(x.mT, scale=s), got.mT)
    assert torch.equal(f.orthogonalize(x.clone(), overwrite_input=True, scale=s), got)


@pytest.mark.parametrize("scale", [1.0, 0.2 * 20**0.5])
@pytest.mark.parametrize("ns_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("gpu_form", [False, True])
def test_tall_matrices_come_back_in_their_own_memory_order(monkeypatch, scale: float, ns_dtype, gpu_form) -> None:
    """A batch of wide matrices and transposed tall ones: the tall results transposed back,
    contiguous, with :meth:`orthogonalize`'s values; on a GPU (forced here) the restoring pass
    writes them so, on a CPU a tiled copy does, over the batch's own memory or not."""
    if gpu_form:
        monkeypatch.setattr(_newton_schulz, "cpu_passes", lambda t: False)
    f = muonfn.NewtonSchulz("keller", dtype=ns_dtype)
    stack = torch.cat([gaussian(2, 12, 20, seed=7), gaussian(3, 20, 12, seed=8).mT])
    expected = f.orthogonalize(stack, scale=scale)
    for owned in (False, True):
        kept, turned = f.orthogonalize_turning(stack.clone(), 3, overwrite_input=owned, scale=scale)
        assert torch.equal(kept, expected[:2]) and torch.equal(turned, expected[2:].mT)
        assert turned.shape == (3, 20, 12) and turned.is_contiguous() and kept.is_contiguous()
    only_tall = stack[2:].contiguous()
    kept, turned = f.orthogonalize_turning(only_tall, 3, scale=scale)
    assert kept.shape == (0, 12, 20) and torch.equal(turned, f.orthogonalize(only_tall, scale=scale).mT)


@pytest.mark.parametrize("decayed", [False, True])
@pytest.mark.parametrize("gpu_form", [False, True])
def test_matrices_given_to_overwrite_may_hold_their_own_results(monkeypatch, gpu_form: bool, decayed: bool) -> None:
    """``orthogonalize_matrices(..., overwrite_input=True)`` gives the results it gives into a new
    batch, bit for bit, in the order of the matrices (the tall ones in their own orientation,
    contiguous), with or without a decay. Off the CPU (forced here) the wide matrices' memory
    holds their results and the tall ones get a batch of their own (their transposing copy into
    each matrix would take a kernel per matrix); on a CPU, where the batch's own memory holds the
    results, no matrix is written."""
    if gpu_form:
        monkeypatch.setattr(_newton_schulz, "cpu_passes", lambda t: False)
    f = muonfn.NewtonSchulz("keller", dtype=torch.bfloat16)
    originals = [
        gaussian(12, 20, seed=31),
        gaussian(12, 20, seed=32),
        gaussian(20, 12, seed=33),
        gaussian(20, 12, seed=34),
    ]
    params = [gaussian(*m.shape, seed=40 + k) for k, m in enumerate(originals)]
    decay = _newton_schulz.Decay([params[0], None, params[2].mT, None], -0.002) if decayed else None

    def pieces(matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        """The matrices as an orthogonalizer hands them over: the tall ones turned wide."""
        return [*matrices[:2], *(m.mT for m in matrices[2:])]

    expected = f.orthogonalize_matrices(pieces(originals), 2, scale=0.5, decay=decay)
    inputs = [m.clone() for m in originals]
    got = f.orthogonalize_matrices(pieces(inputs), 2, scale=0.5, decay=decay, overwrite_input=True)
    assert [tuple(r.shape) for r in got] == [(12, 20), (12, 20), (20, 12), (20, 12)]
    for result, wanted in zip(got, expected):
        assert torch.equal(result, wanted) and result.is_contiguous()
    held = [result.data_ptr() == m.data_ptr() for result, m in zip(got, inputs)]
    assert held == ([True, True, False, False] if gpu_form else [False] * 4)
    if not gpu_form:
        assert all(torch.equal(m, o) for m, o in zip(inputs, originals))


def test_a_batch_built_from_matrices_norms_each_in_its_own_memory() -> None:
    """Off the CPU, an orthogonalizer's batch is normed matrix by matrix from the matrices' own
    memory: a contiguous one as in the stack, bit for bit; a tall one read as its transpose as the
    tall matrix itself; under ``vmap`` (an ensemble's members, mapped on any dimension) each
    member as when it is alone."""
    wide, tall = gaussian(12, 20, seed=21), gaussian(20, 12, seed=22)
    matrices = [wide, tall.mT]
    norms = _newton_schulz._fp64_norms_of(matrices)
    assert norms.shape == (2, 1, 1) and norms.dtype == torch.float64
    assert torch.equal(norms[0], _newton_schulz._fp64_norms(wide[None])[0])
    assert torch.equal(norms[1], _newton_schulz._fp64_norms(tall[None])[0])
    members_wide, members_tall = gaussian(3, 12, 20, seed=23), gaussian(3, 20, 12, seed=24)
    alone = torch.stack([_newton_schulz._fp64_norms_of([w, t.mT]) for w, t in zip(members_wide, members_tall)])
    mapped = torch.vmap(lambda w, t: _newton_schulz._fp64_norms_of([w, t.mT]))(members_wide, members_tall)
    assert torch.equal(mapped, alone)
    turned = torch.vmap(lambda w, t: _newton_schulz._fp64_norms_of([w, t.mT]), in_dims=(1, 0))(
        members_wide.transpose(0, 1).contiguous(), members_tall
    )
    assert torch.equal(turned, alone)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_term_weighted_zero_leaves_nothing_behind_in_16_bit(dtype: torch.dtype) -> None:
    """A step whose c is 0, and a last step scaled by 0 (a learning rate of 0), in bf16 and fp16: the
    zero-weighted product is left out (torch's CPU baddbmm returns wrong values for alpha=0 in bf16)."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    cubic = newton_schulz(x, [(1.5, -0.5, 0.0)], steps=12, dtype=dtype)
    assert cubic.isfinite().all()
    expected = newton_schulz(x, [(1.5, -0.5, 0.0)], steps=12, dtype=torch.float32)
    torch.testing.assert_close(cubic, expected, atol=0.1, rtol=0)
    params = TensorDict({"w": x.clone()}, [])
    tx = muonfn.muon(lr=0.0, weight_decay=0.0, ns_dtype=dtype)
    updates, _ = tx.update(TensorDict({"w": torch.randn_like(x)}, []), tx.init(params), params)
    assert torch.equal(muonfn.apply_updates(params, updates)["w"], x)
