"""Names for what ships: the recipes (``--config mnist``), the experiments, and the trained models
(``--checkpoint mnist``) with their model cards.

A bare name (no folder, no suffix) of a recipe is the packaged ``experiments/configs/<name>.toml``; a bare name of a
model is a shipped model, read from the repository's ``checkpoints/`` in a clone, else from the user cache
(``$XDG_CACHE_HOME/probcaps/checkpoints``, default ``~/.cache/probcaps/checkpoints``), and its sha256 is checked
against the model card before it is used.  Anything else is a path.  The model cards (``probcaps/model_cards.json``,
package data) are written by ``probcaps report`` from each model's checkpoint and results files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path

from probcaps.errors import CheckpointError, ConfigError

__all__ = ["CONFIGS_DIR", "CARDS_FILE", "is_bare_name", "recipes", "resolve_config", "model_cards",
           "shipped_model_dir", "resolve_checkpoint", "sha256_file", "experiments", "first_sentence",
           "write_model_cards", "describe_checkpoint", "CARD_READOUTS",
           "cards_table"]

_PACKAGE = Path(__file__).resolve().parent
#: a clone (or an editable install) keeps models/, inference/ and experiments/ beside probcaps/; an installed package
#: has them inside it (probcaps.experiments, ...)
_IN_CLONE = (_PACKAGE.parent / "pyproject.toml").is_file() and (_PACKAGE.parent / "experiments").is_dir()
_EXPERIMENTS_DIR = _PACKAGE.parent / "experiments" if _IN_CLONE else _PACKAGE / "experiments"
#: the packaged recipes (``experiments/configs`` in the repository, ``probcaps/experiments/configs`` when installed)
CONFIGS_DIR = _EXPERIMENTS_DIR / "configs"
#: the shipped models' cards: file name, sha256, recipe, data, steps, device, wall time, readouts
CARDS_FILE = _PACKAGE / "model_cards.json"
_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")


def is_bare_name(text: str | os.PathLike) -> bool:
    """Whether ``text`` names a shipped thing rather than a file: a name without a folder or a suffix."""
    text = os.fspath(text)
    return bool(_NAME.fullmatch(text)) and "." not in text


def first_sentence(text: str, width: int = 110) -> str:
    """The first sentence of ``text`` (up to a full stop before a capital), cut to ``width`` characters: a line of
    a listing."""
    sentence = re.split(r"\.\s+(?=[A-Z`])", " ".join(text.split()))[0].rstrip(".")  # not at "et al. 2020"
    return sentence if len(sentence) <= width else sentence[:width - 1].rstrip() + "…"


def recipes() -> dict[str, str]:
    """``{name: the first sentence of its opening comment}`` of every packaged recipe, sorted."""
    found = {}
    for path in sorted(CONFIGS_DIR.glob("*.toml")):
        comment = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.startswith("#"):
                break
            if not line.lstrip("# ").startswith(("probcaps ", "python ")):  # a command line is no description
                comment.append(line.lstrip("# "))
        found[path.stem] = first_sentence(" ".join(comment))
    return found


def resolve_config(text: str | os.PathLike) -> Path:
    """The TOML file of ``text``: a packaged recipe by bare name (``mnist``), else the path itself.  A bare name that
    is no recipe is a one-line :class:`ConfigError` listing the recipes."""
    if not is_bare_name(text):
        return Path(text)
    path = CONFIGS_DIR / f"{text}.toml"
    if not path.is_file() and not Path(text).is_file():
        raise ConfigError(f"--config {text}: no such recipe (recipes: {', '.join(recipes())}; or give a path to a "
                          f"TOML file)")
    return path if path.is_file() else Path(text)


@functools.lru_cache(maxsize=1)
def model_cards() -> dict[str, dict]:
    """``{name: card}`` of the shipped models (empty when the package has no cards)."""
    if not CARDS_FILE.is_file():
        return {}
    try:
        cards = json.loads(CARDS_FILE.read_text(encoding="utf-8"))["models"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{CARDS_FILE}: not a model-card file ({e})") from None
    return dict(cards)


def shipped_model_dir() -> Path:
    """Where shipped models are read from: the repository's ``checkpoints/`` in a clone, else the user cache."""
    if _IN_CLONE and (_PACKAGE.parent / "checkpoints").is_dir():
        return _PACKAGE.parent / "checkpoints"
    from probcaps.data.mnist import user_cache_dir

    return user_cache_dir() / "checkpoints"


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of the file at ``path``, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def resolve_checkpoint(text: str | os.PathLike) -> Path:
    """The checkpoint file of ``text``: an existing file as it is; a bare name, the shipped model of that name (its
    sha256 checked against its card).  A one-line :class:`CheckpointError` for a name that ships no model, a missing
    file (saying where to put it), or a file whose sha256 is not its card's."""
    path = Path(text)
    if path.is_file() or not is_bare_name(text):
        return path  # a missing path is reported by the loader, which names it
    cards = model_cards()
    if text not in cards:
        raise CheckpointError(f"--checkpoint {text}: no such file, and no shipped model of that name (shipped: "
                              f"{', '.join(cards) or 'none'}; or give a path to a checkpoint)")
    card = cards[text]
    path = shipped_model_dir() / card["file"]
    if not path.is_file():
        raise CheckpointError(f"--checkpoint {text}: the shipped model is not on this machine; put {card['file']} "
                              f"(sha256 {card['sha256'][:12]}…, in the repository's checkpoints/) at {path}")
    if (digest := sha256_file(path)) != card["sha256"]:
        raise CheckpointError(f"{path}: sha256 {digest[:12]}… is not the shipped model's {card['sha256'][:12]}… "
                              f"(a damaged or replaced file)")
    return path


