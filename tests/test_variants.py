"""The variant options: settings reach the map they configure, and bad ones fail when built."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import muonfn
from muonfn import MatrixView
from muonfn.distributed import sharded_orthogonalizer
from muonfn.testing import simulate


def test_ns_restarts_reach_gram_newton_schulz():
    g = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    params = TensorDict({"w": torch.zeros(8, 64)}, [])
    tx = muonfn.orthogonalize(muonfn.NewtonSchulz(method="gram", restarts=(1, 2)))
    out, _ = tx.update(TensorDict({"w": g}, []), tx.init(params), params)
    assert torch.equal(out["w"], muonfn.gram_newton_schulz(g, restarts=(1, 2)))
    assert not torch.equal(out["w"], muonfn.gram_newton_schulz(g))


def test_qr_orthogonal_is_orthonormal_in_both_orientations():
    for shape in [(5, 9), (9, 5)]:
        q = muonfn.qr_orthogonal(torch.randn(shape, dtype=torch.float64))
        small = q @ q.mT if shape[0] < shape[1] else q.mT @ q
        assert torch.allclose(small, torch.eye(5, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize(
    "make",
    [
        lambda: muonfn.ema_momentum(nesterov="add", bias_correction=True),
        lambda: muonfn.ema_momentum(nesterov="yes"),
        lambda: muonfn.NewtonSchulz(restarts=(1,)),
        lambda: muonfn.NewtonSchulz(method="svd", restarts=(1,)),
        lambda: muonfn.NewtonSchulz(method="polar"),
        lambda: muonfn.NewtonSchulz(eps_mode="sum"),
        lambda: muonfn.cautious(muonfn.ema_momentum(), mode="timm"),
    ],
)
def test_bad_settings_fail_when_built(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize(
    "make",
    [
        lambda: muonfn.scale_by_neuron_norm(rescale="rms"),
        lambda: muonfn.scale_by_element_rms(beta=1.0),
        lambda: muonfn.normuon(rescale="x"),
        lambda: muonfn.adamuon(sign_momentum="yes"),
        lambda: muonfn.muon(cautious_mode="timm"),
        lambda: muonfn.muon(nesterov="sub"),
        lambda: muonfn.adamw(nesterov=1),
        lambda: muonfn.orthogonalize("polar"),
        lambda: muonfn.muon(ns="polar"),
    ],
)
def test_bad_variant_settings_fail_when_built(make):
    with pytest.raises((ValueError, TypeError)):
        make()


def test_adapted_variants_refuse_a_sharded_orthogonalizer():
    """Their statistics need whole matrices, and a sharded orthogonalizer returns shards."""

    def build(col):
        for variant in (muonfn.normuon, muonfn.adamuon):
            with pytest.raises(ValueError, match="the adapted variants need each whole orthogonalized matrix"):
                variant(orthogonalizer=sharded_orthogonalizer(col))

    simulate(2, build)


def _fused_and_split(transposed: bool):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    fused = torch.cat([q, k, v])
    store = (lambda t: t.mT.contiguous()) if transposed else (lambda t: t)
    params = TensorDict({"qkv": store(fused), "q": store(q), "k": store(k)}, [])
    view = muonfn.MatrixView(transposed=transposed)
    fused_view = muonfn.MatrixView(transposed=transposed, split=(8, 8, 8))
    return params, view, fused_view


@pytest.mark.parametrize("transposed", [False, True])
def test_qk_clip_fused_equals_separate(transposed):
    params, view, fused_view = _fused_and_split(transposed)
    logits = {"a": torch.tensor([10.0, 300.0, 120.0, 99.0], dtype=torch.float64)}
    fused = muonfn.qk_clip(params, logits, {"a": muonfn.QKHeads(heads=4, fused="qkv", view=fused_view)})
    split = muonfn.qk_clip(params, logits, {"a": muonfn.QKHeads(heads=4, query="q", key="k", view=view)})
    rows = (lambda t: t.mT) if transposed else (lambda t: t)
    assert torch.equal(rows(fused["qkv"])[:8], rows(split["q"]))
    assert torch.equal(rows(fused["qkv"])[8:16], rows(split["k"]))
    assert torch.equal(rows(fused["qkv"])[16:], rows(params["qkv"])[16:])  # values untouched


def test_qk_clip_brings_every_head_to_the_threshold():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    params = TensorDict(
        {
            "q": torch.randn(8, 6, generator=gen, dtype=torch.float64),
            "k": torch.randn(4, 6, generator=gen, dtype=torch.float64),
        },
        [],
    )

    def max_logits(p):  # 4 query heads of 2 rows, 2 key heads (grouped-query attention)
        q = (x @ p["q"].mT).reshape(5, 4, 2)
        k = (x @ p["k"].mT).reshape(5, 2, 2).repeat_interleave(2, dim=1)
        return torch.einsum("ihd,jhd->hij", q, k).amax(dim=(1, 2))

    before = max_logits(params)
    tau = float(before.median())
    after = max_logits(
        muonfn.qk_clip(
            params, {"a": before}, {"a": muonfn.QKHeads(heads=4, kv_heads=2, query="q", key="k")}, threshold=tau
        )
    )
    assert torch.all(after <= tau * (1 + 1e-12))
    clipped = before > tau
    assert torch.allclose(after[clipped & (after >= tau * (1 - 1e-12))], torch.tensor(tau, dtype=torch.float64))


@pytest.mark.parametrize("transposed", [False, True])
def test_qk_clip_of_a_stacked_ensemble_clips_each_member_by_its_own_logits(transposed):
    """Params of batch size [3] take (3, heads) logits: the same as each member alone, and as torch.vmap."""
    members = [_fused_and_split(transposed)[0].apply(lambda t, i=i: t * (i + 1)) for i in range(3)]
    stacked = torch.stack(members)
    logits = {"a": torch.tensor([[10.0, 300.0, 120.0, 99.0], [400.0, 1.0, 150.0, 200.0], [99.0] * 4])}
    fused_view = muonfn.MatrixView(transposed=transposed, split=(8, 8, 8))
    heads = {
        "a": [
            muonfn.QKHeads(heads=4, kv_heads=2, fused="qkv", view=fused_view),
            muonfn.QKHeads(heads=4, query="q", key="k", view=muonfn.MatrixView(transposed=transposed)),
        ]
    }
    clipped = muonfn.qk_clip(stacked, logits, heads)
    vmapped = torch.vmap(lambda p, m: muonfn.qk_clip(p, {"a": m}, heads))(stacked, logits["a"])
    for i, member in enumerate(members):
        alone = muonfn.qk_clip(member, {"a": logits["a"][i]}, heads)
        for key in ("qkv", "q", "k"):
            assert torch.equal(clipped[key][i], alone[key]), (i, key)
            assert torch.equal(vmapped[key][i], alone[key]), (i, key)
    assert torch.equal(clipped["q"][2], stacked["q"][2])  # every head of the third member at the threshold
    with pytest.raises(ValueError, match=r"shape \(3, 4\), got \(4,\)"):
        muonfn.qk_clip(stacked, {"a": logits["a"][0]}, heads)


@pytest.mark.parametrize(
    ("logits", "layout", "match"),
    [
        ({"b": torch.ones(4)}, muonfn.QKHeads(heads=4, query="q"), "layouts"),
        ({"a": torch.ones(3)}, muonfn.QKHeads(heads=4, query="q"), r"shape \(4,\)"),
        ({"a": torch.ones(4)}, muonfn.QKHeads(heads=4, query="nope"), "nope"),
        ({"a": torch.ones(3)}, muonfn.QKHeads(heads=3, query="q"), "do not divide"),
        ({"a": torch.ones(4)}, muonfn.QKHeads(heads=4, fused="q"), "fused"),
        ({"a": torch.ones(4)}, muonfn.QKHeads(heads=4, kv_heads=3, query="q"), "kv_heads"),
        ({"a": torch.ones(4)}, muonfn.QKHeads(heads=0, query="q"), r"heads must be an integer >= 1, got 0"),
        ({"a": torch.ones(4)}, muonfn.QKHeads(heads=True, query="q"), r"heads must be an integer >= 1, got True"),
        ({"a": torch.ones(4)}, muonfn.QKHeads(heads=4, query="q", alpha=1.5), "alpha"),
        ({"a": torch.ones(4)}, muonfn.QKHeads(heads=4, query="q", fused="q"), "not both"),
        ({"a": torch.ones(4)}, muonfn.QKHeads(heads=4), "names no tensor"),
        ({"a": torch.ones(4)}, muonfn.QKHeads(heads=4, query="q", view=MatrixView(batch_dims=1)), "batch_dims=1"),
        ({"a": torch.ones(4)}, muonfn.QKHeads(heads=4, fused="q", view=MatrixView(split=(8,))), "split=\\(q, k"),
        ({"a": torch.ones(4)}, muonfn.QKHeads(heads=4, query="q", view=MatrixView(split=(4, 4))), "pass it as fused="),
    ],
)
def test_qk_clip_bad_input_names_the_culprit(logits, layout, match):
    params = TensorDict({"q": torch.ones(8, 6)}, [])
    with pytest.raises(ValueError, match=match):
        muonfn.qk_clip(params, logits, {"a": layout})


def test_qk_clip_refuses_a_layout_that_is_no_qkheads():
    params = TensorDict({"q": torch.ones(8, 6)}, [])
    with pytest.raises(TypeError, match=r"attention 'a': expected a muonfn.QKHeads, got dict"):
        muonfn.qk_clip(params, {"a": torch.ones(4)}, {"a": [{"heads": 4, "query": "q"}]})


def test_qk_clip_compiles_without_graph_breaks():
    params = TensorDict({"q": torch.randn(8, 6), "k": torch.randn(8, 6)}, [])
    heads = {"a": muonfn.QKHeads(heads=4, query="q", key="k")}
    logits = {"a": torch.tensor([50.0, 400.0, 1600.0, 100.0])}
    eager = muonfn.qk_clip(params, logits, heads)
    compiled = torch.compile(lambda p, m: muonfn.qk_clip(p, m, heads), fullgraph=True, backend="aot_eager")(
        params, logits
    )
    assert torch.equal(eager["q"], compiled["q"]) and torch.equal(eager["k"], compiled["k"])


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("transposed", [False, True])
def test_qk_clip_skips_and_reports_a_head_whose_max_logit_is_not_finite(transposed):
    """A NaN max logit turned its head's weights into NaN, an inf one zeroed them: such a head is left as it
    is (it shrinks no shared key head either), as one at the threshold would be, and reported; -inf is no overflow."""
    params, view, fused_view = _fused_and_split(transposed)
    heads = {
        "a": [
            muonfn.QKHeads(heads=4, kv_heads=2, fused="qkv", view=fused_view),
            muonfn.QKHeads(heads=4, query="q", key="k", view=view),
        ]
    }
    stacked = torch.stack([params, params.apply(lambda t: t * 2)])
    logits = torch.tensor([[NAN, 300.0, INF, 120.0], [-INF, INF, 400.0, NAN]], dtype=torch.float64)
    finite = torch.where(logits.isnan() | logits.isposinf(), 1.0, logits)  # those heads as if at rest
    clipped, skipped = muonfn.qk_clip(stacked, {"a": logits}, heads, return_skipped=True)
    expected = muonfn.qk_clip(stacked, {"a": finite}, heads)
    for key in ("qkv", "q", "k"):
        assert clipped[key].isfinite().all(), key
        assert torch.equal(clipped[key], expected[key]), key
    assert torch.equal(skipped["a"], torch.tensor([[True, False, True, False], [False, True, False, True]]))
    rows = (lambda t: t.mT) if transposed else (lambda t: t)
    assert torch.equal(rows(clipped["q"][0])[:2], rows(stacked["q"][0])[:2])  # the NaN head's query rows
    alone = muonfn.qk_clip(stacked[1], {"a": logits[1]}, heads, return_skipped=True)  # one model, the same
    assert torch.equal(alone[0]["q"], clipped["q"][1]) and torch.equal(alone[1]["a"], skipped["a"][1])


def test_qk_clip_of_non_finite_logits_compiles_and_vmaps():
    params = TensorDict({"q": torch.randn(8, 6), "k": torch.randn(8, 6)}, [])
    heads = {"a": muonfn.QKHeads(heads=4, query="q", key="k")}
    logits = {"a": torch.tensor([NAN, 400.0, INF, 100.0])}

    def clip(p, m):
        return muonfn.qk_clip(p, m, heads, return_skipped=True)

    eager, skipped = clip(params, logits)
    compiled, compiled_skipped = torch.compile(clip, fullgraph=True, backend="aot_eager")(params, logits)
    assert torch.equal(eager["q"], compiled["q"]) and torch.equal(eager["k"], compiled["k"])
    assert torch.equal(skipped["a"], compiled_skipped["a"])
    assert torch.equal(skipped["a"], torch.tensor([True, False, True, False]))
    stacked = torch.stack([params, params])
    mapped, mapped_skipped = torch.vmap(clip)(stacked, {"a": torch.stack([logits["a"], logits["a"].flip(0)])})
    assert torch.equal(mapped["q"][0], eager["q"]) and torch.equal(mapped_skipped["a"][0], skipped["a"])
    assert torch.equal(mapped_skipped["a"][1], skipped["a"].flip(0))


@pytest.mark.parametrize(("threshold", "dtype"), [(49.0, torch.float64), (41.0, torch.float32)])
def test_qk_clip_leaves_heads_at_or_below_the_threshold_bit_for_bit(threshold, dtype):
    """For these thresholds threshold * (1 / threshold) rounds below 1: that factor shrank every head at rest
    (seen in the query, which takes the whole factor at alpha=1)."""
    gen = torch.Generator().manual_seed(2)
    params = TensorDict({name: torch.randn(8, 6, generator=gen, dtype=dtype) for name in ("q", "k")}, [])
    logits = torch.tensor([threshold, threshold - 1.0, -INF, 0.0], dtype=dtype)
    clipped = muonfn.qk_clip(
        params, {"a": logits}, {"a": muonfn.QKHeads(heads=4, query="q", key="k")}, threshold=threshold, alpha=1.0
    )
    assert torch.equal(clipped["q"], params["q"]) and torch.equal(clipped["k"], params["k"])


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.qkv = torch.nn.Linear(6, 8), torch.nn.Linear(6, 8), torch.nn.Linear(6, 24)


def test_qk_clip_finds_leaves_by_their_dotted_names():
    """Its docs name leaves as named_parameters() does; on TensorDict.from_module's nested keys only tuples worked."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([_Attention(), _Attention()])})
    params = TensorDict.from_module(model).detach()
    logits = {"attn1": torch.tensor([50.0, 400.0, 150.0, 100.0])}
    fused = muonfn.MatrixView(split=(8, 8, 8))

    def layout(name):
        return [
            muonfn.QKHeads(heads=4, query=name("q_proj"), key=name("k_proj")),
            muonfn.QKHeads(heads=4, kv_heads=2, fused=name("qkv"), view=fused),
        ]

    dotted = muonfn.qk_clip(params, logits, {"attn1": layout(lambda m: f"layers.1.{m}.weight")})
    tupled = muonfn.qk_clip(params, logits, {"attn1": layout(lambda m: ("layers", "1", m, "weight"))})
    for module in ("q_proj", "k_proj", "qkv"):
        key = ("layers", "1", module, "weight")
        assert torch.equal(dotted[key], tupled[key]), key
        assert not torch.equal(dotted[key], params[key]), key  # clipped
        assert dotted["layers", "0", module, "weight"] is params["layers", "0", module, "weight"]
    with pytest.raises(ValueError, match=r"attention 'attn1': no parameter named 'layers\.1\.q_porj\.weight'"):
        muonfn.qk_clip(params, logits, {"attn1": muonfn.QKHeads(heads=4, query="layers.1.q_porj.weight")})


