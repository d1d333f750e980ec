"""What one optimizer step moves and launches: ``python benchmarks/traffic.py [--device meta]``.

:class:`TrafficCounter` is a ``TorchDispatchMode`` that sees every aten op of one step and
counts, from the tensors' shapes, strides and dtypes alone (no values), so that a GPT-2 small
step runs on the meta device in a second or two and without memory. The contenders are those of
``_contenders.py`` on GPT-2 small's parameter shapes (``_sets.gpt2``: Muon on the blocks' 2-D
weights, AdamW on the embeddings with the tied head, the norms and the biases; fp32, or another
dtype with ``--dtype``, e.g. a bf16 model), each counted on its second step (the first builds the
torch optimizers' state).

Counting rules
--------------
- **aten ops**: every op the mode sees, after the decompositions above the dispatcher
  (``torch.matmul`` is seen as the ``mm``/``bmm`` it becomes); a ``_foreach_*`` op is one op
  for its whole list.
- **kernel ops**: the aten ops that run a kernel. Not counted: views and metadata ops (every op
  whose schema returns an alias of an argument it does not write: ``view``, ``t``, ``transpose``,
  ``as_strided``, ``detach``, ``alias``, ``split``, ``unbind``, ...; ``_unsafe_view`` and
  ``lift_fresh``; queries on dtypes and sizes, ``promote_types``; ``.item()``'s read of one
  number, ``_local_scalar_dense``), and allocations (``empty``, ``empty_like``,
  ``empty_strided``, ``new_empty``), which write nothing.
- **per-tensor kernels** (``launches``, off the CPU): what a GPU launches for the step's kernel
  ops. A ``_foreach_*`` op takes the fused multi-tensor kernels only when its tensors share one
  device and one dtype, and the tensors of each index share their sizes and strides and are
  dense without overlap (torch's fast-path restrictions); otherwise it runs op by op, one
  kernel per tensor of its first list, which this column counts (the kernel ops column counts
  it once). A fused kernel that streams a long list in several launches counts once.
- **matmul flops**: ``2·m·n·k`` per matrix product for ``mm``, ``bmm``, ``addmm``, ``baddbmm``,
  ``addbmm``, ``mv``, ``addmv``, ``dot`` (the ``beta·C`` term of the ``add`` forms is not counted).
  A matmul's bytes are kept apart (``matmul_bytes``), out of the non-matmul traffic.
- **bytes read** by a non-matmul op: for each tensor argument it reads (lists flattened), the
  distinct elements it addresses times their size: a broadcast (stride-0) dimension counts
  once, a view counts its own elements, not its storage's. An argument the op only writes is
  not read: ``out=`` arguments, and the destination of ``copy_``, ``fill_``, ``zero_`` and of
  the random fills.
- **bytes written**: in-place and ``out=`` ops count the arguments they write, functional ops
  the tensors they return, an op that does both (batch norm: its running statistics and its
  output) both; a returned view
  of a written argument counts once (torch's fused optimizer steps write their gradients only to
  unscale them by a ``grad_scale``: without one the gradients are read, not written). Views,
  metadata ops and allocations count 0 bytes.
- **temporaries**: the peak, during the step, of the bytes held by the storages that the step's
  ops created and that are still alive: what the step allocates above the parameters,
  gradients and state that existed before it. A storage is freed when its last tensor dies
  (a finalizer on its Python object, which torch keeps for as long as the storage lives). An
  undonated step's new state counts until the step returns.

Seen below the dispatcher: a reduction given a wider ``dtype=`` than its input (``sum``,
``mean``, ``linalg_vector_norm``, ...) first copies the input into that dtype (TensorIterator
reduces in one dtype), which counts as written and read again; a GPU's bf16/fp16 reduced into
fp32 is the exception, read as it is. ``_foreach_norm(dtype=)`` widens as it loads: no copy.
Not seen: other work below the dispatcher (a fused kernel's passes, a BLAS library's packing
buffers, the caching allocator), and reads where a kernel's differ from its arguments' (a
reduction in two passes, data reused from a cache). The bytes are those of a kernel that
streams each argument once.

Devices: ``meta`` takes the code paths of a non-CPU device, as CUDA does (muonfn's GPU forms,
``muonfn/_devices.py``: the fused normalisation and torch's fused AdamW kernel), and the
muonfn contenders are given CUDA's default Newton–Schulz dtype, bf16 (``--ns-dtype``:
``ns=muonfn.NewtonSchulz(dtype=...)``);
``cpu`` and ``cuda`` step real tensors, with each device's defaults. On ``meta``, torch's fused
AdamW (which has no meta kernel) steps zero CPU tensors of its parameters' shapes.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.metadata
import json
import math
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import _contenders as C  # noqa: E402
import _sets  # noqa: E402
import torch  # noqa: E402
from torch._prims_common import is_non_overlapping_and_dense_or_false  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

import muonfn  # noqa: E402

aten = torch.ops.aten
GB, MB = 1e9, 2**20

MATMULS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot"}
#: ops that alias their input without a schema saying so, and ``.item()``'s read of one number
#: (on a GPU a copy to the host, no kernel; torch.optim's step counts live on the host)
METADATA = {"_unsafe_view", "lift_fresh", "_reshape_alias", "resolve_conj", "resolve_neg", "_local_scalar_dense"}
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
#: torch.optim's fused steps, whose schemas mark the gradients written: only unscaled by a ``grad_scale``
FUSED_OPTIMIZERS = {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"}
#: reductions that accumulate in a ``dtype=`` of their own: TensorIterator reduces in one dtype,
#: so torch first copies a narrower input into it (but a GPU reduces bf16/fp16 into fp32 as it loads)
WIDENING_REDUCTIONS = {"sum", "nansum", "mean", "prod", "norm", "linalg_vector_norm"}
#: in-place ops that overwrite their destination without reading it
OVERWRITES = {"copy_", "fill_", "zero_", "uniform_", "normal_", "bernoulli_", "random_", "exponential_"}


def addressed_bytes(t: torch.Tensor) -> int:
    """The bytes of the distinct elements ``t`` addresses (a stride-0 dimension counts once)."""
    elements = math.prod(size for size, stride in zip(t.shape, t.stride()) if stride != 0)
    return elements * t.element_size() if t.numel() else 0


def _tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, list | tuple):
            yield from (x for x in v if isinstance(x, torch.Tensor))


def matmul_flops(name: str, args: tuple[Any, ...]) -> int:
    """``2·m·n·k`` per product (``addmm``/``baddbmm``/``addbmm``/``addmv``: of the two factors)."""
    if name in ("addmm", "baddbmm", "addbmm", "addmv"):
        args = args[1:]
    a, b = args[0], args[1]
    if name in ("dot", "vdot"):
        return 2 * a.numel()
    if name in ("mv", "addmv"):
        return 2 * a.shape[0] * a.shape[1]
    batch = a.shape[0] if name in ("bmm", "baddbmm", "addbmm") else 1
    m, k = a.shape[-2:]
    return 2 * batch * m * k * b.shape[-1]


def op_kind(func: torch._ops.OpOverload) -> str:
    """``"matmul"``, ``"view"`` (views and metadata), ``"alloc"`` or ``"kernel"``."""
    name = func.overloadpacket.__name__
    if name in MATMULS:
        return "matmul"
    if func.is_view or name in METADATA:
        return "view"
    if name in ALLOCATIONS:
        return "alloc"
    return "kernel"


def bound_arguments(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[Any, Any]]:
    """``(schema argument, value)`` for every argument of the call, positional or by keyword."""
    return [
        (arg, args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name))
        for i, arg in enumerate(func._schema.arguments)
    ]


def is_written(name: str, arg: Any, value: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the op ``name`` writes this argument (in-place ``self``, ``out=``)."""
    if arg.alias_info is None or not arg.alias_info.is_write or value is None:
        return False
    return not (name in FUSED_OPTIMIZERS and arg.name == "grads" and kwargs.get("grad_scale") is None)


