"""Make ``from fairscale.optim import OSS`` resolve to :class:`oss_plus.compat.fairscale.OSS`.

An explicit opt-in, called once at the program's entry point (before the modules that
import ``OSS`` are imported):

* fairscale installed: its modules ``fairscale.optim`` and ``fairscale.optim.oss`` are
  imported and their ``OSS`` attribute is replaced (the rest of fairscale is untouched);
* fairscale absent (or failing to import): an import hook serves small stand-in modules:
  ``fairscale``, ``fairscale.optim`` and ``fairscale.optim.oss`` (``OSS``),
  ``fairscale.optim.grad_scaler`` (``ShardedGradScaler``: :class:`oss_plus.ShardedGradScaler`),
  ``fairscale.nn``, ``fairscale.nn.data_parallel`` and
  ``fairscale.nn.data_parallel.sharded_ddp`` (``ShardedDataParallel``:
  :class:`oss_plus.ShardedDataParallel`); any other ``fairscale.*`` import still fails with
  ``ModuleNotFoundError``;
* fairscale installed: only ``OSS`` is replaced, as before, unless ``data_parallel=True``
  also replaces ``ShardedDataParallel`` and ``ShardedGradScaler`` in their modules. The
  default stays narrow because a codebase that keeps fairscale installed may rely on the
  rest of it (FSDP, its own grad scaler); a codebase that wants fairscale gone entirely runs
  with it uninstalled and gets everything.

:func:`uninstall` reverts either mode.

:func:`install` also registers oss_plus's exit handler (:mod:`oss_plus.runtime.exit`) at once,
not at the first oss_plus collective: a process that installs the adapter may train with
torch's collectives only (the DDP reference run of the same script), and gloo's workers may
still need the GIL when it exits.
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

from oss_plus.runtime.exit import drain_at_exit

__all__ = ["install", "is_installed", "uninstall"]

logger = logging.getLogger(__name__)

#: Modules served by the import hook when fairscale is absent (packages have a ``__path__``).
SHIM_MODULES = {
    "fairscale": True,
    "fairscale.optim": True,
    "fairscale.optim.oss": False,
    "fairscale.optim.grad_scaler": False,
    "fairscale.nn": True,
    "fairscale.nn.data_parallel": True,
    "fairscale.nn.data_parallel.sharded_ddp": False,
}
#: Modules whose ``OSS`` attribute is replaced when fairscale is installed.
PATCHED_MODULES = ("fairscale.optim", "fairscale.optim.oss")
#: With ``data_parallel=True``: further (module, attribute) pairs replaced in a real fairscale.
PATCHED_DATA_PARALLEL = (
    ("fairscale.nn.data_parallel", "ShardedDataParallel"),
    ("fairscale.nn.data_parallel.sharded_ddp", "ShardedDataParallel"),
    ("fairscale.nn", "ShardedDataParallel"),
    ("fairscale.optim.grad_scaler", "ShardedGradScaler"),
)
#: Marks the modules created by the hook.
SHIM_MARKER = "__oss_plus_shim__"
#: The fairscale version the shim modules report.
SHIM_VERSION = "0.4.13"

#: "patched" or "shim" once installed; the replaced attributes; the hook.
_installed: dict[str, Any] = {"mode": None, "saved": {}, "finder": None}
#: The class fairscale's ``OSS`` resolves to, given by :mod:`oss_plus.compat.fairscale` at its
#: import (:func:`provide`), so that this module imports nothing above it.
_provided: dict[str, Any] = {}


def provide(oss: type) -> None:
    """Register the adapter class that :func:`install` puts in place of fairscale's ``OSS``."""
    _provided["OSS"] = oss


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
        setattr(module, SHIM_MARKER, True)
        module.__doc__ = "oss_plus stand-in for fairscale (see oss_plus.compat.fairscale)."
        if module.__name__ == "fairscale":
            module.__version__ = SHIM_VERSION  # type: ignore[attr-defined]
        exports = _replacements().get(module.__name__, {})
        for name, value in exports.items():
            setattr(module, name, value)
        module.__all__ = sorted(exports)  # type: ignore[attr-defined]


