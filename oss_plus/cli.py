"""Command line: ``python -m oss_plus demo | bench | ckpt | plan ...`` (also ``oss-plus``).

Each subcommand lives with its feature: a module listed in :data:`COMMANDS` exposes
``register(subparsers)``, which adds its parser and sets ``func`` (``args -> exit code``).
"""

from __future__ import annotations

import argparse
import importlib
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
        description="oss_plus: sharded optimizer state (ZeRO-1) for torch.distributed.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMANDS.values():
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m oss_plus`` and ``oss-plus``."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError, FileNotFoundError, NotADirectoryError) as exc:
        print(f"oss-plus {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
