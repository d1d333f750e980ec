"""The long study (examples/study.py) at toy size: the schema of its results, its resume path
(interrupted twice, resumed, the same results as a straight run), and its reported figures
recomputed from the losses it records."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import pathlib
import statistics
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TOY = ["--toy", "--no-progress"]
TIMING = {"seconds", "median_step_seconds", "seconds_to_target", "seconds_ratio"}  # wall time: not reproducible


def loaded_example(name: str):
    """``examples/<name>.py`` imported as ``example_<name>``, with the examples' folder on the path while
    it is used (the studies import the demo's pieces as ``demo``)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def study():
    yield from loaded_example("study")


@pytest.fixture(scope="module")
def straight(study, tmp_path_factory):
    """One uninterrupted toy study: (its results, its output folder)."""
    out = tmp_path_factory.mktemp("straight")
    return study.main([*TOY, "--out", str(out)]), out


def without_timing(tree):
    if isinstance(tree, dict):
        return {k: without_timing(v) for k, v in tree.items() if k not in TIMING}
    if isinstance(tree, list):
        return [without_timing(v) for v in tree]
    return tree


def test_study_results_schema(straight):
    results, out = straight
    assert json.loads((out / "results.json").read_text()) == results
    methods = ["adamw", "muon", "normuon", "adamuon"]
    assert results["methods"] == methods and results["seeds"] == [0, 1]
    config = results["config"]
    for kind in methods:
        lrs = [r["lr"] for r in results["sweep"][kind]]
        assert len(lrs) >= 3 and lrs == sorted(lrs)
        assert all(b / a == pytest.approx(3.0) for a, b in itertools.pairwise(lrs)), f"{kind}: not a factor 3 apart"
        assert all(r["steps"] == config["sweep_steps"] for r in results["sweep"][kind])
        final = results["final"][kind]
        assert final["lr"] in lrs and final["steps"] == config["steps"]
        assert set(final["val_loss"]) == {"mean", "std", "min", "max"}
        assert [r["seed"] for r in final["runs"]] == results["seeds"]
        for run in final["runs"]:
            history = run["history"]
            assert set(history) == {"step", "seconds", "train_loss", "val_loss"}
            assert history["step"] == list(range(0, config["steps"] + 1, config["eval_every"]))
            assert run["val_loss"] == history["val_loss"][-1] < history["val_loss"][0]  # each learns
            assert 0 < run["median_step_seconds"] <= run["seconds"]
        assert set(results["sensitivity"][kind]) == {
            "best_lr",
            "best_val_loss",
            "lr_over_3",
            "lr_times_3",
            "increase_over_3",
            "increase_times_3",
        }
        for table in ("steps_to_target", "steps_ratio", "seconds_to_target", "seconds_ratio", "steps_ratio_by_seed"):
            assert kind in results[table], table
    assert results["steps_ratio"]["adamw"] == 1.0
    assert set(results["overfitting_check"]["by_method"]) == set(methods)
    sweep = [f"sweep-{k}-lr{r['lr']:.3e}-seed0-{config['sweep_steps']}" for k in methods for r in results["sweep"][k]]
    finals = [f"final-{k}-lr{results['final'][k]['lr']:.3e}-seed{s}-{config['steps']}" for k in methods for s in (0, 1)]
    assert sorted(p.name for p in (out / "runs").iterdir()) == sorted(f"{name}.json" for name in sweep + finals)
    assert list((out / "checkpoints").iterdir()) == []  # a finished run's record is its result file
    if importlib.util.find_spec("matplotlib") is not None:
        for plot in ("loss_curves.png", "lr_sensitivity.png"):
            assert (out / plot).read_bytes()[:4] == b"\x89PNG", plot


def test_study_resumes_without_losing_finished_runs(study, straight, tmp_path):
    """Interrupted in the sweep and again in the final runs, then resumed: the runs finished before
    an interruption are kept as they were, and the results equal the straight run's bit for bit."""
    expected, _ = straight
    config = expected["config"]
    runs, checkpoints = tmp_path / "runs", tmp_path / "checkpoints"
    split = [*TOY, "--out", str(tmp_path)]

    # 1. inside the sweep: sweep runs take 3 steps each, so step 14 falls inside one
    assert config["sweep_steps"] == 3
    assert study.main([*split, "--stop-after", "14"]) == {}
    kept = {p.name: p.read_bytes() for p in runs.iterdir()}
    assert len(kept) == 4
    (unfinished,) = checkpoints.iterdir()
    assert f"{unfinished.stem}.json" not in kept

    # 2. inside the first seed's final runs, 10 steps into their 4 x 9 (interleaved)
    sweep_steps = sum(len(r) for r in expected["sweep"].values()) * config["sweep_steps"]
    assert study.main([*split, "--resume", "--stop-after", str(sweep_steps - 14 + 10)]) == {}
    finals = sorted(p.name for p in checkpoints.iterdir())
    assert len(finals) == 4 and all(name.startswith("final-") and "-seed0-" in name for name in finals)
    assert not any(name.startswith("final-") for name in (p.name for p in runs.iterdir()))

    resumed = study.main([*split, "--resume"])
    assert {name: (runs / name).read_bytes() for name in kept} == kept  # kept, not trained again
    assert list(checkpoints.iterdir()) == []
    assert without_timing(resumed) == without_timing(expected)
    assert json.loads((tmp_path / "results.json").read_text()) == resumed


def test_study_refuses_to_resume_under_other_settings(study, tmp_path):
    study.main([*TOY, "--out", str(tmp_path), "--stop-after", "4"])
    with pytest.raises(SystemExit, match="other settings"):
        study.main([*TOY, "--out", str(tmp_path), "--resume", "--heads", "2"])


def first_reach(steps: list[float], losses: list[float | None], target: float) -> float | None:
    """The first point of the curve at or below ``target``, linearly interpolated from the one before."""
    for i in range(1, len(steps)):
        if losses[i] is not None and losses[i] <= target:
            before, at = losses[i - 1], losses[i]
            if before == at:
                return steps[i]
            return steps[i - 1] + (steps[i] - steps[i - 1]) * (before - target) / (before - at)
    return None


def test_study_figures_follow_from_the_recorded_losses(straight):
    results, _ = straight
    final = results["final"]
    finals = {kind: [r["val_loss"] for r in f["runs"]] for kind, f in final.items()}
    target = results["target_val_loss"]
    assert target == pytest.approx(statistics.fmean(finals["adamw"]), rel=1e-12)
    for kind, f in final.items():
        assert f["val_loss"]["mean"] == pytest.approx(statistics.fmean(finals[kind]), rel=1e-12)
        assert f["val_loss"]["std"] == pytest.approx(statistics.stdev(finals[kind]), rel=1e-9)
        assert (f["val_loss"]["min"], f["val_loss"]["max"]) == (min(finals[kind]), max(finals[kind]))
        curve = f["mean_curve"]
        for name in ("seconds", "train_loss", "val_loss"):
            columns = zip(*(r["history"][name] for r in f["runs"]))
            assert curve[name] == pytest.approx([sum(c) / len(c) for c in columns], rel=1e-12), (kind, name)
        for axis, table in (("step", "steps_to_target"), ("seconds", "seconds_to_target")):
            reach, adamw_reach = results[table][kind], results[table]["adamw"]
            assert reach == pytest.approx(first_reach(curve[axis], curve["val_loss"], target), rel=1e-12)
            ratio = results[table.replace("to_target", "ratio")][kind]
            assert ratio == (None if reach is None else pytest.approx(reach / adamw_reach, rel=1e-12))
        for i, run in enumerate(f["runs"]):
            adamw = final["adamw"]["runs"][i]
            own = first_reach(adamw["history"]["step"], adamw["history"]["val_loss"], adamw["val_loss"])
            other = first_reach(run["history"]["step"], run["history"]["val_loss"], adamw["val_loss"])
            expected = None if other is None else pytest.approx(other / own, rel=1e-12)
            assert results["steps_ratio_by_seed"][kind][i] == expected, (kind, i)

    for kind, sweep in results["sweep"].items():
        losses = {r["lr"]: r["val_loss"] for r in sweep}
        best = min(losses, key=lambda lr: math.inf if losses[lr] is None else losses[lr])
        s = results["sensitivity"][kind]
        assert (s["best_lr"], s["best_val_loss"]) == (best, losses[best])
        assert final[kind]["lr"] == best
        for side, factor in (("over_3", 1 / 3), ("times_3", 3.0)):
            near = [lr for lr in losses if lr == pytest.approx(best * factor, rel=1e-9)]
            if not near:
                assert s[f"lr_{side}"] is None and s[f"increase_{side}"] is None
                continue
            assert s[f"lr_{side}"] == {"lr": near[0], "val_loss": losses[near[0]]}
            loss = losses[near[0]]
            assert s[f"increase_{side}"] == (None if loss is None else pytest.approx(loss - losses[best], rel=1e-12))

    check, config = results["overfitting_check"], results["config"]
    tokens = config["steps"] * config["batch"] * config["ctx"]
    assert check["tokens_per_final_run"] == tokens
    assert check["epochs"] == pytest.approx(tokens / check["train_characters"])
    assert check["tokens_per_parameter"] == pytest.approx(tokens / results["parameters"])
    for kind, c in check["by_method"].items():
        curve = final[kind]["mean_curve"]
        lowest = min(curve["val_loss"])
        assert c["val_above_lowest"] == pytest.approx(curve["val_loss"][-1] - lowest, abs=1e-12)
        assert curve["val_loss"][curve["step"].index(c["lowest_val_step"])] == lowest
        assert c["val_minus_train"] == pytest.approx(curve["val_loss"][-1] - curve["train_loss"][-1], rel=1e-12)


def test_study_estimate_projects_the_measured_step_times(study, tmp_path):
    projected = study.main([*TOY, "--out", str(tmp_path), "--estimate", "--probe-steps", "3"])
    assert json.loads((tmp_path / "estimate.json").read_text()) == projected
    step, evaluation = projected["median_step_seconds"], projected["evaluation_seconds"]
    assert set(step) == set(study.METHODS) and all(s > 0 for s in step.values()) and evaluation > 0
    steps, sweep_steps, seeds, evals = 9, 3, 2, 9 // 3 + 1  # the toy's budget
    for name, extra in (("fewest", 0), ("most", 2)):
        runs = 3 + extra
        evaluations = (2 * runs + seeds * evals) * evaluation
        seconds = sum((runs * sweep_steps + seeds * steps) * s + evaluations for s in step.values())
        assert projected["projected_seconds"][name] == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["--methods", "muon", "normuon"], "--methods"),
        (["--methods", "adamw", "adamw"], "--methods"),
        (["--muon-lrs", "0.01", "-0.02"], "--muon-lrs"),
        (["--stop-after", "0"], "--stop-after"),
        (["--seeds", "0"], "--seeds"),
    ],
)
def test_study_names_a_bad_option(study, argv, culprit, capsys, tmp_path):
    with pytest.raises(SystemExit):
        study.main([*argv, "--out", str(tmp_path / "never")])
    assert culprit in capsys.readouterr().err
    assert not (tmp_path / "never").exists()  # refused before anything was written


