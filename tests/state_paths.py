"""One harness for "every state path" of an optimizer inside OSS, against the same optimizer
unsharded (issue 49), shared by the test modules that bring optimizers.

A :class:`Case` names an optimizer factory (a module-level function returning
``(class, kwargs)``, so the pool can ship it). :func:`every_path_task` is ONE pool task at
3 ranks that runs, in process, every path for that case:

* global ranks 0 and 1 (a 2-rank group) train OSS :data:`SAVED` steps (params must equal
  the unsharded run's), consolidate to one rank and to all ranks (the state must equal
  ``torch.load(torch.save(plain.state_dict()))``, the pickling reference, value by value,
  stride by stride, storage sharing and offset within each state value), hand the
  consolidated dict to the plain class through ``torch.save``, save sharded, consolidated
  and asynchronous safetensors checkpoints and torch DCP with :data:`DCP_OPTIONS`, and
  resume from ``load_state_dict`` (OSS's dict and the plain class's own);
* then every save is loaded at 3 ranks and at 1 rank (resharded).

Every resume is checked twice: the loaded state equals the reference (as above), and
:data:`MORE` steps later the params are bit-identical to the unsharded run's and the state
equals the one it holds. The result is the sorted list of the paths each rank checked.

The default model is tiny (8 -> 16 -> 4, four params), so a case costs seconds. To add an
optimizer: a module-level factory returning ``(class, kwargs)``, a :class:`Case` (a model
and inputs of its own where it needs them: a quantized optimizer wants 4096-element
weights), and ``pool.run(every_path_task, case, str(tmp_path), world_size=3)`` compared with
:func:`expected_paths` (``tests/test_state_layout.py`` does so for its cases).
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from oss_plus import OSS
from oss_plus.checkpoint import load_checkpoint, save_checkpoint
from oss_plus.state.subclass import is_plain

SAVED, MORE = 3, 2
#: torch DCP's state-dict options the saves and loads go through, by checkpoint name.
DCP_OPTIONS = {
    "dcp": {},
    "dcp-full": {"full_state_dict": True},
    "dcp-flat-keys": {"flatten_optimizer_state_dict": True},
}
#: The safetensors checkpoints, by name: ``save_checkpoint`` keyword arguments.
CHECKPOINTS = {"sharded": {}, "consolidated": {"sharded": False}, "async": {"blocking": False}}


# ------------------------------------------------------------------ model, data, comparisons
def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def make_inputs(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


@dataclass(frozen=True)
class Case:
    """An optimizer to run through every path: ``make()`` returns ``(class, kwargs)``.

    ``model(seed)`` and ``inputs(step)`` give the model and its batches (module-level
    functions: the pool ships a case by reference); ``context()`` wraps the whole task (e.g.
    a patched ``torch.compile``).
    """

    name: str
    make: Callable[[], tuple[type, dict[str, Any]]]
    #: Applied to both sides before states are compared (by param index -> state), for an
    #: optimizer whose state depends on which params one instance holds (say why).
    normalize: Callable[[dict], Any] | None = None
    model: Callable[[int], torch.nn.Module] = make_model
    inputs: Callable[[int], torch.Tensor] = make_inputs
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    #: Keyword arguments of OSS (the partition rule or policy the paths run under).
    oss: Mapping[str, Any] = field(default_factory=dict)
    #: DCP option sets (:data:`DCP_OPTIONS` names) refused at the save, with a fragment of
    #: the error every rank must raise (what they cannot carry of this optimizer, say why).
    refused: Mapping[str, str] = field(default_factory=dict)


#: The case of the task running in this process (set by :func:`every_path_task`).
_CASE: list[Case] = []


def train(model, opt, steps: int, start: int = 0) -> None:
    inputs = _CASE[-1].inputs if _CASE else make_inputs
    mode = getattr(opt, "train", None)
    if mode is not None:  # a schedule-free optimizer steps in train mode (a no-op when in it)
        mode()
    for step in range(start, start + steps):
        opt.zero_grad()
        model(inputs(step)).pow(2).mean().backward()
        opt.step()


def pickled(value):
    """``value`` through ``torch.save`` / ``torch.load``: the pickling reference (layout,
    sharing and all)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def sharing(value) -> list[tuple[int, int]]:
    """Which tensors of ``value`` share a storage (by first holder) and their offsets, counted
    from the first element those tensors use (what the state paths keep: a lone view into a
    larger buffer, pytorch_optimizer's Lamb's ``weight_norm``, comes back at offset 0 of a
    storage of its own; docs/checkpoint_format.md, version 5)."""
    first: dict[int, int] = {}
    found = []
    for n, t in enumerate(_tensors(value)):
        if is_plain(t) and t.numel():
            ptr = t.untyped_storage().data_ptr()
            found.append((first.setdefault(ptr, n), t.storage_offset()))
    base: dict[int, int] = {}
    for holder, offset in found:
        base[holder] = min(base.get(holder, offset), offset)
    return [(holder, offset - base[holder]) for holder, offset in found]


