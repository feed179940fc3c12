"""What surrounds the code stays something a reader can take in: every results file is shown or read somewhere, the
results, docs and checkpoints stay small, every table footer names a clean commit, and every path the README and
docs name is there; and ``probcaps report`` / ``--tables-only`` end in one line on a damaged file.

The results live in ``results/<experiment>/<name>.json`` (its table ``<name>.md``, its figures ``<name>_*.png``); a
try keeps one record, ``results/<experiment>/ablations/<try>.json``, shown as a row of ``ablations.md``.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# results/ holds the recipes' results, at most MAX_RESULTS_FILES files, and one small record per try under
# ablations/ (test_every_try_is_one_small_record), which a table of tries needs one of for each of its rows
MAX_RESULTS_FILES, MAX_DOC_LINES, MAX_CHECKPOINTS, MAX_CHECKPOINT_BYTES = 120, 400, 10, 20 * 2 ** 20
MAX_README_LINES = 250  # the README is for users; the research record is in docs/
_MARKER = re.compile(r"<!-- results:([\w./-]+) -->")
_TABLE_BLOCK = re.compile(r"<!-- results:([\w./-]+) -->\n(.*?)<!-- /results:\1 -->", re.S)


def _tracked(folder: str) -> list[Path]:
    """The files git tracks under ``folder`` (all of them, where this is not a git checkout)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", folder], cwd=ROOT, capture_output=True, text=True,
                                check=True, timeout=60).stdout.split("\0")
    except (OSError, subprocess.SubprocessError):
        return sorted(p for p in (ROOT / folder).rglob("*") if p.is_file())
    return sorted(ROOT / p for p in listed if p and (ROOT / p).is_file())


def _code_text() -> str:
    """The text of the code and tests that may read a results file by its path."""
    files = [ROOT / "Makefile", *(p for folder in ("experiments", "benchmarks", "tests", "probcaps", "inference",
                                                  "models") for p in (ROOT / folder).rglob("*.py"))]
    return "\n".join(p.read_text() for p in files if p.is_file() and p.name != Path(__file__).name)


def unreferenced(results_files: list[Path], documents: list[Path], code: str) -> list[str]:
    """The files of ``results_files`` that nothing refers to: a file is referenced where its path (from
    ``results/``) is in a document, a table or the code; a table ``<experiment>/<name>.md`` where a document has its
    marker, and then its results JSON beside it; a results JSON or a try's record where a referenced table names it
    (```<name>```)."""
    docs = "\n".join(p.read_text() for p in documents)
    markers = set(_MARKER.findall(docs))
    tables = {f"{p.parent.name}/{p.stem}": p for p in results_files if p.suffix == ".md" and p.parent.parent == RESULTS}
    shown = {name for name in tables if name in markers}
    shown_text = "\n".join(tables[name].read_text() for name in shown)
    text = "\n".join([docs, code, *(p.read_text() for p in tables.values())])
    missing = []
    for path in results_files:
        rel = path.relative_to(ROOT).as_posix()
        experiment, stem = path.relative_to(RESULTS).parts[0], path.stem
        named = f"`{stem}`" in shown_text if path.parent.name == "ablations" \
            else path.suffix == ".json" and (f"{experiment}/{stem}" in shown or f"`{stem}`" in shown_text)
        if not (rel in text or f"{experiment}/{stem}" in shown or named):
            missing.append(rel)
    return missing


def test_every_results_file_is_referenced():
    # catches: a result file nothing shows or reads (a try's figure, a stray per-seed copy) left in results/
    missing = unreferenced(_tracked("results"), DOCUMENTS, _code_text())
    assert not missing, f"{len(missing)} results files no page, table, code or test refers to: {missing}"


