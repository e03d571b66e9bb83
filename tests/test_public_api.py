"""The public API, pinned (issue 44): the names of every public module's ``__all__`` and their
signatures, against the checked-in snapshot ``tests/public_api.json`` (as torch's
public-bindings test does).

A change to the public surface (a name added to or removed from an ``__all__``, a parameter
added, renamed or reordered, a public method or property added or removed) fails here. If it
is meant, write the snapshot again and say so in CHANGELOG.md::

    python tests/test_public_api.py --write

Message constants are pinned by name and type, not by text. Members a public class inherits
from torch (``Optimizer.zero_grad``...) are torch's surface, not ours, and are left out.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

SNAPSHOT = Path(__file__).with_name("public_api.json")

#: The public modules (docs/api.rst): ``oss_plus.__all__`` and the documented subpackages.
PUBLIC_MODULES = (
    "oss_plus",
    "oss_plus.planning",
    "oss_plus.checkpoint",
    "oss_plus.data_parallel",
    "oss_plus.data_parallel.plan",
    "oss_plus.data_parallel.flat",
    "oss_plus.overlap",
    "oss_plus.compat.fairscale",
    "oss_plus.compat.torch",
    "oss_plus.integrations.mmengine",
    "oss_plus.hybrid",
    "oss_plus.testing",
)
#: Modules that import an optional framework: pinned where it is installed.
OPTIONAL = {"oss_plus.integrations.mmengine": "mmengine"}

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _signature(obj: Any) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    return _ADDRESS.sub("", text)


def _ours(owner: type) -> bool:
    return owner.__module__.split(".")[0] == "oss_plus"


def _describe_class(cls: type) -> dict[str, Any]:
    members: dict[str, str] = {}
    for name in sorted(dir(cls)):
        if name.startswith("_") and name != "__init__":
            continue
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None or not _ours(owner):
            continue
        value = vars(owner)[name]
        if isinstance(value, property):
            members[name] = "property"
        elif isinstance(value, staticmethod | classmethod):
            members[name] = f"{type(value).__name__}{_signature(value.__func__)}"
        elif callable(value):
            members[name] = f"method{_signature(value)}"
        else:
            members[name] = f"attribute: {type(value).__name__}"
    described: dict[str, Any] = {"kind": "class", "members": members}
    if issubclass(cls, enum.Enum):
        described = {"kind": "enum", "values": [str(m.value) for m in cls]}
    return described


def describe(obj: Any) -> Any:
    """The pinned form of one public name."""
    if inspect.ismodule(obj):
        return {"kind": "module", "name": obj.__name__}
    if inspect.isclass(obj):
        return _describe_class(obj)
    if callable(obj):
        return {"kind": "function", "signature": _signature(obj)}
    return {"kind": "constant", "type": type(obj).__name__}


def surface(module_name: str) -> dict[str, Any]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    assert names is not None, f"public module {module_name} declares no __all__"
    assert len(set(names)) == len(names), f"{module_name}.__all__ lists a name twice"
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{module_name}.__all__ names what it does not define: {missing}"
    return {name: describe(getattr(module, name)) for name in sorted(names)}


def _importable(module_name: str) -> bool:
    needed = OPTIONAL.get(module_name)
    return needed is None or importlib.util.find_spec(needed) is not None


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_the_public_surface_matches_the_snapshot(module_name):
    pinned = json.loads(SNAPSHOT.read_text())
    assert module_name in pinned, f"{module_name} is not in {SNAPSHOT.name}: write it again"
    if not _importable(module_name):
        pytest.skip(f"{OPTIONAL[module_name]} is not installed")
    got, want = surface(module_name), pinned[module_name]
    if got != want:
        added = sorted(set(got) - set(want))
        removed = sorted(set(want) - set(got))
        changed = sorted(n for n in set(got) & set(want) if got[n] != want[n])
        detail = "\n".join(
            f"  {n}:\n    pinned: {json.dumps(want[n])}\n    now:    {json.dumps(got[n])}"
            for n in changed
        )
        pytest.fail(
            f"the public surface of {module_name} changed (added {added}, removed {removed},"
            f" changed {changed}):\n{detail}\nIf that is meant: python tests/test_public_api.py"
            " --write, and list it in CHANGELOG.md"
        )


def test_the_snapshot_pins_exactly_the_public_modules():
    assert sorted(json.loads(SNAPSHOT.read_text())) == sorted(PUBLIC_MODULES)


def test_a_name_added_to_all_fails_the_pin(monkeypatch):
    """The check itself: a new name in ``oss_plus.__all__`` is a difference."""
    import oss_plus

    pinned = json.loads(SNAPSHOT.read_text())["oss_plus"]
    assert surface("oss_plus") == pinned
    monkeypatch.setattr(oss_plus, "__all__", [*oss_plus.__all__, "hybrid"])
    assert surface("oss_plus") != pinned


def write() -> None:
    snapshot = {}
    for name in PUBLIC_MODULES:
        if not _importable(name):
            raise SystemExit(f"install {OPTIONAL[name]} to write the snapshot of {name}")
        snapshot[name] = surface(name)
    SNAPSHOT.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(__doc__)
    write()
