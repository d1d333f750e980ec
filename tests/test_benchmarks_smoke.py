"""The benchmark suite runs end to end in its smallest configuration and writes sane JSON.

Checks fields and that numbers are positive and finite; never speed.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_benchmark_suite_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--threads", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| contender" in proc.stdout and "Targets" in proc.stdout
    results = json.loads(out.read_text())

    assert results["machine"]["torch"] and results["machine"]["cpu_count"] >= 1
    assert results["profile"] == "smoke"

    step = results["step"]
    assert len(step) == 3  # GPT, conv net, MoE
    for record in step.values():
        assert positive(record["ns_gflop"]) and positive(record["ns_limit_ms"])
        assert positive(record["matmul"]["gflops"])
        contenders = record["contenders"]
        muonfn_variants = {"muonfn", "muonfn donated", "muonfn unbatched", "muonfn gram"}
        assert muonfn_variants | {"torch Muon+AdamW", "plain fp32 loop"} <= set(contenders)
        for c in contenders.values():
            assert c["repeats"] >= 1 and len(c["times_ms"]) == c["repeats"]
            for field in ("median_ms", "speedup_vs_torch_muon", "ns_gflops", "x_limit", "peak_mb"):
                assert positive(c[field]), field

    ns = results["ns"]
    for shape in ns["shapes"].values():
        assert positive(shape["gram_speedup"])
        for method in ("standard", "gram"):
            r = shape[method]
            assert positive(r["median_ms"]) and positive(r["gflop"]) and positive(r["rel_error_vs_polar"])
            assert r["rel_diff_vs_standard"] < 1e-3

    elementwise = results["elementwise"]["contenders"]
    assert {"torch AdamW foreach", "muonfn adamw", "muonfn adamw donated", "hand AdamW, TensorDict.apply"} <= set(
        elementwise
    )
    for c in elementwise.values():
        assert positive(c["median_ms"]) and positive(c["x_torch_foreach"]) and positive(c["peak_mb"])

    overhead = results["overhead"]["contenders"]
    assert {"muonfn muon, nested keys", "muonfn muon, flat keys", "torch AdamW foreach"} <= set(overhead)
    assert all(positive(c["median_ms"]) for c in overhead.values())

    targets = results["targets"]
    assert {"muonfn_x_limit", "plain_loop_over_muonfn", "muonfn_adamw_overhead"} <= set(targets)
    for t in targets.values():
        assert math.isfinite(t["value"]) and isinstance(t["met"], bool)