def test_the_reference_check_can_fail(tmp_path):
    # catches: the check above passing whatever results/ holds
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- results:mnist_probe/mnist_recipes -->\nx\n<!-- /results:mnist_probe/mnist_recipes -->\n")
    files = [RESULTS / "mnist_probe" / "mnist_recipes.md", RESULTS / "mnist_probe" / "mnist_training.png",
             RESULTS / "mnist_probe" / "mnist.json"]
    assert unreferenced(files, [doc], "") == ["results/mnist_probe/mnist_training.png"]
    assert unreferenced(files[1:2], [doc], "results/mnist_probe/mnist_training.png") == []


def test_results_stay_small():
    # catches: results/ growing back into a bench of tries
    files = _tracked("results")
    recipes = [p for p in files if p.parent.name != "ablations"]
    assert len(recipes) <= MAX_RESULTS_FILES, \
        f"{len(recipes)} files under results/ outside ablations/ (at most {MAX_RESULTS_FILES})"
    loose = [p.name for p in files if p.parent == RESULTS]
    assert not loose, f"results files outside results/<experiment>/: {loose}"


def test_every_try_is_one_small_record():
    # catches: a try kept as a full results file (per-seed copies, figures) instead of its one record
    from probcaps.report import load_try

    tries = sorted(RESULTS.glob("*/ablations/*"))
    assert tries, "no tries found under results/<experiment>/ablations/"
    for path in tries:
        assert path.suffix == ".json", f"{path.relative_to(ROOT)}: a try keeps one JSON record, nothing else"
        record = load_try(path)
        assert record["name"] == path.stem and "+dirty" not in record["commit"], path
        assert "per_seed" not in record["metrics"] and path.stat().st_size < 8000, path


def test_a_try_record_with_a_malformed_metric_is_named(tmp_path):
    # catches: a metric that is neither a number nor mean and std ending in a KeyError or TypeError in the table
    from probcaps.errors import DataError
    from probcaps.report import TRY_KEYS, load_try

    record = {key: {} for key in TRY_KEYS}
    for bad in ({"mean": 0.9}, "0.9", True, {"mean": 0.9, "std": None}):
        (tmp_path / "t.json").write_text(json.dumps({**record, "metrics": {"probe": bad}}))
        with pytest.raises(DataError, match=r"t\.json: metric 'probe'"):
            load_try(tmp_path / "t.json")
    (tmp_path / "t.json").write_text(json.dumps({**record, "metrics": {"probe": {"mean": 0.9, "std": 0.01}, "k": 3}}))
    assert load_try(tmp_path / "t.json")["metrics"]["k"] == 3
    for bad in ({"seed": 0}, [{"probe": 0.9}], [{"seed": "0", "probe": 0.9}], [{"seed": 0, "probe": "0.9"}]):
        (tmp_path / "t.json").write_text(json.dumps({**record, "metrics": {}, "per_seed": bad}))
        with pytest.raises(DataError, match=r"t\.json: (per_seed\[0\]|'per_seed')"):
            load_try(tmp_path / "t.json")


@pytest.mark.parametrize("doc", [p for p in DOCUMENTS if p.parent.name == "docs"], ids=lambda p: p.name)
def test_docs_page_is_short_enough_to_read(doc):
    # catches: a research page growing into a lab notebook
    lines = len(doc.read_text().splitlines())
    assert lines <= MAX_DOC_LINES, f"{doc.relative_to(ROOT)}: {lines} lines (at most {MAX_DOC_LINES})"


def test_the_readme_is_short_enough_for_a_user():
    # catches: the README growing into the research record that belongs in docs/
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md: {lines} lines (at most {MAX_README_LINES}; move detail to docs/)"


def test_no_table_footer_names_a_dirty_commit():
    # catches: a table that records a run on a tree with uncommitted changes as the commit "<sha>+dirty"
    blocks = [(p, body) for p in DOCUMENTS for _, body in _TABLE_BLOCK.findall(p.read_text())]
    blocks += [(p, p.read_text()) for p in RESULTS.glob("*/*.md")]
    dirty = sorted({str(p.relative_to(ROOT)) for p, body in blocks if "+dirty" in body})
    assert not dirty, f"tables naming a '+dirty' commit: {dirty}"


