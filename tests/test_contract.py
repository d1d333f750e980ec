"""The Transform contract, checked for every exported transform and combinator.

One table (:data:`TABLE`) lists each building block, combinator and preset with
representative non-default options, the parameters it is meant for, and which properties
apply; every property below is parametrized over the whole table (optax's
``_common_test``, torch's ``OptimizerInfo``). A property that an entry is known to break
is an ``xfail(strict=True)`` whose reason names the defect, so that fixing it turns the
case into an unexpected pass that must be acknowledged by removing the mark.

The properties:

1. purity: ``update`` modifies none of its inputs and is deterministic; ``init`` does not
   modify the params;
2. a missing gradient carries state: a leaf absent from ``grads`` gets no update and its
   state is carried over bit for bit, while every other output is the full update's;
3. ``torch.vmap`` over a stacked ensemble, and the stacked ensemble updated as it is (params of
   batch size ``[3]``, every reduction keeping the member dimension), equal updating each member
   alone (bit for bit where the math is elementwise, to :data:`NS_REL` through Newton–Schulz);
4. ``torch.compile(update, fullgraph=True)`` traces without graph breaks and, with the
   ``aot_eager`` backend, equals eager bit for bit (inductor's fused kernels round elementwise
   chains their own way, to rounding);
5. ``donate_state=True`` equals ``donate_state=False``, bit for bit;
6. bad gradients raise an error naming the leaf before anything is modified;
7. the state round-trips through :func:`muonfn.save` / :func:`muonfn.load` and the resumed
   update equals the uninterrupted one.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pytest
import torch
from _bitwise import assert_bitwise
from tensordict import TensorDict, TensorDictBase

import muonfn
from muonfn import MatrixView, Transform

Key = tuple[str, ...]

# --- parameters --------------------------------------------------------------------------------------

# Leaves of every kind: a fused QKV matrix, a plain matrix, a conv kernel, a stack of experts,
# vectors and a scalar. Matrix heights avoid the few small sizes (6, 7, 9, 11) for which MKL
# computes a matrix differently inside a batch than alone, and "mlp.up" is the only leaf of its
# shape, so that dropping it leaves every batched Newton–Schulz call as it was.
SHAPES: dict[Key, tuple[int, ...]] = {
    ("attn", "qkv"): (12, 8),  # split (8, 2, 2): blocks (8, 8), (2, 8), (2, 8)
    ("mlp", "up"): (16, 8),
    ("conv", "weight"): (4, 2, 3, 3),  # flattened to (4, 18)
    ("experts",): (2, 8, 8),  # batch_dims=1: two (8, 8) matrices
    ("mlp", "bias"): (16,),
    ("norm", "weight"): (8,),
    ("gain",): (),
}
MATRICES = tuple(k for k, s in SHAPES.items() if len(s) >= 2)
ALL = tuple(SHAPES)
VIEWS = {"attn.qkv": MatrixView(split=(8, 2, 2)), "experts": MatrixView(batch_dims=1)}
NO_DECAY = {"norm.weight": False, "gain": False}


def random_td(keys: tuple[Key, ...], seed: int) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    return TensorDict({k: torch.randn(SHAPES[k], generator=gen) for k in keys}, batch_size=[])


def random_like(td: TensorDictBase, seed: int) -> TensorDictBase:
    gen = torch.Generator().manual_seed(seed)
    return td.apply(lambda t: torch.randn(t.shape, generator=gen, dtype=t.dtype))


def dotted(key: Key) -> str:
    return ".".join(key)


def leaf_keys(td: TensorDictBase) -> list[Key]:
    """Every leaf key as a tuple (TensorDict gives top-level ones as plain strings)."""
    return [(k,) if isinstance(k, str) else k for k in td.keys(True, True)]


# --- the table ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One transform under contract.

    ``make(**kwargs)`` builds it (``donate_state=True`` is passed only to entries with
    ``donate``); ``leaves`` are the params it is meant for; ``missing`` the leaves whose
    gradient is dropped and ``probes`` those the bad-input cases corrupt (one case each).
    ``bitwise`` names the properties that hold bit for bit, the others holding to
    :data:`NS_REL`. ``skip`` and ``xfail`` map property ids (``fnmatch`` patterns, e.g.
    ``"bad_input:*"``) to the reason.
    """

    id: str
    make: Callable[..., Transform]
    leaves: tuple[Key, ...] = ALL
    missing: tuple[Key, ...] = (("mlp", "up"),)
    probes: tuple[Key, ...] = (("mlp", "up"),)
    donate: bool = False
    bitwise: frozenset[str] = frozenset({"missing", "vmap"})
    skip: Mapping[str, str] = field(default_factory=dict)
    xfail: Mapping[str, str] = field(default_factory=dict)

    def params(self, seed: int = 0) -> TensorDict:
        return random_td(self.leaves, seed)


