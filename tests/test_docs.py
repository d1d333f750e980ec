"""The documentation says what the code does: every public name has an API entry, the measured
Newton–Schulz table is reproducible, every migration claim points at a test that exists, and the
performance page's tables quote the recorded runs."""

from __future__ import annotations

import importlib
import json
import pathlib
import re

import pytest
import torch

import muonfn

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PUBLIC_MODULES = ["muonfn", "muonfn.linalg", "muonfn.optim", "muonfn.distributed", "muonfn.testing", "muonfn.reference"]


def documented_objects() -> set[str]:
    """Names given to autodoc / py directives in the API pages."""
    text = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    return set(re.findall(r"\.\. (?:auto|py:)(?:function|class|exception|data|module)::\s+([\w.]+)", text))


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_has_an_api_entry(module_name):
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        pytest.skip(f"{module_name} is not available")
    public = getattr(module, "__all__", None)
    if public is None:
        pytest.skip(f"{module_name} declares no __all__")
    missing = {f"{module_name}.{name}" for name in public} - documented_objects()
    assert not missing, f"not in docs/api: {sorted(missing)}"


def test_every_public_function_has_a_docstring():
    for name in muonfn.__all__:
        obj = getattr(muonfn, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), f"muonfn.{name} has no docstring"


def ns_table() -> dict[str, tuple[float, float, float]]:
    text = (DOCS / "formulas.md").read_text()
    table = text.split("<!-- ns-table: start -->")[1].split("<!-- ns-table: end -->")[0]
    rows = {}
    for match in re.finditer(r"^\| `(\w+)` \|.*\| \[([\d.]+), ([\d.]+)\] \| ([\d.e+-]+) \|", table, re.M):
        rows[match[1]] = (float(match[2]), float(match[3]), float(match[4]))
    return rows


# fp32 rounding is a CPU's own (a BLAS sums a matmul's products in an order of its own): the bounds
# docs/formulas.md gives for how far it moves the measured error and a singular value, over twice
# the least accurate summation order (`docs/scripts/ns_bands.py --summation`) and Intel AMX's
FP32_ERROR_ROUNDING = 1e-5
FP32_SIGMA_ROUNDING = 2e-6


def test_formulas_ns_table_matches_a_fresh_measurement():
    """The band to the digits shown and the error to 2 %, each up to what fp32 rounding can move them."""
    rows = ns_table()
    assert set(rows) == set(muonfn.COEFFICIENTS)
    g = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    exact = muonfn.polar(g.double())
    for name, (low, high, error) in rows.items():
        out = muonfn.newton_schulz(g, name, dtype=torch.float32).double()
        s = torch.linalg.svdvals(out)
        assert abs(s.min().item() - low) <= 5e-4 + FP32_SIGMA_ROUNDING, name
        assert abs(s.max().item() - high) <= 5e-4 + FP32_SIGMA_ROUNDING, name
        measured = ((out - exact).norm() / exact.norm()).item()
        assert abs(measured - error) <= 0.02 * error + FP32_ERROR_ROUNDING, (name, measured)


def band_table() -> dict[str, list[tuple[float, float]]]:
    text = (DOCS / "formulas.md").read_text()
    table = text.split("<!-- band-table: start -->")[1].split("<!-- band-table: end -->")[0]
    rows = {}
    for match in re.finditer(r"^\| `(\w+)` \|(.*)\|$", table, re.M):
        rows[match[1]] = [(float(lo), float(hi)) for lo, hi in re.findall(r"\[([\d.]+), ([\d.]+)\]", match[2])]
    return rows


def test_formulas_band_table_matches_a_fresh_computation():
    """spectral_band to 7 digits, and the fp32 band of the Gaussian inside it (up to fp32 rounding)."""
    testing = pytest.importorskip("muonfn.testing")
    rows = band_table()
    assert set(rows) == set(muonfn.COEFFICIENTS)
    g = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(g.double())
    assert float(s.min() / s.norm()) >= 0.01  # the Gaussian's relative singular values are in [0.01, 1]
    for name, (wide, narrow, measured) in rows.items():
        assert wide == tuple(round(x, 7) for x in testing.spectral_band(name)), name
        band = testing.spectral_band(name, sigma_min=0.01)
        assert narrow == tuple(round(x, 7) for x in band), name
        out = torch.linalg.svdvals(muonfn.newton_schulz(g, name, dtype=torch.float32).double())
        fresh = (out.min().item(), out.max().item())
        assert fresh == pytest.approx(measured, abs=FP32_SIGMA_ROUNDING), name
        assert band[0] - FP32_SIGMA_ROUNDING <= fresh[0] and fresh[1] <= band[1] + FP32_SIGMA_ROUNDING, name