def only_written(name: str, arg: Any) -> bool:
    """Whether a written argument is written without being read (``out=``, a copy's destination)."""
    return arg.kwarg_only or name in OVERWRITES or name.startswith("_foreach_copy")


def widening_copy_bytes(bound: list[tuple[Any, Any]], off_cpu: bool) -> int:
    """The bytes of the copy a reduction makes of its input in a wider ``dtype=`` (written, then read)."""
    values = {arg.name: value for arg, value in bound}
    x, dtype = values.get("self"), values.get("dtype")
    if not isinstance(x, torch.Tensor) or dtype is None or dtype == x.dtype:
        return 0
    if off_cpu and x.dtype in (torch.bfloat16, torch.float16) and dtype == torch.float32:
        return 0
    return x.numel() * torch.empty((), dtype=dtype).element_size()


def foreach_launches(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Kernels a GPU launches for a ``_foreach_*`` call: 1 on torch's fused fast path, else one per
    tensor of its first list (see the module's rules). ``_foreach_copy_`` casts on its fast path:
    its lists need one dtype each, not one between them."""
    lists = [
        v for v in (*args, *kwargs.values()) if isinstance(v, list | tuple) and v and isinstance(v[0], torch.Tensor)
    ]
    if not lists:
        return 1
    first = lists[0][0]
    casts = name == "_foreach_copy_"
    fast = all(
        t.device == first.device
        and (casts or t.dtype == first.dtype)
        and t.shape == tensors[0].shape
        and t.stride() == tensors[0].stride()
        and is_non_overlapping_and_dense_or_false(t)
        for tensors in zip(*lists)
        for t in tensors
    )
    scalar = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    fast = fast and all(t.dtype == each[0].dtype for each in lists for t in each)  # (one dtype a list)
    fast = fast and all(t.ndim == 0 and t.device in (first.device, torch.device("cpu")) for t in scalar)
    return 1 if fast else len(lists[0])


@dataclass
class Op:
    """One aten op of the step."""

    name: str
    kind: str
    flops: int = 0
    read: int = 0
    written: int = 0
    launches: int = 0


@dataclass
class Summary:
    """One step's figures (bytes and flops as counted by :class:`TrafficCounter`)."""

    aten_ops: int
    kernel_ops: int
    launches: int
    matmul_flops: int
    matmul_bytes: int
    read_bytes: int
    written_bytes: int
    temporaries_peak_bytes: int
    temporaries_left_bytes: int
    by_op: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def nonmatmul_bytes(self) -> int:
        return self.read_bytes + self.written_bytes

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "nonmatmul_bytes": self.nonmatmul_bytes}


class TrafficCounter(TorchDispatchMode):
    """Counts the ops, flops, bytes and temporaries of what runs under it (see the module's rules)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.live = 0  # bytes of the storages created under the mode and still alive
        self.peak = 0
        self._created: dict[int, int] = {}  # id of a created storage -> its bytes
        self._finalizers: list[weakref.finalize] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        inputs = list(_tensors(tree_flatten((args, kwargs))[0]))
        seen = {id(t.untyped_storage()) for t in inputs}
        out = func(*args, **kwargs)
        self.ops.append(self._count(func, args, kwargs, out))
        for t in _tensors(tree_flatten(out)[0]):
            self._track(t, seen)
        return out

    def _count(self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Op:
        name, kind = func.overloadpacket.__name__, op_kind(func)
        bound = bound_arguments(func, args, kwargs)
        written = [(arg, value) for arg, value in bound if is_written(name, arg, value, kwargs)]
        tensors_in, tensors_out = _tensors(value for _, value in bound), _tensors(tree_flatten(out)[0])
        if kind == "kernel" and next(tensors_in, None) is None and next(tensors_out, None) is None:
            kind = "view"  # a query on dtypes or sizes (promote_types): no kernel
        op = Op(name, kind)
        if kind in ("view", "alloc"):
            return op
        off_cpu = any(t.device.type != "cpu" for t in _tensors(value for _, value in bound))
        op.launches = foreach_launches(name, args, kwargs) if name.startswith("_foreach_") and off_cpu else 1
        op.read = sum(
            addressed_bytes(t)
            for arg, value in bound
            if not (is_written(name, arg, value, kwargs) and only_written(name, arg))
            for t in _tensors([value])
        )
        # what it writes in place, and what it returns that is no view of that (an op may do both:
        # batch norm updates its running statistics and returns its output)
        in_place = list(_tensors(value for _, value in written))
        held = {id(t.untyped_storage()) for t in in_place}
        returned = [t for t in _tensors(tree_flatten(out)[0]) if id(t.untyped_storage()) not in held]
        op.written = sum(addressed_bytes(t) for t in (*in_place, *returned))
        if name in WIDENING_REDUCTIONS:
            copied = widening_copy_bytes(bound, off_cpu)
            op.read, op.written = op.read + copied, op.written + copied
        if kind == "matmul":
            op.flops = matmul_flops(name, args)
        return op

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        """Counts ``t``'s storage as the step's own if no input had it and it is new."""
        storage = t.untyped_storage()
        key = id(storage)
        if key in inputs or key in self._created:
            return
        size = storage.nbytes()
        self._created[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        self._finalizers.append(weakref.finalize(storage, self._freed, key))

    def _freed(self, key: int) -> None:
        self.live -= self._created.pop(key, 0)

    def release(self) -> None:
        """Stops following the storages still alive (the step's results)."""
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()

    def summary(self) -> Summary:
        nonmatmul = [op for op in self.ops if op.kind != "matmul"]
        by_op: dict[str, dict[str, Any]] = {}
        for op in self.ops:
            row = by_op.setdefault(op.name, {"calls": 0, "bytes": 0, "flops": 0, "matmul": op.kind == "matmul"})
            row["calls"] += 1
            row["bytes"] += op.read + op.written
            row["flops"] += op.flops
        return Summary(
            aten_ops=len(self.ops),
            kernel_ops=sum(op.kind in ("kernel", "matmul") for op in self.ops),
            launches=sum(op.launches for op in self.ops),
            matmul_flops=sum(op.flops for op in self.ops),
            matmul_bytes=sum(op.read + op.written for op in self.ops if op.kind == "matmul"),
            read_bytes=sum(op.read for op in nonmatmul),
            written_bytes=sum(op.written for op in nonmatmul),
            temporaries_peak_bytes=self.peak,
            temporaries_left_bytes=self.live,
            by_op=dict(sorted(by_op.items(), key=lambda kv: -kv[1]["bytes"])),
        )


def count_step(step: Callable[[], Any]) -> Summary:
    """One call of ``step`` under a :class:`TrafficCounter` (what it returns is alive when the
    temporaries left are taken)."""
    counter = TrafficCounter()
    with counter:
        out = step()
    summary = counter.summary()
    counter.release()
    del out
    return summary


def floor_bytes(ps: _sets.ParamSet) -> int:
    """What the update must touch: in fp32, Muon 24 bytes a matrix element (the gradient read,
    the momentum read and written, the bf16 Newton–Schulz input written and read, the parameter
    read and written), AdamW 28 (the gradient, two moments and the parameter: read, and but for
    the gradient written); in bf16, 14 and 14 (each of those but the bf16 input in 2 bytes)."""
    muon = sum(5 * p.element_size() * p.numel() + 4 * p.numel() for _, p in ps.matrix_params())
    adamw = sum(7 * p.element_size() * p.numel() for _, p in ps.other_params())
    return muon + adamw


# --- contenders -------------------------------------------------------------------------------------


def with_cpu_adamw_params(ps: _sets.ParamSet) -> _sets.ParamSet:
    """``ps`` with its AdamW parameters (and gradients) as zero CPU tensors of the same shapes,
    its matrices left where they are: the meta device has no fused AdamW kernel, and the
    counts come from shapes alike."""
    model = copy.deepcopy(ps.model)  # (a deep copy leaves the gradients behind)
    for name, p in ps.matrix_params():
        model.get_parameter(name).grad = p.grad
    for name, p in ps.other_params():
        owner, _, attr = name.rpartition(".")
        cpu = torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), requires_grad=False)
        cpu.grad = torch.zeros(p.shape, dtype=p.dtype)
        setattr(model.get_submodule(owner), attr, cpu)
    return dataclasses.replace(ps, model=model)


