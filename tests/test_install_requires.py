"""A newcomer's first command prints only its report (issue 15).

Without numpy, ``import torch`` warns "Failed to initialize NumPy" in every process (three
times for ``python -m oss_plus demo``): numpy is therefore an install requirement.
"""

import configparser
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_numpy_is_an_install_requirement():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requires = config["options"]["install_requires"].split()
    assert any(r.startswith("numpy") for r in requires), requires


def test_importing_oss_plus_prints_no_numpy_warning():
    done = subprocess.run(
        [sys.executable, "-c", "import oss_plus, numpy; print(numpy.__name__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert done.stdout.strip() == "numpy"
    assert "NumPy" not in done.stderr, done.stderr