def test_the_testing_page_examples_run(monkeypatch):
    """docs/testing.md: the first kernel fails as the pasted report says, the fixed one and the
    other examples pass."""
    testing = pytest.importorskip("muonfn.testing")
    # the page's newton_schulz iterates in the input's dtype, as it does on every CPU at the sizes drawn
    monkeypatch.setenv("MUONFN_CPU_NS_DTYPE", "float32")
    page = (DOCS / "testing.md").read_text()
    naive, fixed, schedule, strategies = re.findall(r"```python\n(.*?)```", page, re.S)
    report = re.findall(r"```text\n(.*?)```", page, re.S)[0]
    namespace: dict = {}
    exec(compile(naive, "testing.md naive", "exec"), namespace)
    with pytest.raises(testing.InvariantViolation) as info:
        namespace["test_fused_ns"]()
    assert f"orthogonalizer broke '{info.value.invariant}'" in report
    exec(compile(fixed, "testing.md fixed", "exec"), namespace)
    namespace["test_fused_ns"]()
    exec(compile(schedule, "testing.md schedule", "exec"), namespace)
    namespace["test_my_schedule"]()
    exec(compile(strategies, "testing.md strategies", "exec"), namespace)
    namespace["test_null_space_is_preserved"]()
    namespace["test_one_muon_step_is_finite"]()


def test_migration_claims_point_at_existing_tests():
    page = (DOCS / "migration.md").read_text() + (DOCS / "formulas.md").read_text()
    cited = set(re.findall(r"`(?:tests/test_\w+\.py::)?(test_\w+)`", page))
    source = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    defined = set(re.findall(r"^def (test_\w+)", source, re.M))
    assert cited, "the migration page cites no tests"
    assert cited <= defined, f"cited but not defined: {sorted(cited - defined)}"
    migration_tests = set(re.findall(r"^def (test_\w+)", (ROOT / "tests" / "test_migration.py").read_text(), re.M))
    assert migration_tests <= cited, f"migration tests the page does not cite: {sorted(migration_tests - cited)}"


def test_python_snippets_in_the_docs_parse():
    pages = [*DOCS.glob("*.md"), ROOT / "README.md"]
    for page in pages:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            compile(block, f"{page.name} snippet {i}", "exec")


def test_readme_quick_example_runs():
    first = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    namespace: dict = {}
    exec(compile(first, "README.md", "exec"), namespace)
    params, model = namespace["params"], namespace["model"]
    x, y = namespace["x"], namespace["y"]
    with params.to_module(model):
        loss = torch.nn.functional.cross_entropy(model(x), y).item()
    assert loss < 0.5 * torch.log(torch.tensor(8.0)).item()  # well below chance after 100 steps


def marked_table(page: str, name: str) -> dict[str, list[str]]:
    """Rows of the table between ``<!-- name: start -->`` and ``<!-- name: end -->``: first cell -> the others."""
    text = (DOCS / page).read_text()
    assert f"<!-- {name}: start -->" in text, f"docs/{page} has no {name}"
    lines = text.split(f"<!-- {name}: start -->")[1].split(f"<!-- {name}: end -->")[0].strip().splitlines()
    rows = [[cell.strip().strip("*") for cell in line.strip().strip("|").split("|")] for line in lines[2:]]
    return {row[0]: row[1:] for row in rows}


def quoted(figure: float | None, digits: int) -> str:
    return "" if figure is None else f"{figure:.{digits}f}"


