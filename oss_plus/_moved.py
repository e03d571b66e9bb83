"""Where the modules of oss_plus 0.2 went in 0.3: the one table of old paths, and the hooks
that keep them importing (with a :class:`DeprecationWarning` naming the new path) until 0.4.

0.3.0 grouped the package's root by concept (``planning/``, ``step/``, ``wire/``, ``state/``,
``amp/``, ``runtime/``; ``docs/design.md``). ``import oss_plus.plan`` and ``from oss_plus.plan
import make_plan`` still work: a finder on ``sys.meta_path`` answers the old name with the
module at its new path (the same module object, so classes and constants are identical).
Two old modules share their name with a new package (``oss_plus.amp``, ``oss_plus.state``):
those packages forward the old module's names through :func:`forward`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "REMOVED_IN", "forward", "install", "moved_message"]

#: The release that drops the old paths.
REMOVED_IN = "0.4"

#: Old module (0.2) -> its module from 0.3 on, both under ``oss_plus.``.
MOVED: dict[str, str] = {
    # planning (PURE)
    "partition": "planning.partition",
    "policy": "planning.policy",
    "plan": "planning.plan",
    "model_specs": "planning.model_specs",
    "plan_report": "planning.report",
    "scale_report": "planning.scale",
    # the local step, owned by OSS
    "shard": "step.shard",
    "pieces": "step.pieces",
    "replan": "step.replan",
    "stepping": "step.driver",
    "plan_views": "step.views",
    "_params": "step.params",
    # the wire: layouts, the parameter sync, its transports and status, main copies
    "_layout": "wire.layout",
    "changes": "wire.changes",
    "layout_choice": "wire.factory",
    "sync": "wire.sync",
    "transport": "wire.transport",
    "inflight": "wire.inflight",
    "status": "wire.status",
    "split_params": "wire.split_params",
    "main_copy": "wire.main.region",
    "main_copies": "wire.main.copies",
    "main_step": "wire.main.step",
    # state paths
    "state": "state.index",
    "state_dict": "state.api",
    "consolidate": "state.consolidate",
    "dcp": "state.dcp",
    "sharded_tensor": "state.sharded_tensor",
    "torch_callers": "state.torch_callers",
    "_nested": "state.nested",
    # loss scaling and clipping
    "amp": "amp.scaler",
    "clip": "amp.clip",
    "_norms": "amp.norms",
    # runtime helpers
    "_dist": "runtime.dist",
    "_arrival": "runtime.arrival",
    "_exit": "runtime.exit",
    "_launch": "runtime.launch",
    "_trace": "runtime.trace",
}


def moved_message(old: str) -> str:
    """The warning for an import of ``oss_plus.<old>``.

    Example:
        >>> moved_message("plan")
        'oss_plus.plan moved to oss_plus.planning.plan in 0.3; the old path goes in 0.4'
    """
    return (
        f"oss_plus.{old} moved to oss_plus.{MOVED[old]} in 0.3; the old path goes in {REMOVED_IN}"
    )


def _new_module(old: str, stacklevel: int) -> ModuleType:
    warnings.warn(moved_message(old), DeprecationWarning, stacklevel=stacklevel)
    return importlib.import_module(f"oss_plus.{MOVED[old]}")


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``oss_plus.<old>`` with the module at its new path."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, old = fullname.rpartition(".")
        if package != "oss_plus" or old not in MOVED or _is_package(old):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # importlib's frames are skipped when the warning picks its line: it names the import
        module = _new_module(spec.name.rpartition(".")[2], stacklevel=3)
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module is the one at the new path, already executed); give it
        back the spec importlib replaced with the alias's."""
        module.__spec__ = self._specs.pop(module.__name__)


_FINDER = _Alias()


def _is_package(old: str) -> bool:
    """``amp`` and ``state``: the old module's name is now a package's (see :func:`forward`)."""
    return MOVED[old].partition(".")[0] == old


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once; ``oss_plus/__init__`` calls it)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)


def package_getattr(name: str) -> Any:
    """``oss_plus.<name>`` for a name the package does not define: an old module (so
    ``import oss_plus; oss_plus.plan.make_plan`` still works), registered under its old name
    and warned at the line that named it (the caller of ``oss_plus.__getattr__``)."""
    if name in MOVED and not _is_package(name):
        module = _new_module(name, stacklevel=4)
        sys.modules.setdefault(f"oss_plus.{name}", module)
        return module
    raise AttributeError(f"module 'oss_plus' has no attribute {name!r}")


def forward(package: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of a package that took an old module's name (``oss_plus.amp``,
    ``oss_plus.state``): the old module's names, from its new module, with the warning."""
    old = package.rpartition(".")[2]

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        module = importlib.import_module(f"oss_plus.{MOVED[old]}")
        if not hasattr(module, name):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warnings.warn(moved_message(old), DeprecationWarning, stacklevel=2)
        return getattr(module, name)

    return __getattr__
