"""One rank of a short FSDP2 run that ends as training scripts do, for the teardown test.

Launched as a real interpreter per rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` in the environment) by ``_dist_harness.run_interpreters``, so that it exits
through interpreter finalization, unlike the forked workers of ``_dist_harness.run``. A
3-layer MLP of 10, 3 and 7 rows (uneven and empty shards on 3 or 4 ranks) trains for a
few steps with ``muonfn.muon`` over a sharded orthogonalizer, its state donated and the
parameters stepped in place (exit status 1 if a parameter is not finite); then the state
dict is gathered with ``full_tensor()``, rank 0 saves it and the process group is
destroyed, with the model, the mesh, the transform and its state still referenced from
module globals. A crash at exit shows as a negative exit status.
"""

import io
import os
import sys

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

import muonfn
from muonfn.distributed import sharded_orthogonalizer, torch_collectives

torch.set_num_threads(1)
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3), torch.nn.Tanh(), torch.nn.Linear(3, 7)
)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
orthogonalizer = sharded_orthogonalizer(torch_collectives(mesh))
tx = muonfn.muon(lr=0.02, ns=muonfn.NewtonSchulz(dtype=torch.float32), orthogonalizer=orthogonalizer, donate_state=True)
params = TensorDict.from_module(model).detach()
state = tx.init(params)
for step in range(6):
    grads = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        full_grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + i))
        grads[name] = distribute_tensor(full_grad, p.device_mesh, p.placements)
    with torch.no_grad():
        updates, state = tx.update(TensorDict(grads, []), state, params)
        muonfn.apply_updates_(params, updates)
if not all(bool(p.to_local().isfinite().all()) for p in model.parameters()):
    sys.exit(1)
# the script's last collectives, a moment before the interpreter exits
full = {name: value.full_tensor().detach().clone() for name, value in model.state_dict().items()}
if dist.get_rank() == 0:
    torch.save(full, io.BytesIO())
dist.destroy_process_group()
print(f"rank {os.environ['RANK']} done", flush=True)
