"""Required fields of the index's entries, read with messages that name them: pure.

The parsers of :mod:`~oss_plus.checkpoint.format` and :mod:`~oss_plus.checkpoint.entries`
read every field through :func:`need`, so a missing field or one of the wrong type is a
``ValueError`` that names the index, the entry and the field, never a bare ``KeyError``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BAD_FIELD", "need", "need_int", "need_ints", "need_list", "need_str"]

#: Message for a missing or mistyped field of an index entry.
BAD_FIELD = (
    "{where}: {problem}: the index is damaged or was not written by oss_plus; restore it "
    "from a backup or re-save the checkpoint"
)


def _fail(where: str, problem: str) -> ValueError:
    return ValueError(BAD_FIELD.format(where=where, problem=problem))


def need(entry: Any, key: str, where: str, kind: type | tuple[type, ...] = object) -> Any:
    """Return ``entry[key]``, checked to be an instance of ``kind``.

    Example:
        >>> need({"a": 1}, "a", "index.json: file 0", int)
        1
        >>> need({}, "name", "index.json: file 0")
        Traceback (most recent call last):
        ...
        ValueError: index.json: file 0: the required field 'name' is missing: ...
    """
    if not isinstance(entry, dict):
        raise _fail(where, f"expected a JSON object, found {type(entry).__name__}")
    if key not in entry:
        raise _fail(where, f"the required field {key!r} is missing")
    value = entry[key]
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, (int, float)))
    if not ok:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        expected = " or ".join(k.__name__ for k in kinds)
        raise _fail(where, f"the field {key!r} is {value!r}, expected a {expected}")
    return value


def need_int(entry: Any, key: str, where: str) -> int:
    """Return the int field ``key`` (a bool is not an int here)."""
    return int(need(entry, key, where, int))


def need_str(entry: Any, key: str, where: str) -> str:
    """Return the string field ``key``."""
    return str(need(entry, key, where, str))


def need_list(entry: Any, key: str, where: str) -> list[Any]:
    """Return the list field ``key``."""
    return list(need(entry, key, where, list))


def need_ints(entry: Any, key: str, where: str) -> list[int]:
    """Return the field ``key``, a list of ints (a shape, flat indices)."""
    values = need_list(entry, key, where)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise _fail(where, f"the field {key!r} is {values!r}, expected a list of ints")
    return [int(v) for v in values]
