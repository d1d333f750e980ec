import torch
from tensordict import TensorDict

import muonfn


def test_muon_step_reduces_loss():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    params = TensorDict.from_module(model).detach()
    tx = muonfn.muon(lr=0.1)
    state = tx.init(params)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))

    def loss_fn(p):
        with p.to_module(model):
            return torch.nn.functional.cross_entropy(model(x), y)

    first = loss_fn(params).item()
    for _ in range(30):
        grads = torch.func.grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)
    assert loss_fn(params).item() < 0.5 * first
