"""Advisory locks of a save: its stage while in flight, the checkpoint directory at commit.

Two optimizers on disjoint process groups may save to one path at once (hybrid ZeRO-1 built
by hand). The coordinator of a save holds a shared ``flock`` on its stage directory from its
creation to its commit or removal, so another save's sweep of stale stages skips it
(:func:`stale`); a commit runs under an exclusive ``flock`` on the checkpoint directory
(:func:`locked`), so no other commit is between its renames and its ``index.json``. Where
the filesystem cannot lock (some network filesystems; Windows), nothing is locked and the
callers take the safe side: a stale stage is left, only the replaced index's files are
deleted. No collectives.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, the unlocked rules apply
    fcntl = None  # type: ignore[assignment]

__all__ = ["hold", "locked", "release", "stale"]

logger = logging.getLogger(__name__)

#: Stage directories this process holds locked, with their open descriptors.
_HELD: dict[Path, int] = {}
_HELD_LOCK = threading.Lock()
#: Directories in which a lock failed (warned about once).
_UNLOCKABLE: set[Path] = set()


def _lock_fd(directory: Path, flags: int) -> int | None:
    """Open ``directory`` and ``flock`` it; None where the filesystem cannot lock.

    Raises:
        BlockingIOError: ``flags`` has LOCK_NB and another open description holds a lock.
    """
    if fcntl is None:
        return None
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, flags)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError as exc:  # e.g. ENOLCK, EOPNOTSUPP, EBADF on NFS directories
        os.close(fd)
        if directory.parent not in _UNLOCKABLE:  # once per place, not at every save
            _UNLOCKABLE.add(directory.parent)
            logger.warning(
                "cannot lock %s (%s): concurrent saves are not serialised", directory, exc
            )
        return None
    return fd


@contextmanager
def locked(directory: Path) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``directory``; yields whether it is locked."""
    fd = _lock_fd(directory, fcntl.LOCK_EX) if fcntl is not None else None
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)  # closing the last descriptor releases the lock


def hold(stage: Path) -> None:
    """Lock ``stage`` (shared) until :func:`release`: the save is in flight."""
    fd = _lock_fd(stage, fcntl.LOCK_SH) if fcntl is not None else None
    if fd is not None:
        with _HELD_LOCK:
            _HELD[stage] = fd


def release(stage: Path) -> None:
    """Release the in-flight lock of ``stage`` (nothing if this process does not hold it)."""
    with _HELD_LOCK:
        fd = _HELD.pop(stage, None)
    if fd is not None:
        os.close(fd)


def stale(stage: Path) -> bool:
    """Whether ``stage`` belongs to no save in flight (its coordinator holds no lock on it)."""
    if fcntl is None:
        return True
    try:
        fd = _lock_fd(stage, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a save in flight, perhaps of another process group
    except OSError:
        return False  # vanished meanwhile, or unreadable: not ours to remove
    if fd is None:
        return False  # cannot tell: leave it rather than break a live save
    os.close(fd)
    return True
