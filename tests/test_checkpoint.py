"""Checkpoints are saved TensorDicts: atomic writes, weights-only reads, exact resume in a new process."""

from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys

import pytest
import torch
from _bitwise import assert_bitwise
from tensordict import TensorDict, TensorDictBase
from torch import nn

import muonfn
from muonfn.optim import Muon

ROOT = pathlib.Path(__file__).resolve().parents[1]
HP = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.05, "adamw_lr": 0.004}
K, N = 4, 9  # save after K steps, resume to N


def model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).to(
        dtype
    )


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)


def functional_run(params: TensorDictBase, state: TensorDictBase, start: int, stop: int):
    net = model()
    tx = muonfn.muon(**HP)

    def loss_fn(p, x, y):
        with p.to_module(net):
            return nn.functional.mse_loss(net(x), y)

    for i in range(start, stop):
        grads = torch.func.grad(loss_fn)(params, *batch(i))
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)
    return params, state


def shim_setup() -> tuple[nn.Module, Muon, torch.optim.lr_scheduler.LRScheduler]:
    net = model()
    opt = Muon(net.named_parameters(), **HP)
    return net, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def shim_run(net: nn.Module, opt: Muon, scheduler, start: int, stop: int) -> None:
    for i in range(start, stop):
        x, y = batch(i)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        scheduler.step()


def resume_worker(directory: str) -> None:
    """Runs in a fresh interpreter: loads both checkpoints, trains to N steps, saves the results."""
    d = pathlib.Path(directory)
    fresh = TensorDict.from_module(model()).detach()
    like = TensorDict({"params": fresh, "state": muonfn.muon(**HP).init(fresh)}, batch_size=[])
    checkpoint = muonfn.load(d / "functional.pt", like=like)
    params, state = functional_run(checkpoint["params"], checkpoint["state"], K, N)
    muonfn.save({"params": params, "state": state}, d / "functional_final.pt")

    net, opt, scheduler = shim_setup()
    checkpoint = torch.load(d / "shim.pt", weights_only=True)
    net.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    shim_run(net, opt, scheduler, K, N)
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, d / "shim_final.pt")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("resume")
    params = TensorDict.from_module(model()).detach()
    params, state = functional_run(params, muonfn.muon(**HP).init(params), 0, K)
    muonfn.save({"params": params, "state": state}, d / "functional.pt")
    net, opt, scheduler = shim_setup()
    shim_run(net, opt, scheduler, 0, K)
    checkpoint = {"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": scheduler.state_dict()}
    torch.save(checkpoint, d / "shim.pt")

    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", f"import test_checkpoint; test_checkpoint.resume_worker({str(d)!r})"],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return d


def test_functional_resume_in_a_new_process_is_exact(resumed: pathlib.Path):
    params = TensorDict.from_module(model()).detach()
    params, state = functional_run(params, muonfn.muon(**HP).init(params), 0, N)
    final = muonfn.load(resumed / "functional_final.pt")
    assert_bitwise(final["params"], params)
    assert_bitwise(final["state"], state)
    assert int(final["state", "adamw", "step", "0.bias"]) == N


def test_shim_resume_in_a_new_process_is_exact(resumed: pathlib.Path):
    net, opt, scheduler = shim_setup()
    shim_run(net, opt, scheduler, 0, N)
    final = torch.load(resumed / "shim_final.pt", weights_only=True)
    assert_bitwise(TensorDict(final["model"], batch_size=[]), TensorDict(net.state_dict(), batch_size=[]))
    other = Muon(model().named_parameters(), **HP)
    other.load_state_dict(final["optimizer"])
    assert_bitwise(other.functional_state, opt.functional_state)
    assert [g["lr"] for g in other.param_groups] == [g["lr"] for g in opt.param_groups]


# ---------------------------------------------------------------------------- save and load


