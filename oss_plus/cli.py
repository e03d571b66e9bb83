"""Command line: ``python -m oss_plus demo | bench | ckpt ...`` (also ``oss-plus``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    from oss_plus.demo import run_demo

    print(run_demo(world_size=args.world_size, steps=args.steps, width=args.width, depth=args.depth))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``oss-plus`` command."""
    parser = argparse.ArgumentParser(
        prog="oss-plus",
        description="oss_plus: sharded optimizer state (ZeRO-1) for torch.distributed.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="train a small model with DDP + OSS on local gloo ranks and print a report",
        description="Spawn local gloo ranks, train a small MLP with DDP + oss_plus.OSS(Adam) and "
                    "with DDP + plain Adam, and compare losses, state size and step time.",
    )
    demo.add_argument("--world-size", type=int, default=2, help="number of ranks (default 2)")
    demo.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    demo.add_argument("--width", type=int, default=256, help="hidden width (default 256)")
    demo.add_argument("--depth", type=int, default=4, help="hidden layers (default 4)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m oss_plus`` and ``oss-plus``."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"oss-plus {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