_PATH = re.compile(r"(?<![\w/.<-])((?:experiments/configs|checkpoints|results|docs)/[\w./-]*[\w/])")
_LINK = re.compile(r"\]\(((?:\.\./)?)((?:results|checkpoints|docs|experiments)/[^)#\s]+)\)")
_NAMED = re.compile(r"(--config|--checkpoint)((?:[ \t]+[^\s`'\"|;#()-][^\s`'\"|;#()]*)+)")


def named_paths(text: str) -> set[str]:
    """The repository paths ``text`` names: paths under ``experiments/configs/``, ``checkpoints/``, ``results/``
    and ``docs/``, and the configs and models named by bare name (``--config demo`` ->
    ``experiments/configs/demo.toml``, ``--checkpoint mnist`` -> ``checkpoints/mnist.pt``); templates
    (``<name>``, ``$VAR``, ``…``) and run folders are not files of the repository."""
    found = {m.rstrip("/.") for m in _PATH.findall(text)} | {path for _, path in _LINK.findall(text)}
    for option, words in _NAMED.findall(text):
        for word in words.split():
            if re.search(r"[<>$…*{]|^\.\.\.$", word) or word.startswith("runs/") or word.endswith(".pt") and \
                    not word.startswith("checkpoints/") or not re.fullmatch(r"[\w./-]+", word):
                continue
            if "/" not in word:
                word = f"experiments/configs/{word}.toml" if option == "--config" else f"checkpoints/{word}.pt"
            found.add(word)
    return found


