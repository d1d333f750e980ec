"""The fast paths compute what the plain ones do: bucketed Newton–Schulz, multi-tensor
elementwise math, the Gram method, donated and compiled updates. Correctness only; speed is
measured in benchmarks/."""

import collections
import itertools
import operator
from typing import Any

import pytest
import torch
from _steps import compiled_donated_beside_eager, stepper
from _strategies import assert_td_close_to_iteration, iteration_dtype
from tensordict import TensorDict, TensorDictBase
from torch.overrides import TorchFunctionMode

import muonfn
from muonfn import MatrixView

# Real-model shapes. (MKL computes a few matrices with 5–11 rows differently in a batch
# than alone, so bitwise batch = loop is a property of the BLAS for those; not used here.)
SHAPES = {
    "attn.q": (32, 32),
    "attn.k": (32, 32),
    "attn.qkv": (96, 32),  # tall: transposed inside NS
    "mlp.up": (128, 32),
    "mlp.down": (32, 128),
    "mlp2.up": (128, 32),
    "mlp2.down": (32, 128),
    "conv.a": (16, 8, 3, 3),  # (16, 72)
    "conv.b": (16, 8, 3, 3),
    "experts": (3, 32, 128),  # batch_dims=1: three (32, 128) matrices
    "fused": (80, 32),  # split (32, 16, 32) rows
    "norm": (32,),
}
VIEWS = {"experts": MatrixView(batch_dims=1), "fused": MatrixView(split=(32, 16, 32))}


def orthogonalize_blocks(tensors, views, ns, scale, **options):
    """The local orthogonalizer's call on unnamed tensors."""
    return muonfn.linalg.LocalOrthogonalizer(**options)(
        [f"t{i}" for i in range(len(tensors))], tensors, views, ns, scale
    )


