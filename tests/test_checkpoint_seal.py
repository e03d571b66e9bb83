"""The index checksum (format version 5): every damaged byte of ``index.json`` is refused.

The reference is zlib's CRC-32 as the spec defines it (the text with ``00000000`` in place
of the digits), computed here independently of :mod:`oss_plus.checkpoint.seal`.
"""

from __future__ import annotations

import json
import random
import re
import zlib

import pytest
import torch

from oss_plus.checkpoint import write_state_dict
from oss_plus.checkpoint.seal import check_seal, seal
from oss_plus.checkpoint.validate import read_index


def small_checkpoint(path):
    sd = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
        "param_groups": [{"params": [0], "lr": 0.01, "betas": (0.9, 0.999)}],
    }
    write_state_dict(sd, path)
    return path / "index.json"


def test_the_checksum_is_the_crc32_of_the_text_with_zeros_in_its_place(tmp_path):
    text = small_checkpoint(tmp_path / "c").read_text()
    digits = re.search(r'"index_crc32": "([0-9a-f]{8})"\n}\n$', text).group(1)
    blank = text.replace(digits, "00000000")
    assert int(digits, 16) == zlib.crc32(blank.encode()) == check_seal(text, "index.json")
    assert json.loads(text)["format_version"] == 5
    assert read_index(tmp_path / "c").index_crc32 == int(digits, 16)
    assert seal(json.dumps({"a": "é"})) == seal(json.dumps({"a": "é"}) + "\n")


def test_every_bit_flip_of_the_index_is_refused_naming_it(tmp_path):
    """A seeded sample of single-bit flips, and every flip of the version and checksum."""
    index = small_checkpoint(tmp_path / "c")
    good = index.read_bytes()
    sample = random.Random(5).sample(range(len(good) * 8), 300)
    ends = [good.index(b'"format_version"'), good.index(b'"index_crc32"')]
    every = [
        8 * at + bit for s in ends for at in range(s, min(s + 30, len(good))) for bit in range(8)
    ]
    for at, bit in (divmod(n, 8) for n in sorted(set(sample) | set(every))):
        damaged = bytearray(good)
        damaged[at] ^= 1 << bit
        index.write_bytes(damaged)
        with pytest.raises(ValueError, match=re.escape(str(index))):
            read_index(tmp_path / "c")


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda t: t.replace('{"float": 0.01}', '{"float": 0.02}'), "its checksum is"),
        (lambda t: re.sub(r'"index_crc32": "[0-9a-f]{8}"', '"index_crc32": "xyz"', t), "not 8"),
        (lambda t: t.replace('"index_crc32"', '"index_crc32": "00000000", "index_crc32"'), "2 "),
        (lambda t: re.sub(r',\n "index_crc32": "[0-9a-f]{8}"', "", t), "without its"),
        (lambda t: t.replace('"index_crc32": "', '"index_crc32": 1, "x": "'), "malformed"),
    ],
    ids=["hand edit", "bad digits", "twice", "removed", "not a string"],
)
def test_a_hand_edit_or_a_damaged_checksum_field_is_refused(tmp_path, edit, words):
    index = small_checkpoint(tmp_path / "c")
    index.write_text(edit(index.read_text()))
    with pytest.raises(ValueError, match=re.escape(str(index))) as info:
        read_index(tmp_path / "c")
    assert words in str(info.value) and "re-save" in str(info.value)


def test_older_versions_load_without_a_checksum_and_one_they_carry_is_checked(tmp_path):
    index = small_checkpoint(tmp_path / "c")
    text = re.sub(r',\n "index_crc32": "[0-9a-f]{8}"', "", index.read_text())
    index.write_text(text.replace('"format_version": 5', '"format_version": 1'))
    assert read_index(tmp_path / "c").index_crc32 is None
    index.write_text(seal(index.read_text().replace('"lr"', '"lr"')))  # a v1 index, sealed
    assert read_index(tmp_path / "c").index_crc32 is not None
    index.write_text(index.read_text().replace('{"float": 0.01}', '{"float": 0.02}'))
    with pytest.raises(ValueError, match="its checksum is"):
        read_index(tmp_path / "c")
