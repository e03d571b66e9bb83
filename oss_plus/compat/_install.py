"""Make ``from fairscale.optim import OSS`` resolve to :class:`oss_plus.compat.fairscale.OSS`.

An explicit opt-in, called once at the program's entry point (before the modules that
import ``OSS`` are imported):

* fairscale installed: its modules ``fairscale.optim`` and ``fairscale.optim.oss`` are
  imported and their ``OSS`` attribute is replaced (the rest of fairscale is untouched);
* fairscale absent (or failing to import): an import hook serves three small modules,
  ``fairscale``, ``fairscale.optim`` and ``fairscale.optim.oss``, each exposing ``OSS``;
  any other ``fairscale.*`` import still fails with ``ModuleNotFoundError``.

:func:`uninstall` reverts either mode.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["install", "is_installed", "uninstall"]

logger = logging.getLogger(__name__)

#: Modules served by the import hook when fairscale is absent (packages have a ``__path__``).
SHIM_MODULES = {"fairscale": True, "fairscale.optim": True, "fairscale.optim.oss": False}
#: Modules whose ``OSS`` attribute is replaced when fairscale is installed.
PATCHED_MODULES = ("fairscale.optim", "fairscale.optim.oss")
#: Marks the modules created by the hook.
SHIM_MARKER = "__oss_plus_shim__"
#: The fairscale version the shim modules report.
SHIM_VERSION = "0.4.13"

#: "patched" or "shim" once installed; the replaced attributes; the hook.
_installed: dict[str, Any] = {"mode": None, "saved": {}, "finder": None}


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the :data:`SHIM_MODULES` (only those) with ``OSS`` from oss_plus."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in SHIM_MODULES:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, self, is_package=SHIM_MODULES[fullname], origin="oss_plus"
        )

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        from oss_plus.compat.fairscale import OSS

        setattr(module, SHIM_MARKER, True)
        module.__doc__ = "oss_plus stand-in for fairscale: only OSS (oss_plus.compat.fairscale)."
        if module.__name__ == "fairscale":
            module.__version__ = SHIM_VERSION  # type: ignore[attr-defined]
            module.__all__ = []  # type: ignore[attr-defined]
        else:
            module.OSS = OSS  # type: ignore[attr-defined]
            module.__all__ = ["OSS"]  # type: ignore[attr-defined]


def _fairscale_findable() -> bool:
    try:
        return importlib.util.find_spec("fairscale") is not None
    except (ImportError, ValueError):
        return False


def _patch_real() -> bool:
    """Replace ``OSS`` in the real fairscale modules; return False if fairscale fails to import."""
    from oss_plus.compat.fairscale import OSS

    before = set(sys.modules)
    try:
        modules = [importlib.import_module(name) for name in PATCHED_MODULES]
    except ImportError as exc:
        for name in set(sys.modules) - before:
            if name == "fairscale" or name.startswith("fairscale."):
                del sys.modules[name]
        logger.warning("fairscale is installed but failed to import (%s): using the stand-in", exc)
        return False
    for module in modules:
        _installed["saved"][module.__name__] = module.OSS
        module.OSS = OSS  # type: ignore[attr-defined]
    return True


def install() -> str:
    """Make ``fairscale.optim.OSS`` and ``fairscale.optim.oss.OSS`` be oss_plus's adapter.

    Call it once at the entry point, before importing code that does
    ``from fairscale.optim import OSS``: names bound earlier keep the real class.
    Calling it again does nothing.

    Returns:
        ``"patched"`` (fairscale installed, its ``OSS`` replaced) or ``"shim"`` (fairscale
        absent: stand-in modules serve the three import paths).

    Example:
        >>> import oss_plus.compat.fairscale as fs_compat  # doctest: +SKIP
        >>> fs_compat.install()  # doctest: +SKIP
        >>> from fairscale.optim import OSS  # now oss_plus.compat.fairscale.OSS  # doctest: +SKIP
    """
    if _installed["mode"] is not None:
        return str(_installed["mode"])
    if _fairscale_findable() and _patch_real():
        _installed["mode"] = "patched"
    else:
        finder = _ShimFinder()
        sys.meta_path.insert(0, finder)
        _installed.update(mode="shim", finder=finder)
    logger.info("fairscale.optim.OSS now resolves to oss_plus (%s)", _installed["mode"])
    return str(_installed["mode"])


def uninstall() -> None:
    """Undo :func:`install`: restore fairscale's ``OSS`` or remove the stand-in modules."""
    for name, original in _installed["saved"].items():
        module = sys.modules.get(name)
        if module is not None:
            module.OSS = original  # type: ignore[attr-defined]
    finder = _installed["finder"]
    if finder is not None and finder in sys.meta_path:
        sys.meta_path.remove(finder)
    for name in SHIM_MODULES:
        if getattr(sys.modules.get(name), SHIM_MARKER, False):
            del sys.modules[name]
    _installed.update(mode=None, saved={}, finder=None)


def is_installed() -> str | None:
    """Return ``"patched"``, ``"shim"``, or None when :func:`install` is not in effect."""
    mode = _installed["mode"]
    return None if mode is None else str(mode)
