"""One way to launch: README, docs and the experiments' own help show ``probcaps run <experiment>`` (and ``probcaps
train/evaluate/ttvi/draw-objects``), which works from any folder, never ``python -m experiments.X`` or ``python
experiments/X.py``, which work only from the repository root."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: a script form of launching an experiment, in prose or code
OTHER_FORMS = re.compile(r"python3? +(?:-m +(?:probcaps\.)?experiments\.\w+|experiments/\w+\.py)")


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "docs").rglob("*.py")),
            *sorted((ROOT / "experiments").glob("*.py")), *sorted((ROOT / "experiments" / "configs").glob("*.toml"))]


def test_documents_and_help_launch_experiments_one_way():
    # catches: a page or an experiment's usage text showing a launch form that fails outside the repository root
    bad = [f"{path.relative_to(ROOT)}:{n}: {m.group(0)}" for path in _documents()
           for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
           if (m := OTHER_FORMS.search(line))
           and "recorded" not in line]  # a results footer quotes the command a run was made with, as it was
    assert not bad, "\n".join(bad)


def test_the_pattern_finds_the_script_forms():
    # catches: a pattern that can never match, so the test above passes whatever the documents say
    for text in ("python -m experiments.mnist_probe --seeds 0", "python experiments/affnist.py",
                 "python3 -m probcaps.experiments.rotated_digits"):
        assert OTHER_FORMS.search(text), text
    assert not OTHER_FORMS.search("probcaps run mnist_probe --seeds 0")