@functools.lru_cache(maxsize=None)
def experiments() -> dict[str, str]:
    """``{name: first line of its docstring}`` of the modules of ``probcaps.experiments`` that define
    ``main(argv)``, read from their source text (importing, or even parsing, every experiment takes seconds)."""
    found = {}
    for path in sorted(_EXPERIMENTS_DIR.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        if re.search(r"^def main\(", source, re.MULTILINE):
            docstring = re.match(r'\s*r?("""|\'\'\')(.*?)\1', source, re.S)
            found[path.stem] = first_sentence(docstring.group(2)) if docstring else ""
    return dict(sorted(found.items()))


#: what a model card reports of its model's results: (key in a results file, its name in the summary line, scale)
CARD_READOUTS = [("probe_presence_pose_test_acc", "probe on presences + poses", 100),
                 ("probe_presence_test_acc", "on presences", 100),
                 ("kmeans_posterior_counts_test_acc", "k-means", 100),
                 ("object_class_purity", "objects' class purity", 1),
                 ("mean_active_parents", "objects on per image", 1)]


def _model_results(path: Path, results_dir: Path, name: str, seed) -> tuple[Path, dict, dict] | None:
    """``(results file, this model's metrics, the recipe's metrics over its seeds)`` of the checkpoint ``path`` of
    the run ``name``: from the first of these that has it — ``<name>_readout.json`` (the model read out as SCAE reads
    its own), ``<name>.json``, then any results file whose provenance lists the checkpoint — the entry of its
    ``per_seed`` for this checkpoint (by the provenance's checkpoint list, else by training seed), or the file's
    metrics where it holds one model's; None where no results file has it."""
    here = f"checkpoints/{path.name}"
    files = sorted(results_dir.rglob("*.json"), key=lambda f: (f.name != f"{name}_readout.json",
                                                               f.name != f"{name}.json", f.name))
    for file in files:
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
            metrics, prov = data["metrics"], data["provenance"]
            listed = prov.get("checkpoints") or []
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        named = file.stem in (name, f"{name}_readout")
        if not (named or here in listed):
            continue
        if "per_seed" not in metrics:
            if named:
                return file, metrics, metrics
            continue
        runs = metrics["per_seed"]
        mine = runs[listed.index(here)] if here in listed else next((r for r in runs if r.get("seed") == seed), None)
        if mine is not None:
            return file, mine, metrics
    return None


def describe_checkpoint(path: str | os.PathLike, results_dir: str | os.PathLike = "results") -> dict:
    """A shipped model's card, from its checkpoint (recipe, data, sizes, steps, training wall time) and the results
    file that reads it out (readouts, device): what ``probcaps list`` and the docs show."""
    import torch

    path = Path(path)
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    meta, state, train = ckpt.get("metadata", {}), ckpt.get("state", {}), ckpt.get("train_config", {})
    configs = meta.get("configs", {})
    data, model = configs.get("data", {}), configs.get("model", {})
    name, seed = meta.get("name", path.stem), train.get("seed")
    card = {"recipe": name, "kind": meta.get("kind"), "guide": meta.get("guide"), "seed": seed,
            "steps": state.get("step"), "batch_size": train.get("batch_size"),
            "wall_time_min": round(state["wall_time_s"] / 60, 1) if "wall_time_s" in state else None,
            "data": f"{data.get('dataset')} training images ({data.get('train_limit') or 'all'}), "
                    f"{data.get('canvas_size')}×{data.get('canvas_size')} canvas, "
                    f"shifts up to ±{data.get('max_shift')} px",
            "objects": model.get("num_parents"), "parts": model.get("num_parts")}
    found = _model_results(path, Path(results_dir), name, seed)
    if found:
        file, mine, whole = found
        prov = json.loads(file.read_text(encoding="utf-8"))["provenance"]
        card["results"] = str(file)
        card["device"] = prov.get("device")
        card["readouts"] = {key: mine[key] for key, _, _ in CARD_READOUTS if key in mine}
        card["recipe_readouts"] = {k: whole[k] for key, _, _ in CARD_READOUTS for k in (f"{key}_mean", f"{key}_std")
                                   if k in whole}
    shown = [f"{label} {scale * card['readouts'][key]:.{1 if scale == 100 else 2}f}{'%' if scale == 100 else ''}"
             for key, label, scale in CARD_READOUTS[:3] if key in card.get("readouts", {})]
    card["summary"] = first_sentence(f"{name} recipe, seed {seed}, {card['steps']:,} steps" +
                                     (f": {', '.join(shown)}" if shown else ""), width=140)
    return card


def write_model_cards(checkpoints_dir: str | os.PathLike = "checkpoints", cards_file: str | os.PathLike = CARDS_FILE,
                      results_dir: str | os.PathLike = "results") -> Path:
    """Write the model cards of every ``*.pt`` in ``checkpoints_dir`` to ``cards_file``: its file name, sha256 and
    size, and :func:`describe_checkpoint` of it (recipe, data, steps, device, wall time, readouts).  Returns
    ``cards_file``."""
    from probcaps.io import atomic_write

    cards = {}
    for path in sorted(Path(checkpoints_dir).glob("*.pt")):
        card = {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size}
        cards[path.stem] = {**card, **describe_checkpoint(path, results_dir)}
    text = json.dumps({"models": cards}, indent=1, ensure_ascii=False) + "\n"
    model_cards.cache_clear()
    return atomic_write(Path(cards_file), lambda f: f.write(text), mode="w")


def _short_device(device: str | None) -> str:
    """``"cpu: Intel(R) Xeon(R) Processor (2 cores, 1 torch threads)"`` -> ``"Intel Xeon, 1 thread"``."""
    if not device:
        return "—"
    name, _, detail = device.partition(" (")
    name = re.sub(r"\(R\)|\(TM\)|Processor|CPU|^cpu: |^cuda:\d+: ", "", name)
    threads = re.search(r"(\d+) torch thread", detail)
    return " ".join(name.split()) + (f", {threads.group(1)} thread{'s' * (threads.group(1) != '1')}" if threads else "")


def cards_table(cards: dict[str, dict]) -> str:
    """The model cards as a markdown table, one row a shipped model, and the footer naming the data and the files."""
    head = ["model", "recipe, seed", "objects / parts", "steps", "training (min)", "readouts measured on",
            *(label for _, label, _ in CARD_READOUTS), "sha256"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, card in cards.items():
        readouts = card.get("readouts", {})
        cells = [f"`{name}`", f"`{card.get('recipe')}`, {card.get('seed')}",
                 f"{card.get('objects')} / {card.get('parts')}", f"{card.get('steps'):,}",
                 str(card.get("wall_time_min")), _short_device(card.get("device")),
                 *(f"{scale * readouts[key]:.{1 if scale == 100 else 2}f}" if key in readouts else "—"
                   for key, _, scale in CARD_READOUTS),
                 f"`{card['sha256'][:12]}…`"]
        rows.append("| " + " | ".join(cells) + " |")
    data = sorted({str(card.get("data")) for card in cards.values()})
    sources = sorted({card["results"] for card in cards.values() if card.get("results")})
    return "\n".join(rows) + (
        f"\n\nTrained on {'; '.join(data)}; readouts on the MNIST test set (probes and k-means in %) from "
        f"{', '.join(f'`{s}`' for s in sources)}. Written by `probcaps report` from each model's checkpoint in "
        "`checkpoints/` and the results file that reads it out; the full cards (and whole sha256) are "
        "`probcaps/model_cards.json`, checked whenever a model is named by its bare name.\n")
