"""Helpers shared by tests/ and compat/, imported inside the pool's workers too.

pytest puts tests/ on ``sys.path`` (``pythonpath`` in pyproject.toml), so every suite imports
this module as ``helpers``; the pool's workers get the parent's ``sys.path`` and import it by
the same name when they unpickle a task function.

Three families of models and data, kept apart because each suite's exact numbers (which params
rounding touches, which rank owns what) depend on them:

* the unit suites of tests/: :func:`make_model`, :func:`batch`, :func:`backward`, :func:`train`;
* the differential suites of compat/: :func:`make_diff_model`, :func:`diff_loss`,
  :func:`train_diff`, :data:`SGD_AND_ADAM`;
* DDP with the overlapped step (tests/test_overlap.py, compat/test_overlap_diff.py):
  :func:`make_overlap_model`, :func:`overlap_loss`, :func:`ddp_of`, :data:`OVERLAP_OPTIMIZERS`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from oss_plus.wire.sync import transport_override as transport  # noqa: F401 - shared name

#: The repository root (the checkout the tests run from).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------ process groups
#: The process-group configurations every distributed behaviour is checked on.
WORLDS = [{"world_size": n} for n in (1, 2, 3, 4)] + [{"ranks": (2, 3)}]
WORLD_IDS = ["ws1", "ws2", "ws3", "ws4", "offset23"]
#: :data:`WORLDS` without the single rank (DDP's overlap needs someone to talk to).
MULTI_RANK_WORLDS = WORLDS[1:]
MULTI_RANK_WORLD_IDS = WORLD_IDS[1:]

#: Parameter-sync transports of oss_plus.wire.sync, selected with :func:`transport`.
TRANSPORTS = ["broadcast", "all_gather"]

#: Optimizers as name -> (class, kwargs): a stateful SGD and Adam.
SGD_AND_ADAM: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
}


# ------------------------------------------------------------------ data and training
def batch(step: int, width: int = 6, n: int = 5, rank: int = 0) -> torch.Tensor:
    """A batch that depends on ``step`` and ``rank`` only: the same on every process (so grads
    agree without DDP) unless ``rank`` differs."""
    return torch.randn(n, width, generator=torch.Generator().manual_seed(1000 * rank + 100 + step))


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    """The unit suites' loss: :func:`make_model` on :func:`batch`."""
    return model(batch(step)).pow(2).mean()


def backward(model: torch.nn.Module, step: int) -> torch.Tensor:
    loss = loss_of(model, step)
    loss.backward()
    return loss


def diff_loss(model: torch.nn.Module, step: int, rank: int = 0) -> torch.Tensor:
    """The differential suites' loss: :func:`make_diff_model` on 6 rows."""
    return model(batch(step, width=8, n=6, rank=rank)).pow(2).mean()


def train(
    model: torch.nn.Module,
    opt: Any,
    steps: int,
    start: int = 0,
    scheduler: Any = None,
    use_closure: bool = False,
    loss_fn: Callable[[torch.nn.Module, int], torch.Tensor] = loss_of,
) -> list[float]:
    """Plain training loop returning the losses; optionally with a closure (odd steps) and an
    LR scheduler (stepped after every optimizer step)."""
    losses = []
    for step in range(start, start + steps):
        if use_closure and step % 2:

            def closure(step: int = step) -> torch.Tensor:
                opt.zero_grad()
                loss = loss_fn(model, step)
                loss.backward()
                return loss

            losses.append(opt.step(closure).item())
        else:
            opt.zero_grad()
            loss = loss_fn(model, step)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if scheduler is not None:
            scheduler.step()
    return losses


def train_diff(model: torch.nn.Module, opt: Any, steps: int, start: int = 0, **kw: Any):
    """:func:`train` on the differential suites' data (:func:`diff_loss`)."""
    return train(model, opt, steps, start, loss_fn=diff_loss, **kw)


def overlap_loss(model: torch.nn.Module, it: int, rank: int) -> torch.Tensor:
    """A different batch on every rank, so DDP's averaging matters."""
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1000 * rank + it))
    return model(x).pow(2).mean()


