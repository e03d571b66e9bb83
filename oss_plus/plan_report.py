"""How evenly each partition rule spreads a model's optimizer state (PURE planning).

The report describes a model by one :class:`~oss_plus.partition.ParamSpec` per parameter,
built from a list of shapes (:func:`parse_shapes`, :func:`read_shapes`), from a built-in
model (:data:`MODELS`: shapes computed from the published configs, nothing downloaded) or
from a module factory ``"package.module:factory"`` (:func:`specs_from_module`, the model is
built on the meta device), then plans it with :func:`oss_plus.plan.make_plan` for every
rule and world size (:func:`balance_rows`). No process group is involved; ``torch`` is
imported only to load a module.

Also the ``oss-plus plan`` command (:func:`register`)::

    oss-plus plan --model llama2-7b --world-sizes 8,64,256,1024 --rules fairscale,torch,flat

Example:
    >>> rows = balance_rows(parse_shapes("10x10,10,5"), [2], ["torch", "flat"])
    >>> [(r.rule, r.world_size, r.max_load, r.empty) for r in rows]
    [('torch', 2, 100, 0), ('flat', 2, 80, 0)]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oss_plus.partition import ParamSpec, Rule
from oss_plus.plan import ShardPolicy, make_plan

__all__ = [
    "FLAT_ALIGN",
    "MODELS",
    "BalanceRow",
    "balance_rows",
    "gpt2_shapes",
    "llama_shapes",
    "model_specs",
    "parse_shapes",
    "read_shapes",
    "register",
    "specs_from_module",
    "specs_from_shapes",
]

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]

#: Element alignment of the flat rule's offsets in the report: fp32 on the CPU (64 bytes).
FLAT_ALIGN = 16
#: The one flat-buffer key of the report's specs (every param in one buffer).
FLAT_KEY = "cpu/torch.float32"

#: Raised for a shape that is not ``D1xD2x...`` with non-negative integers.
BAD_SHAPE = (
    "cannot read the shape {text!r}{where}: write a shape as dimensions joined by 'x' "
    "(4096x4096, 4096), shapes separated by commas, spaces or new lines"
)
#: Raised for a module spec that does not name a factory.
BAD_MODULE_SPEC = (
    "--module expects 'package.module:factory' (a callable returning a torch.nn.Module), "
    "got {spec!r}"
)
#: Raised for a module or factory that cannot be loaded.
NO_MODULE = "cannot load the model factory {spec!r}: {error}"
#: Raised for a factory that does not return a torch.nn.Module.
NOT_A_MODULE = "the model factory {spec!r} returned {kind}, expected a torch.nn.Module"
#: Raised for a model name that is not built in.
UNKNOWN_MODEL = "unknown model {name!r}: choose one of {known}"
#: Raised when no parameter would carry optimizer state.
NO_TRAINABLE = "the model has no trainable parameters: nothing to partition"

_SHAPE = re.compile(r"[0-9]+(x[0-9]+)*")


# ------------------------------------------------------------------ shapes -> specs
def specs_from_shapes(shapes: Iterable[Sequence[int]], trainable: bool = True) -> list[ParamSpec]:
    """Return one :class:`ParamSpec` per shape (its element count; a ``()`` shape is 1).

    Example:
        >>> [s.numel for s in specs_from_shapes([(4, 3), (3,), ()])]
        [12, 3, 1]
    """
    return [ParamSpec(math.prod(shape), trainable) for shape in shapes]


def _parse_shape(text: str, where: str = "") -> Shape:
    if not _SHAPE.fullmatch(text):
        raise ValueError(BAD_SHAPE.format(text=text, where=where))
    return tuple(int(d) for d in text.split("x"))


def parse_shapes(text: str) -> list[ParamSpec]:
    """Parse ``"4096x4096,4096"`` (shapes separated by commas, spaces or new lines; ``#``
    starts a comment) into trainable specs.

    Raises:
        ValueError: a shape that is not ``D1xD2x...``, or no shape at all.

    Example:
        >>> [s.numel for s in parse_shapes("4x3, 3  # a bias")]
        [12, 3]
    """
    shapes = []
    for number, line in enumerate(text.splitlines(), 1):
        for token in re.split(r"[,\s]+", line.split("#", 1)[0]):
            if token:
                shapes.append(_parse_shape(token.lower(), f" (line {number})"))
    if not shapes:
        raise ValueError(f"no shapes in {text!r}: write them as 4096x4096,4096")
    return specs_from_shapes(shapes)


def _json_shapes(text: str, source: str) -> list[ParamSpec]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON: {exc}") from None
    ok = isinstance(data, list) and all(
        isinstance(s, list) and all(type(d) is int and d >= 0 for d in s) for s in data
    )
    if not ok or not data:
        raise ValueError(
            f"{source} must hold a JSON list of shapes, each a list of non-negative integers "
            f"([[4096, 4096], [4096]]), got {text[:60]!r}"
        )
    return specs_from_shapes(data)


def read_shapes(source: str) -> list[ParamSpec]:
    """Read shapes from a file (a JSON list of lists, or the text form of
    :func:`parse_shapes`) or, when ``source`` is no file, from ``source`` itself.

    Raises:
        ValueError: an unreadable file or shape, naming the file and the expected form.
    """
    path = Path(source)
    if not path.is_file():
        try:
            return parse_shapes(source)
        except ValueError as exc:
            raise ValueError(f"{source!r} is no file, and {exc}") from None
    text = path.read_text()
    if text.lstrip().startswith("["):
        return _json_shapes(text, str(path))
    try:
        return parse_shapes(text)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


# ------------------------------------------------------------------ module -> specs
def _factory(spec: str) -> Callable[[], Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(BAD_MODULE_SPEC.format(spec=spec))
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as exc:  # the user's module may raise anything on import
        raise ValueError(NO_MODULE.format(spec=spec, error=f"{type(exc).__name__}: {exc}")) from exc
    if not callable(target):
        raise ValueError(NO_MODULE.format(spec=spec, error=f"{attr!r} is not callable"))
    return target


def specs_from_module(spec: str) -> list[ParamSpec]:
    """Build the model of ``"package.module:factory"`` and return a spec per parameter.

    The factory is called with no arguments under ``torch.device("meta")``, so that no
    memory is allocated; a factory that fails there is called again on the default device
    (with a warning). Tied parameters count once; ``trainable`` is ``requires_grad``.

    Raises:
        ValueError: a spec that does not name a callable, a module that cannot be
            imported, a factory that raises or returns something other than a module.
    """
    factory = _factory(spec)
    import torch  # only here: the rest of the report is pure

    try:
        with torch.device("meta"):
            model = factory()
    except Exception as exc:  # any failure on meta: retry for real
        logger.warning("%s failed on the meta device (%s); building it for real", spec, exc)
        try:
            model = factory()
        except Exception as again:
            error = f"{type(again).__name__}: {again}"
            raise ValueError(NO_MODULE.format(spec=spec, error=error)) from again
    if not isinstance(model, torch.nn.Module):
        raise ValueError(NOT_A_MODULE.format(spec=spec, kind=type(model).__name__))
    return [ParamSpec(p.numel(), p.requires_grad) for p in model.parameters()]


# ------------------------------------------------------------------ built-in models
def llama_shapes(
    dim: int, layers: int, heads: int, ffn: int, vocab: int, kv_heads: int | None = None
) -> list[Shape]:
    """Return the parameter shapes of a Llama(-2) model (untied embeddings, RMSNorm, no
    biases; grouped-query attention when ``kv_heads < heads``).

    Example:
        >>> sum(math.prod(s) for s in llama_shapes(4096, 32, 32, 11008, 32000))
        6738415616
    """
    kv = dim // heads * (kv_heads or heads)
    layer: list[Shape] = [(dim, dim), (kv, dim), (kv, dim), (dim, dim)]  # q, k, v, o (out, in)
    layer += [(ffn, dim), (ffn, dim), (dim, ffn), (dim,), (dim,)]  # gate, up, down, 2 norms
    return [(vocab, dim), *layer * layers, (dim,), (vocab, dim)]


def gpt2_shapes(n_embd: int, layers: int, vocab: int, n_ctx: int) -> list[Shape]:
    """Return the parameter shapes of GPT-2 (``lm_head`` tied to ``wte``, counted once).

    Example:
        >>> sum(math.prod(s) for s in gpt2_shapes(1600, 48, 50257, 1024))
        1557611200
    """
    d = n_embd
    # ln_1 weight + bias, attn.c_attn weight (in, out) + bias, attn.c_proj; then ln_2, mlp
    layer: list[Shape] = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]
    layer += [(d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]  # ln_2, c_fc, c_proj
    return [(vocab, d), (n_ctx, d), *layer * layers, (d,), (d,)]


#: Built-in models: name -> shapes from the published config.
MODELS: dict[str, Callable[[], list[Shape]]] = {
    "llama2-7b": lambda: llama_shapes(4096, 32, 32, 11008, 32000),
    "llama2-70b": lambda: llama_shapes(8192, 80, 64, 28672, 32000, kv_heads=8),
    "gpt2-xl": lambda: gpt2_shapes(1600, 48, 50257, 1024),
}


def model_specs(name: str) -> list[ParamSpec]:
    """Return the specs of the built-in model ``name`` (see :data:`MODELS`).

    Raises:
        ValueError: an unknown name.
    """
    if name not in MODELS:
        raise ValueError(UNKNOWN_MODEL.format(name=name, known=sorted(MODELS)))
    return specs_from_shapes(MODELS[name]())


# ------------------------------------------------------------------ the report
@dataclass(frozen=True)
class BalanceRow:
    """The optimizer-state balance of one rule at one world size.

    Attributes:
        rule: the partition rule's value.
        world_size: the number of ranks N.
        max_load: trainable elements of the most loaded rank.
        ideal: total trainable elements / N.
        empty: ranks that own no trainable element (no optimizer state).
    """

    rule: str
    world_size: int
    max_load: int
    ideal: float
    empty: int

    @property
    def ratio(self) -> float:
        """``max_load / ideal``: 1.0 is a perfect balance."""
        return self.max_load / self.ideal

    def as_dict(self) -> dict[str, Any]:
        """Return the row as plain JSON data (the ratio included)."""
        return {**dataclasses.asdict(self), "ratio": self.ratio}


def balance_rows(
    specs: Sequence[ParamSpec],
    world_sizes: Iterable[int],
    rules: Iterable[Rule | str],
    align: int = FLAT_ALIGN,
) -> list[BalanceRow]:
    """Plan ``specs`` (one param group) for every rule and world size.

    Args:
        specs: one spec per parameter; frozen ones carry no optimizer state.
        world_sizes: the numbers of ranks N to plan for.
        rules: :class:`~oss_plus.partition.Rule` s or their values.
        align: under the flat rule every spec gets this ``align`` and the one key
            :data:`FLAT_KEY` (the report puts every parameter in one buffer).

    Returns:
        One row per (rule, world size), rules outermost, in the given orders.

    Raises:
        ValueError: a world size < 1, an unknown rule, or no trainable parameter.
    """
    total = sum(s.numel for s in specs if s.trainable)
    if total == 0:
        raise ValueError(NO_TRAINABLE)
    flat = [dataclasses.replace(s, key=FLAT_KEY, align=align) for s in specs]
    rows = []
    world_sizes = list(world_sizes)
    for rule in map(Rule, rules):
        for n in world_sizes:
            if n < 1:
                raise ValueError(f"world sizes must be >= 1, got {n}")
            groups = [flat if rule is Rule.FLAT else list(specs)]
            loads = make_plan(groups, n, ShardPolicy(rule=rule)).rank_loads()
            rows.append(BalanceRow(rule.value, n, max(loads), total / n, loads.count(0)))
    return rows


# ------------------------------------------------------------------ oss-plus plan
def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas (8,64,256), got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def _rules(text: str) -> list[Rule]:
    try:
        return [Rule(r.strip()) for r in text.split(",")]
    except ValueError:
        known = ",".join(r.value for r in Rule)
        raise argparse.ArgumentTypeError(f"rules are among {known}, got {text!r}") from None


def register(subparsers: Any) -> None:
    """Add the ``plan`` subcommand (the balance table of :func:`balance_rows`)."""
    parser = subparsers.add_parser(
        "plan",
        help="how evenly each partition rule spreads a model's optimizer state",
        description="Plan a model's parameters over N ranks by each partition rule (no "
        "processes) and print the largest rank's trainable elements over the ideal 1/N.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=sorted(MODELS), help="a built-in model")
    source.add_argument(
        "--shapes", metavar="FILE_OR_LIST", help="shapes: '4096x4096,4096', or a file of them"
    )
    source.add_argument(
        "--module",
        metavar="PKG.MOD:FACTORY",
        help="a callable returning a torch.nn.Module (built on the meta device; import path "
        "from PYTHONPATH)",
    )
    parser.add_argument(
        "--world-sizes", type=_positive_ints, default=[8, 64, 256, 1024], metavar="N,N,..."
    )
    parser.add_argument(
        "--rules", type=_rules, default=list(Rule), metavar="RULE,...", help="default: all"
    )
    parser.add_argument(
        "--align",
        type=lambda t: _positive_ints(t)[0],
        default=FLAT_ALIGN,
        help=f"element alignment of the flat rule (default {FLAT_ALIGN}: fp32, 64 bytes)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_plan)


def _source_specs(args: argparse.Namespace) -> tuple[str, list[ParamSpec]]:
    if args.model is not None:
        return args.model, model_specs(args.model)
    if args.shapes is not None:
        return args.shapes, read_shapes(args.shapes)
    return args.module, specs_from_module(args.module)


def _plan(args: argparse.Namespace) -> int:
    name, specs = _source_specs(args)
    rows = balance_rows(specs, args.world_sizes, args.rules, args.align)
    total = sum(s.numel for s in specs)
    trainable = sum(s.numel for s in specs if s.trainable)
    if args.json:
        report = {"source": name, "params": len(specs), "elements": total}
        report |= {"trainable": trainable, "align": args.align}
        print(json.dumps({**report, "rows": [r.as_dict() for r in rows]}, indent=2))
        return 0
    print(f"{name}: {len(specs)} params, {total:,} elements, {trainable:,} trainable")
    table = [["rule", "N", "ideal", "max rank", "max/ideal", "empty"]]
    for r in rows:
        cells = [f"{r.ideal:,.0f}", f"{r.max_load:,}", f"{r.ratio:.3f}", str(r.empty)]
        table.append([r.rule, str(r.world_size), *cells])
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    for row in table:
        line = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        print("  ".join(line), file=sys.stdout)
    return 0
