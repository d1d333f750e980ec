"""From a module to the TensorDicts the functional API steps: parameters apart from buffers."""

from __future__ import annotations

from tensordict import TensorDict
from torch import nn

from .. import _tree


def split_buffers(model: nn.Module) -> tuple[TensorDict, TensorDict]:
    """``(params, buffers)``: the model's parameters and its buffers, as two detached TensorDicts.

    ``TensorDict.from_module(model)`` holds both. Buffers are no parameters: an optimizer
    must not step BatchNorm's running statistics, and ``torch.func.grad`` cannot
    differentiate its int64 ``num_batches_tracked`` ("only Tensors of floating point dtype
    can require gradients"). Give ``init``, ``torch.func.grad`` and ``update`` the
    parameters only, and the buffers to the model beside them::

        params, buffers = muonfn.split_buffers(model)
        state = tx.init(params)

        def loss_fn(params, buffers, x, y):
            with params.to_module(model), buffers.to_module(model):
                return F.cross_entropy(model(x), y)

        grads = torch.func.grad(loss_fn)(params, buffers, x, y)  # d/d params only

    Both share storage with the model: in training mode BatchNorm updates ``buffers`` in
    place, as it updates its own. Keys are nested, as ``TensorDict.from_module``'s; a tied
    weight keeps both of its names there (``init`` rejects it with the remedy). A frozen
    parameter (``requires_grad=False``) is still a parameter: ``torch.func.grad`` ignores
    that flag, so leave it out, ``params.exclude(key)``, and pass it with the buffers.
    """
    everything = TensorDict.from_module(model).detach()
    parameter_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    keys = [key for key in _tree.leaf_keys(everything) if _tree.dotted(key) in parameter_names]
    params = everything.select(*keys)
    return params, everything.exclude(*keys)