# ------------------------------------------------------------------ models and param groups
def make_model(seed: int = 0, width: int = 6, depth: int = 3) -> torch.nn.Module:
    """The unit suites' MLP: params of different sizes, identical for a given seed."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    sizes = [width + 2 * i for i in range(depth + 1)]
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(sizes[-1], 1))
    return torch.nn.Sequential(*layers)


def make_cut_model(seed: int = 0) -> torch.nn.Module:
    """29 x (Linear(6, 6) + Tanh): under the flat rule on 2-4 ranks some param is cut by a
    range boundary, and the params cut hold at most ``SLOTTED_SHARE`` of the elements, so
    broadcast ranges carry their status slots (:func:`oss_plus.wire.layout.flat_buckets`)."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(29):
        layers += [torch.nn.Linear(6, 6), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def make_diff_model(seed: int = 0, width: int = 8) -> torch.nn.Module:
    """The differential suites' MLP (matmuls, so the memory layout of params matters for
    rounding)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width + 4),
        torch.nn.Tanh(),
        torch.nn.Linear(width + 4, width + 2),
        torch.nn.Tanh(),
        torch.nn.Linear(width + 2, 1),
    )


#: Optimizers of the overlap suites as name -> (class, kwargs).
OVERLAP_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}
#: Small DDP buckets (about 157 floats): :func:`make_overlap_model` spans 3 buckets of 2-4
#: params once DDP rebuilt them, and with torch's ``shard_buckets`` some bucket is cut across
#: ranks at every world size from 2 to 4.
BUCKET_CAP_MB = 0.0006


def make_overlap_model(seed: int = 0) -> torch.nn.Module:
    """The overlap suites' model (its params fill several :data:`BUCKET_CAP_MB` buckets)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 6),
        torch.nn.Tanh(),
        torch.nn.Linear(6, 6),
        torch.nn.Tanh(),
        torch.nn.Linear(6, 60),
        torch.nn.Linear(60, 4),
    )


def ddp_of(
    ctx: Any, model: torch.nn.Module, static: bool = False, gabv: bool = False
) -> DistributedDataParallel:
    """DDP over the task's group with :data:`BUCKET_CAP_MB` buckets."""
    return DistributedDataParallel(
        model,
        process_group=ctx.group,
        bucket_cap_mb=BUCKET_CAP_MB,
        static_graph=static,
        gradient_as_bucket_view=gabv,
    )


