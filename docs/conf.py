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


def _public_bases(app, name, obj, options, bases):
    """Show ``OSS`` as the ``torch.optim.Optimizer`` it is: its internal mixins (plan views,
    clipping, state dicts, ...) are parts of it, not what it is; an adapter's internal base
    is shown as ``oss_plus.OSS``."""
    from oss_plus import OSS

    if not (isinstance(obj, type) and issubclass(obj, OSS)):
        return
    shown = []
    for base in bases:
        if base.__module__.startswith("oss_plus") and base is not OSS:
            base = OSS if issubclass(base, OSS) else None
        if base is not None and base not in shown:
            shown.append(base)
    bases[:] = shown


def setup(app):
    app.connect("autodoc-process-bases", _public_bases)
