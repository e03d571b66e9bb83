"""``OSS`` in torch's ``torch.distributed.checkpoint`` (DCP) flow, with no gather.

torch's state-dict API (``torch.distributed.checkpoint.state_dict``: ``get_state_dict``,
``get_optimizer_state_dict``, ``set_state_dict``, ``set_optimizer_state_dict``) calls the
optimizer's ``state``, ``state_dict()`` and ``load_state_dict()``. When torch's functions
are the callers (:mod:`oss_plus.state.torch_callers` recognises them, see
``docs/portability.md``), :class:`oss_plus.OSS` answers in a form DCP saves and loads shard
by shard:

* ``state_dict()`` (:func:`sharded_state_dict`) returns every param's entry on every rank
  (torch keys them by FQN), holding only the state this rank owns, as live tensors (no
  copy, nothing gathered): a param owned whole is the owner's plain tensors (other ranks
  hold an empty entry); a param ``partition_rule="flat"`` cuts into pieces has each
  per-element tensor as a ``ShardedTensor`` of the param's shape whose local shards are the
  rectangles of this rank's piece (:mod:`oss_plus.state.sharded_tensor`), so ``dcp.save``
  writes each element once, from its holder, and a reader sees one tensor per FQN. State that is the
  same on every holder (a 0-dim ``step``) is written by each holder; DCP keeps one copy.
* ``load_state_dict()`` (:func:`load_sharded`) takes that form back (or whole tensors, e.g.
  from ``full_state_dict=True``), keyed by FQN in the optimizer's param order; each rank
  keeps what it owns now. The layout is DCP's: any world size, any rule.
* ``state`` (:class:`LocalState`) is this rank's state by param. When torch's
  ``_init_optim_state`` asks whether the optimizer holds state (else it runs a step with
  lr 0, which would advance Adam's ``step`` and moments), every rank first checks that
  every rank came (:mod:`oss_plus.runtime.arrival`) and the ranks agree on the answer, so the
  probe runs on every rank or on none.
* Under a compressed wire (``broadcast_dtype``), the exact values of the params this rank
  steps (its main copies, ``docs/amp.md``) are the entry ``"oss_plus.main"`` of their state,
  also in a fresh optimizer's template, so a resume through DCP is exact. A checkpoint
  without them (DDP's, or one saved without the wire) then needs the wire turned on after
  the load, or ``DefaultLoadPlanner(allow_partial_load=True)``.
* ``StateDictOptions(full_state_dict=True)``: the whole state, consolidated
  (:meth:`oss_plus.OSS.consolidate_state_dict`), on every rank; with ``cpu_offload=True``
  on global rank 0 only.
* A state value DCP cannot carry (a tensor subclass: torchao's low-bit states; a set, a
  key that is not a string: heavyball's; a list under ``flatten_optimizer_state_dict``) is
  handed over in both forms as a dict (:mod:`oss_plus.state.dcp_form`): its plain tensors
  by path, live, so ``dcp.load`` fills them in place, and its JSON description.
  ``load_state_dict()`` rebuilds it (allow-listed classes only).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from oss_plus.runtime import arrival as _arrival
from oss_plus.runtime import dist as _dist
from oss_plus.state.consolidate import ALL_RANKS
from oss_plus.state.dcp_extras import EXTRAS_KEY, agreed_extras, put_extras, taken_extras
from oss_plus.state.dcp_form import SUBCLASS_KEY, from_dcp_form, to_dcp_form
from oss_plus.state.index import (
    ParamState,
    own_group_keys,
    pack_param_groups,
    per_element_keys,
    validate_state_dict,
)
from oss_plus.state.sharded_tensor import holds_sharded, local_piece, range_blocks, to_sharded
from oss_plus.wire.main.region import MAIN_KEY

__all__ = [
    "ARRIVAL_TIMEOUT",
    "DCP_NOT_ALL_ARRIVED",
    "LocalState",
    "SUBCLASS_KEY",
    "from_dcp_form",
    "load_sharded",
    "range_blocks",
    "sharded_state_dict",
    "to_dcp_form",
]

#: How long a rank entering torch's DCP state-dict API waits for the others (None: the
#: default of :mod:`oss_plus.runtime.arrival`).
ARRIVAL_TIMEOUT: timedelta | None = None

#: Raised on every rank that entered torch's state-dict API when some rank did not.
DCP_NOT_ALL_ARRIVED = (
    "torch.distributed.checkpoint.state_dict's get/set functions are collective for "
    "oss_plus.OSS, but not every one of the {world} ranks of the optimizer's group called "
    "them within {seconds:g}s (this is {rank}): call get_state_dict / set_state_dict "
    "(and their optimizer variants) on every rank"
)

#: Raised by :func:`load_sharded` when the state dict does not fit the optimizer.
GROUPS_DIFFER = (
    "the optimizer state dict has {given} param groups with {given_sizes} params, but this "
    "optimizer has {expected} with {expected_sizes}: load a state dict of the same model "
    "and param groups"
)

_WHAT = "torch.distributed.checkpoint.state_dict"


# --------------------------------------------------------------------------- local state
class LocalState(Mapping[torch.Tensor, ParamState]):
    """This rank's optimizer state by param: a param it owns whole maps to its state, a
    param it holds a piece of to the piece's state (1-D tensors), any other param of the
    optimizer to an empty dict (as a ``defaultdict``). Live: the dicts are the inner
    optimizer's, and assigning a param's state replaces it there.

    ``bool()`` is the agreed answer of every rank when ``agreed`` is given.
    """

    def __init__(self, optimizer: Any, agreed: bool | None = None) -> None:
        shard = optimizer.local_shard
        self._local = shard
        self._inner = shard.optim.state
        self._targets = dict(zip(optimizer.flat_params(), shard.targets.targets()))
        self._agreed = agreed

    def __getitem__(self, param: torch.Tensor) -> ParamState:
        target = self._targets[param]
        return self._inner.get(target, {})

    def __setitem__(self, param: torch.Tensor, state: ParamState) -> None:
        """Replace the state of a param this rank holds (what Lightning's device moves do)."""
        self._inner[self._targets[param]] = state
        self._local.touched = True

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p, t in self._targets.items() if self._inner.get(t))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, param: object) -> bool:
        target = self._targets.get(param)
        return target is not None and bool(self._inner.get(target))

    def __bool__(self) -> bool:
        return self._agreed if self._agreed is not None else len(self) > 0


