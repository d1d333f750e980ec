"""The dependency rule, read from the imports: transforms ← steps ← presets ← optim, steps → linalg → _devices,
distributed, qk_clip and testing → linalg, reference → nothing; and docs/architecture.md, its map, held to it:
every module in its tree, its layer table these rules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "muonfn"

#: what each layer (a root module or a package) may import from muonfn (besides itself)
ALLOWED = {
    "_tree": set(),
    "_validation": set(),
    # a GPU's forms and the default Newton–Schulz dtype: what a device needs apart from the math
    "_devices": {"_tree"},
    "_checkpoint": {"_tree"},
    "linalg": {"_devices"},
    # the contract and its combinators know no math
    "transforms": {"_tree", "_validation"},
    "steps": {"transforms", "linalg", "_devices", "_tree", "_validation"},
    # a sharded orthogonalizer is a value handed in (orthogonalizer=): presets need not import distributed
    "presets": {"steps", "transforms", "linalg", "_tree", "_validation"},
    "qk_clip": {"linalg", "_tree"},
    "optim": {"presets", "steps", "transforms", "linalg", "_tree", "_validation"},
    "distributed": {"linalg", "_tree"},
    # hypothesis strategies and invariant checks for users' orthogonalizers (hypothesis is an optional extra),
    # and simulated collectives, a test double of distributed's interface
    "testing": {"linalg", "distributed"},
    # one step in plain PyTorch, the oracle the fast paths are tested against: it shares no code with them
    "reference": set(),
}
#: third-party packages a layer must not need
FORBIDDEN_EXTERNAL = {
    "_devices": {"torch.distributed"},
    "linalg": {"tensordict", "torch.distributed"},
    "distributed": {"tensordict"},
    "reference": {"tensordict", "torch.distributed"},
}
#: the layers that compute a step on one process: none may reach the distributed package
MATH = {"_devices", "linalg", "transforms", "steps", "presets", "qk_clip"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path) -> list[str]:
    """Absolute names of what ``path`` imports, leaving out ``if TYPE_CHECKING:`` blocks."""
    return imports(path)


def imports(path: Path, *, type_only: bool = False) -> list[str]:
    """Absolute names of what ``path`` imports outside ``if TYPE_CHECKING:`` blocks (inside with ``type_only``)."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    type_checked: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_checked |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    names = []
    for node in ast.walk(tree):
        if (id(node) in type_checked) != type_only:
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


def test_the_rules_keep_the_math_one_process_and_the_reference_alone() -> None:
    """The table itself may not be loosened where the design rests on it: the math never imports
    ``distributed`` (sharded parameters reach it as an orthogonalizer), linalg works on plain tensors,
    and the reference shares nothing with the code it checks."""
    assert all("distributed" not in ALLOWED[name] for name in MATH), {n: ALLOWED[n] for n in MATH}
    assert {"tensordict", "torch.distributed"} <= FORBIDDEN_EXTERNAL["linalg"]
    assert ALLOWED["reference"] == set()


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


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def fenced_block_after(heading: str, text: str) -> str:
    """The first ```text block of the section that ``heading`` opens."""
    section = text.split(f"\n{heading}\n", 1)[1]
    return section.split("```text\n", 1)[1].split("```", 1)[0]