def contenders(ps: _sets.ParamSet, muonfn_options: dict[str, Any]) -> dict[str, Callable[[], C.Step]]:
    """Builders of every contender's step on ``ps`` (``muonfn_options``: given to muonfn's; the shim,
    which takes no ``state_dtype``, is left out when they name one)."""
    on_meta = next(ps.model.parameters()).device.type == "meta"
    out: dict[str, Callable[[], C.Step]] = {
        "muonfn donated": lambda: C.make_donated(ps, **muonfn_options),
        "muonfn functional": lambda: C.make_functional(ps, **muonfn_options),
    }
    if "state_dtype" not in muonfn_options:
        out["muonfn shim"] = lambda: C.make_shim(ps, **muonfn_options)
        out["muonfn shim, one part"] = lambda: C.make_shim(ps, chunk_numel=None, **muonfn_options)
    out |= {
        "torch Muon + AdamW foreach": lambda: C.make_torch_muon(ps),
        "torch Muon + AdamW fused": lambda: C.make_torch_muon(with_cpu_adamw_params(ps) if on_meta else ps, fused=True),
    }
    for peer in C.installed_peers(False, lambda _: None):
        if peer.package == "pytorch_optimizer":
            out[peer.name] = peer.entry_make(ps)
    return out


# --- the state's memory -------------------------------------------------------------------------------


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def muonfn_state_bytes(ps: _sets.ParamSet, muonfn_options: dict[str, Any]) -> dict[str, int]:
    """The bytes of muonfn's state after one donated step, by group: ``"muon"`` (the matrices'
    momentum, and its step counts with a bf16 ``state_dtype``) and ``"adamw"`` (the other leaves'
    two moments and step counts)."""
    tx = C.muonfn_tx(ps, donate_state=True, **muonfn_options)
    params, grads = C.tensordicts(ps)
    _, state = tx.update(grads, tx.init(params), params)
    groups = {group: _bytes(state[group].values(include_nested=True, leaves_only=True)) for group in state.keys()}
    if set(groups) != {"muon", "adamw"}:
        raise RuntimeError(f"muonfn's state holds groups {sorted(groups)}, expected 'muon' and 'adamw'")
    return groups


