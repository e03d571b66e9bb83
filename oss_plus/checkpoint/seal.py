"""The checksum that covers ``index.json`` (format version 5): pure, no I/O.

Every tensor of a checkpoint has a CRC-32 in the index; from version 5 the index has one
too. The index text carries it as its own last key, ``"index_crc32": "<8 hex digits>"``: the
CRC-32 (zlib) of the UTF-8 bytes of the whole text in which those 8 digits are
``00000000``. A reader checks it on the raw bytes, before it parses anything, so a damaged
index that is still valid JSON (a renamed key, an edited number) is refused, and the check
does not depend on how JSON numbers are formatted. ``docs/checkpoint_format.md`` is the
specification.
"""

from __future__ import annotations

import re
import zlib

__all__ = ["CHECKSUM_KEY", "DAMAGED_INDEX", "check_seal", "seal"]

#: The key of the index checksum in ``index.json``.
CHECKSUM_KEY = "index_crc32"
#: The 8 digits the checksum is computed with, in its place.
_BLANK = "0" * 8
_FIELD = re.compile(r'"index_crc32"\s*:\s*"([^"]*)"')
#: The message of an index whose checksum does not match (or cannot be found).
DAMAGED_INDEX = (
    "{where}: {problem}: the index is damaged or was edited by hand; restore it from a "
    "backup or re-save the checkpoint (do not edit index.json: every edit is refused)"
)


def seal(text: str) -> str:
    """Return ``text`` (a JSON object ending in ``}``) with the checksum as its last key.

    Example:
        >>> sealed = seal('{"a": 1}\\n')
        >>> sealed
        '{"a": 1,\\n "index_crc32": "c933b356"\\n}\\n'
        >>> check_seal(sealed, "index.json") == int("c933b356", 16)
        True
    """
    body = text.rstrip()
    if not body.endswith("}"):
        raise ValueError("seal() needs the text of a JSON object")
    head = f'{body[:-1].rstrip()},\n "{CHECKSUM_KEY}": "'
    tail = '"\n}\n'
    crc = zlib.crc32(tail.encode(), zlib.crc32(_BLANK.encode(), zlib.crc32(head.encode("utf-8"))))
    return f"{head}{crc:08x}{tail}"


def check_seal(text: str, where: str) -> int | None:
    """Check the checksum of an index ``text``; return it, or None when it carries none.

    Raises:
        ValueError: the checksum field is there but malformed, repeated, or does not match
            the text (:data:`DAMAGED_INDEX`, naming ``where``).
    """
    found = list(_FIELD.finditer(text))
    if not found:
        if CHECKSUM_KEY in text:
            raise ValueError(
                DAMAGED_INDEX.format(where=where, problem=f"its {CHECKSUM_KEY!r} is malformed")
            )
        return None
    if len(found) > 1:
        problem = f"it holds {len(found)} {CHECKSUM_KEY!r} fields"
        raise ValueError(DAMAGED_INDEX.format(where=where, problem=problem))
    match = found[0]
    digits = match.group(1)
    if not re.fullmatch(r"[0-9a-f]{8}", digits):
        problem = f"its {CHECKSUM_KEY!r} is {digits!r}, not 8 lowercase hex digits"
        raise ValueError(DAMAGED_INDEX.format(where=where, problem=problem))
    blank = text[: match.start(1)] + _BLANK + text[match.end(1) :]
    crc = zlib.crc32(blank.encode("utf-8"))
    if crc != int(digits, 16):
        problem = f"its checksum is {crc:08x} but {CHECKSUM_KEY!r} records {digits}"
        raise ValueError(DAMAGED_INDEX.format(where=where, problem=problem))
    return crc