@pytest.mark.parametrize("broken", ["shape", "dtype"])
def test_a_row_moment_that_does_not_fit_fails_before_the_momentum_is_donated(broken):
    params = TensorDict({"w": torch.randn(4, 6), "b": torch.zeros(4)}, [])
    tx = muonfn.normuon(lr=0.02, donate_state=True)
    state = tx.init(params)
    moment = state["muon", "row_second_moment", "w"]
    state["muon", "row_second_moment", "w"] = torch.zeros(6, 1) if broken == "shape" else moment.to(torch.float64)
    before = state.clone()
    grads = TensorDict({"w": torch.randn(4, 6), "b": torch.randn(4)}, [])
    expected = r"\(6, 1\)" if broken == "shape" else "torch.float64"
    with pytest.raises(ValueError, match=rf"state entry 'muon\.row_second_moment\.w' is a .*{expected}.*parameter 'w'"):
        tx.update(grads, state, params)
    assert (state == before).all()


def test_adamuon_with_both_bias_corrections_is_its_parts_chained():
    """Both corrections count steps under ``step``: the second moment's is kept under
    ``second_moment``, and the update is that of the building blocks chained by hand, the
    preset's tail (:func:`muonfn.descent`: shape scale, decay and learning rate in one stage) bit for
    bit, the other building blocks' to a few roundings (they round ``-η·(s·x + λp)``, the tail
    ``(-ηs)·x + (-ηλ)·p``)."""
    tx = muonfn.adamuon(lr=0.02, weight_decay=0.1, momentum_bias_correction=True, second_moment_bias_correction=True)
    head = [
        muonfn.ema_momentum(0.9, nesterov=False, bias_correction=True),
        muonfn.scale_by_sign(),
        muonfn.orthogonalize(),
        muonfn.named("second_moment", muonfn.scale_by_element_rms(0.95, eps=1e-10, bias_correction=True)),
    ]
    parts = muonfn.chain(*head, muonfn.descent(0.02, 0.1, scale="match_rms_adamw"))
    public = muonfn.chain(
        *head,
        muonfn.scale_by_shape("match_rms_adamw"),
        muonfn.add_decayed_weights(0.1),
        muonfn.scale_by_learning_rate(0.02),
    )
    gen = torch.Generator().manual_seed(0)
    params = TensorDict({"w": torch.randn(16, 32, generator=gen)}, [])
    state, reference, chained = tx.init(params), parts.init(params), public.init(params)
    for _ in range(3):
        grads = TensorDict({"w": torch.randn(16, 32, generator=gen)}, [])
        updates, state = tx.update(grads, state, params)
        expected, reference = parts.update(grads, reference, params)
        assert torch.equal(updates["w"], expected["w"])
        by_hand, chained = public.update(grads, chained, params)
        torch.testing.assert_close(updates["w"], by_hand["w"], atol=4e-9, rtol=0)
    assert int(state["muon", "step", "w"]) == int(state["muon", "second_moment", "step", "w"]) == 3


