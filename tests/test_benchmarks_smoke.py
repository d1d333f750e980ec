"""The benchmark suite runs end to end in its smallest configuration and writes sane JSON.

Checks fields and that numbers are positive and finite; never speed. The CUDA configuration
(GPT-2 small and medium, large Newton–Schulz buckets) is checked as configuration here, and
runs at its smoke sizes on the CPU through the same code.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
GPT2_SETS = {"gpt2-small", "gpt2-medium"}


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def load_run():
    spec = importlib.util.spec_from_file_location("benchmarks_run", ROOT / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed_peers() -> set[str]:
    """The peers' eager contenders the suite steps here: those whose package is installed."""
    run_module = load_run()
    return {p.name for p in run_module.C.installed_peers(compiled=False, log=lambda _: None)}


def test_benchmark_suite_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    sets = "gpt,conv,moe,gpt2-small,gpt2-medium"
    command = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--threads", "1", "--device", "cpu"]
    # the fp32 rule on every CPU: the Gram check below is to fp32 rounding
    env = {**os.environ, "MUONFN_CPU_NS_DTYPE": "float32"}
    proc = subprocess.run(
        [*command, "--sets", sets, "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| contender" in proc.stdout and "Targets" in proc.stdout
    assert "Batched Newton–Schulz" in proc.stdout
    results = json.loads(out.read_text())

    assert results["machine"]["torch"] and results["machine"]["cpu_count"] >= 1
    assert results["machine"]["device"] == "cpu"
    assert results["profile"] == "smoke"
    # muonfn's CPU rule, pinned here, with the probe that decides it when it is not
    rule = results["machine"]["cpu_ns_rule"]
    assert rule["variable"] == "float32"
    probe = rule["probe"]
    assert positive(probe["fp32_seconds"]) and positive(probe["bf16_seconds"])
    assert probe["speedup"] == pytest.approx(probe["fp32_seconds"] / probe["bf16_seconds"])
    assert probe["bf16_faster"] == (probe["speedup"] >= probe["min_speedup"])
    assert "muonfn's Newton–Schulz on the CPU: float32, pinned by MUONFN_CPU_NS_DTYPE" in proc.stdout

    step = results["step"]
    assert len(step) == 5  # GPT, conv net, MoE, GPT-2 small and medium (shrunk)
    assert set(step) >= GPT2_SETS
    for record in step.values():
        assert positive(record["ns_gflop"]) and positive(record["ns_limit_ms"])
        assert positive(record["matmul"]["gflops"])
        contenders = record["contenders"]
        muonfn_variants = {"muonfn", "muonfn donated", "muonfn unbatched", "muonfn gram"}
        shim_variants = {"muonfn shim", "muonfn shim donated"}
        assert muonfn_variants | shim_variants | {"torch Muon+AdamW", "plain fp32 loop"} <= set(contenders)
        assert set(contenders) >= installed_peers()
        assert record["fastest_peer"] in {"torch Muon+AdamW"} | installed_peers()
        assert contenders[record["fastest_peer"]]["speedup_vs_fastest_peer"] == 1.0
        for c in contenders.values():
            assert c["repeats"] >= 1 and len(c["times_ms"]) == c["repeats"]
            ratios = ("speedup_vs_torch_muon", "speedup_vs_fastest_peer", "x_limit")
            for field in ("median_ms", *ratios, "ns_gflops", "peak_mb"):
                assert positive(c[field]), field

    ns = results["ns"]
    for shape in ns["shapes"].values():
        assert positive(shape["gram_speedup"])
        for method in ("standard", "gram"):
            r = shape[method]
            assert positive(r["median_ms"]) and positive(r["gflop"]) and positive(r["rel_error_vs_polar"])
            assert r["rel_diff_vs_standard"] < 1e-3
    assert positive(ns["matmul"]["tflops"])
    assert list(ns["batches"]) == ["3x16x64"]
    for batch in ns["batches"].values():
        assert batch["finite"]
        for field in ("median_ms", "tflop", "tflops", "x_matmul_rate"):
            assert positive(batch[field]), field

    elementwise = results["elementwise"]["contenders"]
    assert {"torch AdamW foreach", "muonfn adamw", "muonfn adamw donated", "hand AdamW, TensorDict.apply"} <= set(
        elementwise
    )
    for c in elementwise.values():
        assert positive(c["median_ms"]) and positive(c["x_torch_foreach"]) and positive(c["peak_mb"])

    overhead = results["overhead"]["contenders"]
    assert {"muonfn muon, nested keys", "muonfn muon, flat keys", "torch AdamW foreach"} <= set(overhead)
    assert all(positive(c["median_ms"]) for c in overhead.values())

    fixed = results["fixed"]
    assert fixed["leaves"] == 292 and fixed["threads"] == 1
    fixed_steps = {"muonfn", "muonfn donated", "muonfn shim", "torch Muon+AdamW", "muonfn adamw", "torch AdamW foreach"}
    assert fixed_steps | installed_peers() <= set(fixed["contenders"])
    for c in fixed["contenders"].values():
        assert positive(c["median_ms"]) and positive(c["x_reference"])
    assert set(fixed["ratios"]) == {"functional_over_torch_muon", "shim_over_torch_muon", "adamw_over_torch_adamw"}
    assert all(positive(v) for v in fixed["ratios"].values())

    machine = results["machine"]
    assert isinstance(machine["cpu_bf16_units"], bool) and machine["cpu_bf16_units_from"]
    probe = machine["matmul_probe"]
    assert positive(probe["fp32_gflops"]) and positive(probe["bf16_gflops"]) and positive(probe["bf16_over_fp32"])
    assert "CPU bf16 units: " in proc.stdout

    targets = results["targets"]
    expected = {"muonfn_x_limit", "plain_loop_over_muonfn", "muonfn_adamw_overhead", "ns_batch_x_matmul_rate"}
    expected |= {"fastest_eager_rival_over_muonfn", "fixed_functional_over_torch_muon", "fixed_adamw_over_torch_adamw"}
    assert expected | {"muonfn_shim_peak_over_torch", "muonfn_shim_donated_peak_over_torch"} <= set(targets)
    for t in targets.values():
        assert math.isfinite(t["value"]) and isinstance(t["met"], bool) and t["on"]


def test_fixed_cost_section_runs_on_one_thread_and_restores_the_count():
    run = load_run()
    args, prof, _ = run.configure(["--smoke", "--sections", "fixed"])
    threads = torch.get_num_threads()
    seen = []
    original = run.run_interleaved

    def spy(entries, device, log):
        seen.append(torch.get_num_threads())
        original(entries, device, log)

    run.run_interleaved = spy
    try:
        torch.set_num_threads(2)
        out = run.section_fixed(args, prof, torch.device("cpu"))
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert out["contenders"]["muonfn"]["reference"] == "torch Muon+AdamW"
    assert out["contenders"]["muonfn adamw"]["reference"] == "torch AdamW foreach"


def test_cuda_configuration():
    """``--device cuda`` steps GPT-2 small and medium at their real sizes, times Newton–Schulz on
    64 × 1024×4096 buckets against an 8192² matmul, and writes ``results/cuda-*.json``."""
    run = load_run()
    args, prof, sections = run.configure(["--device", "cuda"])
    assert args.sets == ["gpt2-small", "gpt2-medium", "conv", "moe"]
    assert sections == ["step", "ns", "elementwise", "overhead", "fixed"]
    assert prof["gpt2-small"] == {} and prof["gpt2-medium"] == {}  # the builders' real sizes
    assert prof["ns_batches"][0] == [64, 1024, 4096] and prof["matmul"] == 8192
    assert run.default_out(torch.device("cuda")).match("results/cuda-*.json")
    assert run.configure(["--device", "cpu"])[0].sets == ["gpt", "conv", "moe"]
    _, smoke, _ = run.configure(["--device", "cuda", "--smoke", "--sets", "gpt2-medium"])
    assert smoke["gpt2-medium"]["width"] < 1024


def test_gpt2_sets_have_gpt2s_parameter_counts():
    """GPT-2 small and medium with the head tied to the token embedding: 124.4 M and 354.8 M
    parameters (counted on the meta device, without allocating them)."""
    run = load_run()  # puts benchmarks/ on the path
    sets = sys.modules["_sets"]
    expected = {"gpt2-small": 124_439_808, "gpt2-medium": 354_823_168}
    for name, dims in sets.GPT2_SIZES.items():
        with torch.device("meta"):
            model = sets.GPT(dims["width"], dims["depth"], dims["vocab"], dims["context"])
        assert sum(p.numel() for p in model.parameters()) == expected[name]
        assert name in run._sets.SETS
    shrunk = sets.build("gpt2-medium", "cpu", width=16, depth=2, vocab=32, context=8)
    assert shrunk.name == "gpt2-medium" and "shrunk" in shrunk.description
    assert len(shrunk.matrix_params()) == 4 * 2  # fused QKV, attention and MLP projections per block


def test_profile_step_budgets_the_target_from_its_own_figures(tmp_path):
    """``profile_step.py`` splits every contender's step into its matmuls and everything else,
    and budgets the muonfn steps against the fastest rival of the same run."""
    out = tmp_path / "profile.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), "--width", "16", "--depth", "1"]
    options = ["--repeats", "2", "--steps", "1", "--threads", "1", "--target", "1.25", "--out", str(out)]
    proc = subprocess.run([*command, *options], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    contenders = results["contenders"]
    assert set(contenders) == {"muonfn", "muonfn donated", "torch Muon+AdamW", "plain fp32 loop"} | installed_peers()
    for c in contenders.values():
        assert positive(c["step_ms"]) and positive(c["matmul_ms"])
        assert math.isclose(c["other_ms"], c["step_ms"] - c["matmul_ms"])
        assert set(c["split_ms"]) >= {"matmul", "elementwise", "copy"}
    rivals = {name: c for name, c in contenders.items() if not name.startswith("muonfn")}
    fastest = min(rivals, key=lambda name: rivals[name]["step_ms"])
    assert results["fastest_rival"] == fastest
    for name in ("muonfn", "muonfn donated"):
        budget = results["budgets"][name]
        assert math.isclose(budget["budget_ms"], rivals[fastest]["step_ms"] / 1.25)
        assert math.isclose(budget["other_allowed_ms"], budget["budget_ms"] - contenders[name]["matmul_ms"])


def test_timm_muon_is_loaded_without_a_stand_in_timm():
    """timm's Muon is loaded without timm's package imports, and without a stand-in ``timm`` in
    ``sys.modules``: ``importlib.util.find_spec("timm")`` (which transformers calls when
    pytorch-optimizer imports it) must still work after it, and ``import timm`` still get timm."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed")
    script = (
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import _contenders\n"
        "muon = _contenders.load_timm_muon()\n"
        "assert callable(muon.Muon)\n"
        "spec = importlib.util.find_spec('timm')\n"
        "assert spec is not None and spec.submodule_search_locations, spec\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'timm'], 'a stand-in timm in sys.modules'\n"
        "assert _contenders.load_timm_muon() is muon\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ns_step_forms_times_and_measures_both_forms(tmp_path):
    """``ns_step_forms.py`` times both forms of a bf16 Newton–Schulz step on every shape of its
    device and measures each one's distance from the fp64 iteration: a few bf16 roundings."""
    out = tmp_path / "forms.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "ns_step_forms.py"), "--repeats", "1", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [tuple(r["shape"]) for r in rows] == [(4, 128, 384), (8, 128, 512)]
    for r in rows:
        assert positive(r["epilogue_ms"]) and positive(r["factor_ms"])
        assert 0 < r["epilogue_error"] < 0.05 and 0 < r["factor_error"] < 0.05
