"""Bodies of the multi-process tests: ``fn(rank, world_size, ...)`` run by ``_dist_harness.run``.

Two kinds of check:

- *exact*: after a real forward and backward, every ``.grad`` is overwritten with this
  rank's shard of the single-process gradient, so the optimizer sees bitwise the same
  numbers; the params (and the state, an fp32 or a bf16 one) must then match the
  single-process run bitwise.
- *end to end*: real backward, real reduce-scatter of each rank's share of the batch;
  gradients differ from the single-process ones by rounding, so params are compared with
  a tolerance.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist_models import (
    BATCH,
    NO_GRAD_NAMES,
    NO_GRAD_STEP,
    NS,
    STATE_DTYPES,
    STEPS,
    Net,
    Reference,
    batches,
    check_state,
    loss_of,
    make_net,
    make_shim,
    make_tx,
    take,
)
from tensordict import TensorDict
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import muonfn
import muonfn._devices
from muonfn.distributed import (
    CountingCollectives,
    ShardSpec,
    TorchCollectives,
    shard_sums,
    sharded_orthogonalizer,
    torch_collectives,
)
from muonfn.distributed._layout import Box, placement_layout

EXACT = ("owner", "gather")  # bitwise strategies ("tp_gram" is equal to rounding)
SUBMODULES = ("embed", "fc1", "qkv", "conv", "fc2", "norm", "lm_head")


def fsdp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    for name in SUBMODULES:
        fully_shard(getattr(model, name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tp_fsdp(model: Net, mesh: DeviceMesh) -> nn.Module:
    """fc1 column-parallel, qkv row-parallel, fc2 column-parallel over "tp", then FSDP2 over "dp"."""
    plan = {"fc1": ColwiseParallel(), "qkv": RowwiseParallel(), "fc2": ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(model, mesh["tp"], plan)
    return fsdp(model, mesh["dp"])


def my_box(p: DTensor) -> Box:
    """The part of the global tensor this rank holds, as muonfn computes it from the placements."""
    mesh = p.device_mesh
    coord = mesh.get_coordinate()
    assert coord is not None
    flat = 0
    for c, s in zip(coord, mesh.shape):
        flat = flat * s + c
    layout = placement_layout(tuple(p.shape), tuple(mesh.shape), tuple(p.placements), range(math.prod(mesh.shape)))
    return layout.boxes[flat]


def check_params(model: nn.Module, expected: TensorDict, what: str, exact: bool = True) -> None:
    for name, p in model.named_parameters():
        want = take(expected[name], my_box(p))
        message = f"{what}: {name} ({p.placements}) differs on rank {dist.get_rank()}"
        if exact:
            assert torch.equal(p.to_local(), want), message
        else:
            torch.testing.assert_close(p.to_local(), want, rtol=1e-4, atol=2e-6, msg=message)


def train_step(
    model: nn.Module,
    tx: muonfn.Transform,
    state: TensorDict,
    step: int,
    exact: Reference | None,
    data_slice: slice,
    in_place: bool = False,
) -> TensorDict:
    """One training step; with ``exact``, the gradients are shards of the reference's (after a real
    backward on the first step only, which is all the optimizer's correctness needs). ``in_place``:
    the module's parameters are stepped by ``apply_updates_`` instead of written back."""
    if exact is None or step == 0:
        tokens, targets = batches()[step]
        loss_of(model, tokens[data_slice], targets[data_slice]).backward()
    for name, p in model.named_parameters():
        if step == NO_GRAD_STEP and name in NO_GRAD_NAMES:
            p.grad = None
        elif exact is not None:
            p.grad = DTensor.from_local(
                take(exact.grads[step][name], my_box(p)),
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
    grads = TensorDict({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, [])
    with torch.no_grad():
        params = TensorDict.from_module(model).detach().flatten_keys(".")  # (the module's own tensors)
        updates, state = tx.update(grads, state, params)
        if in_place:
            muonfn.apply_updates_(params, updates)
        else:
            new = muonfn.apply_updates(params, updates)
            for name, p in model.named_parameters():  # TensorDict.copy_ uses _foreach_copy_, which DTensor lacks
                p.copy_(new[name])
    model.zero_grad(set_to_none=True)
    return state


def check_state_mirrors_params(model: nn.Module, state: TensorDict) -> None:
    params = dict(model.named_parameters())
    for name, m in state["muon", "momentum"].items():
        p = params[name]
        assert isinstance(m, DTensor) and m.placements == p.placements, name
        assert m.to_local().shape == p.to_local().shape, name  # a shard, not a full copy


def exact_run(
    model: nn.Module,
    collectives: TorchCollectives,
    strategy: str,
    reference: Reference,
    what: str,
    tx: muonfn.Transform | None = None,
    in_place: bool = False,
    state_dtype: torch.dtype | None = None,
) -> None:
    """Params, and with an exact strategy the state, bitwise the reference's (to rounding otherwise)."""
    check_params(model, reference.params[0], f"{what} initial layout")  # muonfn's layout is FSDP's
    tx = make_tx(collectives, strategy=strategy, state_dtype=state_dtype) if tx is None else tx
    state = tx.init(TensorDict.from_module(model).detach())
    for step in range(STEPS):
        state = train_step(model, tx, state, step, reference, slice(None), in_place)
    check_params(model, reference.params[-1], f"{what} {strategy}", exact=strategy in EXACT)
    check_state_mirrors_params(model, state)
    if strategy in EXACT and reference.state is not None:
        boxes = {name: my_box(p) for name, p in model.named_parameters()}
        check_state(state, reference.state, boxes, f"{what} {strategy} on rank {dist.get_rank()}")


def end_to_end_run(
    model: nn.Module, collectives: TorchCollectives, reference: Reference, share: slice, what: str
) -> float:
    tx = make_tx(collectives)
    state = tx.init(TensorDict.from_module(model).detach())
    for step in range(STEPS):
        state = train_step(model, tx, state, step, None, share)
    worst = 0.0
    for name, p in model.named_parameters():
        got, want = p.full_tensor().detach(), reference.params[-1][name]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{what}: {n}: {m}")
        worst = max(worst, float((got - want).abs().max()))
    return worst


def share_of(index: int, parts: int) -> slice:
    size = BATCH // parts
    return slice(index * size, (index + 1) * size)


def fsdp_cases(rank: int, world: int, reference: Reference, bf16_reference: Reference) -> None:
    """FSDP2 over ``world`` ranks (both strategies, exact), end to end, and, on 4 ranks, HSDP and TP + FSDP;
    the exact layouts also with a bf16 state (``bf16_reference``: the single-process run with one)."""
    mesh = init_device_mesh("cpu", (world,))
    collectives = torch_collectives(mesh)
    bf16 = torch.bfloat16
    for strategy in EXACT:
        exact_run(fsdp(make_net(), mesh), collectives, strategy, reference, f"FSDP2 on {world}")
    exact_run(fsdp(make_net(), mesh), collectives, "owner", bf16_reference, f"FSDP2 on {world}, bf16", state_dtype=bf16)
    end_to_end_run(fsdp(make_net(), mesh), collectives, reference, share_of(rank, world), f"FSDP2 e2e on {world}")
    if world == 4:
        hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        hsdp = torch_collectives(hsdp_mesh)
        tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = torch_collectives(tp_mesh)
        for strategy in EXACT:
            exact_run(fsdp(make_net(), hsdp_mesh), hsdp, strategy, reference, "HSDP 2x2")
            exact_run(tp_fsdp(make_net(), tp_mesh), tp, strategy, reference, "TP2 + FSDP2")
        exact_run(fsdp(make_net(), hsdp_mesh), hsdp, "gather", bf16_reference, "HSDP 2x2, bf16", state_dtype=bf16)
        exact_run(tp_fsdp(make_net(), tp_mesh), tp, "owner", bf16_reference, "TP2 + FSDP2, bf16", state_dtype=bf16)
        exact_run(tp_fsdp(make_net(), tp_mesh), tp, "tp_gram", reference, "TP2 + FSDP2")  # to rounding
        # a DTensor on ranks the collectives do not span is refused, naming both groups
        wide = distribute_tensor(torch.ones(4, 4), tp_mesh, [Shard(0), Shard(1)], src_data_rank=None)
        try:
            muonfn.orthogonalize(orthogonalizer=sharded_orthogonalizer(torch_collectives(tp_mesh["dp"]))).update(
                TensorDict({"w": wide}, []), {}
            )
        except ValueError as e:
            assert "outside the collectives' group" in str(e), e
        else:
            raise AssertionError("a DTensor outside the collectives' group must be refused")
        dp_rank = tp_mesh.get_local_rank("dp")
        end_to_end_run(tp_fsdp(make_net(), tp_mesh), tp, reference, share_of(dp_rank, 2), "TP2 + FSDP2 e2e")


def cautious_runs(rank: int, world: int, references: dict[str, Reference]) -> None:
    """Caution over DTensor shards (FSDP2, HSDP, TP + FSDP2 on 4 ranks): its counts are the whole
    leaf's, so the run is bitwise the single-process one, in both modes."""
    mesh = init_device_mesh("cpu", (world,))
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for mode, reference in references.items():
        for model, group, what in (
            (fsdp(make_net(), mesh), torch_collectives(mesh), "FSDP2"),
            (fsdp(make_net(), hsdp_mesh), torch_collectives(hsdp_mesh), "HSDP 2x2"),
            (tp_fsdp(make_net(), tp_mesh), torch_collectives(tp_mesh), "TP2 + FSDP2"),
        ):
            tx = make_tx(group, cautious_mode=mode)
            exact_run(model, group, "owner", reference, f"{what}, cautious_mode={mode!r}", tx)


def shim_run(model: nn.Module, collectives: TorchCollectives, reference: Reference, what: str) -> None:
    """``muonfn.optim.Muon(..., orthogonalizer=sharded_orthogonalizer(...))`` on a sharded model: bitwise
    the single-process shim."""
    opt = make_shim(model, orthogonalizer=sharded_orthogonalizer(collectives))
    for step in range(STEPS):
        opt.zero_grad()
        grads = reference.grads[step]
        for name, p in model.named_parameters():
            if name in grads:
                p.grad = DTensor.from_local(
                    take(grads[name], my_box(p)),
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
        opt.step()
    check_params(model, reference.params[-1], what)


def shim_runs(rank: int, world: int, shim_reference: Reference) -> None:
    """The optim shim under FSDP2, and on 4 ranks under TP + FSDP2 (whose tensor hyperparameters meet
    params on two meshes): bitwise the single-process shim."""
    mesh = init_device_mesh("cpu", (world,))
    shim_run(fsdp(make_net(), mesh), torch_collectives(mesh), shim_reference, f"optim.Muon under FSDP2 on {world}")
    if world == 4:
        tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        shim_run(
            tp_fsdp(make_net(), tp_mesh), torch_collectives(tp_mesh), shim_reference, "optim.Muon under TP2 + FSDP2"
        )


def plain_shards_and_guards(rank: int, world: int) -> None:
    """ShardSpec leaves over real gloo, and the errors that keep communication explicit."""
    mesh = init_device_mesh("cpu", (world,))
    group = torch_collectives(dist.group.WORLD)
    torch.manual_seed(0)
    full = {"w": torch.randn(10, 6), "e": torch.randn(3, 5)}
    expected = muonfn.orthogonalize(NS).update(TensorDict(full, []), TensorDict())[0]
    mine = {k: v.tensor_split(world)[rank] for k, v in full.items()}
    for strategy in EXACT:
        specs = {"w": ShardSpec(0), "e": ShardSpec(0)}
        orthogonalizer = sharded_orthogonalizer(group, strategy=strategy, shard_specs=specs)
        tx = muonfn.orthogonalize(NS, orthogonalizer=orthogonalizer)  # as `expected`
        out = tx.update(TensorDict(mine, []), TensorDict())[0]
        for k in full:
            assert torch.equal(out[k], expected[k].tensor_split(world)[rank]), (strategy, k)
    orthogonalizer = sharded_orthogonalizer(group, strategy="tp_gram", shard_specs=specs)
    tx = muonfn.orthogonalize(NS, orthogonalizer=orthogonalizer)
    out = tx.update(TensorDict(mine, []), TensorDict())[0]
    for k in full:  # "w" is cut along its long side: Gram sums over gloo; "e" goes to its owner
        torch.testing.assert_close(out[k], expected[k].tensor_split(world)[rank], rtol=1e-4, atol=2e-6)

    sharded = DTensor.from_local(mine["w"], mesh, [Shard(0)], run_check=False, shape=(10, 6), stride=(6, 1))
    try:
        muonfn.orthogonalize().update(TensorDict({"w": sharded}, []), TensorDict())
    except ValueError as e:
        assert "sharded" in str(e) and "sharded_orthogonalizer" in str(e), e
    else:
        raise AssertionError("a sharded DTensor without collectives must be refused")

    # a gradient still pending its reduction (Partial), with collectives: refused before the
    # donated momentum moves
    model = fsdp(make_net(), mesh)
    tx = muonfn.muon(orthogonalizer=sharded_orthogonalizer(torch_collectives(mesh)), donate_state=True)
    params = TensorDict.from_module(model).detach()
    state = tx.init(params)
    before = {k: v.to_local().clone() for k, v in state.items(True, True)}
    grads = params.apply(torch.ones_like)
    whole = torch.ones(grads["fc1", "weight"].shape)  # every rank's partial sum of the whole gradient
    grads["fc1", "weight"] = DTensor.from_local(whole, mesh, [Partial()], run_check=False)
    try:
        tx.update(grads, state, params)
    except ValueError as e:
        assert "'fc1.weight'" in str(e) and "pending reduction" in str(e), e
    else:
        raise AssertionError("a pending reduction must be refused")
    for k, v in state.items(True, True):
        assert torch.equal(v.to_local(), before[k]), ("pending reduction", k)

    # Newton–Schulz without a sharded orthogonalizer, and so the adapted variants, need whole
    # matrices: refused at init, before any state exists
    for variant in ("muon", "normuon", "adamuon"):
        params = TensorDict.from_module(fsdp(make_net(), mesh)).detach()
        try:
            getattr(muonfn, variant)(donate_state=True).init(params)
        except ValueError as e:
            assert "whole matrices" in str(e), e
        else:
            raise AssertionError(f"{variant} over sharded DTensors must be refused")


def replicated_run(rank: int, world: int, reference: Reference) -> None:
    """Data parallelism over plain tensors: every rank holds the whole model and the same gradients.
    Each matrix is orthogonalized by one owner (both pipelining orders, both strategies) or by
    every rank; all bitwise the single-process run. A ``Replicate()`` DTensor is split the same way."""
    group = torch_collectives(dist.group.WORLD)
    cases = [("owner", "split", True), ("owner", "split", False), ("gather", "split", True), ("owner", "local", True)]
    for strategy, mode, overlap in cases:
        params = reference.params[0].clone()
        tx = make_tx(group, strategy=strategy, replicated=mode, overlap=overlap)
        state = tx.init(params)
        for grads in reference.grads:
            updates, state = tx.update(grads, state, params)
            params = muonfn.apply_updates(params, updates)
        for name, value in params.items():
            assert torch.equal(value, reference.params[-1][name]), (strategy, mode, overlap, name)

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = {"w": torch.randn(10, 6), "v": torch.randn(6, 12)}
    expected = muonfn.orthogonalize(NS).update(TensorDict(full, []), TensorDict())[0]
    leaves = {k: distribute_tensor(v, mesh, [Replicate()], src_data_rank=None) for k, v in full.items()}
    counted = CountingCollectives(torch_collectives(mesh))
    tx = muonfn.orthogonalize(NS, orthogonalizer=sharded_orthogonalizer(counted))
    out = tx.update(TensorDict(leaves, []), TensorDict())[0]
    for k in full:
        assert isinstance(out[k], DTensor) and out[k].placements == (Replicate(),), k
        assert torch.equal(out[k].to_local(), expected[k]), k
    assert counted.calls.get("all_to_all_single", 0) >= 1  # the results travel from their owners


def donated_state_run(rank: int, world: int, reference: Reference) -> None:
    """FSDP2 with ``donate_state=True`` and ``apply_updates_``: the DTensor state and parameters are
    updated in place, bitwise the single-process run."""
    mesh = init_device_mesh("cpu", (world,))
    collectives = torch_collectives(mesh)
    tx = make_tx(collectives, donate_state=True)
    exact_run(fsdp(make_net(), mesh), collectives, "owner", reference, "FSDP2 donated", tx=tx, in_place=True)


def skipped_step_run(rank: int, world: int, reference: Reference) -> None:
    """FSDP2 under ``muonfn.apply_if_finite``: a step whose gradient shard on one rank holds a NaN is
    skipped on every rank (params and DTensor state unchanged, counted once); the run then goes on
    bitwise as the single-process one without that step. The same with ``sum_shards``, which DTensor
    leaves do not need but must not mind; and over a donated state, which the guard writes back."""
    for sums, donate in ((False, False), (True, False), (False, True)):
        mesh = init_device_mesh("cpu", (world,))
        collectives = torch_collectives(mesh)
        tx = muonfn.apply_if_finite(
            make_tx(collectives, donate_state=donate), sum_shards=shard_sums(collectives) if sums else None
        )
        skipped_step(rank, world, reference, fsdp(make_net(), mesh), tx)


def skipped_step(rank: int, world: int, reference: Reference, model: nn.Module, tx: muonfn.Transform) -> None:
    state = tx.init(TensorDict.from_module(model).detach())
    for step in range(STEPS):
        state = train_step(model, tx, state, step, reference, slice(None))
        if step == 1:
            before = {n: p.to_local().clone() for n, p in model.named_parameters()}
            momentum = state["muon", "momentum", "fc1.weight"].to_local().clone()
            grads = {}
            for name, p in model.named_parameters():
                local = take(reference.grads[step][name], my_box(p))
                if name == "fc1.weight" and rank == world - 1:
                    local.view(-1)[0] = float("nan")
                grads[name] = DTensor.from_local(
                    local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            with torch.no_grad():
                params = TensorDict.from_module(model).detach().flatten_keys(".")
                updates, state = tx.update(TensorDict(grads, []), state, params)
                new = muonfn.apply_updates(params, updates)
                for name, p in model.named_parameters():
                    p.copy_(new[name])
            assert int(state["notfinite_count"]) == 1
            for name, p in model.named_parameters():
                assert torch.equal(p.to_local(), before[name]), name
            assert torch.equal(state["muon", "momentum", "fc1.weight"].to_local(), momentum)
    check_params(model, reference.params[-1], "FSDP2 under apply_if_finite")


def tensordict_copy_run(rank: int, world: int, reference: Reference) -> None:
    """Writing a step's result back into FSDP2 parameters with ``TensorDict.copy_``."""
    mesh = init_device_mesh("cpu", (world,))
    model = fsdp(make_net(), mesh)
    tx = make_tx(torch_collectives(mesh))
    params = TensorDict.from_module(model)
    state = tx.init(params.detach())
    for step in range(STEPS):
        grads = TensorDict(
            {
                n: DTensor.from_local(
                    take(reference.grads[step][n], my_box(p)),
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
                for n, p in model.named_parameters()
                if n in reference.grads[step]
            },
            [],
        )
        with torch.no_grad():
            updates, state = tx.update(grads, state, params.detach())
            params.detach().copy_(muonfn.apply_updates(params.detach(), updates))
    check_params(model, reference.params[-1], "FSDP2 written back with TensorDict.copy_")


def dcp_segment(
    rank: int,
    world: int,
    references: dict[str, Reference],
    load: tuple[str, int] | None,
    save: tuple[str, int] | None,
) -> None:
    """Trains steps ``[load step, STEPS)`` under FSDP2 on ``world`` ranks, resuming from and saving DCP checkpoints
    (``{path}-{name}``), once for each state kept in ``STATE_DTYPES[name]``, against ``references[name]``."""
    mesh = init_device_mesh("cpu", (world,))
    for kept_in, reference in references.items():
        what = f"DCP, state kept in {kept_in}, on {world} ranks"
        model = fsdp(make_net(seed=0 if load is None else 123), mesh)
        tx = make_tx(torch_collectives(mesh), state_dtype=STATE_DTYPES[kept_in])
        state = tx.init(TensorDict.from_module(model).detach())
        dtypes = {k: v.dtype for k, v in state.items(True, True)}
        start = 0
        if load is not None:
            path, start = load
            before = state["muon", "momentum", "fc1.weight"].to_local().clone()
            dcp.load({"model": model.state_dict(), "optim": state.to_dict()}, checkpoint_id=f"{path}-{kept_in}")
            assert not torch.equal(before, state["muon", "momentum", "fc1.weight"].to_local())  # loaded in place
            assert {k: v.dtype for k, v in state.items(True, True)} == dtypes, what  # (a bf16 state stays bf16)
            check_params(model, reference.params[start], f"{what}: params loaded")
        for step in range(start, STEPS):
            if save is not None and step == save[1]:
                optim = state.to_dict()
                dcp.save({"model": model.state_dict(), "optim": optim}, checkpoint_id=f"{save[0]}-{kept_in}")
            state = train_step(model, tx, state, step, reference, slice(None))
        check_params(model, reference.params[-1], what)
        assert reference.state is not None
        check_state(state, reference.state, {name: my_box(p) for name, p in model.named_parameters()}, what)


def torch_kernel_run(rank: int, world: int, reference: Reference) -> None:
    """FSDP2 with the AdamW leaves through torch's fused kernel (taken here on the CPU, as a GPU
    takes it), donated or not, against the single-process run through the same kernel: to
    rounding, as the CPU's kernel rounds an element by where it falls in its tensor (vector body
    or scalar tail), which a shard moves; CUDA's computes every element alike."""
    calls = []
    kernel = torch._fused_adamw_
    torch._fused_adamw_ = lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs)
    mesh = init_device_mesh("cpu", (world,))
    collectives = torch_collectives(mesh)
    for donate in (False, True):
        model = fsdp(make_net(), mesh)
        tx = make_tx(collectives, fused_adamw=True, donate_state=donate)
        state = tx.init(TensorDict.from_module(model).detach())
        for step in range(STEPS):
            state = train_step(model, tx, state, step, reference, slice(None), in_place=donate)
        check_params(model, reference.params[-1], f"FSDP2, AdamW by torch's kernel, donate={donate}", exact=False)
        check_state_mirrors_params(model, state)
    assert len(calls) == 2 * STEPS, calls