def agreed_state(optimizer: Any) -> LocalState:
    """The ``state`` torch's ``_init_optim_state`` reads: every rank checks that every rank
    came, then the ranks agree whether any of them holds state.

    .. warning:: Collective: call on every rank of the optimizer's group.
    """
    group = optimizer.group
    try:
        _arrival.check_arrival(group, _WHAT, ARRIVAL_TIMEOUT)
    except RuntimeError as exc:
        timeout = ARRIVAL_TIMEOUT or _arrival.ARRIVAL_TIMEOUT
        raise RuntimeError(
            DCP_NOT_ALL_ARRIVED.format(
                world=dist.get_world_size(group),
                seconds=timeout.total_seconds(),
                rank=_dist.name_rank(_dist.group_members(group), dist.get_rank(group)),
            )
        ) from exc
    optimizer.settle()
    local = LocalState(optimizer)
    touched = optimizer.local_shard.touched  # state made at construction is not a step's
    flags = _dist.agree(None, group, value=int(len(local) > 0 and touched))
    return LocalState(optimizer, agreed=any(flags))


# --------------------------------------------------------------------------- get / load
def sharded_state_dict(
    optimizer: Any, template: bool = False, flat: bool = False
) -> dict[str, Any]:
    """The DCP form of ``optimizer``'s state (see the module docstring): keyed by flat index
    (torch maps the keys to FQNs), only what this rank holds, live tensors. With
    ``template`` (torch's full-state load), every param also gets placeholders of its
    0-dim and plain entries, which torch expects on every rank.

    .. warning:: Collective: call on every rank of the optimizer's group.
    """

    def build() -> dict[str, Any]:
        local = optimizer.export_local_state()
        _add_main_entries(optimizer, local)
        plan, rank, group = optimizer.plan, optimizer.rank, optimizer.group
        state: dict[int, ParamState] = {}
        for i, param in enumerate(optimizer.flat_params()):
            mine = plan.piece(rank, i)
            held = local.get(i, {}) if mine is not None else {}
            if i not in plan.split or not held:
                state[i] = to_dcp_form(held, f"state[{i}]", flat, full=template)
                continue
            shape, length = tuple(param.shape), mine.end - mine.start
            piece = {
                k for k, v in held.items() if isinstance(v, torch.Tensor) and v.shape == (length,)
            }
            rest = to_dcp_form(
                {k: v for k, v in held.items() if k not in piece},
                f"state[{i}]",
                flat,
                full=template,
            )
            state[i] = {
                k: to_sharded(v, shape, plan.pieces_of(i), rank, group)
                for k, v in held.items()
                if k in piece
            }
            state[i].update(rest)
        return {
            "state": state,
            "param_groups": pack_param_groups(optimizer.param_groups, _group_keys(optimizer, flat)),
        }

    optimizer.settle()
    extras = agreed_extras(optimizer, flat)
    result = _dist.run_phase(build, optimizer.group)
    put_extras(result["param_groups"], extras)
    if template:
        _add_placeholders(result["state"], optimizer.group)
    return result


