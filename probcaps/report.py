"""The result tables of the README and the docs (``probcaps report``).

Every experiment writes its table as ``results/<name>.md`` beside ``results/<name>.json`` (:func:`write_table`);
``probcaps report`` only splices them into ``README.md`` and ``docs/*.md`` (:func:`splice_tables`), so numbers are
never typed in by hand.  Nothing here imports the models, the inference code or the experiments.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from probcaps.errors import DataError
from probcaps.io import atomic_write
from probcaps.provenance import provenance, repo_relative, write_results

__all__ = ["MARKER", "write_table", "splice_file", "splice_tables", "update_readme", "documents", "fmt_mean_std",
           "load_result", "provenance_line", "results_in", "results_table", "write_report"]

#: one table block: ``<!-- results:NAME -->``, the table, ``<!-- /results:NAME -->``
MARKER = re.compile(r"(<!-- results:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)", re.S)
_OPENING = re.compile(r"<!-- results:([\w.-]+) -->")


def write_table(results_dir: str | Path, name: str, text: str | None) -> Path | None:
    """Atomically write ``text`` (a markdown table and its notes) to ``results_dir/<name>.md``, the block that
    ``probcaps report`` splices into the README and docs; None (no results yet) writes nothing.  Absolute paths
    under the repository are written relative to it, so the text reads the same on every machine."""
    if text is None:
        return None
    body = repo_relative(text).rstrip("\n") + "\n"
    return atomic_write(Path(results_dir) / f"{name}.md", lambda f: f.write(body), mode="w")


def _table_files(path: Path, text: str, results_dir: Path) -> dict[str, Path]:
    """``{marker name: its table file}`` of the markdown ``text`` of ``path``; a :class:`DataError` naming the file
    and the marker when a marker has no closing marker or no table file."""
    closed, files = {m.group("name") for m in MARKER.finditer(text)}, {}
    for name in _OPENING.findall(text):
        if name not in closed:
            raise DataError(f"{path}: marker 'results:{name}' has no closing '<!-- /results:{name} -->'")
        files[name] = results_dir / f"{name}.md"
        if not files[name].is_file():
            raise DataError(f"{path}: marker 'results:{name}' has no table file {files[name]} (the experiment that "
                            f"writes {results_dir / name}.json writes it)")
    return files


def splice_file(path: str | Path, results_dir: str | Path = "results") -> list[str]:
    """Replace the inside of every results marker of the markdown file ``path`` with ``results_dir/NAME.md``,
    rewriting the file only when a table changed; returns the marker names in order.  A :class:`DataError` naming
    the file and the marker when a marker has no closing marker or no table file (and then nothing is written)."""
    path = Path(path)
    text = path.read_text()
    files = _table_files(path, text, Path(results_dir))
    spliced = MARKER.sub(lambda m: m.group(1) + files[m.group("name")].read_text().rstrip("\n") + "\n" + m.group(4),
                         text)
    if spliced != text:
        atomic_write(path, lambda f: f.write(spliced), mode="w")
    return [m.group("name") for m in MARKER.finditer(text)]


def documents(readme: str | Path = "README.md") -> list[Path]:
    """``readme`` and every ``docs/*.md`` beside it, sorted: the files whose tables ``probcaps report`` splices."""
    readme = Path(readme)
    return [readme, *sorted((readme.parent / "docs").glob("*.md"))]


def splice_tables(results_dir: str | Path = "results", files: list[str | Path] | None = None) -> dict[Path, list[str]]:
    """:func:`splice_file` on each of ``files`` (default: :func:`documents` of ``README.md``); returns
    ``{file: marker names}``.  Every file is checked before any is written, so a missing table changes nothing."""
    files = [Path(f) for f in (documents() if files is None else files)]
    for path in files:
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        _table_files(path, path.read_text(), Path(results_dir))
    return {path: splice_file(path, results_dir) for path in files}


def update_readme(results_dir: str | Path = "results", readme: str | Path = "README.md") -> list[str]:
    """Splice the tables of ``readme`` and of ``docs/*.md`` beside it; returns the marker names spliced."""
    return [name for names in splice_tables(results_dir, documents(readme)).values() for name in names]


# --------------------------------------------------------------------------- helpers of the table functions


def load_result(results_dir: str | Path, name: str) -> tuple[dict, dict] | None:
    """``(metrics, provenance)`` of ``results_dir/<name>.json``, or None when it has not been written yet.

    Absolute paths under the repository recorded in the provenance come back relative to it."""
    path = Path(results_dir) / f"{name}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data["metrics"], repo_relative(data["provenance"])


def results_table(default_name: str):
    """Decorate ``table(metrics, provenance, **options) -> str | None`` (of one results JSON) into
    ``table(results_dir, name=default_name, **options) -> str | None``, the table of ``results_dir/<name>.json``:
    None while that is absent."""

    def decorate(table):
        @functools.wraps(table)
        def from_results(results_dir: str | Path, name: str = default_name, **options) -> str | None:
            loaded = load_result(results_dir, name)
            return None if loaded is None else table(*loaded, **options)
        return from_results
    return decorate


def results_in(results_dir: str | Path, folder: str) -> list[tuple[Path, dict]]:
    """``(path, parsed JSON)`` of every results file in ``results_dir/folder``, sorted by name."""
    return [(path, json.loads(path.read_text())) for path in sorted((Path(results_dir) / folder).glob("*.json"))]


def provenance_line(prov: dict) -> str:
    """The closing words of every results paragraph: device, command and commit of the run."""
    return repo_relative(f"device: {prov.get('device')}; command: `{prov.get('command')}`; "
                         f"commit {prov.get('git_commit')}.")


def fmt_mean_std(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    """``"mean ± std"`` (sample std) of ``values`` times ``scale``; the value alone for one value; ``"—"`` where a
    value is undefined (NaN)."""
    import numpy as np

    a = np.asarray(values, dtype=float) * scale
    if np.isnan(a).any():
        return "—"
    return f"{a[0]:.{digits}f}" if len(a) == 1 else f"{a.mean():.{digits}f} ± {a.std(ddof=1):.{digits}f}"


def write_report(results_dir, name: str, metrics: dict, write_tables, **prov) -> Path:
    """Write ``results_dir/<name>.json`` (``metrics`` and the :func:`~probcaps.provenance.provenance` of this run,
    with ``prov``) and its tables, ``write_tables(results_dir)``; returns the JSON's path."""
    path = write_results(Path(results_dir) / f"{name}.json", metrics, provenance(**prov))
    write_tables(Path(results_dir))
    print(f"wrote {path}")
    return path
