"""muonfn.testing: its strategies draw what they promise, its invariant checks pass muonfn's own
orthogonalizers and catch broken ones, and spectral_band is the exact range of a schedule."""

from __future__ import annotations

import importlib
import math
import re
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import muonfn
from muonfn import COEFFICIENTS, Coefficients, newton_schulz
from muonfn.linalg import ns_schedule
from muonfn.testing import (
    INVARIANTS,
    InvariantViolation,
    Spectral,
    Tolerances,
    check_orthogonalizer,
    coefficient_schedules,
    matrices,
    model_params,
    scalar_map,
    spectral_band,
)

# the default Newton–Schulz dtype is the input's (at least fp32), whatever rule the run forces
pytestmark = pytest.mark.usefixtures("fp32_newton_schulz")

ROOT = Path(__file__).resolve().parents[1]
SETS = sorted(COEFFICIENTS)
# small: every example runs the orthogonalizer five or more times (the CI budget for this file is seconds)
EXAMPLES = 12


def ns(coefficients: object, **kw: object):
    return partial(newton_schulz, coefficients=coefficients, **kw)


# --- the checks pass muonfn's orthogonalizers --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", SETS)
def test_builtin_schedules_pass_with_their_documented_band(name: str, dtype: torch.dtype) -> None:
    check_orthogonalizer(ns(name), band=spectral_band(name), dtype=dtype, max_examples=EXAMPLES)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gram_newton_schulz_passes(dtype: torch.dtype) -> None:
    check_orthogonalizer(
        partial(muonfn.gram_newton_schulz, coefficients="cesista"),
        band=spectral_band("cesista"),
        dtype=dtype,
        max_examples=EXAMPLES,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_exact_polar_factor_passes(dtype: torch.dtype) -> None:
    """An fp32 G of rank 1 has, as passed, a second singular value of rounding (~1e-8 relative)
    that the exact polar factor maps to 1: the rank is that of the input as passed."""
    check_orthogonalizer(muonfn.polar, band=(1.0, 1.0), dtype=dtype, max_examples=EXAMPLES)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_iterations_pass_with_16_bit_tolerances(dtype: torch.dtype) -> None:
    """16-bit inputs iterated in 16 bits: the default sigma_min (0.05) and tolerances hold."""
    check_orthogonalizer(
        ns("polar_express", dtype=dtype),
        band=spectral_band("polar_express", sigma_min=0.05),
        dtype=dtype,
        max_examples=EXAMPLES,
    )


# --- ... and catch broken ones, naming the invariant ------------------------------------------------


def keller_band() -> tuple[float, float]:
    return spectral_band("keller")


def wide_keller_tall_cesista(g: torch.Tensor) -> torch.Tensor:
    """A spectral map, but a different one for tall inputs: equivariant, in the band, not transposable."""
    return newton_schulz(g, "keller" if g.size(-2) <= g.size(-1) else "cesista")


def aol_then_ns(g: torch.Tensor) -> torch.Tensor:
    """Rescales rows before Newton–Schulz (as AOL does): no longer left orthogonally equivariant."""
    rows = g.double().norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return newton_schulz((g.double() / rows).to(g.dtype))


def normalizes_the_whole_batch(g: torch.Tensor) -> torch.Tensor:
    """One norm for the whole batch: each matrix then depends on the others."""
    out = newton_schulz((g / g.double().norm().to(g.dtype)).reshape(-1, g.size(-1)))
    return out.reshape(g.shape)


def in_place(g: torch.Tensor) -> torch.Tensor:
    return newton_schulz(g.mul_(1.0).div_(2.0))


def polar_without_null_space(g: torch.Tensor) -> torch.Tensor:
    """U Vᵀ of the full SVD: a zero singular value maps to 1, so a rank-1 G gives an orthogonal O."""
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    return (u @ vh).to(g.dtype)


def polar_of_the_top_direction(g: torch.Tensor) -> torch.Tensor:
    """u₁v₁ᵀ: every direction but the largest maps to 0."""
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    return (u[..., :1] @ vh[..., :1, :]).to(g.dtype)


NEGATED_LAST = [*COEFFICIENTS["keller"].triples[:-1], tuple(-x for x in COEFFICIENTS["keller"].triples[-1])]


@pytest.mark.parametrize(
    ("fn", "dtype", "skip", "invariant"),
    [
        pytest.param(lambda g: g, torch.float32, (), "singular value band", id="identity"),
        pytest.param(ns([(3.4445, 4.7750, 2.0315)], steps=5), torch.float32, (), "finite output", id="sign-of-b"),
        pytest.param(ns(NEGATED_LAST), torch.float64, (), "singular value band", id="sign-of-last-step"),
        pytest.param(wide_keller_tall_cesista, torch.float32, (), "transpose symmetry", id="transpose"),
        pytest.param(lambda g: newton_schulz(g).float(), torch.bfloat16, (), "dtype and shape", id="bf16-to-fp32"),
        pytest.param(in_place, torch.float32, (), "input not mutated", id="in-place"),
        pytest.param(normalizes_the_whole_batch, torch.float64, (), "batch consistency", id="batch-norm"),
        pytest.param(polar_without_null_space, torch.float64, (), "rank preservation", id="null-space-to-one"),
        pytest.param(
            polar_of_the_top_direction, torch.float32, ("singular value band",), "rank preservation", id="rank-one"
        ),
        pytest.param(
            aol_then_ns,
            torch.float64,
            ("singular value band", "rank preservation", "transpose symmetry"),
            "orthogonal equivariance",
            id="row-scaling",
        ),
        pytest.param(
            lambda g: newton_schulz(g / torch.linalg.matrix_norm(g, keepdim=True)),  # ‖G‖² overflows
            torch.float32,
            (),
            "scale invariance",
            id="norm-overflows",
        ),
    ],
)
def test_broken_orthogonalizers_fail_naming_the_invariant(fn, dtype, skip, invariant) -> None:
    with pytest.raises(AssertionError, match=f"orthogonalizer broke '{invariant}'") as info:
        check_orthogonalizer(fn, band=keller_band(), dtype=dtype, max_examples=EXAMPLES, skip=skip)
    assert isinstance(info.value, InvariantViolation)
    assert info.value.invariant == invariant
    report = str(info.value)
    assert "input: _Case(Spectral(g=" in report and "\n  G = tensor(" in report
    assert f"dtype={str(dtype).removeprefix('torch.')}" in report


def test_a_failure_report_is_deterministic_and_shrunk() -> None:
    reports = []
    for _ in range(2):
        with pytest.raises(InvariantViolation) as info:
            check_orthogonalizer(wide_keller_tall_cesista, band=keller_band(), max_examples=EXAMPLES)
        reports.append(str(info.value))
    assert reports[0] == reports[1]
    # shrunk to the smallest shape that shows it: one row or one column
    assert "matrices [1, 2]" in reports[0] or "matrices [2, 1]" in reports[0]


def test_exceptions_inside_the_function_are_reported() -> None:
    def needs_contiguous(g: torch.Tensor) -> torch.Tensor:
        return newton_schulz(g.view(-1).view(g.shape))  # .view fails on non-contiguous layouts

    with pytest.raises(InvariantViolation, match=r"'no error'.*RuntimeError") as info:
        check_orthogonalizer(needs_contiguous, band=keller_band(), max_examples=EXAMPLES)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_tolerances_and_arguments() -> None:
    loose = Tolerances(band=1.0, equivariance=1.0, symmetry=1.0, null_space=0.1)
    # the transposing bug hides under tolerances this loose
    check_orthogonalizer(wide_keller_tall_cesista, band=keller_band(), tolerances=loose, max_examples=EXAMPLES)
    check_orthogonalizer(wide_keller_tall_cesista, band=keller_band(), skip=["transpose symmetry"], max_examples=5)
    with pytest.raises(ValueError, match="unknown invariants"):
        check_orthogonalizer(newton_schulz, band=keller_band(), skip=["transpose"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="band"):
        check_orthogonalizer(newton_schulz, band=(1.2, 0.5))
    with pytest.raises(ValueError, match="tolerances"):
        check_orthogonalizer(newton_schulz, band=keller_band(), dtype=torch.float8_e4m3fn)
    assert len(INVARIANTS) == len(set(INVARIANTS)) == 10


# --- spectral_band and scalar_map -------------------------------------------------------------------


def dense_range(coefficients: object, lo: float, hi: float = 1.0, points: int = 1_000_001) -> tuple[float, float]:
    values = scalar_map(coefficients, sigma=torch.linspace(lo, hi, points, dtype=torch.float64))  # type: ignore[arg-type]
    return float(values.min()), float(values.max())


def test_keller_band_is_the_analytic_one() -> None:
    """p(x) = 3.4445x − 4.7750x³ + 2.0315x⁵: local max p(0.5545) = 1.2024, local min p(1.0501) = 0.6818;
    singular values that reach the neighbourhood of 1 oscillate in [0.6818, p(0.6818) = 1.1344]."""
    lo, hi = spectral_band("keller", sigma_min=0.01)
    assert (round(lo, 4), round(hi, 4)) == (0.6818, 1.1344)
    a, b, c = COEFFICIENTS["keller"].triples[0]
    assert round(a * 0.6818 + b * 0.6818**3 + c * 0.6818**5, 4) == 1.1344
    # from 1e-3 on, some σ reach the local maximum of the last step, and the smallest are not lifted yet
    lo, hi = spectral_band("keller")
    assert round(hi, 4) == 1.2024
    assert lo == pytest.approx(float(scalar_map("keller", sigma=1e-3)), rel=1e-12)


@pytest.mark.parametrize(
    ("name", "measured", "digits"),
    [("keller", (0.682, 1.134), 3), ("cesista", (0.978, 1.032), 3), ("polar_express", (0.9999998, 1.0000002), 7)],
)
def test_band_contains_the_measured_gaussian_bands(name: str, measured: tuple[float, float], digits: int) -> None:
    """A 256×1024 Gaussian has σ/‖G‖_F in about [0.03, 0.1]: its fp32 band (docs/formulas.md, rounded to
    ``digits``) lies inside the exact band over [0.03, 1], up to fp32 rounding (3e-7)."""
    lo, hi = spectral_band(name, sigma_min=0.03)
    slack = 3e-7 + 0.5 * 10**-digits
    assert lo - slack <= measured[0] and measured[1] <= hi + slack
    wide_lo, wide_hi = spectral_band(name)
    assert wide_lo <= lo and hi <= wide_hi


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("sigma_min", [1e-3, 0.01, 0.3])
def test_band_matches_a_dense_grid(name: str, sigma_min: float) -> None:
    lo, hi = spectral_band(name, sigma_min=sigma_min)
    grid_lo, grid_hi = dense_range(name, sigma_min)
    # the grid samples the range from inside; at a sharp extremum of the composition it misses a little
    assert lo <= grid_lo + 1e-15 and grid_hi <= hi + 1e-15
    assert grid_lo - lo < 1e-7 and hi - grid_hi < 1e-7


@given(coefficient_schedules(perturbation=0.05), st.sampled_from([1e-3, 0.02, 0.5]))
def test_band_of_drawn_schedules_matches_a_dense_grid(schedule: Coefficients, sigma_min: float) -> None:
    lo, hi = spectral_band(schedule, sigma_min=sigma_min)
    grid_lo, grid_hi = dense_range(schedule, sigma_min, points=100_001)
    assert lo <= grid_lo + 1e-12 and grid_hi <= hi + 1e-12
    assert grid_lo - lo < 1e-4 and hi - grid_hi < 1e-4


def test_norm_factor_divides_sigma_before_the_first_step() -> None:
    """newton_schulz normalises by c·‖G‖_F: σ/‖G‖_F = x enters the first step as x/c."""
    halved = Coefficients(COEFFICIENTS["keller"].triples, norm_factor=2.0)
    x = torch.linspace(0, 1, 101, dtype=torch.float64)
    torch.testing.assert_close(scalar_map(halved, sigma=x), scalar_map("keller", sigma=x / 2), rtol=0, atol=0)
    assert spectral_band(halved, sigma_min=0.002) == pytest.approx(dense_range("keller", 0.001, 0.5), abs=1e-7)
    assert spectral_band(halved)[0] == pytest.approx(float(scalar_map("keller", sigma=5e-4)), rel=1e-12)


@pytest.mark.parametrize("name", SETS)
def test_scalar_map_is_what_newton_schulz_does_to_singular_values(name: str) -> None:
    g = torch.randn(12, 30, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    s = torch.linalg.svdvals(g)
    expected = scalar_map(name, sigma=s / torch.linalg.matrix_norm(g)).sort().values
    got = torch.linalg.svdvals(newton_schulz(g, name)).sort().values
    assert (got - expected).abs().max() < 1e-10
    assert spectral_band(name, sigma_min=float(s.min() / s.norm()))[0] <= float(got.min()) + 1e-12


def test_steps_and_defaults() -> None:
    assert spectral_band("cesista", 3) == spectral_band(ns_schedule("cesista", 3))
    assert scalar_map("keller").shape == (1001,)
    assert float(scalar_map("keller", sigma=0.0)) == 0.0
    stretched = scalar_map([(3.4445, -4.7750, 2.0315)], steps=5, sigma=[0.1, 0.5])
    assert torch.equal(stretched, scalar_map("keller", sigma=[0.1, 0.5]))
    for bad in (0.0, -1.0, 1.5, math.nan):
        with pytest.raises(ValueError, match="sigma_min"):
            spectral_band("keller", sigma_min=bad)


# --- the strategies draw what they promise ----------------------------------------------------------


def matrix_of(sp: Spectral) -> torch.Tensor:
    return sp.g.reshape(sp.matrix_shape)


@given(matrices(shapes=("wide", "tall", "square", "batched", "conv"), condition_number=1e4))
def test_matrices_carry_their_svd(sp: Spectral) -> None:
    batch = sp.matrix_shape[:-2]
    m, n = sp.matrix_shape[-2:]
    eye = torch.eye
    torch.testing.assert_close(sp.u.mT @ sp.u, eye(m, dtype=torch.float64).expand(*batch, m, m), atol=1e-12, rtol=0)
    torch.testing.assert_close(sp.v.mT @ sp.v, eye(n, dtype=torch.float64).expand(*batch, n, n), atol=1e-12, rtol=0)
    assert (sp.s[..., :-1] >= sp.s[..., 1:]).all()
    exact = sp.exact()
    torch.testing.assert_close(matrix_of(sp).double(), exact, atol=1e-12 * float(sp.s.max()), rtol=0)
    torch.testing.assert_close(torch.linalg.svdvals(exact), sp.s, atol=1e-12 * float(sp.s.max()), rtol=0)
    nonzero = sp.s[sp.s > 0]
    assert float(nonzero.max() / nonzero.min()) <= 1e4 * (1 + 1e-9)


@given(
    matrices(dtypes=[torch.float32, torch.bfloat16, torch.float16], layouts=["transposed", "strided"]),
)
def test_matrices_dtypes_layouts_and_scales(sp: Spectral) -> None:
    g = sp.g
    assert torch.isfinite(g).all()
    assert not g.is_contiguous() or min(g.shape[-2:]) == 1
    info = torch.finfo(g.dtype)
    assert info.tiny / info.eps <= float(sp.s.max()) <= info.max / 64
    # the rounded matrix is the exact one to the dtype's precision
    err = (matrix_of(sp).double() - sp.exact()).norm() / sp.s.norm()
    assert err < 4 * info.eps * max(sp.matrix_shape[-2:])


@given(matrices(rank_deficient=True, max_side=6), matrices(rank_deficient=False, max_side=6))
def test_matrices_rank(deficient: Spectral, full: Spectral) -> None:
    assert deficient.rank < min(deficient.matrix_shape[-2:])
    assert (deficient.s[..., -1] == 0).all()
    assert full.rank == min(full.matrix_shape[-2:]) and (full.s > 0).all()


@given(matrices(singular_values=[3.0, 1.0, 0.25], scales=[1.0, 1e30], dtypes=torch.float32, shapes=["tall"]))
def test_matrices_with_explicit_singular_values(sp: Spectral) -> None:
    scale = float(sp.s.max()) / 3.0
    assert scale == pytest.approx(1.0) or scale == pytest.approx(1e30)
    torch.testing.assert_close(sp.s[..., :3] / scale, torch.tensor([3.0, 1.0, 0.25], dtype=torch.float64))
    assert (sp.s[..., 3:] == 0).all() and sp.rank == 3
    assert sp.g.size(-2) > sp.g.size(-1) >= 3


def test_matrices_scales_per_dtype_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="scales"):
        matrices(dtypes=torch.float16, scales=[1e30])
    with pytest.raises(ValueError, match="shapes"):
        matrices(shapes=["round"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="condition_number"):
        matrices(condition_number=0.5)
    with pytest.raises(ValueError, match="not both"):
        matrices(singular_values=[1.0], rank_deficient=True)
    with pytest.raises(ValueError, match="shape"):
        matrices(singular_values=[1.0] * 5, max_side=4)


@given(matrices(shapes=["conv"], max_side=5))
def test_conv_kernels_are_seen_as_out_by_fan_in(sp: Spectral) -> None:
    assert sp.g.ndim >= 3
    out, *rest = sp.g.shape
    assert sp.matrix_shape == (out, math.prod(rest))


@given(coefficient_schedules())
def test_drawn_schedules_are_valid_and_newton_schulz_stays_in_their_band(schedule: Coefficients) -> None:
    assert all(a > 0 for a, _, _ in schedule.triples)
    lo, hi = spectral_band(schedule)
    assert 0.3 <= lo <= hi <= 1.5
    g = torch.randn(6, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    s = torch.linalg.svdvals(newton_schulz(g, schedule))
    assert lo - 1e-12 <= float(s.min()) and float(s.max()) <= hi + 1e-12


@given(coefficient_schedules(bases=["keller"], perturbation=0.0, steps=(2, 7)))
def test_schedules_without_perturbation_are_the_base_stretched(schedule: Coefficients) -> None:
    assert schedule == ns_schedule("keller", len(schedule.triples))


@given(model_params())
def test_model_params_look_like_models(params) -> None:
    leaves = dict(zip(params.keys(True, True), params.values(True, True)))
    assert any(t.ndim >= 2 for t in leaves.values())
    labels = muonfn.label_params(params)
    names = {".".join(k) if isinstance(k, tuple) else k for k in leaves}
    assert set(labels) == names
    for name, label in labels.items():
        if any(fragment in name for fragment in ("wte", "wpe", "lm_head")) or name.endswith("bias"):
            assert label == "adamw", name
    for key, t in leaves.items():
        if t.ndim >= 3:
            assert key[0].startswith("conv") and key[-1] == "weight", key


@given(model_params(max_width=8, max_depth=2))
def test_muon_steps_on_drawn_models(params) -> None:
    opt = muonfn.muon(lr=1e-2)
    state = opt.init(params)
    grads = params.apply(lambda t: torch.ones_like(t))
    updates, _ = opt.update(grads, state, params)
    new = muonfn.apply_updates(params, updates)
    assert all(torch.isfinite(t).all() for t in new.values(True, True))


# --- packaging --------------------------------------------------------------------------------------


def test_without_hypothesis_the_import_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "muonfn.testing" or m.startswith("muonfn.testing.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # what `import hypothesis` sees when it is missing
    with pytest.raises(ImportError, match=re.escape("pip install 'muonfn[testing]'")):
        importlib.import_module("muonfn.testing")


def test_only_muonfn_testing_imports_hypothesis() -> None:
    """So `import muonfn` (and every other layer) works without the extra."""
    from test_layers import PACKAGE, module_name, runtime_imports

    for path in PACKAGE.rglob("*.py"):
        if module_name(path).startswith("muonfn.testing"):
            continue
        for name in runtime_imports(path):
            assert name.split(".")[0] != "hypothesis" and not name.startswith("muonfn.testing"), (path, name)


def test_the_testing_extra_is_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^testing = \["hypothesis>=6\.100"\]$', text, re.M)
    assert re.search(r'^dev = \[.*"hypothesis>=6\.100".*\]$', text, re.M)