@pytest.mark.parametrize("scale", ["match_rms_adamw", "original", "unit_rms_norm"])
@pytest.mark.parametrize("preset", ["muon", "normuon", "adamuon"])
def test_matrices_without_elements_leave_the_other_leaves_alone(preset, scale):
    """Zero-size matrices of either side, a stack of empty experts and a stack of no experts
    get empty updates and a finite state (a shape scale may divide by the zero side, a row
    statistic average no columns), and every other leaf the update it gets without them."""
    make = getattr(muonfn, preset)
    views = {"none": MatrixView(batch_dims=1), "hollow": MatrixView(batch_dims=1)}
    gen = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(8, 12, generator=gen), "b": torch.randn(8, generator=gen)}
    empty = {
        "no_rows": torch.zeros(0, 8),
        "no_columns": torch.zeros(8, 0),
        "none": torch.zeros(0, 4, 8),
        "hollow": torch.zeros(2, 0, 8),
    }
    params, alone = TensorDict({**full, **empty}, []), TensorDict(full, [])
    tx = make(lr=0.1, views=views, scale=scale)
    grads = params.apply(lambda t: torch.randn(t.shape, generator=gen))
    updates, state = tx.update(grads, tx.init(params), params)
    reference = make(lr=0.1, scale=scale)
    expected, _ = reference.update(grads.select(*full), reference.init(alone), alone)
    for key, value in empty.items():
        assert updates[key].shape == value.shape
    for key in full:
        assert torch.equal(updates[key], expected[key])
    assert all(torch.isfinite(t).all() for t in state.values(True, True) if t.is_floating_point())
