"""Sphinx configuration for the oss_plus docs (``tox -e docs``, warnings are errors)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import oss_plus  # noqa: E402

project = "oss_plus"
author = "oss_plus developers"
release = oss_plus.__version__
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx.ext.intersphinx",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3
intersphinx_mapping = {}
html_theme = "alabaster"
nitpicky = False
suppress_warnings = ["myst.xref_missing"]
