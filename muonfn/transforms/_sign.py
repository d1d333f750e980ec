"""The element-wise sign of the update (AdaMuon's sign-stabilised momentum)."""

from __future__ import annotations

from tensordict import TensorDictBase

from .._validation import check_inputs
from ._base import Transform, empty_state


def scale_by_sign() -> Transform:
    r""":math:`u \leftarrow \operatorname{sign}(u)` element-wise (:math:`\operatorname{sign}(0) = 0`).

    Before :func:`orthogonalize` this is AdaMuon's sign-stabilised momentum,
    :math:`O = \mathrm{NS}(\operatorname{sign}(M_t))`: every entry of the momentum weighs the
    same, whatever its magnitude.

    Returns:
        A stateless :class:`Transform`.

    Example:
        >>> tx = muonfn.scale_by_sign()
        >>> g = TensorDict({"w": torch.tensor([-0.3, 0.0, 2.0])}, [])
        >>> tx.update(g, tx.init(g))[0]["w"]
        tensor([-1.,  0.,  1.])
    """

    def update(
        grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase | None = None
    ) -> tuple[TensorDictBase, TensorDictBase]:
        check_inputs("scale_by_sign", grads, state, params)
        return grads.sign(), state

    return Transform(empty_state, update)