def trained_state(dtype: torch.dtype = torch.bfloat16) -> TensorDict:
    params = TensorDict.from_module(model(dtype)).detach()
    tx = muonfn.muon(**HP)
    state = tx.init(params)
    grads = params.apply(lambda p: torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(dtype))
    _, state = tx.update(grads, state, params)
    return TensorDict({"params": params, "state": state}, batch_size=[])


def test_round_trip_is_exact_and_interoperates_with_torch_save(tmp_path: pathlib.Path):
    checkpoint = trained_state()
    muonfn.save(checkpoint, tmp_path / "a.pt")
    assert_bitwise(muonfn.load(tmp_path / "a.pt"), checkpoint)
    (tmp_path / "plain").write_bytes(b"")
    assert (tmp_path / "a.pt").stat().st_mode == (tmp_path / "plain").stat().st_mode  # as torch.save would make it
    loaded = muonfn.load(tmp_path / "a.pt", like=checkpoint)
    assert list(loaded.keys(True, True)) == list(checkpoint.keys(True, True))
    assert loaded["state", "adamw", "step", "0.bias"].dtype == torch.int64
    # the file is torch.save(td.to_dict()), both ways
    plain = torch.load(tmp_path / "a.pt", weights_only=True)
    assert_bitwise(TensorDict(plain, batch_size=[]), checkpoint)
    torch.save(checkpoint.to_dict(), tmp_path / "b.pt")
    assert_bitwise(muonfn.load(tmp_path / "b.pt", like=checkpoint), checkpoint)
    # a mapping of TensorDicts saves like the TensorDict holding them
    muonfn.save({"params": checkpoint["params"], "state": checkpoint["state"]}, tmp_path / "c.pt")
    assert_bitwise(muonfn.load(tmp_path / "c.pt"), checkpoint)


def test_memmap_round_trip_is_exact(tmp_path: pathlib.Path):
    checkpoint = trained_state()
    checkpoint.memmap(tmp_path / "mm")
    loaded = TensorDict.load_memmap(tmp_path / "mm")
    assert_bitwise(loaded, checkpoint)
    # memory-mapped leaves are saved as plain tensors, so weights_only loading accepts them
    muonfn.save(loaded, tmp_path / "from_memmap.pt")
    assert_bitwise(muonfn.load(tmp_path / "from_memmap.pt"), checkpoint)


def _file_contents(directory: pathlib.Path) -> dict[str, bytes]:
    return {str(f.relative_to(directory)): f.read_bytes() for f in sorted(directory.rglob("*")) if f.is_file()}


