"""A small model with every kind of matrix, its reference (single-process) training run, and sharding helpers.

Shared by the thread-simulation tests and the multi-process workers. Shapes are chosen so
that 1-4 ranks see uneven shards (10 rows on 3 or 4 ranks), empty shards (3 rows on 4
ranks), fused QKV blocks cut across ranks, experts spread over ranks, a conv kernel and a
weight stored transposed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn
from torch.distributed.tensor import DTensor

import muonfn
from muonfn.distributed import sharded_orthogonalizer
from muonfn.distributed._layout import Box, copy_out, length

VOCAB, SEQ, BATCH, STEPS = 11, 5, 12, 10

VIEWS = {
    "qkv.weight": muonfn.MatrixView(split=(8, 8, 8)),
    "experts": muonfn.MatrixView(batch_dims=1),
    "proj_t": muonfn.MatrixView(transposed=True),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.fc1 = nn.Linear(6, 10)  # 10 rows: 5,5 / 4,4,2 / 3,3,3,1
        self.qkv = nn.Linear(10, 24)  # fused q, k, v of 8 rows each
        self.conv = nn.Conv1d(8, 6, 3, padding=1)  # (6, 8, 3): one (6, 24) matrix
        self.experts = nn.Parameter(torch.randn(5, 6, 6) / 6**0.5)  # 5 experts: 3,2 / 2,2,1 / 2,2,1,0
        self.proj_t = nn.Parameter(torch.randn(6, 3) / 6**0.5)  # stored (in, out)
        self.fc2 = nn.Linear(3, 3)  # 3 rows: an empty shard on 4 ranks
        self.norm = nn.LayerNorm(3)
        self.lm_head = nn.Linear(3, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(self.embed(tokens)))
        q, k, v = self.qkv(h).split(8, dim=-1)
        h = q * torch.sigmoid(k) + v
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = torch.einsum("bti,eoi->bteo", h, self.experts).mean(2)
        h = torch.tanh(h @ self.proj_t)
        return self.lm_head(self.norm(self.fc2(h)))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


#: the arguments of make_tx that go to the sharded orthogonalizer
DISTRIBUTED = ("strategy", "shard_specs", "bucket_numel", "replicated", "overlap")
NS = muonfn.NewtonSchulz(dtype=torch.float32)


def make_tx(collectives: Any = None, *, fused_adamw: bool = False, **options: Any) -> muonfn.Transform:
    """The run's Muon; with ``collectives``, over ``sharded_orthogonalizer(collectives, **distributed options)``.
    ``fused_adamw``: the same optimizer from its building blocks, its AdamW leaves through torch's fused
    kernel (``muonfn.adamw(fused=True)``, a GPU's route, on any device)."""
    distributed = {k: options.pop(k) for k in DISTRIBUTED if k in options}
    if collectives is not None:
        options["orthogonalizer"] = sharded_orthogonalizer(collectives, **distributed)
    if not fused_adamw:
        return muonfn.muon(lr=0.05, weight_decay=0.1, ns=NS, views=VIEWS, **options)
    donate = options.pop("donate_state", False)
    descent = muonfn.descent(0.05, 0.1, ns=NS, views=VIEWS, overwrite_input=True, **options)
    matrices = muonfn.chain(muonfn.ema_momentum(0.95, donate_state=donate), descent)
    others = muonfn.adamw(0.05, betas=(0.9, 0.95), weight_decay=0.1, donate_state=donate, fused=True)
    shards = tuple(getattr(options.get("orthogonalizer"), "shard_specs", ()))
    labels = functools.partial(muonfn.label_params, shards=shards)
    return muonfn.partition({"muon": matrices, "adamw": others}, labels)


def batches(steps: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
        for _ in range(steps)
    ]


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


@dataclass
class Reference:
    """The single-process run: ``params[t]`` before step ``t`` (``params[-1]`` at the end), ``grads[t]`` at step ``t``,
    each a flat TensorDict keyed by dotted names; ``state``: the optimizer's state at the end (its leaves keyed by
    dotted names too), where the run keeps one.

    Step 3 leaves ``fc2.bias`` and ``experts`` without a gradient.
    """

    params: list[TensorDict]
    grads: list[TensorDict]
    state: TensorDict | None = None


#: the optimizer states the runs are compared in: the params' dtype (fp32), and bf16 (stochastically rounded)
STATE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


NO_GRAD_STEP = 3
NO_GRAD_NAMES = ("fc2.bias", "experts")


def drop_no_grad(grads: TensorDict, step: int) -> TensorDict:
    return grads.exclude(*NO_GRAD_NAMES) if step == NO_GRAD_STEP else grads


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread: multithreaded CPU sgemm picks kernels by batch size for some small shapes,
    so batched and looped Newton–Schulz agree bitwise only with a single thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference_run(steps: int = STEPS, **options: Any) -> Reference:
    """``options``: more arguments of :func:`make_tx` (the same go to the distributed runs compared with it)."""
    with one_thread():
        return _reference_run(steps, **options)


def _reference_run(steps: int, **options: Any) -> Reference:
    model = make_net()
    params = TensorDict.from_module(model).detach().clone()
    tx = make_tx(**options)
    state = tx.init(params)

    def loss_fn(p: TensorDict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with p.to_module(model):
            return loss_of(model, x, y)

    history, grads_seen = [params.flatten_keys(".")], []
    for step, (x, y) in enumerate(batches(steps)):
        grads = drop_no_grad(torch.func.grad(loss_fn)(params, x, y).flatten_keys("."), step)
        updates, state = tx.update(grads, state, params)  # (nested params, flat grads: both are read by name)
        params = muonfn.apply_updates(params, updates)
        history.append(params.flatten_keys("."))
        grads_seen.append(grads)
    return Reference(history, grads_seen, state)


def take(full: torch.Tensor, box: Box) -> torch.Tensor:
    """``full[box]``: the shard a rank holds."""
    out = torch.empty(tuple(length(r) for r in box), dtype=full.dtype)
    copy_out(full, box, out)
    return out


def check_state(state: TensorDict, expected: TensorDict, boxes: Mapping[str, Box], what: str) -> None:
    """Every entry of this rank's ``state`` (plain shards or DTensors) is its part (``boxes``, by leaf name) of the
    single-process run's ``expected`` state bit for bit, in the same dtype; per-leaf counts whole."""
    assert set(state.keys(True, True)) == set(expected.keys(True, True)), what
    for key, want in expected.items(True, True):
        got = state[key]
        got = got.to_local() if isinstance(got, DTensor) else got
        mine = take(want, boxes[key[-1]]) if want.ndim else want
        assert got.dtype == want.dtype and torch.equal(got, mine), f"{what}: state {key} differs ({got.dtype})"


def shim_reference_run(steps: int = STEPS) -> Reference:
    """The same training through ``muonfn.optim.Muon`` (hyperparameters as tensors, in-place steps)."""
    with one_thread():
        model = make_net()
        opt = make_shim(model)
        history, grads_seen = [TensorDict.from_module(model).detach().clone().flatten_keys(".")], []
        for step, (x, y) in enumerate(batches(steps)):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            if step == NO_GRAD_STEP:
                for name in NO_GRAD_NAMES:
                    model.get_parameter(name).grad = None
            grads_seen.append(
                TensorDict({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, [])
            )
            opt.step()
            history.append(TensorDict.from_module(model).detach().clone().flatten_keys("."))
        return Reference(history, grads_seen)


def make_shim(model: nn.Module, **distributed: Any) -> torch.optim.Optimizer:
    from muonfn.optim import Muon

    ns = muonfn.NewtonSchulz(dtype=torch.float32)
    return Muon(model.named_parameters(), lr=0.05, weight_decay=0.1, ns=ns, views=VIEWS, **distributed)
