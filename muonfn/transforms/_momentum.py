"""Momentum: the exponential moving average of the gradients."""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from .. import _tree
from .._validation import Scalar, check_grads, check_params, unit_interval
from ._arithmetic import one_minus
from ._base import Transform
from ._state import MOMENTUM, check_entries


def ema_momentum(momentum: Scalar = 0.95, *, nesterov: bool = True, donate_state: bool = False) -> Transform:
    r"""Exponential moving average of the gradients (torch.optim.Muon's form).

    .. math::  b_t = \mu\, b_{t-1} + (1-\mu)\, g_t, \qquad
               u_t = \begin{cases} (1-\mu)\, g_t + \mu\, b_t & \text{Nesterov} \\ b_t \end{cases}

    Args:
        momentum: :math:`\mu`, a float or a 0-d tensor in [0, 1).
        nesterov: return the Nesterov look-ahead :math:`u_t` instead of :math:`b_t`.
        donate_state: update the state's tensors in place and return them in the new state
            instead of allocating new ones, so that peak memory holds one copy of the state,
            as with ``torch.optim``. The state passed to ``update`` is consumed: do not read
            it afterwards (it holds the new values, or after an exception some of them), and
            do not wrap the transform in :func:`apply_if_finite`, which falls back on the old
            state. Results are bitwise those of ``donate_state=False``, under
            ``torch.compile`` too.

    Returns:
        A :class:`Transform` with state ``{"momentum": b}`` shaped like the params, in their dtype.
    """
    unit_interval("momentum", momentum)

    def init(params: TensorDictBase) -> TensorDictBase:
        check_params("ema_momentum", params)
        return TensorDict({MOMENTUM: params.apply(torch.zeros_like)}, batch_size=params.batch_size)

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        check_entries("ema_momentum", state, (MOMENTUM,))
        buf = state[MOMENTUM]
        check_grads("ema_momentum", grads, buf)
        current = _tree.subset(buf, _tree.leaf_keys(grads))
        if donate_state:
            new_buf = current.lerp_(grads, one_minus(momentum))
        else:
            new_buf = current.lerp(grads, one_minus(momentum))
        updates = grads.lerp(new_buf, momentum) if nesterov else new_buf
        return updates, TensorDict({MOMENTUM: _tree.carry(buf, new_buf)}, batch_size=state.batch_size)

    return Transform(init, update)
