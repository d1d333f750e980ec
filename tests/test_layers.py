"""The dependency rule, read from the imports: linalg ← transforms ← presets ← optim, distributed → linalg,
testing → linalg."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "muonfn"

FOUNDATION = {"_keys", "_tree", "_validation", "_lists", "_collection"}
#: what each layer may import from muonfn (besides itself)
ALLOWED = {
    "_keys": set(),
    "_tree": {"_keys"},
    "_validation": {"_keys"},
    "_lists": set(),
    "_collection": set(),
    "_checkpoint": {"_keys", "_tree"},
    "linalg": {"_keys"},
    "transforms": {"linalg"} | FOUNDATION,
    # presets build the sharded orthogonalizer that `collectives=` asks for
    "presets": {"transforms", "linalg", "distributed"} | FOUNDATION,
    "optim": {"presets", "transforms", "linalg"} | FOUNDATION,
    "distributed": {"linalg", "_keys"},
    # hypothesis strategies and invariant checks for users' orthogonalizers (hypothesis is an optional extra)
    "testing": {"linalg", "_keys", "_tree"},
    # one step in plain PyTorch, the oracle the fast paths are tested against: it shares no code with them
    "reference": set(),
}
#: third-party packages a layer must not need
FORBIDDEN_EXTERNAL = {"linalg": {"tensordict", "torch.distributed"}, "distributed": {"tensordict"}}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path) -> list[str]:
    """Absolute names of what ``path`` imports, leaving out ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            if node.module is None and node.level:
                names += [f"{stem}.{alias.name}" for alias in node.names]
            else:
                names.append(stem)
    return names


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "muonfn" and len(parts) > 1 else None


def test_each_layer_imports_only_the_layers_below_it() -> None:
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = layer(module_name(path))
        if here is None:  # muonfn/__init__.py re-exports every layer
            continue
        assert here in ALLOWED, f"{path}: no layer rule for {here!r}"
        for name in runtime_imports(path):
            there = layer(name)
            if name.split(".")[0] == "muonfn" and there not in (None, here) and there not in ALLOWED[here]:
                violations.append(f"{module_name(path)} imports {name}")
            for forbidden in FORBIDDEN_EXTERNAL.get(here, ()):
                if name == forbidden or name.startswith(forbidden + "."):
                    violations.append(f"{module_name(path)} imports {name}")
    assert not violations, "\n".join(violations)


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {}
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    for name, path in modules.items():
        graph[name] = {m for m in runtime_imports(path) if m in modules and m != name}
    # a package's __init__ importing its own modules is how packages work, not a cycle
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