ELEMENTWISE = frozenset({"missing", "vmap"})
# vmap stacks the members' matrices into other batched matmuls than the loop's, which round
# differently; fp32 Newton–Schulz amplifies a last-bit change of its input up to its slope at zero
# (keller: 3.4445⁵ ≈ 485, times 2⁻²⁴: 3e-5 of its output; 7e-6 measured here, on the orthogonalize
# entry), so these entries hold to NS_REL, not bitwise, on any BLAS.
NEWTON_SCHULZ = frozenset({"missing"})
NS_REL = 1e-4

BAD_CASES = ("shape", "dtype", "complex", "device", "unknown_key", "batch_size")
PER_LEAF_CASES = ("shape", "dtype", "complex", "device")


# Compiling costs 1–8 s an entry on 2 cores, so the compile property runs on the muon preset
# (partition, chain, scale_by_muon with views, adamw with a decay mask: most of the table traced
# in one update) and a few entries it does not contain; the others say where they are compiled.
IN_MUON = {"compile": "compiled inside the muon entry's update"}


TABLE: tuple[Entry, ...] = (
    Entry(
        "muon",
        lambda **kw: muonfn.muon(
            lr=0.02,
            momentum=0.9,
            weight_decay=0.1,
            adamw_lr=0.01,
            adamw_weight_decay=0.05,
            views=VIEWS,
            weight_decay_mask=NO_DECAY,
            **kw,
        ),
        missing=(("mlp", "up"), ("mlp", "bias")),
        probes=(("mlp", "up"), ("mlp", "bias")),  # one leaf of each branch
        donate=True,
        bitwise=NEWTON_SCHULZ,
    ),
    Entry(
        # a map that hands its input back: the experts' stack is the momentum itself, which the
        # shape scale, the decay and the learning rate write into unless the orthogonalizer copies it
        "muon(identity map, no Nesterov)",
        lambda **kw: muonfn.muon(lr=0.02, nesterov=False, weight_decay=0.1, ns=lambda x: x, views=VIEWS, **kw),
        donate=True,
        skip={"compile": "the same update as the muon entry's, with a map of one's own"},
    ),
    Entry(
        "adamw",
        lambda **kw: muonfn.adamw(
            lr=torch.tensor(0.01), betas=(0.8, 0.99), weight_decay=0.1, weight_decay_mask=NO_DECAY, **kw
        ),
        missing=(("mlp", "up"), ("gain",)),
        probes=(("mlp", "up"), ("gain",)),
        donate=True,
        skip=IN_MUON,
    ),
    Entry(
        "adamw(fused)",
        lambda **kw: muonfn.adamw(lr=0.01, weight_decay=0.1, weight_decay_mask="matrices", fused=True, **kw),
        missing=(("mlp", "up"), ("gain",)),
        probes=(("mlp", "up"), ("gain",)),
        donate=True,
        bitwise=frozenset({"missing"}),  # (an ensemble takes the rule's own passes, to the kernel's rounding)
        skip={"compile": "torch's fused kernel runs eagerly; traced, the rule's own passes (test_adamw)"},
    ),
    Entry("ema_momentum", lambda **kw: muonfn.ema_momentum(torch.tensor(0.9), nesterov=False, **kw), donate=True),
    Entry(
        "scale_by_adam",
        lambda **kw: muonfn.scale_by_adam(0.8, 0.99, eps=1e-6, **kw),
        missing=(("mlp", "up"), ("gain",)),
        donate=True,
        skip=IN_MUON,
    ),
    Entry(
        "ema_momentum(bias_correction)",
        lambda **kw: muonfn.ema_momentum(torch.tensor(0.9), bias_correction=True, **kw),
        missing=(("mlp", "up"), ("gain",)),
        donate=True,
    ),
    Entry("ema_momentum(add)", lambda **kw: muonfn.ema_momentum(0.8, nesterov="add", **kw), donate=True, skip=IN_MUON),
    Entry(
        "scale_by_adam(nesterov)",
        lambda **kw: muonfn.scale_by_adam(0.8, 0.99, eps=1e-6, nesterov=True, **kw),
        missing=(("mlp", "up"), ("gain",)),
        donate=True,
    ),
    Entry(
        "cautious(chain)",
        lambda **kw: muonfn.cautious(
            muonfn.chain(muonfn.ema_momentum(0.9, **kw), muonfn.add_decayed_weights(0.1, cautious=True))
        ),
        donate=True,
    ),
    Entry(
        "cautious(scale_by_adam, pytorch_optimizer)",
        lambda: muonfn.cautious(muonfn.scale_by_adam(), mode="pytorch_optimizer"),
        skip={"compile": "compiled in the cautious(chain) entry"},
    ),
    Entry(
        "scale_by_muon(variants)",
        lambda **kw: muonfn.scale_by_muon(
            0.9,
            momentum_bias_correction=True,
            ns=muonfn.NewtonSchulz(method="gram", restarts=(2,), eps_mode="add"),
            views=VIEWS,
            **kw,
        ),
        leaves=MATRICES,
        donate=True,
        bitwise=NEWTON_SCHULZ,
    ),
    Entry(
        "scale_by_neuron_norm",
        lambda **kw: muonfn.scale_by_neuron_norm(torch.tensor(0.9), views=VIEWS, **kw),
        leaves=MATRICES,
        donate=True,
        skip={"compile": "compiled inside the normuon entry's update"},
    ),
    Entry(
        "scale_by_neuron_norm(orthogonal, column split)",
        lambda: muonfn.scale_by_neuron_norm(
            0.9, rescale="orthogonal", views={**VIEWS, "mlp.up": MatrixView(split=(3, 5), split_dim=1)}
        ),
        leaves=MATRICES,
        skip={"compile": "compiled inside the normuon entry's update"},
    ),
    Entry(
        "scale_by_element_rms(bias_correction)",
        lambda **kw: muonfn.scale_by_element_rms(0.9, bias_correction=True, rescale="preserve_norm", views=VIEWS, **kw),
        leaves=MATRICES,
        donate=True,
    ),
    Entry("scale_by_sign", lambda: muonfn.scale_by_sign(), skip={"compile": "compiled inside the adamuon entry"}),
    Entry(
        "normuon",
        lambda **kw: muonfn.normuon(lr=0.02, views=VIEWS, weight_decay_mask=NO_DECAY, adamw_nesterov=True, **kw),
        missing=(("mlp", "up"), ("mlp", "bias")),
        probes=(("mlp", "up"), ("mlp", "bias")),
        donate=True,
        bitwise=NEWTON_SCHULZ,
    ),
    Entry(
        "adamuon",
        lambda **kw: muonfn.adamuon(
            lr=0.02, views=VIEWS, cautious_weight_decay=True, cautious_mode="pytorch_optimizer", **kw
        ),
        missing=(("mlp", "up"), ("mlp", "bias")),
        probes=(("mlp", "up"), ("mlp", "bias")),
        donate=True,
        bitwise=NEWTON_SCHULZ,
    ),
    Entry(
        "adamuon(both bias corrections)",
        lambda **kw: muonfn.adamuon(
            lr=0.02, views=VIEWS, momentum_bias_correction=True, second_moment_bias_correction=True, **kw
        ),
        missing=(("mlp", "up"), ("mlp", "bias")),
        probes=(("mlp", "up"), ("mlp", "bias")),
        donate=True,
        bitwise=NEWTON_SCHULZ,
        skip={"compile": "the adamuon entry's update with one more named member"},
    ),
    Entry(
        "muon(variant momenta)",
        lambda **kw: muonfn.muon(
            lr=0.02, nesterov="add", cautious_weight_decay=True, cautious_mode="heavyball", views=VIEWS, **kw
        ),
        missing=(("mlp", "up"), ("mlp", "bias")),
        probes=(("mlp", "up"), ("mlp", "bias")),
        donate=True,
        bitwise=NEWTON_SCHULZ,
        skip=IN_MUON,
    ),
    Entry(
        "orthogonalize(svd)",
        lambda: muonfn.orthogonalize("svd", views=VIEWS),
        leaves=MATRICES,
        bitwise=NEWTON_SCHULZ,
        skip={"compile": "an SVD: compiled through the callable entry's path"},
    ),
    Entry(
        "orthogonalize(qr)",
        lambda: muonfn.orthogonalize("qr", views=VIEWS),
        leaves=MATRICES,
        bitwise=NEWTON_SCHULZ,
        skip={"compile": "a QR: compiled through the callable entry's path"},
    ),
    Entry(
        "orthogonalize(callable)",
        lambda: muonfn.orthogonalize(lambda x: x.mul(2.0), views=VIEWS, scale="original"),
        leaves=MATRICES,
        bitwise=NEWTON_SCHULZ,
    ),
    Entry(
        "scale_by_muon",
        lambda **kw: muonfn.scale_by_muon(
            0.9, ns=muonfn.NewtonSchulz("cesista", method="gram"), scale="unit_rms_norm", views=VIEWS, **kw
        ),
        leaves=MATRICES,
        donate=True,
        bitwise=NEWTON_SCHULZ,
        skip=IN_MUON,
    ),
    Entry(
        "orthogonalize",
        lambda: muonfn.orthogonalize(
            muonfn.NewtonSchulz("polar_express", steps=4),
            views=VIEWS,
            scale="spectral",
            orthogonalizer=muonfn.LocalOrthogonalizer(bucket_numel=200),
        ),
        leaves=MATRICES,
        bitwise=NEWTON_SCHULZ,
        skip=IN_MUON,
    ),
    Entry(
        "orthogonalize(a GPU's form)",
        lambda: muonfn.orthogonalize(
            muonfn.NewtonSchulz(dtype=torch.bfloat16),
            views=VIEWS,
            orthogonalizer=muonfn.LocalOrthogonalizer(gpu_form=True),
        ),
        leaves=MATRICES,
        bitwise=NEWTON_SCHULZ,
        skip={
            "compile": "a GPU's form is eager; traced, the stack's (tests/test_cuda.py compiles it on a GPU)",
            "vmap": "vmapped, the stack's form, which a bf16 iteration rounds apart from a GPU's",
        },
    ),
    Entry(
        "descent",
        lambda: muonfn.descent(0.02, 0.1, ns=muonfn.NewtonSchulz("cesista"), views=VIEWS, mask={"conv.weight": False}),
        leaves=MATRICES,
        bitwise=NEWTON_SCHULZ,
        skip=IN_MUON,
    ),
    Entry(
        # a schedule's rate is a number in an eager step, taken by the shape scale's own product;
        # one rate per member (vmapped or stacked) or a traced one is a tensor, a product of its own
        "descent(no Newton–Schulz, schedule, tensor decay)",
        lambda: muonfn.descent(
            lambda count: 0.02 / (1 + count), torch.tensor(0.1), scale="spectral", views=VIEWS, mask="matrices"
        ),
        leaves=MATRICES,
        bitwise=frozenset({"missing"}),
        skip={"compile": "traced, the rate and decay are tensors: passes of their own, to eager's rounding"},
    ),
    Entry(
        "scale_by_shape",
        lambda: muonfn.scale_by_shape(("original", 2.0), views=VIEWS),
        leaves=MATRICES,
        skip={"compile": "the same shape scale as the muon entry's, applied inside its orthogonalize"},
    ),
    Entry(
        "add_decayed_weights",
        lambda: muonfn.add_decayed_weights(torch.tensor(0.1), mask={"norm.weight": False}),
        skip=IN_MUON,
    ),
    Entry(
        "scale_by_learning_rate(float)",
        lambda: muonfn.scale_by_learning_rate(0.1),
        skip=IN_MUON,
    ),
    Entry(
        "scale_by_learning_rate(tensor)",
        lambda: muonfn.scale_by_learning_rate(torch.tensor(0.1)),
        skip={"compile": "compiled with a 0-d lr changed in place in test_performance_paths"},
    ),
    Entry(
        "scale_by_learning_rate(schedule)",
        lambda: muonfn.scale_by_learning_rate(lambda count: 0.1 / (1 + count)),
    ),
    Entry(
        "chain",
        lambda: muonfn.chain(
            muonfn.ema_momentum(0.9),
            muonfn.scale_by_adam(),
            muonfn.add_decayed_weights(0.05),
            muonfn.scale_by_learning_rate(lambda count: 0.1 * 0.5**count),
        ),
        missing=(("mlp", "up"), ("gain",)),
        skip=IN_MUON,
    ),
    Entry(
        "named",
        lambda: muonfn.chain(
            muonfn.named("fast", muonfn.ema_momentum(0.5)),
            muonfn.named("slow", muonfn.ema_momentum(0.9, nesterov=False)),
        ),
        skip={"compile": "named only nests the state; its members are compiled in the ema_momentum entry"},
    ),
    Entry(
        "masked",
        lambda: muonfn.masked(
            muonfn.chain(muonfn.ema_momentum(0.9), muonfn.scale_by_learning_rate(0.1)),
            {"mlp.up": True, "conv.weight": True, "gain": True, "mlp.bias": False},
        ),
        missing=(("mlp", "up"), ("attn", "qkv")),  # one selected leaf, one passed through
        probes=(("mlp", "up"), ("attn", "qkv")),
    ),
    Entry(
        "partition",
        lambda: muonfn.partition(
            {
                "ortho": muonfn.scale_by_muon(views=VIEWS),
                "adam": muonfn.chain(muonfn.scale_by_adam(), muonfn.scale_by_learning_rate(0.01)),
            },
            {dotted(k): "ortho" if len(SHAPES[k]) >= 2 else "adam" for k in ALL},
        ),
        missing=(("mlp", "up"), ("gain",)),
        probes=(("mlp", "up"), ("gain",)),
        bitwise=NEWTON_SCHULZ,
        skip=IN_MUON,
    ),
    Entry(
        "apply_if_finite(adamw)",
        lambda: muonfn.apply_if_finite(muonfn.adamw(lr=0.01, weight_decay=0.1)),
        missing=(("mlp", "up"), ("gain",)),
        skip={"compile": "compiled (inductor, with a NaN step) in test_functional"},
    ),
)


