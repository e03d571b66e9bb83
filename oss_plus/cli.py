"""Command line: ``python -m oss_plus demo | bench | ckpt | plan ...`` (also ``oss-plus``).

Each subcommand lives with its feature: a module listed in :data:`COMMANDS` exposes
``register(subparsers)``, which adds its parser and sets ``func`` (``args -> exit code``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

#: Subcommand name -> module that registers it.
COMMANDS = {
    "demo": "oss_plus.demo",
    "bench": "oss_plus.bench.cli",
    "ckpt": "oss_plus.checkpoint.cli",
    "plan": "oss_plus.planning.report",
}


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``oss-plus`` command."""
    parser = argparse.ArgumentParser(
        prog="oss-plus",
        description="oss_plus: sharded optimizer state and gradients (ZeRO-1 and ZeRO-2) for "
        "torch.distributed.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMANDS.values():
        importlib.import_module(module_name).register(sub)
    return parser


#: The exit status after a reader closed stdout early (``oss-plus ... | head``): 128 + SIGPIPE,
#: what a shell reports for a Unix tool that SIGPIPE ended.
EXIT_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m oss_plus`` and ``oss-plus``.

    A reader that closes the pipe early (``| head``) ends the command quietly with
    :data:`EXIT_PIPE`: stdout is flushed here, where the closed pipe shows, and then pointed at
    ``os.devnull`` so that the interpreter's own flush at exit finds nothing to fail on (the
    Python docs' "Note on SIGPIPE", module :mod:`signal`).
    """
    try:
        try:
            return _main(argv)
        finally:  # also after argparse's SystemExit (--help)
            sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_PIPE


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError, FileNotFoundError, NotADirectoryError) as exc:
        print(f"oss-plus {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _stdout_to_devnull() -> None:
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's StringIO)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
