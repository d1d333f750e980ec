"""What a user installs: the sdist and the wheel, built as a release builds them and installed without the
checkout; the versions the metadata claims, against those CI tests."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import hypothesis
import pytest
import tensordict
import torch
from packaging.requirements import Requirement
from packaging.version import Version

import muonfn

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]

# building and installing take a few seconds each; a hung build must not hold CI for the global 600 s
pytestmark = pytest.mark.timeout(300)


def readme_first_snippet() -> str:
    """The README's first Python block, the 30-second example a reader copies first."""
    match = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.DOTALL)
    assert match, "README.md has no ```python block"
    return match.group(1)


def lower_bound(requirement: str) -> Version:
    """The version after ``>=`` in a requirement with exactly one lower bound (how pyproject.toml states floors)."""
    (spec,) = [s for s in Requirement(requirement).specifier if s.operator == ">="]
    return Version(spec.version)


def floor_pins() -> dict[str, Version]:
    """``.ci/floor.txt``'s pins by package name, the local label (``+cpu``) left out."""
    pins = {}
    for line in (ROOT / ".ci" / "floor.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip()] = Version(Version(version.strip()).public)
    return pins


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The sdist, and the wheel built from that sdist (``python -m build``'s default), so the sdist must be
    complete. Without isolation: the backend comes from the dev extra, and nothing is downloaded."""
    out = tmp_path_factory.mktemp("dist")
    build = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)]
    subprocess.run(build, check=True, capture_output=True, cwd=out)
    (sdist,) = out.glob("muonfn-*.tar.gz")
    (wheel,) = out.glob("muonfn-*.whl")
    return sdist, wheel


def wheel_member(wheel: Path, suffix: str) -> str:
    """The text of the one file in ``wheel`` whose name ends with ``suffix``."""
    with zipfile.ZipFile(wheel) as archive:
        matches = [n for n in archive.namelist() if n.endswith(suffix)]
        assert len(matches) == 1, f"{wheel.name}: {len(matches)} files end with {suffix!r}"
        return archive.read(matches[0]).decode()


def test_twine_check_passes_on_the_sdist_and_the_wheel(dists: tuple[Path, Path]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, dists)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_wheel_carries_the_license_the_typing_marker_and_the_declared_requirements(
    dists: tuple[Path, Path],
) -> None:
    wheel = dists[1]
    assert wheel_member(wheel, "muonfn/py.typed") == ""
    metadata = wheel_member(wheel, ".dist-info/METADATA").splitlines()
    assert "License-Expression: BSD-3-Clause" in metadata
    # the license shipped is the checkout's, and it is the BSD-3-Clause text the metadata declares
    license_text = wheel_member(wheel, ".dist-info/licenses/LICENSE")
    assert license_text == (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert license_text.startswith("BSD 3-Clause License")
    assert "3. Neither the name of the copyright holder nor the names of its" in license_text
    assert f"Requires-Python: {PROJECT['requires-python']}" in metadata
    prefix = "Requires-Dist: "
    declared = [Requirement(line.removeprefix(prefix)) for line in metadata if line.startswith(prefix)]
    assert {str(r) for r in declared if r.marker is None} == {str(Requirement(d)) for d in PROJECT["dependencies"]}
    # muonfn.testing needs hypothesis, which the `testing` extra brings
    testing = [r for r in declared if r.name == "hypothesis" and r.marker and r.marker.evaluate({"extra": "testing"})]
    assert testing, "the wheel's testing extra does not require hypothesis"


def test_the_sdist_carries_what_a_rebuild_and_its_readers_need(dists: tuple[Path, Path]) -> None:
    listing = subprocess.run(["tar", "tzf", str(dists[0])], check=True, capture_output=True, text=True).stdout
    top = dists[0].name.removesuffix(".tar.gz")
    for path in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "muonfn/py.typed", "muonfn/__init__.py"):
        assert f"{top}/{path}" in listing.splitlines(), path


def test_the_installed_wheel_works_without_the_checkout(dists: tuple[Path, Path], tmp_path: Path) -> None:
    """The wheel in a new venv that sees torch, tensordict and hypothesis but not the checkout: every public
    module imports, ``__version__`` is the metadata's, and the README's first snippet runs."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    site_packages = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # the dependencies from this interpreter instead of a download: their folders are added after the venv's
    # own site-packages, as plain paths (no .pth inside them runs, so no editable install of the checkout does)
    dependencies = {str(Path(module.__file__).parents[1]) for module in (torch, tensordict, hypothesis)}
    (site_packages / "dependencies.pth").write_text("\n".join(sorted(dependencies)) + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q"]
    subprocess.run([*install, str(dists[1])], check=True, capture_output=True)

    script = tmp_path / "use_muonfn.py"
    script.write_text(
        "import importlib.metadata, json, sys\n"
        "import muonfn, muonfn.optim, muonfn.distributed, muonfn.testing\n"
        f"exec(compile({readme_first_snippet()!r}, 'README.md', 'exec'), {{}})\n"
        "print(json.dumps({'file': muonfn.__file__, 'version': muonfn.__version__,"
        " 'metadata': importlib.metadata.version('muonfn'), 'path': sys.path}))\n"
    )
    # -I: neither PYTHONPATH, nor the user's site-packages, nor the script's or current folder on sys.path
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    result = subprocess.run([python, "-I", str(script)], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert Path(seen["file"]).is_relative_to(site_packages), seen["file"]
    assert not any(Path(p).resolve() == ROOT for p in seen["path"] if p), seen["path"]
    assert seen["version"] == seen["metadata"] == muonfn.__version__


def test_version_is_the_installed_metadata() -> None:
    assert muonfn.__version__ == importlib.metadata.version("muonfn")


def test_ci_tests_the_floor_pyproject_claims() -> None:
    """``make test-floor`` installs ``.ci/floor.txt``'s pins with ``FLOOR_PYTHON``: they must be the floors
    pyproject.toml states, so that what is claimed is what is tested."""
    floors = {Requirement(d).name: lower_bound(d) for d in PROJECT["dependencies"]}
    assert floor_pins() == floors
    python_floor = lower_bound(f"python{PROJECT['requires-python']}")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(rf"^FLOOR_PYTHON := python{python_floor}$", makefile, re.MULTILINE), python_floor
    assert f'target-version = "py{python_floor.major}{python_floor.minor}"' in (ROOT / "pyproject.toml").read_text()
    classifier = f"Programming Language :: Python :: {python_floor}"
    assert classifier in PROJECT["classifiers"]


def test_the_docs_state_the_floors_pyproject_claims() -> None:
    floors = {Requirement(d).name: lower_bound(d) for d in PROJECT["dependencies"]}
    python_floor = lower_bound(f"python{PROJECT['requires-python']}")
    stated = f"Python ≥ {python_floor}, PyTorch ≥ {floors['torch']} and TensorDict ≥ {floors['tensordict']}"
    for page in ("README.md", "docs/getting-started.md"):
        assert stated in (ROOT / page).read_text(encoding="utf-8"), page