def marks(entry: Entry, prop: str) -> list[pytest.MarkDecorator]:
    """The skip/xfail marks the table gives ``entry`` for property id ``prop``."""
    out = []
    for pattern, reason in entry.skip.items():
        if fnmatch.fnmatchcase(prop, pattern):
            out.append(pytest.mark.skip(reason=reason))
    for pattern, reason in entry.xfail.items():
        if fnmatch.fnmatchcase(prop, pattern):
            out.append(pytest.mark.xfail(strict=True, reason=reason))
    return out


def cases(prop: str, *, where: Callable[[Entry], bool] = lambda e: True) -> list:
    return [pytest.param(e, id=e.id, marks=marks(e, prop)) for e in TABLE if where(e)]


# --- comparisons and a warmed-up state ---------------------------------------------------------------


def assert_close(a: TensorDictBase, b: TensorDictBase, bitwise: bool, rel: float = NS_REL) -> None:
    """Bit for bit, or every floating leaf to ``rel`` in norm (integer leaves always exactly)."""
    if bitwise:
        assert_bitwise(a, b)
        return
    keys_a = sorted(a.keys(True, True), key=str)
    assert keys_a == sorted(b.keys(True, True), key=str)
    for key in keys_a:
        x, y = a.get(key), b.get(key)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), key
        if not x.is_floating_point():
            assert torch.equal(x, y), key
            continue
        err, ref = (x.double() - y.double()).norm(), y.double().norm()
        assert err <= rel * ref, f"{key}: relative error {float(err / ref.clamp_min(1e-300)):.3g}"


