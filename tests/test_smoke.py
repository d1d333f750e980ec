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


def test_import_muonfn_reaches_the_shim_and_distributed_lazily():
    """The README's first lines: ``import muonfn`` then ``muonfn.optim.Muon(...)``, in a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import sys, torch, muonfn\n"
        "assert 'muonfn.distributed' not in sys.modules  # loaded on first use only\n"
        "opt = muonfn.optim.Muon(torch.nn.Linear(4, 3).named_parameters(), lr=0.02)\n"
        "assert callable(muonfn.distributed.torch_collectives)\n"
        "try:\n"
        "    muonfn.nonexistent\n"
        "except AttributeError as e:\n"
        "    assert 'nonexistent' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
