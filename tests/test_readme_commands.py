"""Every command in README.md and docs/*.md still runs as written, and every file they point at is there.

The commands are the fenced ```bash blocks and the inline `python ...`, `probcaps ...` and `make ...` spans, outside
the results tables (those record the commands their results came from).  Each
``python``/``probcaps`` command is parsed by its own entry point's argument parser (in this process, stopping right
after the parse), so a renamed script, subcommand or option fails here; ``make`` targets are checked with
``make -n``.  Config files, checkpoints and results files named in the text must exist, and ``probcaps report`` must
find a table file for every results marker and change nothing (the tables are up to date).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```(?:bash|sh|shell|console)\s*\n(.*?)^```", re.S | re.M)
_ANY_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_INLINE = re.compile(r"`((?:python3?|probcaps|make|\.venv/bin/python|\.venv/bin/probcaps) [^`\n]*|probcaps|make)`")
_PLACEHOLDERS = {"...", "…"}
# the spliced tables record the commands their results came from (history, perhaps under older names): not read
_TABLE_BLOCK = re.compile(r"<!-- results:([\w./-]+) -->\n.*?<!-- /results:\1 -->", re.S)


def _prose(doc: Path) -> str:
    """The text of ``doc`` without its results tables."""
    return _TABLE_BLOCK.sub("", doc.read_text())


def _fenced_lines(text: str) -> list[str]:
    """The shell lines of the fenced blocks: continuation lines joined, comments and blank lines dropped."""
    lines = []
    for block in _FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def _split_commands(line: str) -> list[list[str]]:
    """``a && b; c | d`` -> ``[[a...], [b...], [c...], [d...]]`` (comments dropped, placeholders removed)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, current = [], []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    cleaned = []
    for words in commands:
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value command
            words = words[1:]
        # `--set …` and `...` stand for "more options": drop them with the option they fill
        keep = []
        for word in words:
            if word in _PLACEHOLDERS:
                if keep and keep[-1].startswith("--"):
                    keep.pop()
                continue
            keep.append(word)
        if keep:
            cleaned.append(keep)
    return cleaned


def documented_commands() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of every python/probcaps/make command in the README and the docs."""
    found = []
    for doc in DOCUMENTS:
        text = _prose(doc)
        lines = _fenced_lines(text)
        # inline spans, outside the fenced blocks
        lines += [m.group(1) for m in _INLINE.finditer(_ANY_FENCE.sub("", text))]
        for line in lines:
            for argv in _split_commands(line):
                program = Path(argv[0]).name
                if program in ("python", "python3", "probcaps", "make"):
                    found.append((f"{doc.relative_to(ROOT)}: {shlex.join(argv)}", argv))
    return list({where: (where, argv) for where, argv in found}.values())


COMMANDS = documented_commands()


_MACHINE_OR_FRAGMENT = ("the following arguments are required", "is not available on this machine")


class Parsed(Exception):
    """Raised in place of running an entry point once its arguments parsed."""


class ParseError(Exception):
    """An argument parser's error message."""


def _parse_only(self, args=None, namespace=None):
    namespace, extras = self.parse_known_args(args, namespace)
    if extras:
        self.error(f"unrecognized arguments: {' '.join(extras)}")
    raise Parsed(namespace)


def _raise_error(self, message):
    raise ParseError(f"{self.prog}: {message}")