def clone(*tds: TensorDictBase) -> tuple[TensorDictBase, ...]:
    return tuple(td.clone() for td in tds)


def warmed_up(entry: Entry, **kwargs: bool) -> tuple[Transform, TensorDict, TensorDictBase]:
    """The transform, its params and its state after one step (momenta, step counts not zero)."""
    tx = entry.make(**kwargs)
    params = entry.params()
    _, state = tx.update(random_like(params, 1), tx.init(params), params)
    return tx, params, state


def belongs_to(state_key: Key, leaf: Key) -> bool:
    """Whether a state entry is the leaf's own (``("adamw", "step", "mlp.bias")`` is ``mlp.bias``'s)."""
    return state_key[-1] == dotted(leaf)


# --- 1. purity ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", cases("purity"))
def test_update_is_pure_and_deterministic(entry: Entry) -> None:
    """``init`` leaves the params as they were; ``update`` leaves grads, state and params as they
    were, and two calls on the same inputs return the same bits."""
    tx = entry.make()
    params = entry.params()
    before = params.clone()
    state = tx.init(params)
    assert_bitwise(params, before)
    _, state = tx.update(random_like(params, 1), state, params)
    grads = random_like(params, 2)
    inputs = clone(grads, state, params)
    first = tx.update(grads, state, params)
    for given, copy in zip((grads, state, params), inputs):
        assert_bitwise(given, copy)
    second = tx.update(grads, state, params)
    for a, b in zip(first, second):
        assert_bitwise(a, b)
    assert leaf_keys(first[0]) == leaf_keys(grads)


