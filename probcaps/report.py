"""The result tables of the README and the docs (``probcaps report``).

Every experiment writes its tables as ``results/<experiment>/<name>.md`` beside ``results/<experiment>/<name>.json``
(:func:`write_table`); ``probcaps report`` only splices them into ``README.md`` and ``docs/*.md`` at the markers
``<!-- results:<experiment>/<name> -->`` (:func:`splice_tables`), so numbers are never typed in by hand.  A try that
changed a shipped recipe keeps one small record, ``results/<experiment>/ablations/<try>.json`` (:func:`load_try`),
and :func:`tries_table` lays them out one row each.  Nothing here imports the models, the inference code or the
experiments.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from probcaps.errors import DataError
from probcaps.io import atomic_write
from probcaps.provenance import provenance, repo_relative, write_results

__all__ = ["MARKER", "TRY_KEYS", "write_table", "splice_file", "splice_tables", "update_readme", "documents",
           "fmt_mean_std", "command_text", "load_result", "load_try", "provenance_line", "results_in", "results_table",
           "tries_table", "write_report", "write_tables_and_tries"]

#: a table's name: ``<experiment>/<name>`` (its file: ``results/<experiment>/<name>.md``), or a bare ``<name>``
_NAME = r"[\w.-]+(?:/[\w.-]+)*"
#: one table block: ``<!-- results:NAME -->``, the table, ``<!-- /results:NAME -->``
MARKER = re.compile(rf"(<!-- results:(?P<name>{_NAME}) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)", re.S)
_OPENING = re.compile(rf"<!-- results:({_NAME}) -->")
#: the keys of a try's record, ``results/<experiment>/ablations/<try>.json`` (and ``note`` where the run's tree had
#: uncommitted changes on top of ``commit``)
TRY_KEYS = ("name", "changed", "metrics", "seeds", "steps", "commit", "device", "command")


def _read_text(path: Path, what: str = "file") -> str:
    """The text of ``path``; a :class:`DataError` naming it when it is missing, unreadable or not UTF-8 text."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such {what}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not a text file (byte {e.start} is not UTF-8)") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None


def _read_json_object(path: Path) -> dict:
    """The JSON object in ``path``; a :class:`DataError` naming the file when it is truncated, binary or holds
    anything but an object."""
    text = _read_text(path, "results file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); write it again "
                        "with the experiment that made it") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: holds a JSON {type(data).__name__}, not an object")
    return data


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
    text = _read_text(path)
    files = _table_files(path, text, Path(results_dir))
    tables = {name: _read_text(file, "table file").rstrip("\n") for name, file in files.items()}
    spliced = MARKER.sub(lambda m: m.group(1) + tables[m.group("name")] + "\n" + m.group(4), text)
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
        for table in _table_files(path, _read_text(path), Path(results_dir)).values():
            _read_text(table, "table file")
    return {path: splice_file(path, results_dir) for path in files}


def update_readme(results_dir: str | Path = "results", readme: str | Path = "README.md") -> list[str]:
    """Splice the tables of ``readme`` and of ``docs/*.md`` beside it; returns the marker names spliced."""
    return [name for names in splice_tables(results_dir, documents(readme)).values() for name in names]


# --------------------------------------------------------------------------- helpers of the table functions


def load_result(results_dir: str | Path, name: str) -> tuple[dict, dict] | None:
    """``(metrics, provenance)`` of ``results_dir/<name>.json``, or None when it has not been written yet; a
    :class:`DataError` naming the file when it is truncated, binary, not a JSON object or lacks either part.

    Absolute paths under the repository recorded in the provenance come back relative to it."""
    path = Path(results_dir) / f"{name}.json"
    if not path.is_file():
        return None
    data = _read_json_object(path)
    for key in ("metrics", "provenance"):
        if not isinstance(data.get(key), dict):
            raise DataError(f"{path}: no '{key}' object (a results file holds 'metrics' and 'provenance')")
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
    """``(path, parsed JSON object)`` of every results file in ``results_dir/folder``, sorted by name; a
    :class:`DataError` naming the first that is not a readable JSON object."""
    return [(path, _read_json_object(path)) for path in sorted((Path(results_dir) / folder).glob("*.json"))]


def load_try(path: str | Path) -> dict:
    """The record of one try, ``results/<experiment>/ablations/<try>.json``: ``name``, ``changed`` (``{config key
    or argument: value}`` against the shipped recipe), ``metrics`` (``{key: value or {"mean", "std"}}`` over its
    seeds), ``seeds``, ``steps``, ``commit``, ``device``, ``command`` (and ``note``, and ``per_seed``: each seed's
    readouts, ``{"seed", "steps", ...: number}``); a :class:`DataError` naming the file and the first key missing
    or of the wrong type."""
    path = Path(path)
    data = _read_json_object(path)
    missing = [key for key in TRY_KEYS if key not in data]
    if missing:
        raise DataError(f"{path}: a try's record lacks {', '.join(repr(k) for k in missing)}")
    for key in ("changed", "metrics"):
        if not isinstance(data[key], dict):
            raise DataError(f"{path}: '{key}' is a {type(data[key]).__name__}, not an object")

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    for key, value in data["metrics"].items():
        if not (number(value) or isinstance(value, dict) and set(value) == {"mean", "std"}
                and all(map(number, value.values()))):
            raise DataError(f"{path}: metric '{key}' is neither a number nor {{\"mean\", \"std\"}} numbers")
    if not isinstance(data.get("per_seed", []), list):
        raise DataError(f"{path}: 'per_seed' is a {type(data['per_seed']).__name__}, not a list")
    for i, run in enumerate(data.get("per_seed", [])):
        if not (isinstance(run, dict) and isinstance(run.get("seed"), int) and all(map(number, run.values()))):
            raise DataError(f"{path}: per_seed[{i}] is not an object of numbers with an integer 'seed'")
    return data