def _add_main_entries(optimizer: Any, local: dict[int, ParamState]) -> None:
    """Under a compressed wire, give every tensor this rank steps a :data:`MAIN_KEY` entry
    (a copy of its values where it has no main copy yet: a fresh optimizer's values are
    exact), so that the template a fresh optimizer gives ``dcp.load`` asks for the saved
    exact values (DCP loads only the keys of its template; ``docs/checkpoints.md``)."""
    wire = optimizer.wire_dtype
    if wire is None:
        return
    shard = optimizer.local_shard
    targets = shard.targets.targets()
    for indices in shard.plan.local_indices(shard.rank):
        for i in indices:
            target = targets[i]
            wider = target.is_floating_point() and target.element_size() > wire.itemsize
            if wider and MAIN_KEY not in local.get(i, {}):
                local.setdefault(i, {})[MAIN_KEY] = target.detach().clone()


def _add_placeholders(state: dict[int, ParamState], group: Any) -> None:
    """Give every param the entries torch's full-state load expects on every rank: its
    0-dim tensors and plain values (placeholders, which torch replaces by the loaded ones).

    .. warning:: Collective: call on every rank of ``group``.
    """
    mine = {i: {k: _kind(v) for k, v in s.items() if not _per_element(v)} for i, s in state.items()}
    for data in _dist.all_gather_bytes(json.dumps(mine).encode(), group):
        for i, keys in json.loads(data).items():
            for key, kind in keys.items():
                state[int(i)].setdefault(key, _placeholder(kind))


