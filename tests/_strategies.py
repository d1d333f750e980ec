"""Test helpers: tiny models, TensorDict comparisons, and the strategies of :mod:`muonfn.testing`
(matrices with controlled spectra) under the names and defaults the tests use."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch
from hypothesis import strategies as st
from tensordict import TensorDict

from muonfn import Coefficients
from muonfn.linalg import default_ns_dtype, ns_schedule
from muonfn.testing import (
    TOLERANCES,
    Spectral,
    matrices,
    orthogonal,
    orthonormal_columns,
    scalar_map,
    with_spectrum,
)

__all__ = [
    "Spectral",
    "assert_batched_as_alone",
    "assert_close_to_iteration",
    "assert_td_close",
    "assert_td_close_to_iteration",
    "assert_td_equal",
    "bmm_batch_consistent",
    "composed_polynomial",
    "gaussian",
    "generator",
    "iteration_dtype",
    "mlp",
    "orthogonal",
    "orthonormal_columns",
    "random_like",
    "rel_err",
    "spectral_matrices",
    "with_spectrum",
]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def spectral_matrices(
    max_dim: int = 12, min_sigma: float = 1e-3, rank_deficient: bool = False
) -> st.SearchStrategy[Spectral]:
    """fp64 2-D matrices (m, n in [1, max_dim]) whose nonzero singular values span ``[min_sigma, 1]``
    times a scale of 1e-3 … 1e4; with ``rank_deficient`` at least one is exactly zero."""
    return matrices(
        shapes=("wide", "tall", "square"),
        max_side=max_dim,
        dtypes=torch.float64,
        condition_number=1 / min_sigma,
        rank_deficient=rank_deficient,
        scales=(1e-3, 1.0, 37.0, 1e4),
        layouts=("contiguous",),
    )


def gaussian(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=generator(seed), dtype=torch.float64).to(dtype)


def bmm_batch_consistent(m: int, n: int, batch: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether this BLAS computes Newton–Schulz's products on a stack bitwise equal to the
    products on each matrix alone (``X Xᵀ``, ``bA + cA·A``, then ``P·X`` in fp32 and wider,
    ``aX + B·X`` in 16-bit dtypes, on the wide ``m × n``).

    MKL's result for a matrix can depend on the batch and on the alignment of its memory: some
    small shapes (m ∈ {6, 7, 9, 11} where this was written) differ in the last bit between a stacked call,
    where a matrix sits at an offset, and a fresh allocation, and which shapes do depends on the
    CPU and the BLAS. Batched Newton–Schulz is held to bitwise equality only where these products are.
    """
    m, n = min(m, n), max(m, n)
    x = torch.randn(batch, m, n, generator=generator(m * 1000 + n), dtype=dtype)
    a = torch.bmm(x, x.mT)
    products = (
        lambda x, a: torch.bmm(x, x.mT),
        lambda x, a: torch.baddbmm(a, a, a, beta=-4.775, alpha=2.0315),
        lambda x, a: torch.bmm(a, x),
        lambda x, a: torch.baddbmm(x, a, x, beta=3.4445),
    )
    for product in products:
        stacked = product(x, a)
        for j in range(batch):
            if not torch.equal(stacked[j], product(x[j : j + 1].clone(), a[j : j + 1].clone())[0]):
                return False
    return True


def assert_batched_as_alone(batched: torch.Tensor, alone: torch.Tensor, *, bitwise: bool) -> None:
    """Bit for bit where this BLAS computes a matrix in a batch as it does alone
    (:func:`bmm_batch_consistent`), else to the rounding of an fp32 iteration (and of its cast to a
    16-bit output): batched Newton–Schulz is exact no further."""
    if bitwise:
        assert torch.equal(batched, alone)
    else:
        torch.testing.assert_close(batched, alone, atol=1e-5 if batched.dtype.itemsize >= 4 else 1e-2, rtol=0)


def composed_polynomial(schedule: Coefficients | str, x: torch.Tensor) -> torch.Tensor:
    """The scalar map ``p_K ∘ … ∘ p_1`` with ``p_k(σ) = a_k σ + b_k σ³ + c_k σ⁵``, in fp64, on ``x``
    as given (the schedule's ``norm_factor`` left to the caller)."""
    return scalar_map(ns_schedule(schedule)._replace(norm_factor=1.0), sigma=x)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.to(torch.float64)
    return float((actual.to(torch.float64) - expected).norm() / expected.norm().clamp_min(1e-300))