def same(a, b, where: str = "state") -> None:
    """Exactly the same value: containers (sets too), plain values, and tensors of the same
    class, dtype, shape and strides whose values are equal; within each key's value the same
    tensors share a storage, at the same offsets."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a, b)
        if is_plain(a):
            assert a.stride() == b.stride(), (where, a.stride(), b.stride())
            assert torch.equal(a, b), where
            return
        attrs, context = a.__tensor_flatten__()
        assert (attrs, context) == b.__tensor_flatten__(), where
        for attr in attrs:
            same(getattr(a, attr), getattr(b, attr), f"{where}.{attr}")
    elif isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for key in a:
            same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for n, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{n}]")
    else:
        assert a == b, (where, a, b)


def same_state(a, b, where: str = "state", normalize=None) -> None:
    """:func:`same` per param and key, and the storage sharing of each key's value (after
    ``normalize``, see :class:`Case`)."""
    if normalize is not None:
        (a, a_extra), (b, b_extra) = normalize(a), normalize(b)
        assert a_extra == b_extra, (where, a_extra, b_extra)
    assert sorted(a) == sorted(b), (where, sorted(a), sorted(b))
    for i in a:
        same(a[i], b[i], f"{where}[{i}]")
        for key in a[i]:
            assert sharing(a[i][key]) == sharing(b[i][key]), (where, i, key)


def same_dict(a, b, where: str = "state dict", normalize=None) -> None:
    """Two whole state dicts, as the optimizer's class writes them: the per-param entries of
    ``state`` by :func:`same_state`, everything else but the param groups (extra keys, state
    not keyed by a param; a nested base optimizer's dict, likewise) by :func:`same`, in the
    same key order. Param groups are not compared: torch's DCP ``full_state_dict=True`` load
    gives tuples back as lists; the resumed steps check them."""
    assert [k for k in a if k != "param_groups"] == [k for k in b if k != "param_groups"], (
        where, list(a), list(b),
    )  # fmt: skip
    for key in a:
        if key == "param_groups":
            continue
        if key == "state":
            (mine, other), (theirs, rest) = _by_param(a[key]), _by_param(b[key])
            same_state(mine, theirs, where, normalize)
            same(other, rest, f"{where}['state'] (not keyed by a param)")
        elif isinstance(a[key], dict) and "param_groups" in a[key]:  # a nested optimizer's
            same_dict(a[key], b[key], f"{where}[{key!r}]", normalize)
        else:
            same(a[key], b[key], f"{where}[{key!r}]")


def _by_param(state):
    """``state`` split into the entries keyed by a param index and the others."""
    ints = {k: v for k, v in state.items() if type(k) is int}
    return ints, {k: v for k, v in state.items() if type(k) is not int}


def same_params(model, ref) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def reference(case: Case):
    """The unsharded optimizer: after SAVED steps its model, its ``state_dict()`` through
    the pickling reference, and after MORE its model and its ``state_dict()`` again."""
    cls, kwargs = case.make()
    model = case.model(0)
    opt = cls(model.parameters(), **kwargs)
    train(model, opt, SAVED)
    saved = copy.deepcopy(model), pickled(opt.state_dict())
    train(model, opt, MORE, start=SAVED)
    return saved, (model, pickled(opt.state_dict()))


def fresh(case: Case, group, params_of=None):
    """A new model (the saved run's params when ``params_of`` is given) and OSS over it."""
    cls, kwargs = case.make()
    model = case.model(1)
    if params_of is not None:
        with torch.no_grad():
            for p, q in zip(model.parameters(), params_of.parameters()):
                p.copy_(q)
    opt = OSS(model.parameters(), optim=cls, group=group, **case.oss, **kwargs)
    mode = getattr(opt, "train", None)
    if mode is not None:  # as a user resumes a schedule-free run: torch's DCP steps it
        mode()
    return model, opt


def check_resumed(name: str, model, opt, ref, case: Case) -> str:
    """The loaded state is the reference's, and MORE steps end where the reference did."""
    (_, saved_sd), (ref_model, ref_sd) = ref
    try:
        same_dict(opt.state_dict(all_ranks=True), saved_sd, "loaded", case.normalize)
        opt.drop_consolidated()
        train(model, opt, MORE, start=SAVED)
        same_params(model, ref_model)
        same_dict(opt.state_dict(all_ranks=True), ref_sd, "resumed", case.normalize)
        opt.drop_consolidated()
    except AssertionError as exc:
        raise AssertionError(f"{name}: {exc}") from exc
    return name


# ------------------------------------------------------------------ the paths
def _save_all(case: Case, group, rank: int, root: str, ref) -> list[str]:
    """At 2 ranks: train, consolidate, save every checkpoint, resume from the dicts."""
    (saved_model, saved_sd), want = ref
    model, opt = fresh(case, group, params_of=case.model(0))
    train(model, opt, SAVED)
    same_params(model, saved_model)
    checked = ["train"]

    opt.consolidate_state_dict(recipient_rank=0)
    if rank == 0:
        one = opt.state_dict()
        same_dict(one, saved_sd, "consolidated to one rank", case.normalize)
        plain_model = copy.deepcopy(saved_model)
        cls, kwargs = case.make()
        plain = cls(plain_model.parameters(), **kwargs)
        plain.load_state_dict(pickled(one))  # into the plain class, through torch.save
        train(plain_model, plain, MORE, start=SAVED)
        same_params(plain_model, want[0])
        same_dict(pickled(plain.state_dict()), want[1], "the plain class, from it", case.normalize)
        checked.append("consolidated to one rank")
    everyone = pickled(opt.state_dict(all_ranks=True))  # as torch's, it is live
    same_dict(everyone, saved_sd, "consolidated to all ranks", case.normalize)
    checked.append("consolidated to all ranks")

    futures = [save_checkpoint(opt, os.path.join(root, n), **kw) for n, kw in CHECKPOINTS.items()]
    train(model, opt, 1, start=SAVED)  # the async save holds the state at the call
    for future in futures:
        if future is not None:
            future.result(timeout=60)
    for name, options in DCP_OPTIONS.items():
        m, o = fresh(case, group, params_of=case.model(0))
        train(m, o, SAVED)  # the state opt had at the other saves
        try:
            _, optim_sd = get_state_dict(m, o, options=StateDictOptions(**options))
        except ValueError as exc:  # on every rank, or the task fails
            assert case.refused.get(name, "\0") in str(exc), (name, exc)
            checked.append(f"{name} refused")
            continue
        assert name not in case.refused, f"{name} was not refused"
        dcp.save({"optim": optim_sd}, checkpoint_id=os.path.join(root, name), process_group=group)

    for name, sd in (("load_state_dict", everyone), ("the plain class's dict", saved_sd)):
        m, o = fresh(case, group, params_of=saved_model)
        o.load_state_dict(copy.deepcopy(sd))
        checked.append(check_resumed(name, m, o, ref, case))
    return checked + _load_all(case, group, root, ref, "2 ranks")


def _load_all(case: Case, group, root: str, ref, where: str) -> list[str]:
    """Resume from every save at this group's world size."""
    saved_model = ref[0][0]
    checked = []
    for name in CHECKPOINTS:
        model, opt = fresh(case, group, params_of=saved_model)
        load_checkpoint(opt, os.path.join(root, name))
        checked.append(check_resumed(f"{name} at {where}", model, opt, ref, case))
    for name, options in DCP_OPTIONS.items():
        if name in case.refused:
            continue
        model, opt = fresh(case, group, params_of=saved_model)
        sd_options = StateDictOptions(**options)
        model_sd, optim_sd = get_state_dict(model, opt, options=sd_options)
        dcp.load({"optim": optim_sd}, checkpoint_id=os.path.join(root, name), process_group=group)
        set_state_dict(
            model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=sd_options
        )
        checked.append(check_resumed(f"{name} at {where}", model, opt, ref, case))
    return checked


def every_path_task(ctx, case: Case, root: str) -> list[str]:
    """Every path of one case, at 3 ranks (see the module docstring)."""
    assert ctx.world_size == 3, "every_path_task runs on 3 ranks"
    _CASE.append(case)
    try:
        with case.context():
            ref = reference(case)
            checked = []
            if ctx.rank < 2:
                checked += _save_all(case, ctx.groups[(0, 1)], ctx.rank, root, ref)
            dist.barrier(group=ctx.group)
            checked += _load_all(case, ctx.group, root, ref, "3 ranks")
            if ctx.rank == 0:
                checked += _load_all(case, ctx.groups[(0,)], root, ref, "1 rank")
            dist.barrier(group=ctx.group)
    finally:
        _CASE.pop()
    return sorted(checked)


def expected_paths(refused: Mapping[str, str] | None = None) -> list[list[str]]:
    """What :func:`every_path_task` returns when every path was checked, per rank (the DCP
    option sets of ``refused``: refused at the save)."""
    refused = refused or {}
    names = [*CHECKPOINTS, *(n for n in DCP_OPTIONS if n not in refused)]
    at = {n: [f"{name} at {n}" for name in names] for n in ("1 rank", "2 ranks", "3 ranks")}
    two = ["train", "consolidated to all ranks", "load_state_dict", "the plain class's dict"]
    two += [f"{name} refused" for name in refused]
    rank0 = [*two, "consolidated to one rank", *at["2 ranks"], *at["3 ranks"], *at["1 rank"]]
    rank1 = [*two, *at["2 ranks"], *at["3 ranks"]]
    return [sorted(rank0), sorted(rank1), sorted(at["3 ranks"])]