@pytest.mark.parametrize(
    "make",
    [
        lambda: muonfn.muon(**HP, donate_state=True),
        lambda: muonfn.adamw(lr=0.01, donate_state=True),
        lambda: muonfn.adamw(lr=0.01, donate_state=True, fused=True),
        lambda: muonfn.apply_if_finite(muonfn.muon(**HP, donate_state=True)),
        lambda: muonfn.masked(muonfn.scale_by_neuron_norm(donate_state=True), "matrices"),
        lambda: muonfn.masked(muonfn.scale_by_element_rms(bias_correction=True, donate_state=True), "matrices"),
    ],
    ids=["muon", "adamw", "adamw(fused=True)", "apply_if_finite(muon)", "scale_by_neuron_norm", "scale_by_element_rms"],
)
def test_a_donating_update_refuses_a_memory_mapped_state_and_leaves_the_checkpoint(tmp_path: pathlib.Path, make):
    """A state restored with TensorDict.load_memmap and donated would be stepped in its checkpoint's files."""
    params = TensorDict.from_module(model()).detach()
    tx = make()
    grads = params.apply(lambda p: torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    _, state = tx.update(grads, tx.init(params), params)
    state.memmap(tmp_path / "mm")
    saved = _file_contents(tmp_path / "mm")
    restored = TensorDict.load_memmap(tmp_path / "mm")
    with pytest.raises(ValueError, match=r"state '[\w.]+' is memory-mapped from .*mm.*state\.to_tensordict\(\)"):
        tx.update(grads, restored, params)
    assert _file_contents(tmp_path / "mm") == saved
    assert_bitwise(restored, state)
    # the remedy the error names: the state in memory, stepped as the saved one would have been
    expected_updates, expected = tx.update(grads, state.clone(), params)
    updates, stepped = tx.update(grads, restored.to_tensordict(), params)
    assert_bitwise(updates, expected_updates)
    assert_bitwise(stepped, expected)
    assert _file_contents(tmp_path / "mm") == saved


def test_failed_save_leaves_the_previous_checkpoint(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "ckpt.pt"
    good = trained_state()
    muonfn.save(good, path)

    def broken_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        muonfn.save(trained_state(torch.float32), path)
    monkeypatch.undo()
    assert_bitwise(muonfn.load(path), good)
    assert os.listdir(tmp_path) == ["ckpt.pt"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_crash_mid_save_leaves_the_previous_checkpoint(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "ckpt.pt"
    good = trained_state()
    muonfn.save(good, path)

    def dying_save(obj, f):
        f.write(b"half a checkpoint")
        f.flush()
        os._exit(3)  # the process dies here: no cleanup, no exception handlers

    monkeypatch.setattr(torch, "save", dying_save)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            muonfn.save(trained_state(torch.float32), path)
        finally:
            os._exit(0)
    monkeypatch.undo()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3
    assert_bitwise(muonfn.load(path), good)


def test_load_never_runs_code(tmp_path: pathlib.Path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    torch.save({"x": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError):
        muonfn.load(tmp_path / "evil.pt")
    assert not marker.exists()
    torch.save(torch.ones(2), tmp_path / "tensor.pt")
    with pytest.raises(TypeError, match="holds a Tensor"):
        muonfn.load(tmp_path / "tensor.pt")


def test_load_into_a_mismatched_structure_names_the_first_key(tmp_path: pathlib.Path):
    like = trained_state()
    kept = like.clone()
    leaves = list(like.values(True, True))
    cases = {
        "missing": (like.exclude(("state", "adamw", "exp_avg", "0.bias")), r"missing 'state.adamw.exp_avg.0.bias'"),
        "extra": (like.clone(recurse=False).set(("state", "extra"), torch.ones(1)), r"unexpected 'state.extra'"),
        "dtype": (like.float(), r"'params.0.weight' has dtype torch.float32, expected torch.bfloat16"),
        "shape": (
            like.clone(recurse=False).set(("params", "3", "weight"), torch.zeros(2, 8, dtype=torch.bfloat16)),
            r"'params.3.weight' has shape \(2, 8\), expected \(8, 8\)",
        ),
    }
    for name, (saved, message) in cases.items():
        muonfn.save(saved, tmp_path / f"{name}.pt")
        with pytest.raises(ValueError, match=message):
            muonfn.load(tmp_path / f"{name}.pt", like=like)
    assert all(a is b for a, b in zip(like.values(True, True), leaves))
    assert_bitwise(like, kept)


def test_save_refuses_what_is_not_a_tensor(tmp_path: pathlib.Path):
    with pytest.raises(TypeError, match=r"'meta\.note' is a NonTensorData"):
        muonfn.save({"meta": TensorDict({"note": "hello"}, batch_size=[])}, tmp_path / "x.pt")
    assert os.listdir(tmp_path) == []


def test_save_refuses_a_tensor_on_meta_and_keeps_the_previous_checkpoint(tmp_path: pathlib.Path):
    """A state made on meta (a model not yet materialised) holds no values: saved, it would replace the last
    checkpoint with one that loads as meta tensors."""
    path = tmp_path / "ckpt.pt"
    good = trained_state()
    muonfn.save(good, path)
    on_meta = trained_state().to("meta")
    with pytest.raises(ValueError, match=r"save: '[\w.]+' is on the meta device, which holds no values"):
        muonfn.save(on_meta, path)
    assert_bitwise(muonfn.load(path), good)
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_shim_with_polar_express_resumes_from_a_file_bitwise(tmp_path: pathlib.Path):
    """The schedule's norm factor (1.01) is saved as plain data and restored with the triples."""
    coefficients = muonfn.COEFFICIENTS["polar_express"]

    def setup(ns_coefficients) -> tuple[nn.Module, Muon, torch.optim.lr_scheduler.LRScheduler]:
        net = model()
        opt = Muon(net.named_parameters(), **HP, ns_coefficients=ns_coefficients)
        return net, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    net, opt, scheduler = setup(coefficients)
    shim_run(net, opt, scheduler, 0, K)
    checkpoint = {"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": scheduler.state_dict()}
    torch.save(checkpoint, tmp_path / "polar.pt")
    shim_run(net, opt, scheduler, K, N)

    loaded = torch.load(tmp_path / "polar.pt", weights_only=True)
    resumed, resumed_opt, resumed_scheduler = setup("keller")  # the state_dict brings polar_express back
    resumed.load_state_dict(loaded["model"])
    resumed_opt.load_state_dict(loaded["optimizer"])
    resumed_scheduler.load_state_dict(loaded["scheduler"])
    for group in resumed_opt.param_groups:
        if group["use_muon"]:
            assert group["ns_coefficients"] == (("norm_factor", 1.01), *coefficients.triples)
        else:  # a setting that does not act on AdamW
            assert "ns_coefficients" not in group
    shim_run(resumed, resumed_opt, resumed_scheduler, K, N)
    assert_bitwise(TensorDict.from_module(resumed), TensorDict.from_module(net))
    assert_bitwise(resumed_opt.functional_state, opt.functional_state)

    # the norm factor shows in the parameters: without it the same run ends elsewhere
    plain, plain_opt, plain_scheduler = setup(coefficients.triples)
    shim_run(plain, plain_opt, plain_scheduler, 0, N)
    assert not torch.equal(plain[0].weight, net[0].weight)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", r"the file is empty"),
        (b"epoch,loss\n1,0.5\n", r"torch.load cannot read it"),
        (None, r"torch.load cannot read it"),  # a real checkpoint cut short
    ],
    ids=["empty", "text", "truncated"],
)
def test_load_of_what_is_no_checkpoint_names_the_file(tmp_path: pathlib.Path, content: bytes | None, reason: str):
    path = tmp_path / "ckpt.pt"
    if content is None:
        muonfn.save(trained_state(), path)
        content = path.read_bytes()[:200]
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"load: '{path}' is not a muonfn checkpoint \({reason}"):
        muonfn.load(path)


def test_save_into_a_missing_directory_names_the_target(tmp_path: pathlib.Path):
    target = tmp_path / "runs" / "ckpt.pt"
    with pytest.raises(
        FileNotFoundError, match=rf"save: cannot write '{target}': the directory '{target.parent}' does not exist"
    ):
        muonfn.save(trained_state(), target)
    assert os.listdir(tmp_path) == []  # nothing written, no directory made


def test_load_names_the_file_at_every_truncation(tmp_path: pathlib.Path):
    """torch's archive reader fails some cuts with a bare OSError (EINVAL): still a ValueError naming the file."""
    path, cut = tmp_path / "ckpt.pt", tmp_path / "cut.pt"
    muonfn.save(trained_state(), path)
    data = path.read_bytes()
    for length in sorted({len(data) - 1, len(data) - 30, len(data) - 2000, *range(4, len(data), 997)}):
        cut.write_bytes(data[: max(length, 4)])
        with pytest.raises((ValueError, pickle.UnpicklingError), match=rf"load: '{cut}' is not a muonfn checkpoint"):
            muonfn.load(cut)


def test_a_stacked_ensemble_comes_back_with_like_and_is_refused_without(tmp_path: pathlib.Path):
    """The file keeps no batch size: ``like=`` restores it; without it an update refuses the state unchanged."""
    ensemble = torch.stack([TensorDict({"w": torch.randn(16, 8), "b": torch.randn(16)}, []) for _ in range(3)])
    tx = muonfn.adamw(lr=1e-2, donate_state=True)
    state = tx.init(ensemble)
    muonfn.save({"params": ensemble, "state": state}, tmp_path / "ensemble.pt")
    loaded = muonfn.load(tmp_path / "ensemble.pt", like=TensorDict({"params": ensemble, "state": state}, [3]))
    assert loaded["state"].batch_size == (3,)
    assert_bitwise(loaded["state"], state)
    bare = muonfn.load(tmp_path / "ensemble.pt")
    before = bare["state"].clone()
    with pytest.raises(
        ValueError, match=r"state entry 'step\.w' is a torch\.int64 tensor of shape \(3,\), expected .* \(\)"
    ):
        tx.update(bare["params"].apply(torch.randn_like), bare["state"], bare["params"])
    assert_bitwise(bare["state"], before)


@pytest.mark.parametrize("mapped", ["muon", "adamw"])
def test_the_shim_refuses_a_memory_mapped_state_when_it_is_handed_over(tmp_path: pathlib.Path, mapped: str):
    """A group's state restored with TensorDict.load_memmap and handed to the shim (``functional_state``), which
    steps its state in place, is refused at the hand-over: otherwise the groups before it would step before
    that group's update refused it. The optimizer's state and the checkpoint stay as they were."""
    net = model()
    opt = Muon(net.named_parameters(), **HP)
    for i, p in enumerate(net.parameters()):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
    opt.step()
    state = opt.functional_state
    state[mapped].memmap(tmp_path / "mm")
    saved = _file_contents(tmp_path / "mm")
    state[mapped] = TensorDict.load_memmap(tmp_path / "mm")
    held = opt.functional_state.clone()
    with pytest.raises(ValueError, match=r"functional_state: state '[\w.]+' is memory-mapped from .*mm"):
        opt.functional_state = state
    assert_bitwise(opt.functional_state, held)
    params = TensorDict.from_module(net).detach().clone()
    opt.step()  # its own state, in memory
    after = TensorDict.from_module(net).detach()
    assert not all(torch.equal(a, b) for a, b in zip(params.values(True, True), after.values(True, True)))
    assert _file_contents(tmp_path / "mm") == saved


@pytest.mark.parametrize(
    ("make", "mapped"),
    [
        (lambda: muonfn.muon(**HP, donate_state=True), "adamw"),
        (lambda: muonfn.muon(**HP, momentum_bias_correction=True, donate_state=True), "muon.step"),
        (lambda: muonfn.adamw(lr=0.01, donate_state=True), "exp_avg_sq"),
    ],
    ids=["one branch", "the counts", "the second moment"],
)
def test_a_donating_update_refuses_a_state_with_any_memory_mapped_entry(tmp_path: pathlib.Path, make, mapped: str):
    """One entry of a state memory-mapped from a file is refused before any member writes: the other entries,
    stepped in place, and the file stay as they were."""
    params = TensorDict.from_module(model()).detach()
    tx = make()
    grads = params.apply(lambda p: torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    _, state = tx.update(grads, tx.init(params), params)
    key = tuple(mapped.split("."))
    state[key].memmap(tmp_path / "mm")
    saved = _file_contents(tmp_path / "mm")
    state[key] = TensorDict.load_memmap(tmp_path / "mm")
    before = state.to_tensordict().clone()
    with pytest.raises(ValueError, match=r"state '[\w.]+' is memory-mapped from .*mm.*state\.to_tensordict\(\)"):
        tx.update(grads, state, params)
    assert _file_contents(tmp_path / "mm") == saved
    assert_bitwise(state.to_tensordict(), before)
