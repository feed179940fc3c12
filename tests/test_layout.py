"""The package's layers point one way, and installing it claims no name but ``probcaps``."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("probcaps", "models", "inference", "experiments")


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports (absolute names)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _layer_imports(folder: str) -> dict[str, set[str]]:
    """``{file: the layers among models/inference/experiments it imports}`` for every module of ``folder``."""
    out = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        hits = {name.split(".")[1] for name in _imports(path)
                if name.startswith("probcaps.") and name.split(".")[1] in LAYERS[1:]}
        hits |= {name.split(".")[0] for name in _imports(path) if name.split(".")[0] in LAYERS[1:]}
        out[str(path.relative_to(ROOT))] = hits
    return out


def test_building_blocks_import_no_model_inference_or_experiment():
    # catches: an import cycle between the building blocks and the folders above them (the CLI and the package's
    # lazy public facade, probcaps/__init__.py, are the front doors)
    bad = {f: h for f, h in _layer_imports("probcaps").items()
           if h and f not in ("probcaps/cli.py", "probcaps/__init__.py")}
    assert not bad, bad


def test_models_do_not_import_inference_and_nothing_imports_experiments():
    bad = {f: h for f, h in _layer_imports("models").items() if h - {"models"}}
    assert not bad, bad
    bad = {f: h for folder in ("models", "inference") for f, h in _layer_imports(folder).items()
           if "experiments" in h}
    assert not bad, bad


def test_no_generic_top_level_import_names_and_no_sys_path_edits():
    # catches: `import models` (works only from the repository root, and claims a generic name when installed)
    # and sys.path edits
    for folder in (*LAYERS, "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            top = {name.split(".")[0] for name in _imports(path)}
            assert not top & set(LAYERS[1:]), f"{path}: imports {top & set(LAYERS[1:])} (use probcaps.<layer>)"
            calls = {f"{n.func.value.attr}.{n.func.attr}" for n in ast.walk(ast.parse(path.read_text()))
                     if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                     and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "path"}
            assert not calls & {"path.insert", "path.append"}, f"{path}: edits sys.path"


def test_installing_puts_only_probcaps_into_site_packages():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = cfg["tool"]["setuptools"]
    assert all(p == "probcaps" or p.startswith("probcaps.") for p in setuptools["packages"]), setuptools["packages"]
    assert setuptools["package-dir"] == {f"probcaps.{layer}": layer for layer in LAYERS[1:]}
    listed = set(setuptools["packages"])
    for layer in LAYERS:  # every package folder of the repository is installed
        for init in (ROOT / layer).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).parts
            name = ".".join(rel) if layer == "probcaps" else ".".join(("probcaps", *rel))
            assert name in listed, f"{init.parent} is not installed (add {name} to [tool.setuptools] packages)"
    assert cfg["project"]["requires-python"] == ">=3.11"  # tomllib


def test_no_machine_paths_in_results_readme_or_docs():
    # catches: provenance or prose recording where a file lay on one machine instead of its path in the repository
    import re

    absolute = re.compile(r"(?<![\w.])/(?:work|tmp|root|home|Users|private|var)/")
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "results").rglob("*.json"),
             *(ROOT / "results").rglob("*.md")]
    bad = [str(p.relative_to(ROOT)) for p in files if absolute.search(p.read_text())]
    assert not bad, bad
