"""The element-wise sign of the update (AdaMuon's sign-stabilised momentum)."""

from __future__ import annotations

from .. import _multi_tensor
from .._tree import Leaves
from ._contract import Transform, empty_state
from ._rules import Rule, Scope, from_rule, no_needs


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

    def update(grads: Leaves, scope: Scope, params: Leaves | None) -> Leaves:
        return dict(zip(grads, _multi_tensor.apply("sign", list(grads.values()))))

    return from_rule(empty_state, Rule("scale_by_sign", update, no_needs))
