"""How much of muonfn a reader follows to understand one step: ``python benchmarks/step_lines.py [--json]``.

One default step of a small GPT (an embedding, two blocks, a head: 17 leaves) is traced with
``sys.settrace`` after two warm-up steps: the distinct source lines of the ``muonfn`` package that
execute, and the functions (code objects: a comprehension is one on Python 3.11) and files they sit
in. Counted for the functional ``muonfn.muon(...).update`` + ``muonfn.apply_updates`` and for the shim's
``step()``, on the CPU and on the meta device (which takes a GPU's paths), beside ``muonfn.reference.step``.
Also the package's size in code lines (not blank, not comment, not docstring), its core's (the root
modules and ``linalg``, and 0.1.0's ``transforms`` and ``presets`` where a checkout has them), and the
keywords of ``muonfn.muon`` (every parameter that can be given by name, ``lr`` too).
``tests/test_step_budget.py`` holds the budget.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import sys
import tokenize
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE.parent))  # the checkout's muonfn, run from a checkout without installing

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

import muonfn  # noqa: E402

PACKAGE = Path(muonfn.__file__).resolve().parent


def tiny_gpt(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    d, vocab = 32, 97
    with torch.device(device):
        layers: list[torch.nn.Module] = []
        for _ in range(2):
            layers += [torch.nn.LayerNorm(d), torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)]
            layers += [torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)]
        return torch.nn.ModuleDict(
            {
                "wte": torch.nn.Embedding(vocab, d),
                "h": torch.nn.Sequential(*layers),
                "ln_f": torch.nn.LayerNorm(d),
                "lm_head": torch.nn.Linear(d, vocab, bias=False),
            }
        )


def traced(step: Callable[[], object]) -> dict[str, object]:
    """The distinct lines, functions and files of the package that ``step`` executes."""
    root = str(PACKAGE)
    lines: set[tuple[str, int]] = set()
    functions: set[tuple[str, int, str]] = set()

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        code = frame.f_code
        if not code.co_filename.startswith(root):
            return None
        if event == "call":
            functions.add((code.co_filename, code.co_firstlineno, code.co_name))
        elif event == "line":
            lines.add((code.co_filename, frame.f_lineno))
        return tracer

    sys.settrace(tracer)
    try:
        step()
    finally:
        sys.settrace(None)
    per_file: dict[str, int] = {}
    for filename, _ in lines:
        name = str(Path(filename).relative_to(PACKAGE.parent))
        per_file[name] = per_file.get(name, 0) + 1
    ordered = dict(sorted(per_file.items(), key=lambda item: -item[1]))
    return {"lines": len(lines), "functions": len(functions), "files": len(per_file), "by_file": ordered}


def random_grads(module: torch.nn.Module, device: str) -> None:
    for p in module.parameters():
        p.grad = torch.randn_like(p) if device == "cpu" else torch.empty_like(p)


def functional(device: str) -> dict[str, object]:
    model = tiny_gpt(device)
    params = TensorDict.from_module(model).detach()
    grads = params.apply(lambda p: torch.randn_like(p) if device == "cpu" else torch.empty_like(p))
    tx = muonfn.muon(lr=1e-3, weight_decay=0.1)
    state = tx.init(params)

    def step() -> None:
        nonlocal params, state
        updates, state = tx.update(grads, state, params)
        params = muonfn.apply_updates(params, updates)

    step()
    step()
    return traced(step)


def shim(device: str) -> dict[str, object]:
    model = tiny_gpt(device)
    opt = muonfn.optim.Muon(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    random_grads(model, device)
    opt.step()
    opt.step()
    return traced(opt.step)


def reference() -> dict[str, object]:
    from muonfn import reference as ref

    model = tiny_gpt("cpu")
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = ref.init()
    heads = ("wte.weight", "lm_head.weight")
    for _ in range(2):
        ref.step(params, grads, state, lr=1e-3, adamw_names=heads)
    return traced(lambda: ref.step(params, grads, state, lr=1e-3, adamw_names=heads))


def code_lines(path: Path) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    source = path.read_text(encoding="utf-8")
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    code: set[int] = set()
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings)


#: The core: the root modules, ``linalg``, and the subpackages 0.1.0 had in their place
CORE = ("(root)", "linalg", "transforms", "presets")


def package_size() -> dict[str, object]:
    parts: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        top = path.relative_to(PACKAGE).parts[0]
        part = top if (PACKAGE / top).is_dir() else "(root)"
        parts[part] = parts.get(part, 0) + code_lines(path)
    core = sum(parts.get(part, 0) for part in CORE)
    return {"code_lines": sum(parts.values()), "core_code_lines": core, "by_part": parts}


def measure() -> dict[str, object]:
    given_by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    keywords = [n for n, p in inspect.signature(muonfn.muon).parameters.items() if p.kind in given_by_name]
    return {
        "package": package_size(),
        "muon_keywords": len(keywords),
        "reference": reference(),
        "functional_cpu": functional("cpu"),
        "shim_cpu": shim("cpu"),
        "functional_meta": functional("meta"),
        "shim_meta": shim("meta"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    figures = measure()
    if parser.parse_args().json:
        print(json.dumps(figures, indent=1))
        return
    size = figures["package"]
    print(f"package: {size['code_lines']} code lines, core {size['core_code_lines']}; by part: {size['by_part']}")
    print(f"keywords of muonfn.muon: {figures['muon_keywords']}")
    for name in ("reference", "functional_cpu", "shim_cpu", "functional_meta", "shim_meta"):
        row = figures[name]
        top = ", ".join(f"{f} {n}" for f, n in list(row["by_file"].items())[:4])  # type: ignore[union-attr]
        print(f"{name:16s} lines {row['lines']:4d}  functions {row['functions']:4d}  files {row['files']:3d}   [{top}]")


if __name__ == "__main__":
    main()