def assert_td_equal(a: TensorDict, b: TensorDict) -> None:
    """Same leaf keys, and every leaf bitwise equal (dtype included)."""
    ka, kb = set(a.keys(True, True)), set(b.keys(True, True))
    assert ka == kb, f"keys differ: {ka ^ kb}"
    for key in ka:
        x, y = a.get(key), b.get(key)
        assert x.dtype == y.dtype, f"{key}: {x.dtype} != {y.dtype}"
        assert torch.equal(x, y), f"{key}: max abs diff {(x.double() - y.double()).abs().max()}"


def assert_td_close(a: TensorDict, b: TensorDict, atol: float, rtol: float = 0.0) -> None:
    ka, kb = set(a.keys(True, True)), set(b.keys(True, True))
    assert ka == kb, f"keys differ: {ka ^ kb}"
    for key in ka:
        torch.testing.assert_close(a.get(key), b.get(key), atol=atol, rtol=rtol, msg=lambda m, key=key: f"{key}: {m}")


def iteration_dtype(*shapes: Sequence[int]) -> torch.dtype:
    """The least precise dtype the default Newton–Schulz iterates fp32 CPU matrices of ``shapes``
    in, under this run's CPU rule: fp32 as the suite pins it, bf16 where ``MUONFN_CPU_NS_DTYPE``
    forces it (or ``auto`` measured it faster, for large matrices)."""
    dtypes = [default_ns_dtype(torch.device("cpu"), torch.float32, shape) for shape in shapes]
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).eps, default=torch.float32)


def assert_close_to_iteration(
    actual: torch.Tensor,
    expected: torch.Tensor,
    iteration: torch.dtype,
    *,
    atol: float,
    rtol: float = 0.0,
    produced: torch.Tensor | None = None,
    msg: str = "",
) -> None:
    """``actual`` against ``expected``: two results that differ by how a Newton–Schulz iteration in
    ``iteration`` was rounded (a compiled step against eager, a formula against the preset).

    An fp32 (or wider) iteration: elementwise, to ``atol`` and ``rtol``, fp32's rounding. A 16-bit
    one: two roundings of the iteration lie up to ``muonfn.testing.TOLERANCES[iteration].symmetry``
    apart, relative to the Frobenius norm of what the iteration produced (``produced``, default
    ``expected``), and ``atol``/``rtol`` still cover the fp32 rounding of the rest; the difference is
    measured in the same norm.
    """
    if not expected.is_floating_point() or torch.finfo(iteration).bits >= 32:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=msg or None)
        return
    assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), msg
    actual, expected = actual.detach(), expected.detach()
    produced = expected if produced is None else produced.detach()
    norm = functools.partial(torch.linalg.vector_norm, dtype=torch.float64)
    fp32_rounding = atol * math.sqrt(expected.numel()) + rtol * float(norm(expected))
    bound = TOLERANCES[iteration].symmetry * float(norm(produced)) + fp32_rounding
    difference = float(norm(actual - expected))
    assert difference <= bound, f"{msg}: {difference:.3g} apart, beyond a {iteration} iteration's rounding {bound:.3g}"


def assert_td_close_to_iteration(
    a: TensorDict,
    b: TensorDict,
    *,
    atol: float,
    iteration: torch.dtype | None = None,
    initial: TensorDict | None = None,
) -> None:
    """:func:`assert_close_to_iteration` for every leaf. ``iteration``: the dtype of a run whose
    Newton–Schulz results feed back into every leaf (steps of a model); ``None``: each matrix's own
    (:func:`iteration_dtype`), fp32 for the rest (updates of fixed parameters). What the iteration
    produced is ``b`` less ``initial`` (parameters moved from there), or ``b`` (updates, states)."""
    ka, kb = set(a.keys(True, True)), set(b.keys(True, True))
    assert ka == kb, f"keys differ: {ka ^ kb}"
    for key in ka:
        want = b.get(key)
        dtype = iteration if iteration is not None else iteration_dtype(want.shape) if want.ndim >= 2 else torch.float32
        produced = want if initial is None else want - initial.get(key)
        assert_close_to_iteration(a.get(key), want, dtype, atol=atol, produced=produced, msg=str(key))


def mlp(seed: int = 0, sizes: tuple[int, ...] = (6, 12, 8, 3), bias: bool = True) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        if i:
            layers.append(torch.nn.Tanh())
        layers.append(torch.nn.Linear(fan_in, fan_out, bias=bias))
    return torch.nn.Sequential(*layers)


class TiedLM(torch.nn.Module):
    """A language model whose output head is its token embedding (one tensor, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.hidden = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def random_like(td: TensorDict, seed: int, scale: float = 1.0) -> TensorDict:
    gen = generator(seed)
    return td.apply(lambda t: (scale * torch.randn(t.shape, generator=gen, dtype=torch.float64)).to(t.dtype))
