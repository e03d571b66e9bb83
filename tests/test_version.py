"""One version: ``oss_plus.__version__``, the installed distribution's metadata (setup.cfg reads
it with ``attr:``), and the newest release of CHANGELOG.md (Keep a Changelog 1.1.0)."""

from __future__ import annotations

import configparser
import importlib.metadata
import re
from pathlib import Path

import oss_plus

ROOT = Path(__file__).resolve().parents[1]
#: A release heading: ``## [0.2.0] - 2026-11-26``.
RELEASE = re.compile(r"^## \[(\d+)\.(\d+)\.(\d+)\] - (\d{4}-\d{2}-\d{2})$")
#: The change types of Keep a Changelog, in its order.
TYPES = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")


def releases(text: str) -> list[tuple[tuple[int, int, int], str, list[str]]]:
    """(version, date, its ``###`` headings) per release, in the file's order; raises on a
    ``##`` heading that is neither ``[Unreleased]`` nor a release."""
    found: list[tuple[tuple[int, int, int], str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            match = RELEASE.match(line)
            if line == "## [Unreleased]":
                assert not found, "[Unreleased] comes before every release"
                continue
            assert match, f"not a release heading: {line!r}"
            major, minor, patch, date = match.groups()
            found.append(((int(major), int(minor), int(patch)), date, []))
        elif line.startswith("### ") and found:
            found[-1][2].append(line[4:])
    return found


def test_the_installed_metadata_is_this_version():
    installed = importlib.metadata.version("oss_plus")
    assert installed == oss_plus.__version__, (
        f"the installed oss_plus metadata says {installed}, the package {oss_plus.__version__}:"
        " reinstall (pip install -e .)"
    )


def test_setup_cfg_reads_the_version_from_the_package():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["metadata"]["version"] == "attr: oss_plus.__version__"


def test_the_newest_changelog_release_is_this_version():
    found = releases((ROOT / "CHANGELOG.md").read_text())
    assert found, "CHANGELOG.md has no release"
    assert ".".join(map(str, found[0][0])) == oss_plus.__version__


def test_the_changelog_follows_keep_a_changelog():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog\n")
    found = releases(text)
    versions = [version for version, _, _ in found]
    dates = [date for _, date, _ in found]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
    assert dates == sorted(dates, reverse=True)
    for version, _, sections in found:
        assert sections, f"{version} lists no change"
        assert all(s in TYPES for s in sections), (version, sections)
        assert sections == sorted(sections, key=TYPES.index), (version, sections)


def test_the_changelog_check_rejects_what_it_should():
    good = "# Changelog\n\n## [Unreleased]\n\n## [0.2.0] - 2026-11-26\n### Added\n- x\n"
    assert releases(good) == [((0, 2, 0), "2026-11-26", ["Added"])]
    for bad in ("## 0.2.0\n", "## [0.2.0]\n", "## [0.2] - 2026-11-26\n"):
        try:
            releases(bad)
        except AssertionError:
            continue
        raise AssertionError(f"accepted {bad!r}")
