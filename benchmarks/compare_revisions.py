"""Two revisions' CPU steps, interleaved in one process: ``python benchmarks/compare_revisions.py --old REV``.

The package of git revision ``--old`` (and of ``--new``, by default the checkout) is extracted with ``git archive``
under another top-level name (the package imports itself relatively), so that both step the same parameters with
the same gradients, round-robin, one step each per round: a busy neighbour slows both alike. For each parameter
set of ``_sets`` (GPT blocks, the conv net, the MoE layer by default) it times the functional donated step
(``muon(..., donate_state=True)`` + ``apply_updates_``) and the shim's ``step()``, on one thread, Newton–Schulz in
fp32 (the same arithmetic on every CPU), and prints each one's median and the ratio new / old of the medians.
The options are spelled each revision's way: the old presets took ``ns_dtype=``, the new ``ns=NewtonSchulz(...)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _sets  # noqa: E402


def extracted(revision: str, name: str, into: Path) -> Any:
    """The package ``muonfn`` of ``revision`` (``"."``: the working tree) imported as ``name``."""
    target = into / name
    if revision == ".":
        target.symlink_to(ROOT / "muonfn", target_is_directory=True)
    else:
        archive = subprocess.run(["git", "archive", revision, "muonfn"], cwd=ROOT, check=True, capture_output=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(into / f"{name}_tree", filter="data")
        target.symlink_to(into / f"{name}_tree" / "muonfn", target_is_directory=True)
    sys.path.insert(0, str(into))
    return importlib.import_module(name)


def fp32_options(package: Any) -> dict[str, Any]:
    """Newton–Schulz in fp32, spelled as ``package``'s presets take it."""
    if "ns_dtype" in inspect.signature(package.muon).parameters:
        return {"ns_dtype": torch.float32}
    return {"ns": package.NewtonSchulz(dtype=torch.float32)}


def contenders(package: Any, ps: _sets.ParamSet) -> dict[str, Callable[[], Any]]:
    """The functional donated step and the shim's step of ``package`` on a copy of ``ps``'s parameters."""
    options = fp32_options(package)
    views = {name: package.MatrixView(**dataclasses.asdict(view)) for name, view in ps.views.items()} or None
    params = TensorDict({name: p.detach().clone() for name, p in ps.named()}, batch_size=[]).unflatten_keys(".")
    grads = TensorDict({name: p.grad.clone() for name, p in ps.named()}, batch_size=[]).unflatten_keys(".")
    tx = package.muon(lr=1e-3, labels=ps.labels, views=views, donate_state=True, **options)
    state = tx.init(params)

    def functional() -> None:
        nonlocal state
        updates, state = tx.update(grads, state, params)
        package.apply_updates_(params, updates)

    copies = [(name, torch.nn.Parameter(p.detach().clone())) for name, p in ps.named()]
    for (_, copy), (_, p) in zip(copies, ps.named()):
        copy.grad = p.grad.clone()
    opt = package.optim.Muon(copies, lr=1e-3, labels=ps.labels, views=views, **options)
    return {"functional donated": functional, "shim": opt.step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="the git revision to compare with (e.g. main, a tag, a sha)")
    parser.add_argument("--new", default=".", help="the other revision ('.': the working tree)")
    parser.add_argument("--sets", default="gpt,conv,moe")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        old = extracted(args.old, "muonfn_old", Path(tmp))
        new = extracted(args.new, "muonfn_new", Path(tmp))
        figures: dict[str, dict[str, float]] = {}
        for set_name in args.sets.split(","):
            ps = _sets.build(set_name, "cpu")
            runs = {}
            for label, package in (("old", old), ("new", new)):
                for kind, step in contenders(package, ps).items():
                    runs[(kind, label)] = step
            for step in runs.values():  # warm-up: state made, kernels loaded
                step()
                step()
            times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
            for _ in range(args.repeats):
                for key, step in runs.items():
                    start = time.perf_counter()
                    step()
                    times[key].append(time.perf_counter() - start)
            for kind in ("functional donated", "shim"):
                old_ms = statistics.median(times[(kind, "old")]) * 1e3
                new_ms = statistics.median(times[(kind, "new")]) * 1e3
                figures[f"{set_name} {kind}"] = {"old_ms": old_ms, "new_ms": new_ms, "ratio": new_ms / old_ms}
                print(
                    f"{set_name:5s} {kind:20s} old {old_ms:8.2f} ms  new {new_ms:8.2f} ms  "
                    f"new/old {new_ms / old_ms:.3f}"
                )
    if args.out:
        args.out.write_text(json.dumps({"old": args.old, "new": args.new, "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
