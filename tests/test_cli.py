"""The ``oss-plus`` entry point: every command ends quietly when its reader closes the pipe
(``python -m oss_plus ... | head``), as Unix tools do."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oss_plus import cli

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = str(ROOT / "tests" / "fixtures" / "checkpoint_v1" / "sharded")


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["plan", "--model", "llama2-7b"],
        ["ckpt", "inspect", FIXTURE],
        ["bench", "--no-plot"],  # its first line goes out before any rank starts
    ],
    ids=["help", "plan", "inspect", "bench"],
)
def test_a_command_whose_reader_is_gone_exits_quietly(argv, tmp_path):
    """The reader closes the pipe before the command writes anything (``| head -0``), so
    every write fails: the command must still end with 141 (0 where argparse swallowed the
    error itself: --help) and a quiet stderr. One case per kind of output; the demo and
    ``ckpt inspect --verify`` take the same path through :func:`oss_plus.cli.main`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "oss_plus", *argv],
        cwd=tmp_path,  # bench-results/ (if any) goes there
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, cli.EXIT_PIPE), err[-3000:]
    assert proc.returncode == cli.EXIT_PIPE or argv == ["--help"]
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-3000:]
    if argv[0] == "bench":
        assert not (tmp_path / "bench-results").exists()  # it stopped at its first line


class _ClosedPipe(io.StringIO):
    """A stdout whose reader is gone: every flush fails as a closed pipe does."""

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_main_turns_a_broken_pipe_into_141_and_keeps_other_errors(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert cli.main(["plan", "--shapes", "4x4", "--world-sizes", "2"]) == cli.EXIT_PIPE
    monkeypatch.undo()
    assert cli.main(["plan", "--shapes", "4x4", "--world-sizes", "2"]) == 0
    assert "4x4: 1 params, 16 elements" in capsys.readouterr().out
    assert cli.main(["plan", "--shapes", "0x4"]) == 2  # a bad input is still a one-line error
    assert capsys.readouterr().err.startswith("oss-plus plan: error:")


def test_the_package_names_its_stages_alike_everywhere():
    """setup.cfg (what ``pip show`` prints), the CLI's help, the package's docstring and the
    README's first line all say ZeRO-1 and ZeRO-2; the metadata names its authors."""
    import configparser

    import oss_plus

    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    readme = (ROOT / "README.md").read_text().split("\n\n")[1]
    texts = {
        "setup.cfg": setup["metadata"]["description"],
        "oss-plus --help": cli.build_parser().description or "",
        "oss_plus.__doc__": (oss_plus.__doc__ or "").splitlines()[0],
        "README.md": readme,
    }
    for where, text in texts.items():
        assert "ZeRO-1" in text and "ZeRO-2" in text, where
        assert "stage 1" not in text and "(ZeRO-1)" not in text, where
    assert setup["metadata"]["author"] == "the oss_plus authors"
    assert "the oss_plus authors" in (ROOT / "LICENSE").read_text()
