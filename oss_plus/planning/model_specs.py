"""Describe a model by one :class:`~oss_plus.planning.partition.ParamSpec` per parameter (PURE,
except that a module factory is imported and built on the meta device).

From a list of shapes (:func:`parse_shapes`, :func:`read_shapes`), from a built-in model
(:data:`MODELS`: shapes computed from the published configs, nothing downloaded) or from a
module factory ``"package.module:factory"`` (:func:`specs_from_module`). What
``oss-plus plan`` (:mod:`oss_plus.planning.report`) plans.

Example:
    >>> [s.numel for s in parse_shapes("10x10,10,5")]
    [100, 10, 5]
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from oss_plus.planning.partition import ParamSpec

__all__ = [
    "BAD_MODULE_SPEC",
    "BAD_SHAPE",
    "EMBEDDINGS",
    "MODELS",
    "NOT_A_MODULE",
    "NO_MODULE",
    "UNKNOWN_MODEL",
    "gpt2_shapes",
    "llama_shapes",
    "model_specs",
    "module_embeddings",
    "parse_shapes",
    "read_shapes",
    "specs_from_module",
    "specs_from_shapes",
]

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]
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

_SHAPE = re.compile(r"[0-9]+(x[0-9]+)*")


# ------------------------------------------------------------------ shapes -> specs
def specs_from_shapes(shapes: Iterable[Sequence[int]], trainable: bool = True) -> list[ParamSpec]:
    """Return one :class:`ParamSpec` per shape (its element count; a ``()`` shape is 1).

    Example:
        >>> [s.numel for s in specs_from_shapes([(4, 3), (3,), ()])]
        [12, 3, 1]
    """
    return [ParamSpec(math.prod(shape), trainable, shape=tuple(shape)) for shape in shapes]


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
    model = _build(spec)
    return [ParamSpec(p.numel(), p.requires_grad, shape=tuple(p.shape)) for p in model.parameters()]


def module_embeddings(spec: str) -> tuple[int, ...]:
    """The indices, among the params of :func:`specs_from_module`, of the weights of the
    model's ``torch.nn.Embedding`` s and of the other 2-D params of an embedding's shape (an
    untied output head): what Muon leaves to a second optimizer.

    Raises:
        ValueError: as :func:`specs_from_module`.
    """
    import torch

    model = _build(spec)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    params = list(model.parameters())
    shapes = {tuple(p.shape) for p in params if id(p) in tables}
    return tuple(
        i
        for i, p in enumerate(params)
        if id(p) in tables or (p.ndim == 2 and tuple(p.shape) in shapes)
    )


def _build(spec: str) -> Any:
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
    return model


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

#: Built-in models: name -> the indices in its shapes of the embeddings and the output head
#: (negative: from the end), which Muon leaves to a second optimizer.
EMBEDDINGS: dict[str, tuple[int, ...]] = {
    "llama2-7b": (0, -1),
    "llama2-70b": (0, -1),
    "gpt2-xl": (0, 1),  # wte (the head is tied to it) and wpe
}


def model_specs(name: str) -> list[ParamSpec]:
    """Return the specs of the built-in model ``name`` (see :data:`MODELS`).

    Raises:
        ValueError: an unknown name.
    """
    if name not in MODELS:
        raise ValueError(UNKNOWN_MODEL.format(name=name, known=sorted(MODELS)))
    return specs_from_shapes(MODELS[name]())
