"""The front door is only a door: nothing imports the command line, no experiment imports another, and the files of
the package import each other without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: installed name prefix -> repository folder (pyproject.toml's package-dir)
FOLDERS = {"probcaps.models": "models", "probcaps.inference": "inference", "probcaps.experiments": "experiments",
           "probcaps": "probcaps"}


def _file_of(module: str) -> str | None:
    """The repository file (relative path) of the absolute module name ``module``, or None outside the package."""
    for prefix, folder in FOLDERS.items():
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix):].lstrip(".").split(".") if module != prefix else []
            base = ROOT / folder / Path(*rest) if rest else ROOT / folder
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return str(candidate.relative_to(ROOT))
            return None
    return None


def _imported_files(path: Path) -> set[str]:
    """The package files ``path`` imports anywhere in it (``from a.b import c`` counts ``a/b/c.py`` when that is a
    module, else ``a/b.py``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names if _file_of(f"{node.module}.{a.name}")] or \
                [node.module]
        found |= {f for f in map(_file_of, names) if f}
    return found - {str(path.relative_to(ROOT))}


def _graph() -> dict[str, set[str]]:
    files = [p for folder in FOLDERS.values() for p in sorted((ROOT / folder).rglob("*.py"))]
    return {str(p.relative_to(ROOT)): _imported_files(p) for p in files}


def test_the_graph_sees_imports():
    # catches: a graph that finds no edges (and so no cycle) because module names do not map onto files
    graph = _graph()
    assert "probcaps/cli.py" in graph["probcaps/__main__.py"]
    assert "inference/train.py" in graph["inference/capsule_svi.py"]
    assert "experiments/common.py" in graph["experiments/mnist_probe.py"]


def test_only_main_imports_the_command_line():
    # catches: the front door used as a library (an experiment or building block importing probcaps.cli)
    importers = sorted(f for f, deps in _graph().items() if "probcaps/cli.py" in deps)
    assert importers == ["probcaps/__main__.py"], importers
    for folder in ("benchmarks",):
        for path in (ROOT / folder).rglob("*.py"):
            assert "probcaps/cli.py" not in _imported_files(path), path


def test_no_experiment_imports_another_experiment():
    # catches: experiments borrowing from each other instead of from the shared module
    experiments = {f for f in _graph() if f.startswith("experiments/") and "\ndef main(" in (ROOT / f).read_text()}
    bad = {f: sorted(deps & experiments) for f, deps in _graph().items() if f in experiments and deps & experiments}
    assert not bad, bad
    assert "experiments/common.py" not in experiments  # the shared module is no experiment


def test_no_import_cycle_between_files():
    # catches: two modules that import each other (directly or round a longer loop), which breaks as soon as one of
    # them is imported first
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            raise AssertionError(" -> ".join(cycle))
