"""What each checkpoint format version may hold (pure): the entries a version-N index can
carry, checked when an index is parsed, and whether a param's entries need version 5.

Version 2 added tensors inside containers (``nested``), 3 tensors stored as pieces, 4 tensor
subclasses, 5 sets, views and keys that are not strings (and the index checksum, checked on
the raw bytes: :mod:`oss_plus.checkpoint.seal`). An older index holding what a later version
added is damaged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oss_plus.checkpoint.entries import NestedValue, PiecesValue, PlainValue, check_pieces
from oss_plus.checkpoint.values import encode_value
from oss_plus.state.nested import NEW_IN_5, holds_subclass, tags_in

__all__ = ["check_entries", "needs_version_5"]


def needs_version_5(entries: Mapping[Any, Any]) -> bool:
    """Whether one param's entries need format version 5: a key that is not a string, or a
    value holding a set or frozenset, or a tensor stored as a view (its strides, or its
    storage shared, :mod:`oss_plus.state.layout`)."""
    for key, entry in entries.items():
        if not isinstance(key, str):
            return True
        if isinstance(entry, NestedValue) and tags_in(entry.skeleton) & NEW_IN_5:
            return True
        if isinstance(entry, PlainValue) and tags_in(encode_value(entry.value, "")) & NEW_IN_5:
            return True
    return False


def check_entries(state: Mapping[int, Mapping[str, Any]], version: int, where: str) -> None:
    """Check that each entry's kind exists in ``version`` and that pieces cover their tensor."""
    for i, entries in state.items():
        for key, entry in entries.items():
            if isinstance(entry, PiecesValue):
                if version < 3:
                    raise ValueError(f"{where}: a 'pieces' entry in a version-2 index")
                check_pieces(entry, f"{where}: state {i} key {key!r}")
            if version < 4 and isinstance(entry, NestedValue) and holds_subclass(entry.skeleton):
                raise ValueError(f"{where}: a tensor subclass in a version-{version} index")
        if version < 5 and needs_version_5(entries):
            raise ValueError(
                f"{where}: state {i} holds a set, a view or a non-string key, which a "
                f"version-{version} index cannot: the index is damaged"
            )