def documented_tree() -> dict[str, str]:
    """Module name -> description, from the tree of docs/architecture.md: two spaces of indent per
    level, a folder's line standing for its ``__init__.py``."""
    text = ARCHITECTURE.read_text()
    assert "\n## The tree\n" in text, "docs/architecture.md has no '## The tree' section"
    block = fenced_block_after("## The tree", text)
    lines = [line for line in block.splitlines() if line.strip()]
    assert lines[0] == "muonfn/", f"the tree must start at muonfn/, not {lines[0]!r}"
    folders = ["muonfn"]
    listed: dict[str, str] = {}
    for line in lines[1:]:
        indent = len(line) - len(line.lstrip(" "))
        assert indent % 2 == 0 and 2 <= indent <= 2 * len(folders), f"misindented tree line: {line!r}"
        del folders[indent // 2 :]
        entry, _, description = line.strip().partition(" ")
        if entry.endswith("/"):
            folders.append(entry.removesuffix("/"))
            name = ".".join(folders)
        else:
            assert entry.endswith(".py"), f"tree line neither a folder nor a module: {line!r}"
            stem = entry.removesuffix(".py")
            name = ".".join(folders if stem == "__init__" else [*folders, stem])
        listed[name] = description.strip()
    return listed


def test_architecture_tree_lists_every_module() -> None:
    on_disk = {module_name(p) for p in PACKAGE.rglob("*.py")}
    listed = set(documented_tree())
    problems = [f"misses {sorted(on_disk - listed)}"] if on_disk - listed else []
    problems += [f"lists {sorted(listed - on_disk)}, which do not exist"] if listed - on_disk else []
    assert not problems, "docs/architecture.md's tree " + " and ".join(problems)


def test_architecture_tree_describes_every_module() -> None:
    undescribed = sorted(name for name, description in documented_tree().items() if not description)
    assert not undescribed, f"docs/architecture.md's tree gives no description for {undescribed}"


def documented_layer_rules() -> dict[str, tuple[set[str], set[str]]]:
    """Layer -> (may import, must not import), from the table of docs/architecture.md."""
    text = ARCHITECTURE.read_text()
    assert "<!-- layer-rules: start -->" in text, "docs/architecture.md has no layer-rules table"
    table = text.split("<!-- layer-rules: start -->")[1].split("<!-- layer-rules: end -->")[0]
    rules = {}
    for row in table.splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        may, must_not = (set(re.findall(r"`([\w.]+)`", cell)) for cell in cells[1:])
        rules[cells[0].strip("`")] = (may, must_not)
    return rules


def test_architecture_layer_table_is_the_rule_this_file_enforces() -> None:
    documented = documented_layer_rules()
    enforced = {name: (ALLOWED[name], FORBIDDEN_EXTERNAL.get(name, set())) for name in ALLOWED}
    differ = sorted(set(documented) ^ set(enforced)) + sorted(
        name for name in set(documented) & set(enforced) if documented[name] != enforced[name]
    )
    assert not differ, f"docs/architecture.md's layer table and ALLOWED / FORBIDDEN_EXTERNAL differ on {differ}"


def test_architecture_tree_folders_are_the_layers() -> None:
    """Every folder of the tree, and every top-level module but the package's own ``__init__``, has
    a layer rule, and every rule a folder or module in the tree."""
    layers = {layer(name) for name in documented_tree()} - {None}
    problems = [f"layers without a rule: {sorted(layers - set(ALLOWED))}"] if layers - set(ALLOWED) else []
    problems += [f"rules for layers not in the tree: {sorted(set(ALLOWED) - layers)}"] if set(ALLOWED) - layers else []
    assert not problems, "docs/architecture.md: " + "; ".join(problems)


OPTIM = PACKAGE / "optim"


def test_optim_has_no_type_only_back_imports() -> None:
    """The shim's modules take what they read (the layout, the groups) as arguments: none imports a
    sibling for its types only, as the state-dict, ``opt.state`` and migration modules once imported
    the optimizer to reach into it."""
    back = {
        p.name: names
        for p in sorted(OPTIM.glob("*.py"))
        if (names := [n for n in imports(p, type_only=True) if n.startswith("muonfn.optim")])
    }
    assert not back, f"type-only imports of the shim's own modules: {back}"


def test_only_the_package_imports_the_optimizer() -> None:
    importers = sorted(
        p.name
        for p in OPTIM.glob("*.py")
        if p.name != "__init__.py" and "muonfn.optim._optimizer" in imports(p) + imports(p, type_only=True)
    )
    assert not importers, f"{importers} import the optimizer: they should take the layout or the groups instead"


def test_optim_modules_touch_only_their_own_privates() -> None:
    """An underscore attribute is read only on ``self`` or ``cls`` (``opt._slots`` from another module
    couples it to the optimizer's insides; a sibling module is reached by its public names)."""
    reached = []
    for path in sorted(OPTIM.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            # torch's own underscore API (torch._foreach_*) is how fused multi-tensor ops are reached
            if (isinstance(root, ast.Name) and root.id == "torch") or ast.unparse(node.value) in ("self", "cls"):
                continue
            reached.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not reached, f"private attributes of other objects: {reached}"


def test_no_module_imports_another_packages_private_module() -> None:
    """A layer reaches another through its package (``muonfn.transforms``), never through a
    private module of it (``muonfn.transforms._adam``); the top-level helpers (``muonfn._tree``,
    ...) belong to every layer."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = module_name(path)
        own = here if path.name == "__init__.py" else here.rpartition(".")[0]
        for name in imports(path):
            parts = name.split(".")
            if parts[0] != "muonfn" or len(parts) < 3 or not parts[2].startswith("_"):
                continue
            if ".".join(parts[:2]) != own and not own.startswith(".".join(parts[:2]) + "."):
                found.append(f"{here} imports {name}")
    assert not found, found