def _replacements() -> dict[str, dict[str, Any]]:
    """What each fairscale module exposes from oss_plus (imported lazily)."""
    from oss_plus.amp.scaler import ShardedGradScaler
    from oss_plus.data_parallel import ShardedDataParallel

    OSS = _provided["OSS"]  # noqa: N806 - a class
    sdp = {"ShardedDataParallel": ShardedDataParallel}
    return {
        "fairscale.optim": {"OSS": OSS},
        "fairscale.optim.oss": {"OSS": OSS},
        "fairscale.optim.grad_scaler": {"ShardedGradScaler": ShardedGradScaler},
        "fairscale.nn": dict(sdp),
        "fairscale.nn.data_parallel": dict(sdp),
        "fairscale.nn.data_parallel.sharded_ddp": dict(sdp),
    }


def _fairscale_findable() -> bool:
    try:
        return importlib.util.find_spec("fairscale") is not None
    except (ImportError, ValueError):
        return False


def _patch_real(data_parallel: bool) -> bool:
    """Replace ``OSS`` (and with ``data_parallel`` the wrapper and scaler) in the real
    fairscale modules; return False if fairscale fails to import."""
    targets = [(name, "OSS") for name in PATCHED_MODULES]
    if data_parallel:
        targets += list(PATCHED_DATA_PARALLEL)
    values = _replacements()
    before = set(sys.modules)
    try:
        modules = {name: importlib.import_module(name) for name, _ in targets}
    except ImportError as exc:
        for name in set(sys.modules) - before:
            if name == "fairscale" or name.startswith("fairscale."):
                del sys.modules[name]
        logger.warning("fairscale is installed but failed to import (%s): using the stand-in", exc)
        return False
    for name, attribute in targets:
        module = modules[name]
        _installed["saved"][(name, attribute)] = getattr(module, attribute, None)
        setattr(module, attribute, values[name][attribute])
    return True


def install(*, data_parallel: bool = False) -> str:
    """Make fairscale's ``OSS`` (and with fairscale absent, its ``ShardedDataParallel`` and
    ``ShardedGradScaler``) resolve to oss_plus.

    Call it once at the entry point, before importing code that does
    ``from fairscale.optim import OSS``: names bound earlier keep the real class.
    Calling it again does nothing.

    Args:
        data_parallel: with fairscale installed, also replace
            ``fairscale.nn.data_parallel.ShardedDataParallel`` and
            ``fairscale.optim.grad_scaler.ShardedGradScaler`` (with fairscale absent they
            are always served).

    Returns:
        ``"patched"`` (fairscale installed, its classes replaced) or ``"shim"`` (fairscale
        absent: stand-in modules serve the import paths).

    Example:
        >>> import oss_plus.compat.fairscale as fs_compat  # doctest: +SKIP
        >>> fs_compat.install()  # doctest: +SKIP
        >>> from fairscale.optim import OSS  # now oss_plus.compat.fairscale.OSS  # doctest: +SKIP
    """
    if _installed["mode"] is not None:
        return str(_installed["mode"])
    drain_at_exit()  # a process that installs may train with torch's collectives only
    if _fairscale_findable() and _patch_real(data_parallel):
        _installed["mode"] = "patched"
    else:
        finder = _ShimFinder()
        sys.meta_path.insert(0, finder)
        _installed.update(mode="shim", finder=finder)
    logger.info("fairscale.optim.OSS now resolves to oss_plus (%s)", _installed["mode"])
    return str(_installed["mode"])


def uninstall() -> None:
    """Undo :func:`install`: restore fairscale's classes or remove the stand-in modules."""
    for (name, attribute), original in _installed["saved"].items():
        module = sys.modules.get(name)
        if module is not None:
            setattr(module, attribute, original)
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
