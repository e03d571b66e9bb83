"""Make ``torch.distributed.optim.ZeroRedundancyOptimizer`` resolve to
:class:`oss_plus.compat.torch.ZeroRedundancyOptimizer`.

An explicit opt-in, called once at the program's entry point, before the modules that name
torch's class are imported (as :func:`oss_plus.compat.fairscale.install` for fairscale):
the ``ZeroRedundancyOptimizer`` attribute of ``torch.distributed.optim`` and of
``torch.distributed.optim.zero_redundancy_optimizer`` is replaced; nothing else of torch
changes. Code that bound torch's class before (``from torch.distributed.optim import
ZeroRedundancyOptimizer`` run earlier, or a subclass defined earlier) keeps it.
:func:`uninstall` restores torch's class.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__all__ = ["PATCHED_MODULES", "install", "is_installed", "uninstall"]

logger = logging.getLogger(__name__)

#: The modules whose ``ZeroRedundancyOptimizer`` attribute is replaced.
PATCHED_MODULES = (
    "torch.distributed.optim",
    "torch.distributed.optim.zero_redundancy_optimizer",
)
_ATTRIBUTE = "ZeroRedundancyOptimizer"

#: The replaced attributes, by module name, while installed.
_saved: dict[str, Any] = {}
#: The adapter class, given by :mod:`oss_plus.compat.torch` at its import (:func:`provide`),
#: so that this module imports nothing above it.
_provided: dict[str, Any] = {}


def provide(zero: type) -> None:
    """Register the class :func:`install` puts in place of torch's."""
    _provided[_ATTRIBUTE] = zero


def install() -> bool:
    """Make torch's ``ZeroRedundancyOptimizer`` resolve to oss_plus's adapter.

    Call it once at the entry point, before importing code that does
    ``from torch.distributed.optim import ZeroRedundancyOptimizer``: names bound earlier
    keep torch's class. Calling it again does nothing.

    Returns:
        True if this call installed it, False if it was installed already.

    Example:
        >>> import oss_plus.compat.torch as zero_compat
        >>> zero_compat.install()
        True
        >>> from torch.distributed.optim import ZeroRedundancyOptimizer
        >>> ZeroRedundancyOptimizer is zero_compat.ZeroRedundancyOptimizer
        True
        >>> zero_compat.uninstall()
    """
    if _saved:
        return False
    zero = _provided[_ATTRIBUTE]
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        _saved[name] = getattr(module, _ATTRIBUTE)
        setattr(module, _ATTRIBUTE, zero)
    logger.info("torch.distributed.optim.ZeroRedundancyOptimizer now resolves to oss_plus")
    return True


def uninstall() -> None:
    """Undo :func:`install`: torch's class is back in its modules."""
    for name, original in _saved.items():
        setattr(importlib.import_module(name), _ATTRIBUTE, original)
    _saved.clear()


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_saved)