def torch_state_bytes(ps: _sets.ParamSet) -> dict[str, int]:
    """The bytes of torch.optim.Muon's state (``"muon"``: a momentum buffer per matrix) and torch.optim.AdamW's
    (``"adamw"``: two moments and a 0-d step per leaf, the step on the host) after one step (foreach)."""
    muon, adamw = C.torch_muon_optimizers(ps)
    groups = {}
    for group, opt in (("muon", muon), ("adamw", adamw)):
        opt.step()
        groups[group] = _bytes(t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor))
    return groups


def bitsandbytes_state_bytes(ps: _sets.ParamSet) -> dict[str, int] | str:
    """The bytes of bitsandbytes' ``AdamW8bit`` state on the CPU (real tensors of ``ps``'s shapes; its
    defaults: 8-bit blockwise moments for leaves of at least 4096 entries, fp32 for smaller ones), over the
    AdamW leaves and, as if it trained them too, over the Muon matrices; or why it could not be counted."""
    try:
        import bitsandbytes as bnb  # type: ignore[import-not-found]
    except ImportError as error:
        return f"not installed ({error})"
    groups = {}
    for group, named in (("muon", ps.matrix_params()), ("adamw", ps.other_params())):
        params = [torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype)) for _, p in named]
        for q in params:
            q.grad = torch.ones_like(q)
        try:
            opt = bnb.optim.AdamW8bit(params, lr=C.ADAM_LR, betas=C.BETAS, eps=C.ADAM_EPS, weight_decay=C.WD)
            opt.step()
        except Exception as error:  # a build without a CPU optimizer fails at its first step
            return f"no CPU step ({type(error).__name__}: {error})"
        held = {t.untyped_storage().data_ptr(): t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)}
        groups[group] = _bytes(held.values())  # its quantization maps are one tensor shared by every leaf
    return groups


