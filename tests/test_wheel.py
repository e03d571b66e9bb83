"""The wheel: built from this checkout, installed into a fresh venv, ``oss-plus bench`` runs there.

Offline and fast: the wheel is built with the running interpreter's setuptools (no build
isolation, no download); the fresh venv gets this interpreter's torch, safetensors and numpy
through a ``.pth`` file pointing at a directory of links to their site-packages (without
oss_plus itself and without fairscale, so the bench must skip that row). Everything runs from a
directory outside the checkout, with no PYTHONPATH, so only the installed wheel can be imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: What the build reads: the package, its metadata, the README (the long description) and
#: the license text the wheel carries.
BUILD_INPUTS = ("oss_plus", "setup.cfg", "pyproject.toml", "README.md", "LICENSE")
#: Packages the fresh venv borrows from this interpreter (numpy only where installed).
BORROWED = ("torch", "safetensors", "numpy")
#: Entries of the running site-packages the fresh venv must not see.
HIDDEN = ("oss_plus", "__editable__", "fairscale")
ROWS = ("oss_plus", "fairscale", "torch_zero_bv", "unsharded")


def _run(*cmd: str | Path, cwd: Path, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONNOUSERSITE"] = "1"
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _build_wheel(tmp: Path) -> Path:
    """Build from a copy of the sources, so build/ and *.egg-info stay out of the checkout."""
    src = tmp / "src"
    shutil.copytree(
        ROOT / "oss_plus", src / "oss_plus", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in BUILD_INPUTS[1:]:
        shutil.copy2(ROOT / name, src / name)
    pip = (sys.executable, "-m", "pip")
    _run(*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", src, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("oss_plus-*.whl")
    return wheel


def _link_dependencies(tmp: Path, site_packages: Path) -> None:
    """Make this interpreter's torch, safetensors and numpy importable in the fresh venv."""
    specs = [importlib.util.find_spec(name) for name in BORROWED]
    homes = {Path(s.origin).resolve().parent.parent for s in specs if s and s.origin}
    lines = []
    for i, home in enumerate(sorted(homes)):
        links = tmp / f"deps{i}"
        links.mkdir()
        for entry in home.iterdir():
            if not entry.name.startswith(HIDDEN) and entry.suffix != ".pth":
                (links / entry.name).symlink_to(entry)
        lines.append(str(links))
    (site_packages / "_oss_plus_test_deps.pth").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed (``--no-deps``); returns its directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = _build_wheel(tmp)
    env_dir = tmp / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", env_dir, cwd=tmp)
    python = env_dir / "bin" / "python"
    where = {"base": str(env_dir), "platbase": str(env_dir)}
    scheme = "venv" if "venv" in sysconfig.get_scheme_names() else "posix_prefix"
    _link_dependencies(tmp, Path(sysconfig.get_path("purelib", scheme, where)))
    pip = (sys.executable, "-m", "pip", "--python", python)
    _run(*pip, "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp)
    return env_dir


def test_the_installed_package_is_the_wheel_not_the_checkout(venv: Path) -> None:
    code = (
        "import importlib.metadata, importlib.util, oss_plus.bench; print(oss_plus.__file__); "
        "print(importlib.util.find_spec('fairscale')); print(oss_plus.__version__); "
        "print(importlib.metadata.version('oss_plus'))"
    )
    out = _run(venv / "bin" / "python", "-c", code, cwd=venv.parent).stdout.split()
    assert Path(out[0]).resolve().is_relative_to(venv.resolve()), out[0]
    assert not Path(out[0]).resolve().is_relative_to(ROOT), out[0]
    assert out[1] == "None"  # fairscale is hidden: the bench must skip its row
    # the wheel's metadata carries the package's version (setup.cfg: attr:), this checkout's
    (checkout,) = re.findall(r'^__version__ = "(.+)"$', (ROOT / "oss_plus" / "__init__.py")
                             .read_text(), re.M)  # fmt: skip
    assert out[2] == out[3] == checkout


def test_bench_runs_from_the_wheel(venv: Path) -> None:
    cli = venv / "bin" / "oss-plus"
    help_text = _run(cli, "bench", "--help", cwd=venv.parent).stdout
    assert "--ddp" in help_text and "--checkpoint" in help_text and "unavailable" not in help_text
    out = venv.parent / "bench-results"
    tiny = ("--size", "0.05", "--width", "64", "--world-size", "2", "--rounds", "1")
    quick = ("--steps", "2", "--warmup", "1", "--sweep-sizes", "", "--no-memory", "--no-plot")
    flags = ("--impls", ",".join(ROWS), "--out", out)
    done = _run(cli, "bench", *tiny, *quick, *flags, cwd=venv.parent, timeout=300.0)
    assert "skipping ['fairscale']: fairscale is not installed" in done.stderr  # progress
    for label in ("oss_plus OSS fp32", "torch ZeRO bucket view", "skipped fairscale OSS"):
        assert label in done.stdout, label
    data = json.loads((out / "bench.json").read_text())
    rows = data["rows"]
    assert list(rows) == ["oss_plus", "torch_zero_bv", "unsharded"]
    assert "fairscale is not installed" in data["skipped"]["fairscale"]
    for key, row in rows.items():
        assert len(row["times_s"]) == 2 and min(row["times_s"]) > 0, key
    # real optimizers ran: each sharded row holds the unsharded Adam state, split over 2 ranks
    total = rows["unsharded"]["state_bytes"][0]
    assert total > 0
    for key in ("oss_plus", "torch_zero_bv"):
        assert sum(rows[key]["state_bytes"]) == total and 0 not in rows[key]["state_bytes"], key
    # the same params on the wire as torch's, plus oss_plus's one fp32 status slot per owner
    # bucket (2 ranks, one dtype: docs/design.md, "When a step fails")
    assert rows["oss_plus"]["wire_bytes"] == rows["torch_zero_bv"]["wire_bytes"] + 2 * 4 > 8


def test_the_wheel_carries_the_license_it_declares(venv: Path) -> None:
    code = (
        "import importlib.metadata as m; d = m.distribution('oss_plus'); "
        "print(d.metadata.get('License-Expression') or d.metadata.get('License')); "
        "print(*[f.locate() for f in d.files or () if f.name == 'LICENSE'], sep='\\n')"
    )
    declared, *found = _run(venv / "bin" / "python", "-c", code, cwd=venv.parent).stdout.split("\n")
    assert declared == "BSD-3-Clause"
    (text,) = [Path(f).read_text() for f in found if f]  # exactly one copy, in the dist-info
    assert text == (ROOT / "LICENSE").read_text() and "BSD 3-Clause License" in text
