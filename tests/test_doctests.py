"""The examples in the package's docstrings run, and give what they show (the pure planning,
index and state code is documented by them; STYLE.md)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import oss_plus

#: Modules that import an optional framework, or run when imported (``python -m oss_plus``).
SKIPPED = {"oss_plus.integrations.mmengine", "oss_plus.__main__"}
MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(oss_plus.__path__, "oss_plus.")
    if info.name not in SKIPPED
)


def test_the_walk_found_the_packages():
    assert {"oss_plus.planning.partition", "oss_plus.state.index", "oss_plus.wire.sync"} <= set(
        MODULES
    )


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed"