def with_extra_layer(
    kinds: Iterable[str],
) -> Iterator[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """Per kind: fresh copies of one :func:`make_diff_model` and of an 8x8 layer put in front of
    it (a param group to add later), the same for every kind."""
    torch.manual_seed(3)
    model, extra = make_diff_model(), torch.nn.Linear(8, 8)
    for kind in kinds:
        yield kind, copy.deepcopy(model), copy.deepcopy(extra)


def extra_layer_loss(model: torch.nn.Module, extra: torch.nn.Module, step: int) -> torch.Tensor:
    """The loss of ``model`` behind ``extra`` (see :func:`with_extra_layer`)."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
    return model(torch.tanh(extra(x))).pow(2).mean()


def clone_model(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def clones(model: torch.nn.Module, n: int) -> list[torch.nn.Module]:
    return [copy.deepcopy(model) for _ in range(n)]


def groups_of(model: torch.nn.Module, two_groups: bool = True) -> list[dict[str, Any]]:
    """Two param groups (every other param) with different learning rates, or one group."""
    params = list(model.parameters())
    if not two_groups:
        return [{"params": params}]
    return [{"params": params[::2]}, {"params": params[1::2], "lr": 0.003}]


def index_of(model_params: list[torch.Tensor]) -> Callable[[torch.Tensor], int]:
    ids = {id(p): i for i, p in enumerate(model_params)}
    return lambda p: ids[id(p)]


def partition_indices(opt: Any, params: list[torch.Tensor], method: str) -> list[list[list[int]]]:
    """Per rank, per group, the indices (in ``params``) of the params the rank owns."""
    idx = index_of(params)
    return [[[idx(p) for p in g["params"]] for g in groups] for groups in getattr(opt, method)()]


class KwargSGD(torch.optim.SGD):
    """An optimizer whose step takes an extra keyword (as apex's fused optimizers do)."""

    def step(self, closure=None, scale=1.0):
        for group in self.param_groups:
            group["seen_scale"] = scale
        return super().step(closure)


@contextlib.contextmanager
def wire_traffic() -> Iterator[list[tuple[str, torch.dtype, int]]]:
    """Record ``(collective, dtype, bytes)`` of every tensor the parameter sync hands to
    ``torch.distributed`` inside the block: the broadcast tensor, or the whole output of an
    all_gather (every rank's region). Measured at the call, not taken from the layout's own
    bookkeeping (``wire_bytes()``)."""
    import torch.distributed as dist

    from oss_plus.wire import sync

    seen: list[tuple[str, torch.dtype, int]] = []
    broadcast, gather = dist.broadcast, sync._all_gather_single

    def counting_broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(("broadcast", tensor.dtype, tensor.numel() * tensor.element_size()))
        return broadcast(tensor, *args, **kwargs)

    def counting_gather(out: torch.Tensor, mine: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(("all_gather", out.dtype, out.numel() * out.element_size()))
        return gather(out, mine, *args, **kwargs)

    dist.broadcast, sync._all_gather_single = counting_broadcast, counting_gather
    try:
        yield seen
    finally:
        dist.broadcast, sync._all_gather_single = broadcast, gather


#: The ``torch.distributed`` functions :func:`collective_tensors` watches.
WATCHED_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "gather",
    "send",
    "recv",
    "isend",
    "irecv",
)


@contextlib.contextmanager
def collective_tensors() -> Iterator[list[tuple[str, torch.Tensor, int]]]:
    """Record ``(collective, tensor, use count before the call)`` of every tensor handed to
    the functions of :data:`WATCHED_COLLECTIVES` inside the block (lists of tensors too).

    Taken at the ``torch.distributed`` call, not from oss_plus's own bookkeeping: after the
    caller returned, a use count still above the recorded one means gloo's worker still holds
    the tensor (it drops it after ``wait()`` returned; docs/reliability.md, "Process exit").
    """
    import torch.distributed as dist

    seen: list[tuple[str, torch.Tensor, int]] = []
    real = {name: getattr(dist, name) for name in WATCHED_COLLECTIVES}

    def tensors_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        for value in (*args, *kwargs.values()):
            items = value if isinstance(value, (list, tuple)) else [value]
            found += [t for t in items if isinstance(t, torch.Tensor)]
        return found

    def watching(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.extend((name, t, t._use_count()) for t in tensors_in(args, kwargs))
            return real[name](*args, **kwargs)

        return call

    for name in WATCHED_COLLECTIVES:
        setattr(dist, name, watching(name))
    try:
        yield seen
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def still_held(seen: list[tuple[str, torch.Tensor, int]]) -> list[tuple[str, int, int]]:
    """``(collective, use count now, before)`` of the recorded tensors still held by a
    collective (see :func:`collective_tensors`)."""
    return [(name, t._use_count(), count) for name, t, count in seen if t._use_count() > count]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def logged(name: str) -> Iterator[list[str]]:
    """The messages logged to logger ``name`` inside the block (also on a pool worker)."""
    records, log = _Records(), logging.getLogger(name)
    log.addHandler(records)
    try:
        yield records.messages
    finally:
        log.removeHandler(records)


# ------------------------------------------------------------------ params and comparisons
def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """All params of ``model`` in one new 1-d tensor."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def flat_double(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """``params`` in one 1-d float64 tensor (mixed dtypes compare without rounding)."""
    return torch.cat([p.detach().reshape(-1).double() for p in params])


def load_flat(model: torch.nn.Module, values: torch.Tensor) -> None:
    """Copy ``values`` (as from :func:`flat_params`) into the params of ``model``."""
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(values[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def state_equal(a: dict, b: dict) -> bool:
    """Exact equality of two torch.optim state dicts (tensors, values and groups)."""
    if sorted(a["state"]) != sorted(b["state"]) or a["param_groups"] != b["param_groups"]:
        return False
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        if sorted(sa) != sorted(sb):
            return False
        for key in sa:
            x, y = sa[key], sb[key]
            if isinstance(x, torch.Tensor):
                if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                    return False
            elif x != y:
                return False
    return True


def same_value(a: Any, b: Any) -> bool:
    """Exact, dtype-sensitive equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return bool(a == b)


# ------------------------------------------------------------------ scenarios of several suites
def train_in_lockstep(
    model: torch.nn.Module, opt: Any, ref_model: torch.nn.Module, ref: Any, steps: int
) -> list[bool]:
    """Train both pairs on the same batches; after each step, whether params are identical."""
    exact = []
    for step in range(steps):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            backward(m, step)
            o.step()
        exact.append(params_equal(model, ref_model))
    return exact


def mixed_dtype_training(
    make: Callable[[str, list[torch.nn.Parameter]], Any], kinds: Iterable[str]
) -> dict[str, tuple[str, Any]]:
    """Three steps on fp32, fp64 and fp32 params (5, 3 and 4 elements: on 2 ranks fairscale's
    partition gives rank 1 the fp64 one and the last one) with ``make(kind, params)``, per kind.

    Returns per kind ("constructor", error type name) when ``make`` raised, else the status of
    the steps (as :func:`catch` names it) and the params after them.
    """
    torch.manual_seed(0)
    values = [torch.randn(5), torch.randn(3, dtype=torch.float64), torch.randn(4)]
    out: dict[str, tuple[str, Any]] = {}
    for kind in kinds:
        params = [torch.nn.Parameter(v.clone()) for v in values]
        made = catch(make, kind, params)
        if made[0] != "ok":
            out[kind] = ("constructor", made[0])
            continue

        def steps(opt: Any = made[1], params: list[torch.nn.Parameter] = params) -> None:
            for _ in range(3):
                opt.zero_grad()
                sum((p.double() ** 2).sum() for p in params).backward()
                opt.step()

        out[kind] = (catch(steps)[0], [p.detach().clone() for p in params])
    return out


def loads_without_touching(model: torch.nn.Module, opt: Any, sd: dict) -> bool:
    """Load ``sd`` into ``opt`` and train a step: whether the caller's ``sd`` kept its entries
    and values (neither mutated by the load nor aliased by the optimizer's state)."""
    pristine = copy.deepcopy(sd)
    opt.load_state_dict(sd)
    train(model, opt, 1)
    same = all(
        torch.equal(pristine["state"][i][k], sd["state"][i][k])
        for i in sd["state"]
        for k in sd["state"][i]
    )
    return same and sd["state"].keys() == pristine["state"].keys()


# ------------------------------------------------------------------ optimizers
class ShampooLike(torch.optim.Optimizer):
    """A per-param optimizer whose state nests tensors (a test double of Shampoo).

    Per param: ``pre`` is a dict holding a list of two preconditioner tensors and a tuple
    ``(int, float)``; ``count`` an int, ``warm`` a bool, ``none`` None, ``scale`` a 0-dim
    tensor and ``hist`` a fixed-size ``(3,)`` histogram (legal on a param of any shape). The
    update reads all of them, so state that is lost, mis-typed or moved to another param
    changes the parameters.
    """

    def __init__(self, params: Any, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["pre"] = {
                        "mats": [torch.zeros_like(p), torch.zeros_like(p)],
                        "k": (1, 2.5),
                    }
                    state["count"] = 0
                    state["warm"] = False
                    state["none"] = None
                    state["scale"] = torch.tensor(1.0)
                    state["hist"] = torch.zeros(3)
                mats = state["pre"]["mats"]
                mats[0].addcmul_(g, g)
                mats[1].mul_(0.9).add_(g)
                state["scale"].mul_(0.99)
                state["count"] += 1
                state["hist"].add_(torch.histc(g, bins=3, min=-1.0, max=1.0))
                k0, k1 = state["pre"]["k"]
                state["pre"]["k"] = (k0 + 1, k1 * 0.5)
                boost = (2.0 if state["warm"] else 1.0) * (1.0 + state["hist"].sum() / 1000) * k1
                update = mats[1] / (mats[0].sqrt() + 1e-8)
                p.sub_(update * (group["lr"] * boost * state["scale"] / state["count"]))
                state["warm"] = state["count"] > 1
        return None


# ------------------------------------------------------------------ errors as data
def catch(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """Run ``fn``; return ("ok", result) or (exception type name, message).

    Lets a pool task return an error as data, so a test can assert that every rank raised.
    """
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return (type(exc).__name__, str(exc))


def caught(ctx: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """Pool task: run ``fn(ctx, *args, **kwargs)`` and return :func:`catch`'s result."""
    return catch(fn, ctx, *args, **kwargs)


def run_python(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` from the repository root in a fresh interpreter; assert exit 0.

    Run once: a process that aborts at exit fails the test (``tests/test_lifecycle.py``).
    """
    done = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env if env is not None else {**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def sgd_pair(ctx: Any) -> tuple[torch.nn.Module, torch.nn.Module, Any, torch.optim.SGD]:
    """A model under ``OSS`` (SGD with momentum) over ``ctx.group`` and its unsharded twin."""
    from oss_plus import OSS

    model = make_model()
    ref_model = clone_model(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=ctx.group, lr=0.1, momentum=0.9)
    return model, ref_model, opt, torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)


def counts_while_holding_the_gil(
    tensors: list[torch.Tensor], run: Callable[[int], Any], steps: int
) -> tuple[list[int], list[list[int]]]:
    """The C++ use counts of ``tensors`` before, and right after each ``run(step)`` for
    ``step`` in 1..steps, with a 1 s switch interval: this thread keeps the GIL after a
    collective's ``wait()``, so a gloo worker that still has to drop its reference (which
    takes the GIL) cannot do it before the counts are read, unless the code under test
    yielded until it did (``oss_plus.runtime.dist.await_release``)."""
    from oss_plus.runtime.dist import use_counts

    before = use_counts(tensors)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    after = []
    try:
        for step in range(1, steps + 1):
            run(step)
            after.append(use_counts(tensors))
    finally:
        sys.setswitchinterval(interval)
    return before, after


# ------------------------------------------------------------------ checkpoints
def reseal(index_file: Any) -> None:
    """Recompute the checksum of an ``index.json`` edited by a test (format version 5).

    A test that edits an index to check what the validation behind the checksum refuses
    reseals it, as a buggy writer (or a hand edit that also fixes the checksum) would.
    """
    import re
    from pathlib import Path

    from oss_plus.checkpoint.seal import CHECKSUM_KEY, seal

    path = Path(index_file)
    text = re.sub(rf',?\s*"{CHECKSUM_KEY}"\s*:\s*"[^"]*"', "", path.read_text("utf-8"))
    path.write_text(seal(text), "utf-8")
