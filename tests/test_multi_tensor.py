"""Multi-tensor arithmetic: the fused calls give the bits of one op per tensor."""

from __future__ import annotations

import pytest
import torch
from _bitwise import bits
from hypothesis import given
from hypothesis import strategies as st

from muonfn import _multi_tensor

NUMBERS = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_subnormal=False).filter(lambda v: v != 0)


def _leaves(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(), (1,), (7,), (3, 5), (17, 9), (2, 3, 4)]
    return [torch.randn(s, generator=g, dtype=torch.float64).mul(10).to(dtype) for s in shapes]


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert [t.dtype for t in a] == [t.dtype for t in b]
    for x, y in zip(a, b):
        assert torch.equal(bits(x), bits(y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("op", ["mul", "div", "add", "sub"])
@given(value=NUMBERS)
def test_a_number_operand_gives_the_bits_of_one_op_per_tensor(dtype, op, value) -> None:
    leaves = _leaves(dtype)
    expected = [getattr(t, op)(value) for t in leaves]
    _same_bits(_multi_tensor.apply(op, leaves, value), expected)
    inplace = [t.clone() for t in leaves]
    _same_bits(_multi_tensor.apply_(op, inplace, value), expected)


@pytest.mark.parametrize("op", ["mul", "div", "add"])
@given(value=NUMBERS)
def test_a_double_zero_dim_operand_meets_fp32_leaves_as_a_number(op, value) -> None:
    """fp32 leaves and an fp64 0-d tensor (the shim's hyperparameters): the bits of the Python
    number, a 0-d leaf included (which the tensor alone would promote to fp64)."""
    leaves = _leaves(torch.float32, seed=1)
    factor = torch.tensor(value, dtype=torch.float64)
    expected = [getattr(t, op)(value) for t in leaves]
    _same_bits(_multi_tensor.apply(op, leaves, factor), expected)
    _same_bits(_multi_tensor.apply_(op, [t.clone() for t in leaves], factor), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@given(weight=st.floats(min_value=0.0, max_value=1.0))
def test_a_number_lerp_weight_gives_the_bits_of_one_lerp_per_tensor(dtype, weight) -> None:
    starts, ends = _leaves(dtype, seed=2), _leaves(dtype, seed=3)
    expected = [s.lerp(e, weight) for s, e in zip(starts, ends)]
    _same_bits(_multi_tensor.apply("lerp", starts, ends, weight), expected)
    _same_bits(_multi_tensor.apply_("lerp", [s.clone() for s in starts], ends, weight), expected)


def test_mixed_dtypes_and_integer_counts_keep_their_own_arithmetic() -> None:
    mixed = [torch.ones(3), torch.ones(3, dtype=torch.float64)]
    _same_bits(_multi_tensor.apply("mul", mixed, 0.1), [t.mul(0.1) for t in mixed])
    steps = [torch.zeros((), dtype=torch.int64) for _ in range(3)]
    out = _multi_tensor.apply("add", steps, 1)
    assert all(t.dtype == torch.int64 and int(t) == 1 for t in out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_quotients_written_over_large_denominators_keep_their_bits(dtype) -> None:
    """A large quotient goes into its denominator's buffer (no second buffer of that size),
    a small one into a fresh tensor; every quotient has the bits of a plain division."""
    g = torch.Generator().manual_seed(1)
    shapes = [(256, 256), (3,), (), (300, 300)]
    nums = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    dens = [torch.rand(s, generator=g).add(0.5).to(dtype) for s in shapes]
    expected = [n / d for n, d in zip(nums, dens)]
    kept = [d.clone() for d in dens]
    assert all(
        torch.equal(bits(q), bits(e)) for q, e in zip(_multi_tensor.quotients(nums, kept, overwrite=False), expected)
    )
    assert all(torch.equal(k, d) for k, d in zip(kept, dens))  # without overwrite the denominators stay
    out = _multi_tensor.quotients(nums, dens, overwrite=True)
    assert all(torch.equal(bits(q), bits(e)) for q, e in zip(out, expected))
    shares = [q.data_ptr() == d.data_ptr() for q, d in zip(out, dens)]
    assert shares == [True, False, False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_host_lerp_weight_is_read_as_a_number_off_the_cpu_with_the_same_bits(monkeypatch, dtype) -> None:
    """Off the CPU a 0-d host weight goes to torch's scalar lerp (one fused kernel for the list),
    not one weight per leaf (a kernel per leaf); forced here on the CPU, where both run."""
    starts, ends = _leaves(dtype)[1:], _leaves(dtype, seed=1)[1:]  # (a 0-d leaf meets a 0-d weight as an equal)
    weight = torch.tensor(0.1, dtype=torch.float64)
    expected = _multi_tensor.lerp(starts, ends, weight)
    _same_bits(_multi_tensor.lerp(starts, ends, 0.1), expected)
    assert _multi_tensor.host_number(weight, starts) is weight
    monkeypatch.setattr(_multi_tensor, "off_cpu", lambda t: True)
    assert _multi_tensor.host_number(weight, starts) == 0.1
    assert _multi_tensor.host_number(weight.to("meta"), starts).device.type == "meta"  # (a device's is kept)
    _same_bits(_multi_tensor.lerp(starts, ends, weight), expected)
    _same_bits(_multi_tensor.lerp([s.clone() for s in starts], ends, weight, inplace=True), expected)
