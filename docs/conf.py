"""Sphinx configuration of the documentation site: ``make docs`` builds it into build/docs (strict: a warning fails).

The pages are the markdown of docs/ (MyST), the API reference is generated from the docstrings (autodoc with
napoleon for their Google-style sections), and the tutorials are shown as their source.
"""

from __future__ import annotations

from importlib.metadata import version as _installed_version

project = "probcaps"
author = "the probcaps authors"
release = _installed_version("probcaps")
copyright = "the probcaps authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# the tutorials are executable .py files, shown through literalinclude, not pages of their own
exclude_patterns = ["_build", "tutorials/*.py"]

# markdown: `page.md#a-heading` links resolve to the heading's anchor; $...$ maths; GitHub tables are built in
myst_heading_anchors = 4
myst_enable_extensions = ["dollarmath"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
# the results tables are wide: the page takes the window's width rather than alabaster's 940 px
html_theme_options = {"page_width": "95%", "body_max_width": "none"}
html_title = "probcaps"