def make(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[TensorDict, TensorDict]:
    g = torch.Generator().manual_seed(seed)
    params = TensorDict(
        {tuple(k.split(".")): torch.randn(s, generator=g).to(dtype) for k, s in SHAPES.items()}, batch_size=[]
    )
    grads = params.apply(lambda p: torch.randn(p.shape, generator=g).to(dtype))
    return params, grads


def matrices_only(td: TensorDictBase) -> TensorDictBase:
    return td.exclude("norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_bucketed_equals_unbatched_bitwise(dtype, method):
    _, grads = make(dtype=dtype)
    grads = matrices_only(grads)
    outs = []
    for bucket_numel in (1, 32 * 128 * 2, muonfn.linalg.DEFAULT_BUCKET_NUMEL):
        tx = muonfn.orthogonalize(
            muonfn.NewtonSchulz(method=method),
            views=VIEWS,
            scale="match_rms_adamw",
            orthogonalizer=muonfn.LocalOrthogonalizer(bucket_numel=bucket_numel),
        )
        outs.append(tx.update(grads, tx.init(grads))[0])
    for out in outs[1:]:
        for key in grads.keys(True, True):
            assert torch.equal(out[key], outs[0][key]), key


def test_muon_step_does_not_depend_on_bucket_size():
    params, grads = make(1)
    results = []
    for bucket_numel in (1, muonfn.linalg.DEFAULT_BUCKET_NUMEL):
        tx = muonfn.muon(lr=0.1, views=VIEWS, orthogonalizer=muonfn.LocalOrthogonalizer(bucket_numel=bucket_numel))
        state, p = tx.init(params), params
        for _ in range(2):
            updates, state = tx.update(grads, state, p)
            p = muonfn.apply_updates(p, updates)
        results.append((p, state))
    (p1, s1), (p2, s2) = results
    assert (p1 == p2).all() and (s1 == s2).all()


class CallCounter(TorchFunctionMode):
    """Counts the torch functions called from Python (a foreach op counts once)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.calls[name] += 1
        if name in ("bmm", "baddbmm") and isinstance(args[0], torch.Tensor):
            self.shapes.append((name, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


def count_update(tx: muonfn.Transform, leaves: int, shape=(16, 48)) -> CallCounter:
    g = torch.Generator().manual_seed(2)
    leaf = lambda: {"w": torch.randn(shape, generator=g), "b": torch.randn(shape[0], generator=g)}  # noqa: E731
    params = TensorDict({f"l{i}": leaf() for i in range(leaves)}, batch_size=[])
    grads = params.apply(lambda p: torch.randn(p.shape, generator=g))
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)  # the first step may differ (none does today)
    with CallCounter() as counter:
        updates, state = tx.update(grads, state, params)
        muonfn.apply_updates(params, updates)
    return counter


# Per-leaf calls allowed on the hot path: metadata and views; no elementwise math, no casts.
PER_LEAF_OK = {
    "__get__",
    "__len__",
    "is_complex",
    "is_contiguous",
    "numel",
    "size",
    "dim",
    "element_size",
    "promote_types",
    "reshape",
    "view",
}


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_elementwise_math_is_multi_tensor(name):
    """Elementwise work runs as one multi-tensor call per op, whatever the number of leaves."""
    tx = muonfn.adamw(weight_decay=0.1) if name == "adamw" else muonfn.muon(weight_decay=0.1)
    few, many = count_update(tx, 2), count_update(tx, 6)
    grows = {k for k in set(few.calls) | set(many.calls) if many.calls[k] != few.calls[k]}
    assert grows <= PER_LEAF_OK, sorted(grows - PER_LEAF_OK)
    foreach = {k for k in many.calls if k.startswith("_foreach_")}
    assert {"_foreach_lerp", "_foreach_add", "_foreach_mul"} <= foreach


def count_matrix_update(tx: muonfn.Transform, leaves: int) -> CallCounter:
    """:func:`count_update` over ``leaves`` matrices only (the variants' transforms take no vectors)."""
    g = torch.Generator().manual_seed(2)
    params = TensorDict({f"l{i}": torch.randn(16, 48, generator=g) for i in range(leaves)}, batch_size=[])
    grads = params.apply(lambda p: torch.randn(p.shape, generator=g))
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    with CallCounter() as counter:
        tx.update(grads, state, params)
    return counter


# NorMuon's row statistics are reductions of each leaf's own shape, and each row block is divided
# by its own column of them: leaf by leaf.
ROW_STATISTICS = {"square", "mean", "div"}


@pytest.mark.parametrize(
    ("make_tx", "per_leaf", "fused"),
    [
        (lambda: muonfn.scale_by_sign(), set(), {"_foreach_sign"}),
        (
            lambda: muonfn.scale_by_element_rms(0.9, bias_correction=True, rescale="none"),
            set(),
            {"_foreach_mul", "_foreach_lerp", "_foreach_add", "_foreach_sqrt", "_foreach_div"},
        ),
        (
            lambda: muonfn.scale_by_neuron_norm(torch.tensor(0.9), rescale="none", donate_state=True),
            ROW_STATISTICS,
            {"_foreach_lerp_", "_foreach_sqrt", "_foreach_add"},
        ),
    ],
    ids=["scale_by_sign", "scale_by_element_rms", "scale_by_neuron_norm"],
)
def test_variant_elementwise_math_is_multi_tensor(make_tx, per_leaf, fused):
    """The variants' elementwise math is one multi-tensor call per op, whatever the number of leaves."""
    few, many = count_matrix_update(make_tx(), 2), count_matrix_update(make_tx(), 6)
    grows = {k for k in set(few.calls) | set(many.calls) if many.calls[k] != few.calls[k]}
    assert grows <= PER_LEAF_OK | per_leaf, sorted(grows - PER_LEAF_OK - per_leaf)
    assert fused <= set(many.calls), sorted(fused - set(many.calls))


def test_same_shape_matrices_share_one_batched_iteration():
    """Six same-shape matrices cost the matmul calls of one: 3 per step, each on the whole batch."""
    counter = count_update(muonfn.muon(), 6)
    assert counter.calls["bmm"] + counter.calls["baddbmm"] == 3 * 5
    assert {shape[0] for _, shape in counter.shapes} == {6}


class CountedNewtonSchulz(muonfn.NewtonSchulz):
    """muonfn's Newton–Schulz, noting the shape of every wide batch it iterates on."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        object.__setattr__(self, "calls", [])

    def orthogonalize_wide(self, batch, **options):
        self.calls.append(tuple(batch.shape))
        return super().orthogonalize_wide(batch, **options)


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_tall_matrices_join_the_batch_of_their_transposed_shape(method: str):
    """An MLP's 16×48 and 48×16 matrices make one Newton–Schulz call, with each result the
    bits of its own call, contiguous like its input; a function that is not muonfn's
    Newton–Schulz keeps the orientations apart."""
    g = torch.Generator().manual_seed(3)
    mats = [
        torch.randn(2, 16, 48, generator=g),
        torch.randn(1, 48, 16, generator=g),
        torch.randn(1, 16, 48, generator=g),
    ]
    ns = muonfn.NewtonSchulz(method=method)
    none = muonfn.linalg.shape_scale("none")
    counted = CountedNewtonSchulz(method=method)
    out = orthogonalize_blocks(mats, [MatrixView(batch_dims=1)] * 3, counted, none)
    assert counted.calls == [(4, 16, 48)]
    for m, o in zip(mats, out):
        alone = ns(m)
        assert torch.equal(o, alone) and o.is_contiguous() and alone.is_contiguous()
    seen = []
    orthogonalize_blocks(mats, [MatrixView(batch_dims=1)] * 3, lambda x: seen.append(x.shape) or ns(x), none)
    assert seen == [(3, 16, 48), (1, 48, 16)]


def test_plain_matrices_are_stacked_as_they_are():
    """2-D matrices go into the call of their shape as they are (tall ones transposed into
    their wide shape's call), with the blocks of tensors their views reshape; every result is
    the bits of its own call, in order, contiguous, scaled by its own shape's factor (which the
    last Newton–Schulz step takes)."""
    g = torch.Generator().manual_seed(4)
    tensors = [
        torch.randn(16, 48, generator=g),
        torch.randn(8, 4, 3, 3, generator=g),  # a conv kernel: one 8×36 matrix
        torch.randn(48, 16, generator=g),
        torch.randn(2, 16, 48, generator=g),  # two experts
        torch.randn(16, 48, generator=g),
        torch.randn(16, 16, generator=g),
    ]
    views = [MatrixView(), MatrixView(), MatrixView(), MatrixView(batch_dims=1), MatrixView(), MatrixView()]
    ns = muonfn.NewtonSchulz()
    scale = muonfn.linalg.shape_scale("match_rms_adamw")
    counted = CountedNewtonSchulz()
    out = orthogonalize_blocks(tensors, views, counted, scale)
    assert sorted(counted.calls) == [(1, 8, 36), (1, 16, 16), (5, 16, 48)]
    for t, view, o in zip(tensors, views, out):
        rows, cols = view.matrix_shape(t.shape)
        alone = view.from_matrices([ns.orthogonalize(m, scale=scale(rows, cols)) for m in view.to_matrices(t)], t.shape)
        assert torch.equal(o, alone) and o.is_contiguous() and o.shape == t.shape
    seen = []
    mine = orthogonalize_blocks(
        tensors, views, lambda x: seen.append(tuple(x.shape)) or ns(x).mT.contiguous().mT, scale
    )
    assert sorted(seen) == [(1, 8, 36), (1, 16, 16), (1, 48, 16), (4, 16, 48)]  # a function of one's own: no turning
    assert all(o.is_contiguous() for o in mine)


def test_bucket_cap_splits_batches():
    mats = [torch.randn(1, 8, 24) for _ in range(7)]
    seen = []

    def ns(x):
        seen.append(x.shape[0])
        return muonfn.newton_schulz(x)

    none = muonfn.linalg.shape_scale("none")
    out = orthogonalize_blocks(mats, [MatrixView(batch_dims=1)] * 7, ns, none, bucket_numel=3 * 8 * 24)
    assert seen == [3, 3, 1]
    for m, o in zip(mats, out):
        assert torch.equal(o, muonfn.newton_schulz(m))
    # a matrix larger than the cap is still orthogonalized, alone
    seen.clear()
    orthogonalize_blocks(mats[:2], [MatrixView(batch_dims=1)] * 2, ns, none, bucket_numel=10)
    assert seen == [1, 1]


def test_update_does_not_call_tensordict_apply(monkeypatch):
    """TensorDict.apply runs a Python lambda per leaf; the update path uses multi-tensor ops."""
    params, grads = make(3)
    tx = muonfn.muon(views=VIEWS, weight_decay=0.1)
    state = tx.init(params)
    calls = []
    original = TensorDictBase.apply

    def counting_apply(self, *args, **kwargs):
        calls.append(args[0] if args else kwargs.get("fn"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TensorDictBase, "apply", counting_apply)
    updates, state = tx.update(grads, state, params)
    muonfn.apply_updates(params, updates)
    assert calls == []


def test_muon_with_gram_method():
    g = torch.Generator().manual_seed(6)
    shapes = {"a": (16, 48), "b": (16, 16), "c": (16,)}
    params = TensorDict({k: torch.randn(s, generator=g) for k, s in shapes.items()}, batch_size=[])
    grads = params.apply(lambda p: torch.randn(p.shape, generator=g))
    updates = {}
    for method in ("standard", "gram"):
        tx = muonfn.muon(lr=0.1, ns=muonfn.NewtonSchulz(method=method, dtype=torch.float32))  # equal to fp32 rounding
        updates[method], _ = tx.update(grads, tx.init(params), params)
    rel = (updates["gram"]["a"] - updates["standard"]["a"]).norm() / updates["standard"]["a"].norm()
    assert rel < 1e-5
    assert torch.equal(updates["gram"]["b"], updates["standard"]["b"])  # square: the standard iteration
    assert torch.equal(updates["gram"]["c"], updates["standard"]["c"])
    with pytest.raises(ValueError, match="unknown Newton–Schulz method 'cholesky'"):
        muonfn.NewtonSchulz(method="cholesky")  # type: ignore[arg-type]
    for make in (muonfn.muon, muonfn.orthogonalize):
        with pytest.raises(TypeError, match=r"ns must be a muonfn\.NewtonSchulz, 'svd', 'qr', 'gram'"):
            make(ns="cholesky")


def run_steps(tx, params, grads_list):
    state, p = tx.init(params), params
    for grads in grads_list:
        updates, state = tx.update(grads, state, p)
        p = muonfn.apply_updates(p, updates)
    return p, state


@pytest.mark.parametrize("preset", ["muon", "adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_donated_state_is_updated_in_place_with_the_same_results(preset, nesterov):
    params, grads = make(5)
    partial = grads.exclude("attn", "norm")  # leaves without a gradient keep their state
    steps = [grads, partial, grads]
    momentum = torch.tensor(0.9, dtype=torch.float64)
    kwargs = {"lr": 0.05, "weight_decay": 0.1}
    if preset == "muon":
        build = lambda donate: muonfn.muon(  # noqa: E731
            momentum=momentum, nesterov=nesterov, views=VIEWS, donate_state=donate, **kwargs
        )
    else:
        build = lambda donate: muonfn.adamw(donate_state=donate, **kwargs)  # noqa: E731
    p_ref, s_ref = run_steps(build(False), params, steps)

    tx = build(True)
    state = tx.init(params)
    originals = {k: t for k, t in zip(state.keys(True, True), state.values(True, True))}
    p = params
    for g in steps:
        updates, state = tx.update(g, state, p)
        p = muonfn.apply_updates(p, updates)
    assert (p == p_ref).all() and (state == s_ref).all()  # bit for bit
    for key, t in zip(state.keys(True, True), state.values(True, True)):
        assert t is originals[key], key  # the same tensors, updated in place


def test_donation_keeps_carried_state_untouched():
    params, grads = make(6)
    tx = muonfn.muon(views=VIEWS, donate_state=True)
    state = tx.init(params)
    before = state.clone()
    _, state = tx.update(grads.exclude("mlp"), state, params)
    for key in before.keys(True, True):
        assert torch.equal(state[key], before[key]) == key[-1].startswith("mlp."), key


def test_compiled_update_fullgraph_matches_eager():
    """``torch.compile(update, fullgraph=True)`` traces the whole Muon + AdamW step (no graph
    breaks), with labels, views and a decay mask given as dicts and the state donated; the
    learning rate is a tensor changed in place, so steps never recompile. The compiled step
    updates the donated state in place and matches the eager, undonated one."""
    torch._dynamo.reset()
    params, grads = (td.select("attn", "mlp", "experts", "fused", "norm") for td in make(4))
    lr = torch.tensor(0.02)
    labels = {"norm": "adamw", "attn.k": "adamw", "attn.q": "muon", "attn.qkv": "muon"}
    labels.update({k: "muon" for k in ("mlp.up", "mlp.down", "experts", "fused")})
    decay = {k: k != "norm" for k in labels}
    options = {"lr": lr, "views": VIEWS, "weight_decay": 0.1, "labels": labels, "weight_decay_mask": decay}
    eager_tx, donating_tx = muonfn.muon(**options), muonfn.muon(**options, donate_state=True)

    params_e, state_e, params_c, state_c = compiled_donated_beside_eager(eager_tx, donating_tx, grads, params, lr)
    # (inductor fuses the elementwise chains its own way: to the rounding of the Newton–Schulz iteration)
    iteration = iteration_dtype(*(p.shape[-2:] for p in matrices_only(params).values(True, True)))
    assert_td_close_to_iteration(params_c, params_e, atol=2e-6, iteration=iteration, initial=params)
    torch.testing.assert_close(state_c["adamw", "step", "norm"], state_e["adamw", "step", "norm"])


def test_update_traces_whole_off_the_cpu():
    """The branches a GPU takes (rates read as host numbers, the AdamW kernel route declined
    while tracing) trace with ``fullgraph=True`` too: on
    the meta device, which takes them and holds no values (so ``aot_eager``, and a float rate).
    tests/test_cuda.py compiles the same step on a GPU."""
    torch._dynamo.reset()
    params, grads = (td.select("attn", "mlp", "experts", "fused", "norm").to("meta") for td in make(4))
    labels = {"norm": "adamw", "attn.k": "adamw", "attn.q": "muon", "attn.qkv": "muon"}
    labels.update({k: "muon" for k in ("mlp.up", "mlp.down", "experts", "fused")})
    tx = muonfn.muon(lr=0.02, views=VIEWS, weight_decay=0.1, labels=labels, donate_state=True)

    def step(grads: TensorDictBase, state: TensorDictBase, params: TensorDictBase) -> Any:
        updates, state = tx.update(grads, state, params)
        return muonfn.apply_updates(params, updates), state

    new_params, state = torch.compile(step, fullgraph=True, backend="aot_eager")(grads, tx.init(params), params)
    for key, p in params.items(True, True):
        assert new_params[key].shape == p.shape and new_params[key].dtype == p.dtype and new_params[key].is_meta, key
    assert set(state.keys(True, True)) == set(tx.init(params).keys(True, True))


# --- no multi-tensor kernel next to a transposed read ------------------------------------------------
# Inductor (torch 2.11, CUDA) fails on a fused `_foreach_*` kernel that shares a buffer with a read of
# it in the other order (its loop reordering asserts); the CPU backend never reorders loops, so the
# pattern is looked for in the traced graph instead: every buffer a `_foreach_*` op touches, through
# views and through the copies and pointwise ops inductor inlines into it, and every read of its
# results by a kernel it could fuse with, must walk that buffer in one order.

TRANSPOSED_SHAPES = {
    "up": (128, 32),  # tall: joins the (32, 128) call transposed
    "down": (32, 128),
    "qkv": (96, 32),  # split in three (32, 32) blocks
    "experts": (2, 64, 32),  # a batch of tall matrices
    "stored": (64, 32),  # stored (in, out): a (32, 64) matrix
    "embed": (64, 32),
    "norm": (32,),
}
TRANSPOSED_OPTIONS = {
    "labels": {k: "adamw" if k in ("embed", "norm") else "muon" for k in TRANSPOSED_SHAPES},
    "views": {
        "qkv": MatrixView(split=(32, 32, 32)),
        "experts": MatrixView(batch_dims=1),
        "stored": MatrixView(transposed=True),
    },
    "weight_decay": 0.1,
}
UNFUSED = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot"}  # run as library calls


def traced(fn, *args) -> torch.fx.GraphModule:
    """The functional ATen graph ``torch.compile(fn, fullgraph=True)`` hands its backend."""
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def backend(gm, inputs):
        def keep(graph, _):
            graphs.append(graph)
            return graph.forward

        return aot_module_simplified(gm, inputs, fw_compiler=keep)

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=backend)(*args)
    torch._dynamo.reset()
    return graphs[0]


def _aten(node: torch.fx.Node) -> str | None:
    """The name of ``node``'s aten op (``None`` for other nodes, and for muonfn's own ops, which a
    compiler runs as they are)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return target.overloadpacket.__name__
    return None


def _is_view(node: torch.fx.Node) -> bool:
    if node.target is operator.getitem:  # an element of split's or unbind's views, or of an op's results
        return node.args[0].op == "call_function" and _is_view(node.args[0])
    return _aten(node) is not None and (node.target.is_view or _aten(node) == "_unsafe_view")


def _inlined(node: torch.fx.Node) -> bool:
    """An op inductor computes inside its reader's kernel: a copy, a cast, a pointwise op."""
    return _aten(node) in ("clone", "_to_copy", "copy") or (
        _aten(node) is not None and torch.Tag.pointwise in node.target.tags
    )


def _base(node: torch.fx.Node) -> torch.fx.Node:
    while _is_view(node):
        node = node.args[0]
    return node


def _flipped(node: torch.fx.Node) -> bool:
    value = node.meta["val"]  # (a list for split's views, whose elements say)
    return isinstance(value, torch.Tensor) and transposed(value)


def transposed(x: torch.Tensor) -> bool:
    """Whether ``x`` walks its memory out of order (a transposed view): its strides, over the
    dimensions longer than 1, do not decrease."""
    strides = [stride for size, stride in zip(x.shape, x.stride()) if size > 1]
    return any(a < b for a, b in itertools.pairwise(strides))


def _sources(read: torch.fx.Node, flipped: bool = False) -> list[tuple[torch.fx.Node, bool]]:
    """``(buffer, transposed?)`` for every buffer the tensor ``read`` comes from."""
    base, flipped = _base(read), flipped != _flipped(read)
    if base.op == "call_function" and _inlined(base):
        return [source for arg in base.all_input_nodes for source in _sources(arg, flipped)]
    return [(base, flipped)]


def _readers(node: torch.fx.Node) -> list[tuple[torch.fx.Node, bool]]:
    """``(op, transposed?)`` for every op reading ``node``'s buffer, through views."""
    out = []
    for user in node.users:
        if _is_view(user):
            out += [(reader, flipped != _flipped(user)) for reader, flipped in _readers(user)]
        else:
            out.append((user, False))
    return out


def mixed_orders(graph: torch.fx.GraphModule) -> list[str]:
    """Every ``_foreach_*`` op that touches a buffer in both orders, with the buffer."""
    found = []
    for node in graph.graph.nodes:
        if not (_aten(node) or "").startswith("_foreach_"):
            continue
        orders: dict[torch.fx.Node, set[bool]] = collections.defaultdict(set)
        for arg in node.args:
            for t in arg if isinstance(arg, list | tuple) else ():
                if isinstance(t, torch.fx.Node):
                    for source, flipped in _sources(t):
                        orders[source].add(flipped)
        for result in node.users:  # its results, written in order, and their readers
            orders[result].add(False)
            for reader, flipped in _readers(result):
                if _aten(reader) not in (None, *UNFUSED):
                    orders[result].add(flipped)
        found += [f"{node.name} reads and writes {buffer.name} both ways" for buffer, o in orders.items() if len(o) > 1]
    return found


@pytest.mark.parametrize("gpu_form", [None, True])
@pytest.mark.parametrize("donate", [False, True])
def test_compiled_step_reads_no_multi_tensor_buffer_transposed(donate: bool, gpu_form: bool | None) -> None:
    """Tall matrices, a tall batch, transposed storage and split blocks: in the compiled step no
    ``_foreach_*`` op shares a buffer with a transposed read of it (torch 2.11's inductor fails on
    CUDA there), in the CPU's form and in a GPU's (asked for here). Eager, the transposed views are
    read as they are."""
    g = torch.Generator().manual_seed(0)
    params = TensorDict({k: torch.randn(s, generator=g) for k, s in TRANSPOSED_SHAPES.items()}, batch_size=[])
    grads = params.apply(lambda p: torch.randn(p.shape, generator=g))
    forms = {
        "orthogonalizer": muonfn.LocalOrthogonalizer(gpu_form=gpu_form),
        "ns": muonfn.NewtonSchulz(dtype=torch.bfloat16),
    }
    tx = muonfn.muon(lr=0.02, donate_state=donate, **TRANSPOSED_OPTIONS, **(forms if gpu_form else {}))
    graph = traced(stepper(tx), grads, tx.init(params), params)
    assert any((_aten(n) or "").startswith("_foreach_") for n in graph.graph.nodes)
    assert mixed_orders(graph) == []


def test_the_check_finds_a_multi_tensor_op_beside_a_transposed_read() -> None:
    """The check itself: a ``_foreach_*`` result read transposed, and a list holding a buffer and a
    transposed copy of it, are found; the same ops in one order are not."""

    def transposed_reader(a, b):
        u, v = torch._foreach_mul([a, b], 2.0)
        return torch.stack([u.mT, v])

    def mixed_list(a, b):
        return torch._foreach_add([a.mT.contiguous(), a], [b, b])

    def in_order(a, b):
        u, v = torch._foreach_mul([a, b], 2.0)
        return torch.stack([u, v]), torch._foreach_add([a.contiguous(), a], [b, b])

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    for fn, found in ((transposed_reader, 1), (mixed_list, 1), (in_order, 0)):
        assert len(mixed_orders(traced(fn, a, b))) == found, fn.__name__


# --- Newton–Schulz's results in the look-ahead's memory -----------------------------------------------


def lerp_outputs(step) -> tuple[Any, set[int]]:  # type: ignore[no-untyped-def]
    """``step()``'s result and the addresses of the tensors its lerps wrote (seen below the dispatcher)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    written: set[int] = set()

    class Lerps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten._foreach_lerp, torch.ops.aten.lerp):
                written.update(t.data_ptr() for t in (out if isinstance(out, list | tuple) else [out]))
            return out

    with Lerps():
        result = step()
    return result, written


@pytest.mark.parametrize("nesterov", [True, False])
def test_newton_schulz_stores_its_results_in_the_look_aheads_memory(nesterov: bool) -> None:
    """In a GPU's form (asked for here on the CPU), Muon's wide matrices get their Newton–Schulz
    results stored in the Nesterov look-ahead's memory (``overwrite_input``), a temporary of the
    step: the same bits as a new tensor. Without Nesterov the direction is the momentum itself,
    the state, which is never written into."""
    g = torch.Generator().manual_seed(9)
    params = TensorDict({"wide": torch.randn(16, 48, generator=g), "tall": torch.randn(48, 16, generator=g)}, [])
    grads = params.apply(lambda p: torch.randn(p.shape, generator=g))
    ns = muonfn.NewtonSchulz(dtype=torch.bfloat16)
    gpu = muonfn.LocalOrthogonalizer(gpu_form=True)
    tx = muonfn.scale_by_muon(0.9, nesterov=nesterov, ns=ns, orthogonalizer=gpu)
    state = tx.init(params)
    (updates, new_state), lerped = lerp_outputs(lambda: tx.update(grads, state, params))
    momentum = muonfn.ema_momentum(0.9, nesterov=nesterov)
    look_ahead, expected_state = momentum.update(grads, momentum.init(params))
    assert (new_state == expected_state).all()  # the state holds the momentum, not a result
    separate = muonfn.orthogonalize(ns, orthogonalizer=gpu, scale="match_rms_adamw")
    assert (updates == separate.update(look_ahead, TensorDict())[0]).all()
    assert (updates["wide"].data_ptr() in lerped) == nesterov
    assert new_state["momentum", "wide"].data_ptr() != updates["wide"].data_ptr()