#: the performance page's row names -> the contenders' names in the recorded JSON
GPU_ROWS = {
    "pytorch-optimizer Muon": "pytorch-optimizer Muon",
    "muonfn shim, one part (`chunk_numel=None`)": "muonfn shim one part",
    "muonfn donated (`donate_state=True` + `apply_updates_`)": "muonfn donated",
    'muonfn gram (`ns="gram"`, functional)': "muonfn gram",
    "muonfn functional (`update` + `apply_updates`)": "muonfn",
    "muonfn shim (`muonfn.optim.Muon`, defaults)": "muonfn shim",
    "torch Muon + foreach AdamW": "torch Muon+AdamW",
    "timm Muon": "timm Muon",
    "plain fp32 loop (hand-written, + AdamW foreach)": "plain fp32 loop",
    "heavyball Muon (eager)": "heavyball Muon",
}
CPU_ROWS = {
    "pytorch-optimizer Muon": "pytorch-optimizer Muon",
    'muonfn gram (`ns="gram"`)': "muonfn gram",
    "torch Muon + foreach AdamW": "torch Muon+AdamW",
    "muonfn donated (`donate_state=True` + `apply_updates_`)": "muonfn donated",
    "timm Muon": "timm Muon",
    "muonfn functional (`update` + `apply_updates`)": "muonfn",
    "muonfn shim (`muonfn.optim.Muon`, defaults)": "muonfn shim",
    "heavyball Muon (eager)": "heavyball Muon",
    "plain fp32 loop (hand-written, + AdamW foreach)": "plain fp32 loop",
}


def test_performance_gpu_table_quotes_the_recorded_run():
    run = json.loads((ROOT / "benchmarks" / "results" / "cuda-h200-step-gpt2-795db15.json").read_text())
    assert run["machine"]["gpu"] == "NVIDIA H200" and run["machine"]["torch"].startswith("2.11")
    small, medium = (run["step"][name]["contenders"] for name in ("gpt2-small", "gpt2-medium"))
    table = marked_table("performance.md", "gpu-table")
    assert set(table) == set(GPU_ROWS)
    for row, key in GPU_ROWS.items():
        recorded = [
            quoted(small[key]["median_ms"], 2),
            quoted(medium[key]["median_ms"], 2),
            quoted(small[key]["peak_mb"], 0),
            quoted(medium[key]["peak_mb"], 0),
        ]
        assert table[row] == recorded, row


def test_performance_cpu_table_quotes_the_recorded_runs():
    results = ROOT / "benchmarks" / "results"
    with_units = json.loads((results / "cpu-2core-avx512bf16-final.json").read_text())
    without = json.loads((results / "cpu-2core-avx2.json").read_text())
    assert with_units["machine"]["cpu_bf16_units"] is True and without["machine"]["cpu_capability"] == "AVX2"
    a, b = (run["step"]["gpt-w256-d4"]["contenders"] for run in (with_units, without))
    table = marked_table("performance.md", "cpu-table")
    assert set(table) == set(CPU_ROWS)
    for row, key in CPU_ROWS.items():
        recorded = [
            quoted(a[key]["median_ms"], 1),
            quoted(a[key]["peak_mb"], 1),
            quoted(b[key]["median_ms"] if key in b else None, 1),
        ]
        assert table[row] == recorded, row


def fused_adamw_calls(step) -> int:  # type: ignore[no-untyped-def]
    """How many times ``step()`` calls ``torch._fused_adamw_`` (seen below the dispatcher)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Calls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.overloadpacket is torch.ops.aten._fused_adamw_:
                calls.append(func)
            return func(*args, **(kwargs or {}))

    with Calls():
        step()
    return len(calls)


def test_the_functional_pages_promises_of_bits_say_where_cuda_differs():
    """The functional page promises an ensemble member its own update's bits, and a compiled
    (``aot_eager``) update eager's. On a CUDA GPU one model's eager step sends its fp32 AdamW
    leaves through torch's fused AdamW kernel, which a vmapped ensemble does not take (counted
    here on meta, which takes CUDA's paths), nor a compiled step: the paragraph of each promise
    says where the two part."""
    from tensordict import TensorDict

    params = TensorDict({"bias": torch.empty(8, device="meta"), "norm": torch.empty(16, device="meta")}, [])
    tx = muonfn.adamw(1e-3, weight_decay=0.1)
    assert fused_adamw_calls(lambda: tx.update(params, tx.init(params), params)) == 1
    members = torch.stack([params, params])
    state = torch.vmap(tx.init)(members)
    assert fused_adamw_calls(lambda: torch.vmap(tx.update)(members, state, members)) == 0
    paragraphs = [" ".join(p.split()) for p in (DOCS / "functional-api.md").read_text().split("\n\n")]
    for promise in ("bit for bit its own update", "gives eager's bits"):
        at = next(i for i, p in enumerate(paragraphs) if promise in p)
        said = " ".join(paragraphs[at : at + 2])  # (the promise and the paragraph after it)
        assert "CUDA GPU" in said and "fused AdamW kernel" in said, promise