def test_named_paths_are_read_as_meant():
    # catches: the path check reading nothing, or reading a template as a file
    text = ("`probcaps run mnist_probe --config demo --seeds 0` `probcaps evaluate --checkpoint mnist "
            "mnist_seed1 --name x`; results/mnist_probe/mnist.json, results/<experiment>/<name>.json, "
            "`--checkpoint runs/x/final.pt`, docs/README.md, ![a figure](../results/mnist_probe/mnist_training.png).")
    assert named_paths(text) == {"experiments/configs/demo.toml", "checkpoints/mnist.pt",
                                 "checkpoints/mnist_seed1.pt", "results/mnist_probe/mnist.json", "docs/README.md",
                                 "results/mnist_probe/mnist_training.png"}


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.name)
def test_every_path_named_in_readme_and_docs_exists(doc):
    # catches: a renamed or removed config, model, results file or page still named in the text or a table footer
    missing = sorted(p for p in named_paths(doc.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_checkpoints_stay_few_and_small():
    # catches: models of tries committed beside the shipped ones
    files = _tracked("checkpoints")
    size = sum(p.stat().st_size for p in files)
    assert len(files) <= MAX_CHECKPOINTS, f"{len(files)} checkpoints (at most {MAX_CHECKPOINTS})"
    assert size <= MAX_CHECKPOINT_BYTES, f"checkpoints/ holds {size / 2 ** 20:.1f} MiB (at most 20)"


# ------------------------------------------------------------------------------------------- damaged files


DAMAGED = {"truncated": b'{"metrics": {"a": 1', "binary": b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "a list": b"[1, 2]",
           "no provenance": b'{"metrics": {}}'}


@pytest.mark.parametrize("kind", DAMAGED)
def test_load_result_names_a_damaged_results_file(tmp_path, kind):
    # catches: a truncated, binary or non-object results JSON ending in a JSONDecodeError, UnicodeDecodeError or
    # TypeError traceback
    from probcaps.errors import DataError
    from probcaps.report import load_result

    (tmp_path / "x.json").write_bytes(DAMAGED[kind])
    with pytest.raises(DataError, match=r"x\.json: "):
        load_result(tmp_path, "x")


@pytest.mark.parametrize("kind", DAMAGED)
def test_tables_only_on_a_damaged_results_file_ends_in_one_line(tmp_path, capsys, kind):
    # catches: `--tables-only` dying with a traceback on a damaged results JSON instead of one line naming it
    from probcaps.experiments import affnist

    (tmp_path / "affnist.json").write_bytes(DAMAGED[kind])
    assert affnist.main(["--tables-only", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "affnist.json" in err and "Traceback" not in err, err


def test_a_damaged_try_record_ends_in_one_line(tmp_path, capsys):
    # catches: a broken record under ablations/ failing the whole table with a traceback
    from probcaps.experiments import affnist

    (tmp_path / "ablations").mkdir()
    (tmp_path / "ablations" / "broken.json").write_bytes(b"\x00\xff")
    assert affnist.main(["--tables-only", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "broken.json" in err, err


@pytest.mark.parametrize("damaged", ["readme", "table"])
def test_report_on_a_binary_readme_or_table_ends_in_one_line(tmp_path, capsys, damaged):
    # catches: `probcaps report` dying with a UnicodeDecodeError traceback, or writing anything, when the README or
    # a table file it splices is not text
    from probcaps.cli import main

    results, readme = tmp_path / "results", tmp_path / "README.md"
    (results / "exp").mkdir(parents=True)
    (results / "exp" / "t.md").write_bytes(b"\xff\xfe\x00binary" if damaged == "table" else b"| t |\n")
    text = b"<!-- results:exp/t -->\nold\n<!-- /results:exp/t -->\n"
    readme.write_bytes(b"\x89PNG\r\n\x1a\n\xff" + text if damaged == "readme" else text)
    before = readme.read_bytes()
    assert main(["report", "--results-dir", str(results), "--readme", str(readme)]) == 2
    err = capsys.readouterr().err.strip()
    named = readme.name if damaged == "readme" else "t.md"
    assert len(err.splitlines()) == 1 and named in err and "Traceback" not in err, err
    assert readme.read_bytes() == before


def test_report_splices_a_table_by_experiment_and_name(tmp_path):
    # catches: a marker `results:<experiment>/<name>` not found, or spliced from results/<name>.md instead of
    # results/<experiment>/<name>.md
    from probcaps.report import splice_tables

    results = tmp_path / "results"
    (results / "exp").mkdir(parents=True)
    (results / "exp" / "t.md").write_text("| new |\n")
    (results / "t.md").write_text("| wrong |\n")
    doc = tmp_path / "doc.md"
    doc.write_text("a\n<!-- results:exp/t -->\nold\n<!-- /results:exp/t -->\nb\n")
    assert splice_tables(results, [doc]) == {doc: ["exp/t"]}
    assert doc.read_text() == "a\n<!-- results:exp/t -->\n| new |\n<!-- /results:exp/t -->\nb\n"


def test_recorded_commands_are_shown_in_the_one_launch_form():
    # catches: a table footer showing `experiments/x.py` or `probcaps/__main__.py` instead of the documented forms
    from probcaps.report import command_text, provenance_line

    assert command_text("experiments/affnist.py --checkpoint checkpoints/mnist.pt --name a") == \
        "probcaps run affnist --checkpoint mnist --name a"
    assert command_text("probcaps/__main__.py evaluate --checkpoint checkpoints/mnist.pt checkpoints/mnist_seed1.pt "
                        "--config experiments/configs/mnist.toml --out runs/x") == \
        "probcaps evaluate --checkpoint mnist mnist_seed1 --config mnist --out runs/x"
    line = provenance_line({"device": "cpu", "command": "experiments/affnist.py", "git_commit": "abc1234",
                            "note": "the tree had uncommitted changes"})
    assert line == "device: cpu; command: `probcaps run affnist`; commit abc1234 (the tree had uncommitted changes)."
    assert "\n" not in line
