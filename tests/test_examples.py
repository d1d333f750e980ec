"""Smoke tests: every example runs end to end on a small budget and checks its own result.

Each example exits non-zero when its training did not work (loss not reduced, an identity it
demonstrates not holding), so a zero exit status is the assertion; the output is checked too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run(args: list[str], timeout: float = 120, cwd: pathlib.Path = ROOT) -> str:
    # One thread each: the models are tiny, and an oversubscribed OpenMP pool is slower than one thread.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_demo_quick_writes_results_plot_and_checkpoints(tmp_path):
    out = run([str(EXAMPLES / "demo.py"), "--quick", "--no-progress", "--out", str(tmp_path)])
    assert "steps to target" in out
    results = json.loads((tmp_path / "results.json").read_text())
    for kind in ("adamw", "muon"):
        final = results["final"][kind]
        assert final["steps"] == 12
        assert final["val_loss"] < final["history"]["val_loss"][0]  # both learn something
        assert final["tokens_per_second"] > 0
        assert 0 < final["median_step_seconds"] <= final["seconds"]
    assert results["target_val_loss"] == results["final"]["adamw"]["val_loss"]
    assert_time_to_target_from_the_recorded_steps(results)
    pinned = os.environ["MUONFN_CPU_NS_DTYPE"]  # the suite's rule (fp32, or the forced one), in the header
    assert f"Newton-Schulz: {pinned}, pinned by MUONFN_CPU_NS_DTYPE" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["adamw-lr1e-02-12.pt", "muon-lr3e-02-12.pt"]


def assert_time_to_target_from_the_recorded_steps(results: dict) -> None:
    """The time to the target is the steps to it times the run's median step, both from the step
    times results.json records; the wall time to it (the history's seconds) is the second figure."""
    demo = load_example("demo")
    target = results["target_val_loss"]
    for kind in ("adamw", "muon"):
        final = results["final"][kind]
        assert len(final["step_seconds"]) == final["steps"]
        median = statistics.median(final["step_seconds"])
        assert final["median_step_seconds"] == median
        steps = results["steps_to_target"][kind]
        wall = demo.steps_to_reach(final["history"], target, "seconds")
        if kind == "adamw":  # its own final loss: reached at its last step at the latest
            steps = steps or float(final["steps"])
            wall = wall or final["seconds"]
        assert results["seconds_to_target"][kind] == (None if steps is None else pytest.approx(steps * median))
        assert results["wall_seconds_to_target"][kind] == (None if wall is None else pytest.approx(wall))
    for table in ("seconds", "wall_seconds"):
        muon, adamw = results[f"{table}_to_target"]["muon"], results[f"{table}_to_target"]["adamw"]
        assert results[f"{table}_ratio"] == (None if muon is None else pytest.approx(muon / adamw))


def test_demo_time_to_target_is_steps_times_the_interleaved_median():
    """A busy machine's slow patch fell on Muon's steps more than on AdamW's: the wall times to the
    target came out 0.84× apart, the steps times the medians (66 × 98.0 ms against 200 × 82.8 ms)
    0.39×."""
    demo = load_example("demo")

    def run(kind: str, median_ms: float, steps: list[int], seconds: list[float], losses: list[float]):
        step_seconds = [median_ms / 1e3 - 0.001, median_ms / 1e3, median_ms / 1e3 + 0.5]  # one step slowed down
        history = {"step": steps, "seconds": seconds, "train_loss": losses, "val_loss": losses}
        return demo.Run(kind, kind, 0.01, 200, 100, history, seconds=seconds[-1], step_seconds=step_seconds)

    adamw = run("adamw", 82.8, [0, 100, 200], [0.0, 8.28, 16.56], [4.0, 3.0, 2.0])
    muon = run("muon", 98.0, [0, 66, 200], [0.0, 13.9, 42.0], [4.0, 2.0, 1.0])  # at AdamW's 2.0 by step 66
    figures = demo.to_target({"adamw": adamw, "muon": muon}, target=2.0)
    assert figures["steps_to_target"] == {"adamw": 200, "muon": 66}
    assert figures["seconds_to_target"] == {"adamw": pytest.approx(200 * 0.0828), "muon": pytest.approx(66 * 0.098)}
    assert figures["seconds_ratio"] == pytest.approx(0.39, abs=0.005)
    assert figures["wall_seconds_to_target"] == {"adamw": 16.56, "muon": 13.9}
    assert figures["wall_seconds_ratio"] == pytest.approx(0.84, abs=0.005)
    never = demo.to_target({"adamw": adamw, "muon": muon}, target=0.5)
    assert never["seconds_to_target"] == {"adamw": pytest.approx(200 * 0.0828), "muon": None}
    assert never["seconds_ratio"] is None and never["wall_seconds_ratio"] is None


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_demo_resume_continues_exactly(tmp_path, one_thread):
    demo = load_example("demo")
    quick = ["--quick", "--no-progress"]
    straight = demo.main([*quick, "--out", str(tmp_path / "straight")])
    assert demo.main([*quick, "--out", str(tmp_path / "split"), "--stop-after", "5"]) == {}
    resumed = demo.main([*quick, "--out", str(tmp_path / "split"), "--resume"])
    for kind in ("adamw", "muon"):
        a, b = resumed["final"][kind]["history"], straight["final"][kind]["history"]
        for curve in ("step", "train_loss", "val_loss"):  # not "seconds": wall time is not reproducible
            assert a[curve] == b[curve], (kind, curve)
    for name in ("adamw-lr1e-02-12.pt", "muon-lr3e-02-12.pt"):
        a = torch.load(tmp_path / "straight" / "checkpoints" / name, weights_only=True)
        b = torch.load(tmp_path / "split" / "checkpoints" / name, weights_only=True)
        assert int(a["step"]) == int(b["step"]) == 12
        for part in ("params", "state"):
            flat_a, flat_b = _flatten(a[part]), _flatten(b[part])
            assert flat_a.keys() == flat_b.keys()
            for key in flat_a:
                assert torch.equal(flat_a[key], flat_b[key]), (name, part, key)


def _flatten(tree: dict, prefix: tuple = ()) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def test_demo_refuses_to_resume_under_other_settings(tmp_path, one_thread):
    demo = load_example("demo")
    demo.main(["--quick", "--no-progress", "--out", str(tmp_path), "--stop-after", "3"])
    with pytest.raises(SystemExit, match="other settings"):
        demo.main(["--quick", "--no-progress", "--out", str(tmp_path), "--resume", "--seed", "1"])


def test_demo_reports_a_diverged_run_instead_of_crashing(tmp_path, one_thread):
    """Diverged by construction, not by a CPU's rounding: AdamW's first update is about lr·sign(g)
    (plus decay), so the next forward multiplies weights of ~1e30, whose products overflow fp32."""
    demo = load_example("demo")
    results = demo.main(["--quick", "--no-progress", "--out", str(tmp_path), "--adamw-lrs", "1e30"])
    assert results["final"]["adamw"]["val_loss"] is None
    assert results["final"]["adamw"]["history"]["step"] == [0, 2]  # the second forward already overflows
    assert results["steps_ratio"] is None
    assert results["final"]["muon"]["val_loss"] < results["final"]["muon"]["history"]["val_loss"][0]
    assert "Infinity" not in (tmp_path / "results.json").read_text()


def test_demo_interleaves_the_timed_runs_round_robin():
    demo = load_example("demo")
    order = []

    class Scripted:
        def __init__(self, name: str, steps: int) -> None:
            self.name, self.left = name, steps

        @property
        def finished(self) -> bool:
            return self.left == 0

        def step(self) -> None:
            order.append(self.name)
            self.left -= 1

        def close(self) -> str:
            return self.name

    assert demo.train_round_robin([Scripted("adamw", 3), Scripted("muon", 2)]) == ["adamw", "muon"]
    assert order == ["adamw", "muon", "adamw", "muon", "adamw"]


def test_demo_steps_to_reach_interpolates():
    demo = load_example("demo")
    history = {"step": [0, 10, 20], "val_loss": [4.0, 3.0, 2.0]}
    assert demo.steps_to_reach(history, 2.5) == pytest.approx(15.0)
    assert demo.steps_to_reach(history, 3.0) == pytest.approx(10.0)
    assert demo.steps_to_reach(history, 1.0) is None


def test_functional_loop():
    out = run([str(EXAMPLES / "functional_loop.py"), "--steps", "80"])
    assert "loss" in out and "optimizer state layout" in out


def test_ensemble_vmap():
    out = run([str(EXAMPLES / "ensemble_vmap.py"), "--steps", "40", "--members", "3"])
    assert "one vmapped step == one step of each member alone" in out


def test_custom_views():
    out = run([str(EXAMPLES / "custom_views.py"), "--steps", "10"])
    assert "wrong split rejected" in out
    assert out.count("error vs its own polar factor") == 3


def test_shim_script():
    pytest.importorskip("muonfn.optim", reason="muonfn.optim (the torch.optim shim) is not available")
    out = run([str(EXAMPLES / "shim_script.py"), "--steps", "60"])
    assert "functional state" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_torchrun(tmp_path):
    pytest.importorskip("torch.distributed.fsdp", reason="this torch build has no FSDP2")
    distributed = pytest.importorskip("muonfn.distributed")
    if not hasattr(distributed, "torch_collectives"):
        pytest.skip("muonfn.distributed.torch_collectives is not available")
    # three launches: a crash at interpreter exit is a race, and torchrun reports it as a failure
    for launch in range(3):
        out = run(
            [
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_port",
                str(_free_port()),
                str(EXAMPLES / "fsdp2_torchrun.py"),
                "--steps",
                "3",
                "--checkpoint",
                str(tmp_path / f"dcp{launch}"),
            ],
            timeout=180,
        )
        assert "resumed from the DCP checkpoint" in out


def test_ddp_torchrun():
    pytest.importorskip("muonfn.distributed")
    args = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    out = run([*args, str(EXAMPLES / "ddp_torchrun.py"), "--steps", "6"], timeout=180)
    assert "parameters identical on every rank" in out


def test_hf_trainer(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    pytest.importorskip("muonfn.optim", reason="muonfn.optim (the torch.optim shim) is not available")
    out = run([str(EXAMPLES / "hf_trainer.py"), "--steps", "5", "--out", str(tmp_path)], timeout=180)
    assert "train_loss" in out