def memory(ps: _sets.ParamSet, muonfn_options: dict[str, Any], bitsandbytes: bool) -> dict[str, dict[str, Any]]:
    """Per contender: the state's bytes by group and per trainable parameter of the group, and the peak of the
    step's temporaries (above the parameters, gradients and state; :class:`TrafficCounter`)."""
    numel = {
        "muon": sum(p.numel() for _, p in ps.matrix_params()),
        "adamw": sum(p.numel() for _, p in ps.other_params()),
    }
    rows: dict[str, dict[str, Any]] = {}

    def row(state: dict[str, int], steps: dict[str, Callable[[], C.Step]]) -> dict[str, Any]:
        temporaries = {name: count_contender(make).temporaries_peak_bytes for name, make in steps.items()}
        per_param = {group: state[group] / numel[group] for group in numel}
        return {"state_bytes": state, "bytes_per_param": per_param, "temporaries_peak_bytes": temporaries}

    for state_dtype in (None, torch.bfloat16):
        options = muonfn_options if state_dtype is None else {**muonfn_options, "state_dtype": state_dtype}
        label = "params' dtype" if state_dtype is None else "bf16"
        rows[f"muonfn, state_dtype {label}"] = row(
            muonfn_state_bytes(ps, options),
            {
                "donated": lambda options=options: C.make_donated(ps, **options),  # type: ignore[misc]
                "functional": lambda options=options: C.make_functional(ps, **options),  # type: ignore[misc]
            },
        )
    rows["torch Muon + AdamW"] = row(torch_state_bytes(ps), {"foreach": lambda: C.make_torch_muon(ps)})
    if bitsandbytes:
        counted = bitsandbytes_state_bytes(ps)
        rows["bitsandbytes AdamW8bit"] = (
            {"skipped": counted}
            if isinstance(counted, str)
            else {
                "version": importlib.metadata.version("bitsandbytes"),
                "state_bytes": counted,
                "bytes_per_param": {g: counted[g] / numel[g] for g in numel},
            }
        )
    return rows