# --- 2. missing gradients ----------------------------------------------------------------------------


def missing_cases() -> list:
    return [
        pytest.param(e, leaf, id=f"{e.id}-{dotted(leaf)}", marks=marks(e, f"missing:{dotted(leaf)}"))
        for e in TABLE
        for leaf in e.missing
    ]


@pytest.mark.parametrize(("entry", "leaf"), missing_cases())
def test_missing_gradient_carries_state(entry: Entry, leaf: Key) -> None:
    """A leaf without a gradient (``p.grad is None``) gets no update and keeps its state bit for
    bit; every other update and state entry is what the update with all gradients gives."""
    tx, params, state = warmed_up(entry)
    grads = random_like(params, 2)
    full_updates, full_state = tx.update(grads, state, params)
    updates, new_state = tx.update(grads.exclude(leaf), state, params)
    assert leaf not in leaf_keys(updates)
    assert_close(updates, full_updates.exclude(leaf), bitwise="missing" in entry.bitwise)
    mine = [k for k in leaf_keys(state) if belongs_to(k, leaf)]
    assert_bitwise(new_state.select(*mine), state.select(*mine))
    assert_close(new_state.exclude(*mine), full_state.exclude(*mine), bitwise="missing" in entry.bitwise)


# --- 3. vmap -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", cases("vmap"))
def test_vmap_over_an_ensemble_equals_the_loop(entry: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.vmap`` of ``init`` and ``update`` over three stacked param sets equals running each
    member alone, for two steps (bit for bit where the entry's math is elementwise)."""
    monkeypatch.setenv("MUONFN_CPU_NS_DTYPE", "float32")  # NS_REL is fp32's: bf16 rounds the two apart by percents
    tx = entry.make()
    members = [entry.params(seed) for seed in range(3)]
    stacked = torch.stack(members)
    state = torch.vmap(tx.init)(stacked)
    alone = [tx.init(p) for p in members]
    bitwise = "vmap" in entry.bitwise
    for i in range(3):
        assert_bitwise(state[i], alone[i])
    for t in range(2):
        grads = random_like(stacked, 10 + t)
        updates, state = torch.vmap(tx.update)(grads, state, stacked)
        for i in range(3):
            expected, alone[i] = tx.update(grads[i], alone[i], members[i])
            assert_close(updates[i], expected, bitwise)
            assert_close(state[i], alone[i], bitwise)


@pytest.mark.parametrize("entry", cases("stacked"))
def test_a_stacked_ensemble_without_vmap_equals_the_loop(entry: Entry) -> None:
    """Three param sets stacked into a batch size of ``[3]`` and updated without ``torch.vmap``
    equal each member updated alone, for two steps: no reduction may sum over the members, the
    0-d ``gain`` (one scalar per member) included."""
    tx = entry.make()
    members = [entry.params(seed) for seed in range(3)]
    stacked = torch.stack(members)
    state = tx.init(stacked)
    alone = [tx.init(p) for p in members]
    bitwise = "vmap" in entry.bitwise
    for t in range(2):
        grads = random_like(stacked, 10 + t)
        updates, state = tx.update(grads, state, stacked)
        for i in range(3):
            expected, alone[i] = tx.update(grads[i], alone[i], members[i])
            assert_close(updates[i], expected, bitwise)
            assert_close(state[i], alone[i], bitwise)


# --- 4. torch.compile --------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", cases("compile"))
def test_compiled_update_equals_eager(entry: Entry) -> None:
    """``torch.compile(update, fullgraph=True)`` traces without graph breaks and returns the eager
    updates and state bit for bit, over two steps that reuse one graph."""
    torch._dynamo.reset()
    tx = entry.make()
    params = entry.params()
    compiled = torch.compile(tx.update, fullgraph=True, backend="aot_eager")
    eager_state = compiled_state = tx.init(params)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(2):
            grads = random_like(params, 20 + t)
            expected, eager_state = tx.update(grads, eager_state, params)
            got, compiled_state = compiled(grads, compiled_state, params)
            assert_bitwise(got, expected)
            assert_bitwise(compiled_state, eager_state)
    torch._dynamo.reset()


# --- 5. donated state --------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", cases("donate", where=lambda e: e.donate))
def test_donated_state_gives_the_same_bits(entry: Entry) -> None:
    """``donate_state=True`` updates the state's own tensors in place and otherwise changes
    nothing: the same updates and states bit for bit over three steps (the second without the
    first ``missing`` leaf's gradient), grads and params untouched."""
    params = entry.params()
    plain, donating = entry.make(), entry.make(donate_state=True)
    state, donated = plain.init(params), donating.init(params)
    tensors = dict(zip(donated.keys(True, True), donated.values(True, True)))
    for t in range(3):
        grads = random_like(params, 30 + t)
        if t == 1:
            grads = grads.exclude(entry.missing[0])
        inputs = clone(grads, params)
        expected, state = plain.update(grads, state, params)
        got, donated = donating.update(grads, donated, params)
        assert_bitwise(got, expected)
        assert_bitwise(donated, state)
        for given, copy in zip((grads, params), inputs):
            assert_bitwise(given, copy)
    for key, t in zip(donated.keys(True, True), donated.values(True, True)):
        assert t is tensors[key], key


# --- 6. bad input ------------------------------------------------------------------------------------

UNKNOWN: Key = ("mlp", "upp")


def corrupt(grads: TensorDictBase, probe: Key, case: str) -> TensorDictBase:
    """``grads`` with one defect: ``probe``'s gradient of another shape, dtype, complex, or on
    another device;
    a gradient for no parameter; or a batch size the state does not have."""
    bad = grads.clone()
    g = grads.get(probe)
    if case == "shape":
        bad.set(probe, torch.ones(*g.shape[:-1], g.shape[-1] + 1) if g.ndim else torch.ones(1))
    elif case == "dtype":
        bad.set(probe, g.double())
    elif case == "complex":
        bad.set(probe, torch.complex(g, torch.zeros_like(g)))
    elif case == "device":  # (the meta device stands for another one: a step there would compute nothing)
        bad.set(probe, g.to("meta"))
    elif case == "unknown_key":
        bad.set(UNKNOWN, torch.ones(SHAPES[("mlp", "up")]))
    elif case == "batch_size":
        bad = torch.stack([grads, grads])
    return bad


def bad_input_cases() -> list:
    out = []
    for e in TABLE:
        for donate in (False, True) if e.donate else (False,):
            for case in BAD_CASES:
                for probe in e.probes if case in PER_LEAF_CASES else e.probes[:1]:
                    prop = ":".join(["bad_input", *(["donated"] if donate else []), case])
                    if case in PER_LEAF_CASES:
                        prop += f":{dotted(probe)}"
                    name = prop.replace("bad_input:", e.id + "-").replace(":", "-")
                    out.append(pytest.param(e, donate, case, probe, id=name, marks=marks(e, prop)))
    return out


@pytest.mark.parametrize(("entry", "donate", "case", "probe"), bad_input_cases())
def test_bad_gradients_raise_before_anything_changes(entry: Entry, donate: bool, case: str, probe: Key) -> None:
    """Gradients that do not fit the params raise a ValueError or TypeError naming the leaf
    (or the batch size), and grads, state and params are left as they were: the check comes
    before any in-place update of a donated state."""
    tx, params, state = warmed_up(entry, **({"donate_state": True} if donate else {}))
    grads = corrupt(random_like(params, 2), probe, case)
    inputs = clone(grads, state, params)
    name = {"unknown_key": dotted(UNKNOWN), "batch_size": "batch size"}.get(case, dotted(probe))
    with pytest.raises((ValueError, TypeError), match=name.replace(".", r"\.")):
        tx.update(grads, state, params)
    for given, copy in zip((grads, state, params), inputs):
        assert_bitwise(given, copy)


# --- 7. checkpoints ----------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", cases("checkpoint"))
def test_state_round_trips_through_a_checkpoint(entry: Entry, tmp_path) -> None:
    """The state is a TensorDict that :func:`muonfn.save` writes and ``muonfn.load(path, like=state)``
    reads back bit for bit, and the update from the loaded state is the uninterrupted one."""
    tx, params, state = warmed_up(entry)
    assert isinstance(state, TensorDictBase)
    muonfn.save(state, tmp_path / "state.pt")
    loaded = muonfn.load(tmp_path / "state.pt", like=state)
    assert_bitwise(loaded, state)
    assert loaded.batch_size == state.batch_size
    grads = random_like(params, 2)
    for a, b in zip(tx.update(grads, loaded, params), tx.update(grads, state, params)):
        assert_bitwise(a, b)
