"""Names for what ships: recipes and models by bare name, the model cards and their sha256."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from probcaps import registry
from probcaps.errors import CheckpointError, ConfigError
from probcaps.runner import checkpoint_arg, config_arg

ROOT = Path(__file__).resolve().parent.parent


def test_a_bare_recipe_name_is_the_packaged_recipe_and_a_path_stays_a_path(tmp_path):
    # catches: `--config mnist` not finding the shipped recipe, or a path (even a missing one) taken for a name
    assert registry.resolve_config("mnist") == registry.CONFIGS_DIR / "mnist.toml"
    assert registry.resolve_config("experiments/configs/mnist.toml") == Path("experiments/configs/mnist.toml")
    assert registry.resolve_config(str(tmp_path / "x.toml")) == tmp_path / "x.toml"
    with pytest.raises(ConfigError, match="no such recipe.*mnist"):
        registry.resolve_config("nonexistent_recipe")
    with pytest.raises(argparse.ArgumentTypeError, match="no such recipe"):
        config_arg("nonexistent_recipe")
    assert set(registry.recipes()) == {p.stem for p in registry.CONFIGS_DIR.glob("*.toml")}
    assert all(line and "\n" not in line for line in registry.recipes().values())


def test_every_shipped_model_has_a_card_with_its_sha256():
    # catches: a model added to or removed from checkpoints/ without its card, or a card whose hash is stale
    cards = registry.model_cards()
    shipped = {p.stem: p for p in (ROOT / "checkpoints").glob("*.pt")}
    assert set(cards) == set(shipped)
    for name, path in shipped.items():
        assert cards[name]["file"] == path.name
        assert cards[name]["sha256"] == registry.sha256_file(path), f"{name}: run `probcaps report`"
        assert cards[name]["steps"] > 0 and cards[name]["summary"].startswith(cards[name]["recipe"])


def test_a_bare_model_name_resolves_and_is_checked(tmp_path, monkeypatch):
    # catches: a shipped model loaded without its hash checked, a damaged copy used silently, or a missing one
    # reported without saying where it goes
    assert registry.resolve_checkpoint("mnist") == ROOT / "checkpoints" / "mnist.pt"
    assert checkpoint_arg("mnist") == str(ROOT / "checkpoints" / "mnist.pt")
    assert registry.resolve_checkpoint("runs/x/final.pt") == Path("runs/x/final.pt")  # a path, left to the loader
    with pytest.raises(CheckpointError, match="no shipped model of that name"):
        registry.resolve_checkpoint("no_such_model")
    elsewhere = tmp_path / "cache"
    elsewhere.mkdir()
    monkeypatch.setattr(registry, "shipped_model_dir", lambda: elsewhere)
    with pytest.raises(CheckpointError, match=f"put mnist.pt .* at {elsewhere / 'mnist.pt'}"):
        registry.resolve_checkpoint("mnist")
    shutil.copy(ROOT / "checkpoints" / "mnist.pt", elsewhere / "mnist.pt")
    assert registry.resolve_checkpoint("mnist") == elsewhere / "mnist.pt"
    with open(elsewhere / "mnist.pt", "r+b") as f:  # one byte changed
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CheckpointError, match="sha256 .* is not the shipped model's"):
        registry.resolve_checkpoint("mnist")


def test_the_cards_table_is_what_the_cards_give():
    # catches: the docs' table of shipped models edited by hand or not rebuilt after the cards changed
    table = ROOT / "results" / "models" / "cards.md"
    assert table.read_text() == registry.cards_table(registry.model_cards()).rstrip("\n") + "\n"
    cards = json.loads(registry.CARDS_FILE.read_text())["models"]
    assert all(card.get("results", "results/").startswith("results/") for card in cards.values())