NAMES = {"AdamW": "adamw", "Muon": "muon", "NorMuon": "normuon", "AdaMuon": "adamuon"}


@pytest.mark.parametrize(
    ("run", "data", "steps", "sweep_steps", "seeds"),
    [
        ("reduced", "study-reduced-300steps.json", 300, 75, [0, 1]),
        ("full", "study-full-1000steps.json", 1000, 250, [0, 1, 2]),
    ],
)
def test_the_study_page_quotes_the_recorded_runs(run, data, steps, sweep_steps, seeds):
    """docs/study.md's table of each recorded run: every cell from the results.json it cites."""
    recorded = json.loads((ROOT / "docs" / "data" / data).read_text())
    page = (ROOT / "docs" / "study.md").read_text()
    table = page.split(f"<!-- study-{run}-table: start -->")[1].split(f"<!-- study-{run}-table: end -->")[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.strip().splitlines()[2:]]
    assert [row[0] for row in rows] == list(NAMES)
    config = recorded["config"]
    assert (config["steps"], config["sweep_steps"], recorded["seeds"]) == (steps, sweep_steps, seeds)
    assert f"({sweep_steps} steps)" in table and f"({len(seeds)} seeds)" in table
    assert f"data/{data}" in page
    for name, *cells in rows:
        kind = NAMES[name]
        sens, final = recorded["sensitivity"][kind], recorded["final"][kind]
        around = (sens["lr_over_3"]["val_loss"], sens["best_val_loss"], sens["lr_times_3"]["val_loss"])
        sweep = " / ".join(f"{v:.3f}" for v in around)
        expected = [
            f"{final['lr']:.0e}".replace("e-0", "e-"),
            sweep,
            f"{final['val_loss']['mean']:.4f} ± {final['val_loss']['std']:.4f}",
            f"{recorded['steps_to_target'][kind]:.0f} ({recorded['steps_ratio'][kind]:.2f}×)",
            f"{recorded['seconds_ratio'][kind]:.2f}×",
            f"{final['median_step_seconds'] * 1e3:.1f}",
        ]
        assert cells == expected, name