def memory_table(rows: dict[str, dict[str, Any]]) -> str:
    """The state's bytes per parameter, its MB, the step's temporaries and the two together (MB)."""
    lines = [
        "| optimizer | Muon matrices, bytes / param | AdamW leaves, bytes / param | state MB "
        "| step temporaries MB | state + temporaries MB |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | | |")
            continue
        per, state = r["bytes_per_param"], sum(r["state_bytes"].values())
        temporaries = r.get("temporaries_peak_bytes", {})
        each = ", ".join(f"{how} {b / MB:.0f}" for how, b in temporaries.items()) or "not counted"
        total = ", ".join(f"{how} {(state + b) / MB:.0f}" for how, b in temporaries.items()) or "-"
        lines.append(f"| {name} | {per['muon']:.6f} | {per['adamw']:.6f} | {state / MB:.1f} | {each} | {total} |")
    return "\n".join(lines)


def count_contender(make: Callable[[], C.Step], warmup: int = 1) -> Summary:
    """``make()``'s step counted after ``warmup`` steps."""
    step = make()
    for _ in range(warmup):
        step()
    return count_step(step)


def table(results: dict[str, Summary]) -> str:
    lines = [
        "| contender | aten ops | kernel ops | per-tensor kernels | matmul GFLOP | non-matmul GB | temporaries MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in results.items():
        lines.append(
            f"| {name} | {s.aten_ops} | {s.kernel_ops} | {s.launches} | {s.matmul_flops / 1e9:.0f} | "
            f"{s.nonmatmul_bytes / GB:.2f} | {s.temporaries_peak_bytes / MB:.0f} |"
        )
    return "\n".join(lines)


def top_ops(s: Summary, rows: int) -> str:
    """The ``rows`` non-matmul ops of ``s`` that move the most bytes, as a markdown table."""
    lines = ["| op | calls | GB |", "|---|---|---|"]
    moving = [(name, row) for name, row in s.by_op.items() if not row["matmul"]]
    for name, row in moving[:rows]:
        lines.append(f"| {name} | {row['calls']} | {row['bytes'] / GB:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="meta", help="meta (shapes only; the default), cpu or cuda")
    p.add_argument("--set", default="gpt2-small", choices=sorted(_sets.GPT2_SIZES))
    p.add_argument(
        "--ns-dtype", default=None, help="muonfn's Newton–Schulz dtype (default: bfloat16 on meta, else the device's)"
    )
    p.add_argument("--dtype", default="float32", help="the parameters' dtype (bfloat16: a bf16 model)")
    p.add_argument("--state-dtype", help="muonfn's state_dtype (float32 or bfloat16; default: the parameters')")
    p.add_argument(
        "--memory",
        action="store_true",
        help="instead: the state's bytes per parameter and the step's temporaries, muonfn's state in the "
        "parameters' dtype and in bf16, torch.optim.Muon + AdamW, bitsandbytes' AdamW8bit where it imports",
    )
    p.add_argument("--only", nargs="*", help="count only these contenders")
    p.add_argument("--top", type=int, default=12, help="rows of the donated step's per-op table")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args()
    ns_dtype = args.ns_dtype or ("bfloat16" if args.device == "meta" else None)
    options = {"ns": muonfn.NewtonSchulz(dtype=getattr(torch, ns_dtype))} if ns_dtype else {}
    ps = _sets.gpt2(args.set, device=args.device, dtype=getattr(torch, args.dtype))
    if args.memory:
        rows = memory(ps, options, bitsandbytes=True)
        print(f"\n{ps.description}, {ps.numel() / 1e6:.1f} M parameters, device {args.device}\n")
        print(memory_table(rows))
        if args.out:
            record = {"set": ps.description, "device": args.device, "torch": torch.__version__, "memory": rows}
            args.out.write_text(json.dumps(record, indent=2) + "\n")
            print(f"wrote {args.out}")
        return
    if args.state_dtype:
        options["state_dtype"] = getattr(torch, args.state_dtype)
    builders = contenders(ps, options)
    results = {}
    for name, make in builders.items():
        if args.only and name not in args.only:
            continue
        results[name] = count_contender(make)
        print(f"  {name}: counted", flush=True)
    floor = floor_bytes(ps)
    described = f"{ps.description}, {ps.numel() / 1e6:.1f} M parameters, device {args.device}"
    print(f"\n{described}, muonfn's Newton–Schulz in {ns_dtype}")
    print(f"floor (the bytes the update must touch): {floor / GB:.2f} GB\n")
    print(table(results))
    if "muonfn donated" in results and args.top:
        print(f"\nmuonfn donated, the {args.top} non-matmul ops that move the most bytes:\n")
        print(top_ops(results["muonfn donated"], args.top))
    if args.out:
        from _harness import machine

        record = {
            "machine": machine(torch.device("cpu" if args.device == "meta" else args.device)),
            "device": args.device,
            "set": ps.description,
            "params": ps.numel(),
            "param_dtype": args.dtype,
            "muonfn_ns_dtype": ns_dtype,
            "muonfn_state_dtype": args.state_dtype,
            "floor_bytes": floor,
            "contenders": {name: s.record() for name, s in results.items()},
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