def _script_main(path: Path):
    """``main`` of a script outside the package (``benchmarks/*.py``)."""
    spec = importlib.util.spec_from_file_location(f"_documented_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def entry_point(argv: list[str]):
    """``(main, args)`` for a documented ``python``/``probcaps`` command line."""
    program, args = Path(argv[0]).name, argv[1:]
    if program == "probcaps" or args[:2] == ["-m", "probcaps"]:
        args = args if program == "probcaps" else args[2:]
        if args[:1] == ["run"] and len(args) > 1:  # probcaps run <experiment> ...: the experiment's own parser
            return importlib.import_module(f"probcaps.experiments.{args[1]}").main, args[2:]
        from probcaps.cli import main

        return main, args
    if args[:1] == ["-m"]:
        module = args[1]
        if module.startswith("experiments."):  # python -m experiments.<name> from the repository root
            module = f"probcaps.{module}"
        return importlib.import_module(module).main, args[2:]
    script = ROOT / args[0]
    assert script.is_file(), f"{args[0]}: no such script"
    if script.parent.name == "experiments":
        return importlib.import_module(f"probcaps.experiments.{script.stem}").main, args[1:]
    return _script_main(script), args[1:]


@pytest.mark.parametrize("where, argv", [c for c in COMMANDS if Path(c[1][0]).name != "make"],
                         ids=[c[0] for c in COMMANDS if Path(c[1][0]).name != "make"])
def test_documented_command_parses(where, argv, monkeypatch):
    # catches: a renamed script, experiment, subcommand or option in a documented command
    if any(re.search(r"<\w+>", word) for word in argv[1:3]):
        pytest.skip("a template (`python -m experiments.<name>`), not a command")
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", _parse_only)
    monkeypatch.setattr(argparse.ArgumentParser, "error", _raise_error)
    main, args = entry_point(argv)
    try:
        main(args)
    except Parsed:
        pass
    except ParseError as e:
        # an inline fragment may leave out a required argument, and `--device cuda` needs a GPU; any other parse
        # error is a broken command
        assert any(ok in str(e) for ok in _MACHINE_OR_FRAGMENT), f"{where}: {e}"
    else:
        pytest.fail(f"{where}: the entry point ran without parsing its arguments")


def test_documented_make_targets_exist():
    # catches: a documented `make <target>` whose target was renamed or removed
    targets = sorted({word for _, argv in COMMANDS if Path(argv[0]).name == "make"
                      for word in argv[1:] if not word.startswith("-") and "=" not in word})
    proc = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"make -n {' '.join(targets)}: {proc.stderr.strip()}"


def _mentioned(pattern: str) -> list[tuple[str, str]]:
    return sorted({(str(doc.relative_to(ROOT)), m) for doc in DOCUMENTS for m in re.findall(pattern, _prose(doc))})


@pytest.mark.parametrize("doc, path", _mentioned(r"(?<![\w/.-])((?:experiments/)?configs/[\w./-]+\.toml)"))
def test_documented_config_exists(doc, path):
    # catches: a renamed or removed config still named in the text
    candidates = [ROOT / path, ROOT / "experiments" / path]
    assert any(p.is_file() for p in candidates), f"{doc}: {path} does not exist"


@pytest.mark.parametrize("doc, path", _mentioned(r"(?<![\w/.-])((?:results|checkpoints)/[\w./-]+\.(?:png|json|pt|md))"))
def test_documented_results_file_exists(doc, path):
    # catches: a figure, results file or checkpoint the text points at that was renamed or never committed
    assert (ROOT / path).is_file(), f"{doc}: {path} does not exist"


def test_every_results_marker_has_its_table_and_the_tables_are_spliced(tmp_path):
    # catches: a marker whose table file is missing, or README/docs tables that `probcaps report` would change
    from probcaps.report import MARKER, splice_tables

    copies = []
    for doc in DOCUMENTS:
        copy = tmp_path / doc.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(doc.read_text())
        copies.append(copy)
    splice_tables(ROOT / "results", copies)
    stale = [str(doc.relative_to(ROOT)) + ": " + ", ".join(
                 m.group("name") for m, n in zip(MARKER.finditer(doc.read_text()), MARKER.finditer(copy.read_text()))
                 if m.group("body") != n.group("body"))
             for doc, copy in zip(DOCUMENTS, copies) if doc.read_text() != copy.read_text()]
    assert not stale, f"tables out of date (run `probcaps report`): {stale}"


def test_commands_are_found():
    # catches: the extraction silently finding nothing (every test above would pass vacuously)
    programs = {Path(argv[0]).name for _, argv in COMMANDS}
    assert {"probcaps", "make"} <= programs and len(COMMANDS) >= 10
    assert _split_commands("A=1 python -m x --set … && make -n demo  # note") == [["python", "-m", "x"],
                                                                                   ["make", "-n", "demo"]]


# ------------------------------------------------------------------------------------------- the splicing itself


def test_splice_replaces_only_inside_markers_and_names_a_missing_table(tmp_path):
    # catches: text outside the markers rewritten, a table spliced into the wrong marker, a missing table file
    # passing silently or a half-written set of documents
    from probcaps.errors import DataError
    from probcaps.report import splice_tables, update_readme, write_table

    results = tmp_path / "results"
    (tmp_path / "docs").mkdir()
    readme, doc = tmp_path / "README.md", tmp_path / "docs" / "b.md"
    readme.write_text("head\n<!-- results:a -->\nold a\n<!-- /results:a -->\nmiddle\n<!-- results:b -->\n"
                      "<!-- /results:b -->\ntail\n")
    doc.write_text("<!-- results:b -->\nold b\n<!-- /results:b -->\n")
    write_table(results, "a", "| a |")
    with pytest.raises(DataError, match=r"README.md: marker 'results:b' has no table file .*b\.md"):
        update_readme(results, readme)
    assert "old a" in readme.read_text()  # nothing written before every table was found
    write_table(results, "b", "| b |\n\nnote\n")
    assert update_readme(results, readme) == ["a", "b", "b"]
    assert readme.read_text() == ("head\n<!-- results:a -->\n| a |\n<!-- /results:a -->\nmiddle\n<!-- results:b -->\n"
                                  "| b |\n\nnote\n<!-- /results:b -->\ntail\n")
    assert doc.read_text() == "<!-- results:b -->\n| b |\n\nnote\n<!-- /results:b -->\n"
    stamp = doc.stat().st_mtime_ns
    splice_tables(results, [doc])  # up to date: not rewritten
    assert doc.stat().st_mtime_ns == stamp
    doc.write_text("<!-- results:b -->\nno end\n")
    with pytest.raises(DataError, match="no closing"):
        splice_tables(results, [doc])


def test_recorded_paths_are_relative_to_the_repository(tmp_path, monkeypatch):
    # catches: an absolute machine path (a checkout, a script under -m) in a results file or a table
    from probcaps.provenance import REPO_ROOT, command_line, provenance, repo_relative, write_results
    from probcaps.report import write_table

    here = str(REPO_ROOT)
    assert repo_relative(f"{here}/checkpoints/mnist.pt") == "checkpoints/mnist.pt"
    assert repo_relative({"a": [f"x {here}/results/a.png", 3], "b": None}) == {"a": ["x results/a.png", 3], "b": None}
    assert repo_relative("/elsewhere/checkpoints/mnist.pt") == "/elsewhere/checkpoints/mnist.pt"
    assert command_line([f"{here}/probcaps/__main__.py", "train", "--out", f"{here}/runs/x", "--set", "a=b c"]) == \
        "probcaps train --out runs/x --set 'a=b c'"
    assert command_line([f"{here}/experiments/affnist.py", "--limit", "3"]) == "experiments/affnist.py --limit 3"
    # under `probcaps run X` the experiment's parser is named "probcaps run X" and its arguments begin "run X"
    assert command_line(["probcaps run affnist", "run", "affnist", "--limit", "3"]) == "probcaps run affnist --limit 3"
    monkeypatch.setattr(sys, "argv", [f"{here}/experiments/affnist.py", "--checkpoint", f"{here}/checkpoints/m.pt"])
    prov = provenance(checkpoint=f"{here}/checkpoints/m.pt")
    assert prov["command"] == "experiments/affnist.py --checkpoint checkpoints/m.pt"
    assert prov["checkpoint"] == "checkpoints/m.pt"
    path = write_results(tmp_path / "r.json", {"figure": f"{here}/results/r.png"}, {"checkpoint": f"{here}/c.pt"})
    assert here not in path.read_text() and "results/r.png" in path.read_text()
    table = write_table(tmp_path, "r", f"command: `{here}/experiments/affnist.py`")
    assert table.read_text() == "command: `experiments/affnist.py`\n"


# ------------------------------------------------------------------------------------------- the table files

def _mnist_probe_runs() -> list[str]:
    """The names of the multi-seed runs of experiments/mnist_probe.py in results/mnist_probe/: each aggregate JSON
    records the command that wrote it and its seeds' metrics (``per_seed``); the readouts are tables of their own."""
    from probcaps.report import command_text  # the launch form, whether run as a script or `probcaps run`

    names = []
    for path in sorted((ROOT / "results" / "mnist_probe").glob("*.json")):
        record = json.loads(path.read_text())
        prov, metrics = record.get("provenance") or {}, record.get("metrics") or {}
        if command_text(prov.get("command")).startswith("probcaps run mnist_probe") and "per_seed" in metrics:
            names.append(path.stem)
    return names


#: how each committed table file is rebuilt from the committed results: (entry point, its results folder under
#: results/, its arguments, the tables it writes there)
TABLE_SOURCES = [
    ("experiments.heldout_likelihood", "heldout_likelihood", [], ["likelihood_normal_guide", "inferences"]),
    ("experiments.rotated_recognition", "rotated_recognition", [], ["rotated_recognition"]),
    *[("experiments.mnist_probe", "mnist_probe", ["--name", n],
       [n, "ablations", "mnist_layers_by_recipe", "mnist_nonlinear_by_recipe", "mnist_recipes", "mnist_clustering"])
      for n in _mnist_probe_runs()],
    *[("experiments.affnist", "affnist", ["--name", n], [n, "ablations"]) for n in ("affnist", "affnist_fast",
                                                                                       "affnist_objects")],
    *[("experiments.rotated_digits", "rotated_digits", ["--name", n], [n]) for n in ("rotated_digits",
                                                                                  "rotated_digits_fast")],
    *[("experiments.ttvi_classification", "ttvi_classification", ["--name", n], [n, "ablations"])
      for n in ("ttvi_classification", "ttvi_classification_fast", "ttvi_classification_fair",
                "ttvi_classification_fair_objects")],
    ("experiments.normal_guide", "normal_guide", [], ["normal_guide"]),
    *[("experiments.rotated_training", "rotated_training", ["--name", n], [n, "ablations"])
      for n in ("rotated_training", "rotated_training_headline", "rotated_training_regions",
                "rotated_training_objects_one_on")],
    ("experiments.rotated_mnist_cnn_vs_capsnet", "rotated_mnist_cnn_vs_capsnet", [], ["rotated_mnist_cnn_vs_capsnet"]),
    ("experiments.rotated_mnist_cnn_vs_capsnet", "rotated_mnist_cnn_vs_capsnet",
     ["--config", "experiments/configs/rotated_mnist_full_capsnet.toml"], ["rotated_mnist_full_capsnet"]),
    ("experiments.multimnist", "multimnist", [], ["multimnist", "multimnist_bench", "ablations"]),
    ("experiments.transforming_autoencoder", "transforming_autoencoder", [], ["transforming_autoencoder",
                                                                               "ablations"]),
    *[("experiments.norb_viewpoints", "norb_viewpoints", ["--name", n], [n, "ablations"])
      for n in ("norb_azimuth", "norb_elevation", "norb_all_views")],
]


def test_committed_tables_are_what_their_results_give(tmp_path, monkeypatch):
    # catches: a table function changed without its table file rebuilt, a table file edited by hand, or a table
    # file nothing rebuilds
    monkeypatch.setenv("PROBCAPS_NO_REEXEC", "1")
    results = ROOT / "results"
    for folder in (p for p in results.iterdir() if p.is_dir()):
        # the results, read-only: links in a scratch folder the tables are written to
        (tmp_path / folder.name).mkdir()
        for path in folder.iterdir():
            if path.suffix != ".md":
                (tmp_path / folder.name / path.name).symlink_to(path)
    rebuilt = set()
    for module, folder, args, tables in TABLE_SOURCES:
        main = importlib.import_module(f"probcaps.{module}").main
        assert main(["--tables-only", "--results-dir", str(tmp_path / folder), *args]) == 0, (module, args)
        rebuilt.update(f"{folder}/{t}" for t in tables)
    from probcaps.experiments.common import throughput_table
    from probcaps.report import write_table

    write_table(tmp_path / "ttvi_classification", "ttvi_throughput",
                throughput_table(tmp_path / "ttvi_classification", "ttvi_throughput"))
    benchmarks = ("bench_step", "bench_render", "bench_vs_torch_scae", "bench_gpu")
    for bench in benchmarks:
        write_table(tmp_path / "speed", bench, inspect.unwrap(_script_main(ROOT / "benchmarks" / f"{bench}.py"))
                    .__globals__["readme_table"](tmp_path / "speed", bench))
    rebuilt |= {"ttvi_classification/ttvi_throughput", *(f"speed/{b}" for b in benchmarks)}
    # `probcaps evaluate --name <name>` writes the readout table of a checkpoint, or of several seeds' checkpoints
    from probcaps.inference.evaluate import readout_table

    for path in sorted(results.glob("*/*.md")):
        name, source = f"{path.parent.name}/{path.stem}", path.with_suffix(".json")
        if name not in rebuilt and source.is_file() and {"object_class_purity", "per_seed"} & set(json.loads(
                source.read_text())["metrics"]):
            write_table(tmp_path / path.parent.name, path.stem, readout_table(tmp_path / path.parent.name, path.stem))
            rebuilt.add(name)
    from probcaps.registry import cards_table, model_cards

    write_table(tmp_path / "models", "cards", cards_table(model_cards()))  # the shipped models' cards
    rebuilt.add("models/cards")
    committed = {f"{p.parent.name}/{p.stem}" for p in results.glob("*/*.md")}
    assert committed <= rebuilt, f"no rule rebuilds {sorted(committed - rebuilt)} (add it to TABLE_SOURCES)"
    differ = [name for name in sorted(committed) if (tmp_path / f"{name}.md").read_text()
              != (results / f"{name}.md").read_text()]
    assert not differ, f"results/<experiment>/<name>.md differs from what its results give (rebuild with " \
        f"--tables-only): {differ}"