#: the launch forms recorded in old provenance, and the one form the docs use: ``probcaps run <experiment>``
_LAUNCH = [(re.compile(r"^(?:python3? )?(?:-m )?experiments[./](\w+?)(?:\.py)?(?= |$)"), r"probcaps run \1"),
           (re.compile(r"^\S*(?:probcaps/__main__\.py|probcaps/cli\.py|bin/probcaps|-m probcaps)(?= |$)"), "probcaps")]


_CONFIG_PATH = re.compile(r"(--config) experiments/configs/([\w.-]+)\.toml(?= |$)")
_CHECKPOINT_PATHS = re.compile(r"(--checkpoint)((?: checkpoints/[\w.-]+\.pt(?= |$))+)")


def command_text(command) -> str:
    """A recorded command as the docs show it: in the one launch form (``probcaps run <experiment>``, ``probcaps
    <subcommand>``) whatever script or module path ran it, shipped configs and models by their bare names
    (``--config mnist``, ``--checkpoint mnist``), other paths relative to the repository."""
    text = repo_relative(str(command))
    for pattern, form in _LAUNCH:
        text = pattern.sub(form, text)
    text = _CONFIG_PATH.sub(r"\1 \2", text)
    return _CHECKPOINT_PATHS.sub(lambda m: m.group(1) + re.sub(r" checkpoints/([\w.-]+)\.pt", r" \1", m.group(2)),
                                 text)


def provenance_line(prov: dict) -> str:
    """The closing words of every results paragraph: device, command and commit of the run, and the run's
    ``note`` (uncommitted changes on top of that commit, files renamed since) where it has one."""
    note = f" ({prov['note']})" if prov.get("note") else ""
    return repo_relative(f"device: {prov.get('device')}; command: `{command_text(prov.get('command'))}`; "
                         f"commit {prov.get('git_commit')}{note}.")


def _try_cell(value, scale: float, digits: int) -> str:
    """A metric of a try's record as a cell: the value, or ``mean ± std`` over its seeds; "—" where absent."""
    if isinstance(value, dict):
        return f"{value['mean'] * scale:.{digits}f} ± {value['std'] * scale:.{digits}f}"
    return "—" if value is None else f"{value * scale:.{digits}f}"


_SHIPPED_PATH = re.compile(r"(?:checkpoints|experiments/configs)/([\w.-]+?)\.(?:pt|toml)")


def _change_text(key: str, value) -> str:
    """``key = value`` of a try's change; an argument without its dashes, models and configs by their bare names
    (a try's own models and configs are not kept: its commit has them)."""
    argument, key = key.startswith("--"), key.removeprefix("--")
    if value is None:
        return f"{key} not given"
    if value is True and argument:  # a flag
        return key
    text = value if isinstance(value, str) else json.dumps(value)
    return f"{key} = " + _SHIPPED_PATH.sub(r"\1", text)


def tries_table(results_dir: str | Path, columns: list[tuple[str, str, float, int]], recipe: str,
                folder: str = "ablations") -> str | None:
    """One row per try of ``results_dir/<folder>/*.json`` (:func:`load_try`), sorted by name: the try, what it
    changed against ``recipe`` (the shipped recipe it is compared with), its seeds and steps, the metrics of
    ``columns`` (``(metric key, column head, scale, digits)``: mean ± std over the seeds) and its commit (marked
    ``*`` where the run's tree had uncommitted changes on top of it); None when there is no try."""
    tries = [load_try(path) for path in sorted((Path(results_dir) / folder).glob("*.json"))]
    if not tries:
        return None
    lines = ["| try | changed from " + recipe + " | seeds | steps | " + " | ".join(head for _, head, _, _ in columns)
             + " | commit |", "| --- |" + " --- |" * (len(columns) + 4)]
    for t in tries:
        change = "; ".join(_change_text(k, v) for k, v in sorted(t["changed"].items())) or "none"
        cells = " | ".join(_try_cell(t["metrics"].get(key), scale, digits) for key, _, scale, digits in columns)
        seeds = ", ".join(str(s) for s in t["seeds"]) if isinstance(t["seeds"], list) else str(t["seeds"])
        lines.append(f"| `{t['name']}` | {change.replace('|', '/')} | {seeds} | {t['steps']} | {cells} | "
                     f"{t['commit']}{'*' if t.get('note') else ''} |")
    where = Path(results_dir).name
    lines += ["", f"One row per try, each `results/{where}/{folder}/<try>.json` (its changes, numbers, seeds, the "
              "command it ran under and its device); mean ± std over its seeds; —: not measured in that try. A commit "
              "marked * is the one the run's tree stood on, with uncommitted changes on top. To run a try again, "
              "check out its commit and pass its changes as `--set` to the recipe."]
    return "\n".join(lines)


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


def write_tables_and_tries(results_dir: str | Path, name: str, table, columns: list[tuple[str, str, float, int]],
                           recipe: str, folder: str = "ablations") -> list[Path | None]:
    """Write ``results_dir/<name>.md`` (``table(results_dir, name)``) and, when ``results_dir/<folder>/`` holds
    tries, their :func:`tries_table` as ``results_dir/<folder>.md``; returns the files written (None: not written)."""
    return [write_table(results_dir, name, table(results_dir, name)),
            write_table(results_dir, folder, tries_table(results_dir, columns, recipe, folder))]
