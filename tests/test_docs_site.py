"""The documentation site builds in strict mode (``make docs``: ``sphinx-build -W``), lists every experiment page and
the tutorials, and its API reference documents every public name of the API; strict mode does fail on a broken
link."""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import myst_parser  # noqa: F401
import pytest
import sphinx  # noqa: F401 - the test extra installs it: missing, the suite fails rather than skips

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _build(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(source),
                           str(out)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build = _build(DOCS, out)
    assert build.returncode == 0, build.stdout + build.stderr
    return out


@pytest.mark.slow
def test_the_reference_documents_every_public_name_of_the_api(site):
    # catches: a function or method added to the API without a place in the reference (or one whose docstring
    # autodoc could not import)
    from probcaps.inference import api

    html = (site / "api.html").read_text()
    public = [f"probcaps.inference.api.{name}" for name in api.__all__]
    public += [f"probcaps.inference.api.{cls.__name__}.{name}" for cls in (api.TrainedCapsuleModel, api.ObjectDrawings)
               for name, _ in inspect.getmembers(cls) if not name.startswith("_")]
    public += [f"probcaps.inference.api.Capsules.{name}" for name in api.Capsules.__dataclass_fields__]
    public += ["probcaps.registry.resolve_checkpoint"]
    # the building blocks under it
    public += ["probcaps.models.capsule_model.CapsuleModel", "probcaps.models.capsule_model.CapsuleModel.log_joint",
               "probcaps.inference.capsule_svi.CapsuleSystem", "probcaps.inference.capsule_svi.load_trained",
               "probcaps.inference.capsule_svi.encode_dataset", "probcaps.inference.capsule_svi.probe_features",
               "probcaps.inference.guides.DeltaGuide", "probcaps.inference.ttvi.run_ttvi",
               "probcaps.inference.evaluate.parent_log_posterior", "probcaps.inference.train.make_elbo"]
    missing = [name for name in public if f'id="{name}"' not in html]
    assert not missing, missing
    text = " ".join(re.sub(r"<[^>]+>", "", html).split())
    assert "parent_posterior¶ (N, M, K + 1) the exact posterior" in text  # the docstrings' shapes come through


@pytest.mark.slow
def test_every_experiment_page_and_the_tutorials_are_in_the_site(site):
    # catches: an experiment page left out of the glob toctree, or a tutorial not shown
    pages = {p.stem for p in DOCS.glob("*.md")} | {"api"}
    assert pages <= {p.stem for p in site.glob("*.html")}, pages - {p.stem for p in site.glob("*.html")}
    index = (site / "index.html").read_text()
    assert all(f'href="{page}.html"' in index for page in pages - {"index"}), index
    tutorials = (site / "tutorials" / "index.html").read_text()
    for name in ("generative_model", "trained_model", "training"):
        assert "PROBCAPS_TUTORIAL_TINY" in tutorials and name.replace("_", " ").split()[0] in tutorials


@pytest.mark.slow
def test_strict_mode_fails_on_a_broken_link(tmp_path):
    # catches: a build that is not strict (a broken link that passes would pass in the real pages too)
    source = tmp_path / "docs"
    source.mkdir()
    shutil.copy(DOCS / "conf.py", source / "conf.py")
    (source / "index.md").write_text("# A page\n\nSee [the missing page](no_such_page.md).\n\n"
                                     "<!-- results:kept -->\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n\n"
                                     "<!-- /results:kept -->\n")
    build = _build(source, tmp_path / "out")
    assert build.returncode != 0 and "no_such_page" in build.stderr, build.stderr
    (source / "index.md").write_text((source / "index.md").read_text().replace("(no_such_page.md)", "(index.md)"))
    build = _build(source, tmp_path / "out2")  # and the results comments and tables alone build cleanly
    assert build.returncode == 0, build.stderr