@pytest.fixture(scope="module")
def state_study():
    """examples/state_study.py: fp32 against bf16 optimizer state."""
    yield from loaded_example("state_study")


def test_state_study_toy_reports_each_setting_from_its_runs(state_study, tmp_path):
    """The toy state study: every setting over both seeds, its figures recomputed from the runs' losses, the
    bf16 runs trained with a bf16 state (their losses differ from the fp32 runs' from the same start)."""
    results = state_study.main([*TOY, "--out", str(tmp_path)])
    assert json.loads((tmp_path / "results.json").read_text()) == results
    settings = results["settings"]
    assert list(settings) == ["adamw fp32 state", "adamw bf16 state", "muon fp32 state", "muon bf16 state"]
    assert results["seeds"] == [0, 1]
    for name, s in settings.items():
        losses = [r["val_loss"] for r in s["runs"]]
        assert [r["seed"] for r in s["runs"]] == [0, 1]
        assert all(
            r["history"]["val_loss"][-1] == loss < r["history"]["val_loss"][0] for r, loss in zip(s["runs"], losses)
        )
        assert s["val_loss"]["mean"] == pytest.approx(statistics.fmean(losses), rel=1e-12)
        assert s["val_loss"]["std"] == pytest.approx(statistics.stdev(losses), rel=1e-9)
        assert (s["val_loss"]["min"], s["val_loss"]["max"]) == (min(losses), max(losses))
        fp32 = settings[f"{s['kind']} fp32 state"]
        reference = [r["val_loss"] for r in fp32["runs"]]
        assert s["minus_fp32_by_seed"] == pytest.approx([a - b for a, b in zip(losses, reference)], abs=1e-12)
        if s["state_dtype"] is None:
            assert s["within_fp32_range"] is None and s["minus_fp32_by_seed"] == [0.0, 0.0]
            continue
        assert s["state_dtype"] == "bfloat16"
        assert s["within_fp32_range"] == (min(reference) <= s["val_loss"]["mean"] <= max(reference))
        assert all(a != b for a, b in zip(losses, reference)), f"{name}: the same losses as fp32 state"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(
        f"state-{s['kind']}-{s['state_dtype'] or 'fp32'}-lr{s['lr']:.3e}-seed{seed}-9.json"
        for s in settings.values()
        for seed in (0, 1)
    )
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_the_demo_optimizers_keep_the_state_dtype_they_are_given(state_study):
    import demo

    model = demo.GPT(vocab=11, ctx=8, width=16, depth=1, heads=2)
    params = demo.TensorDict.from_module(model).detach()
    for kind in ("adamw", "muon"):
        for state_dtype in (None, torch.bfloat16):
            state = demo.make_optimizer(kind, 1e-2, 10, 1, model, state_dtype).init(params)
            floats = {t.dtype for t in state.values(include_nested=True, leaves_only=True) if t.is_floating_point()}
            assert floats == {state_dtype or torch.float32}, (kind, state_dtype)


def test_the_study_page_quotes_the_recorded_state_study(state_study):
    """docs/study.md's table of the recorded state study: every cell from the results.json it cites."""
    data = "state-study-300steps.json"
    recorded = json.loads((ROOT / "docs" / "data" / data).read_text())
    page = (ROOT / "docs" / "study.md").read_text()
    table = page.split("<!-- state-study-table: start -->")[1].split("<!-- state-study-table: end -->")[0]
    assert table.strip() == state_study.markdown_table(recorded)
    assert (recorded["config"]["steps"], recorded["seeds"]) == (300, [0, 1, 2])
    assert recorded["lr"] == state_study.TUNED_LR
    assert f"data/{data}" in page