def _kind(value: Any) -> Any:
    """What :func:`_add_placeholders` stands in for ``value`` with (JSON): a dtype, a
    subclass form's description only (torch copies a tensor only where the template has
    it), a dict's kinds of its 0-dim and plain entries (torch sets those on every rank,
    inside the described form too), or an empty list (torch fills the template's list)."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype)
    if isinstance(value, Mapping) and SUBCLASS_KEY in value:
        return SUBCLASS_KEY
    if isinstance(value, Mapping):
        return {"dict": {k: _kind(v) for k, v in value.items() if not _per_element(v)}}
    return "list" if isinstance(value, (list, tuple)) else None


def _placeholder(kind: Any) -> Any:
    """The placeholder of :func:`_kind`: what stands for a param this rank does not hold
    (its load drops it)."""
    if kind == SUBCLASS_KEY:
        return {SUBCLASS_KEY: torch.zeros(0, dtype=torch.uint8)}
    if isinstance(kind, dict):
        return {k: _placeholder(v) for k, v in kind["dict"].items()}
    if kind == "list":
        return []
    return torch.zeros((), dtype=getattr(torch, kind[6:])) if kind else None


def _group_keys(optimizer: Any, flat: bool) -> list[frozenset[str]] | None:
    """The param-group keys handed to torch: those of the inner optimizer's own
    ``state_dict()``, or every key under ``flatten_optimizer_state_dict`` (torch's flat
    load looks up every key of the live groups)."""
    return None if flat else own_group_keys(optimizer.optim)


def _per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def full_state_dict(optimizer: Any, cpu_offload: bool, flat: bool = False) -> dict[str, Any]:
    """The whole state (``full_state_dict=True``), on CPU: on every rank, or with
    ``cpu_offload`` on global rank 0 only (where it is in the group; else on every rank).

    .. warning:: Collective: call on every rank of the optimizer's group.
    """
    group = optimizer.group
    ranks = dist.get_process_group_ranks(group)
    to = ranks.index(0) if cpu_offload and 0 in ranks else ALL_RANKS
    extras = agreed_extras(optimizer, flat)
    optimizer.consolidate_state_dict(to)
    whole = optimizer.consolidated_state or {}
    state = {i: to_dcp_form(whole[i], f"state[{i}]", flat, full=True) for i in sorted(whole)}
    optimizer.drop_consolidated()
    groups = pack_param_groups(optimizer.param_groups, _group_keys(optimizer, flat))
    put_extras(groups, extras)
    return {"state": state, "param_groups": groups}


def _check_whole(
    optimizer: Any, states: dict[int, ParamState], packed: list[dict[str, Any]]
) -> None:
    """Check whole states against the params' shapes, as the plain load does
    (:func:`oss_plus.state.index.validate_state_dict`)."""
    shapes = [[p.shape for p in g["params"]] for g in optimizer.param_groups]
    sd = {"state": states, "param_groups": packed}
    validate_state_dict(sd, shapes, per_element_keys(optimizer.optim))


def load_sharded(optimizer: Any, state_dict: Mapping[str, Any]) -> None:
    """Load a state dict torch's ``set_*state_dict`` hands over (keys: FQNs, in the order of
    the optimizer's param groups; values: this module's form or whole tensors); each rank
    keeps what it owns now.

    Raises:
        ValueError: the param groups do not match the optimizer's (raised on every rank).

    .. warning:: Collective: call on every rank of the optimizer's group.
    """

    def load() -> None:
        groups = state_dict["param_groups"]
        given = [len(g["params"]) for g in groups]
        expected = [len(g["params"]) for g in optimizer.param_groups]
        if given != expected:
            raise ValueError(
                GROUPS_DIFFER.format(
                    given=len(given),
                    given_sizes=given,
                    expected=len(expected),
                    expected_sizes=expected,
                )
            )
        keys = [k for g in groups for k in g["params"]]
        plan, rank, saved = optimizer.plan, optimizer.rank, state_dict["state"]
        states: dict[int, ParamState] = {}
        for i, key in enumerate(keys):
            if plan.piece(rank, i) is None or not saved.get(key):
                continue
            values = from_dcp_form(saved[key], key)
            pieces = {k: local_piece(v) for k, v in values.items()}  # None: no piece here
            states[i] = {
                k: v for k, v in pieces.items() if v is not None or values[k] is None
            }  # a state value that is None stays (StableAdamW's kahan_comp)
        packed, start = [], 0
        for g in groups:
            hyper = {k: v for k, v in g.items() if k != EXTRAS_KEY}  # dcp_extras's
            packed.append({**hyper, "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        whole = {i: st for i, st in states.items() if not holds_sharded(saved[keys[i]])}
        _check_whole(optimizer, whole, packed)  # this module's pieces fit by construction
        optimizer.import_local_state(states, packed, extras=taken_extras(groups))

    optimizer.settle()
    _dist.run_phase(load, optimizer.group)
