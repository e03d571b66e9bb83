"""State with tensors nested in containers: the pure flattening and every path that moves it.

``helpers.ShampooLike`` keeps, per param, what third-party optimizers keep: a dict holding a
list of tensors and a tuple, an int, a bool, None, a 0-dim tensor and a fixed-size ``(3,)``
histogram (legal on a bias of any length). Its update reads all of them, so a state that is
lost, mis-typed or belongs to another param changes the parameters; every distributed test
compares with the same optimizer unsharded, exactly (fp32).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from helpers import ShampooLike, backward, make_model

from oss_plus import OSS
from oss_plus.compat.fairscale import OSS as FairscaleOSS
from oss_plus.compat.torch import ZeroRedundancyOptimizer
from oss_plus.state.nested import (
    flatten_state,
    flatten_value,
    map_tensors,
    tensor_paths,
    unflatten_state,
    unflatten_value,
)

# ------------------------------------------------------------------ pure flattening
NESTED = {
    "pre": {"mats": [torch.arange(4.0).reshape(2, 2), torch.ones(3)], "k": (1, 2.5)},
    "count": 7,
    "warm": True,
    "none": None,
    "scale": torch.tensor(0.5),
    "big": 2**70,
    "inf": (math.inf, -math.inf),
    3: "int key",
}


def assert_same(a, b, atol: float = 0.0):
    """Equal values with the same container and leaf types; tensors of the same dtype and
    shape, equal (within ``atol``: the adapters' unaligned layout is not bit-exact)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert torch.equal(a, b) if atol == 0 else torch.allclose(a, b, rtol=0, atol=atol)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k], atol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y, atol)
    else:
        assert a == b or (a != a and b != b)


def test_flatten_round_trips_through_json_with_types_kept():
    skeleton, tensors = flatten_value(NESTED)
    assert [t.shape for t in tensors] == [(2, 2), (3,), ()]
    text = json.dumps(skeleton, allow_nan=False)  # strict JSON: inf is tagged
    rebuilt = unflatten_value(json.loads(text), tensors)
    assert_same(rebuilt, NESTED)
    assert rebuilt["pre"]["mats"][0] is tensors[0]  # tensors are not copied
    nan = unflatten_value(json.loads(json.dumps(flatten_value(math.nan)[0])), [])
    assert math.isnan(nan)


def test_flatten_state_numbers_tensors_by_index_then_depth_first():
    states = {5: {"m": torch.ones(1)}, 2: {"pre": [torch.zeros(2), torch.zeros(3)], "step": 4}}
    structure, tensors = flatten_state(states)
    assert [t.numel() for t in tensors] == [2, 3, 1]
    assert list(structure) == ["2", "5"]
    assert tensor_paths(structure["2"]) == ["pre/0", "pre/1"]
    rebuilt = unflatten_state(json.loads(json.dumps(structure)), tensors)
    assert_same(rebuilt, {2: states[2], 5: states[5]})


@pytest.mark.parametrize(
    "bad, where",
    [
        ({"f": object()}, "state[0]['f']"),
        ({"l": [1, {object()}]}, "state[0]['l'][1] item"),
        ({"s": {torch.ones(1)}}, "state[0]['s'] item"),
        ({"d": {(1, torch.ones(1)): 2}}, "state[0]['d'] key"),
    ],
)
def test_flatten_rejects_what_json_cannot_hold_naming_where(bad, where):
    with pytest.raises(TypeError, match=r"optimizer state .* is a"):
        flatten_state({0: bad})
    with pytest.raises(TypeError) as info:
        flatten_state({0: bad})
    assert where in str(info.value)


@pytest.mark.parametrize(
    "skeleton", [{"tensor": 3}, {"nope": 1}, {"dict": [[1]]}, {"a": 1, "b": 2}, {"tuple": 3}]
)
def test_unflatten_rejects_malformed_skeletons(skeleton):
    with pytest.raises(ValueError):
        unflatten_value(skeleton, [torch.ones(1)])


def test_unflatten_state_rejects_non_index_keys():
    with pytest.raises(ValueError, match="not a param index"):
        unflatten_state({"x": {"dict": []}}, [])


def test_map_tensors_rebuilds_containers():
    value = {"a": [torch.ones(1), (torch.ones(1), 3)], "b": None}
    doubled = map_tensors(value, lambda t: t * 2)
    assert_same(doubled, {"a": [torch.full((1,), 2.0), (torch.full((1,), 2.0), 3)], "b": None})
    assert value["a"][0].item() == 1.0  # the input is untouched


# ------------------------------------------------------------------ distributed round trips
def _reference(steps: int):
    model = make_model()
    opt = ShampooLike(model.parameters())
    for step in range(steps):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    return model, opt


def _train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        backward(model, step)
        opt.step()


def _state_without_ids(sd):
    return [sd["state"][i] for i in sorted(sd["state"])]


def consolidate_task(ctx, recipient):
    """2 steps sharded; the full state on ``recipient`` and on every rank."""
    ref_model, ref_opt = _reference(2)
    model = make_model()
    opt = OSS(model.parameters(), optim=ShampooLike, group=ctx.group)
    _train(model, opt, 2)
    opt.consolidate_state_dict(recipient_rank=recipient)
    one = opt.state_dict() if ctx.rank == recipient else None
    everyone = opt.state_dict(all_ranks=True)
    expected = ref_opt.state_dict()
    assert_same(_state_without_ids(everyone), _state_without_ids(expected))
    if one is not None:
        assert_same(_state_without_ids(one), _state_without_ids(expected))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    return len(everyone["state"])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_nested_state_consolidates_exactly_like_the_unsharded_optimizer(pool, world_size):
    counts = pool.run(consolidate_task, world_size - 1, world_size=world_size)
    assert counts == [len(list(make_model().parameters()))] * world_size


def save_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), optim=ShampooLike, group=ctx.group)
    _train(model, opt, 2)
    return opt.state_dict(all_ranks=True)


ADAPTERS = {
    "core": lambda params, group: OSS(params, optim=ShampooLike, group=group),
    "fairscale": lambda params, group: FairscaleOSS(params, optim=ShampooLike, group=group),
    "torch": lambda params, group: ZeroRedundancyOptimizer(params, ShampooLike, group),
}


def resume_task(ctx, saved, kind):
    """Load a state dict saved at another world size, freeze/unfreeze, 3 more steps."""
    ref_model, ref_opt = _reference(2)
    model = make_model()
    opt = ADAPTERS[kind](model.parameters(), ctx.group)
    with torch.no_grad():  # the params the saved run ended with
        for p, q in zip(model.parameters(), ref_model.parameters()):
            p.copy_(q)
    opt.load_state_dict(saved)
    frozen = list(model.parameters())[0]
    for m in (ref_model, model):  # a trainability change repartitions (state moves)
        list(m.parameters())[0].requires_grad_(False)
    _train(ref_model, ref_opt, 1, start=2)
    _train(model, opt, 1, start=2)
    for m in (ref_model, model):
        list(m.parameters())[0].requires_grad_(True)
    _train(ref_model, ref_opt, 2, start=3)
    _train(model, opt, 2, start=3)
    assert frozen.requires_grad
    if kind == "torch":
        opt.consolidate_state_dict(to=-1)
        final = opt.state_dict()
    else:
        final = opt.state_dict(all_ranks=True)
    atol = 0.0 if kind == "core" else 1e-6  # the adapters' unaligned layout (docs/design.md)
    assert_same(_state_without_ids(final), _state_without_ids(ref_opt.state_dict()), atol)
    return [
        torch.allclose(p, q, rtol=0, atol=atol)
        for p, q in zip(model.parameters(), ref_model.parameters())
    ]


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
@pytest.mark.parametrize("saved_at, loaded_at", [(3, 2), (2, 4), (1, 3)])
def test_nested_state_resumes_at_another_world_size(pool, kind, saved_at, loaded_at):
    saved = pool.run(save_task, world_size=saved_at)[0]
    results = pool.run(resume_task, saved, kind, world_size=loaded_at)
    assert all(all(r) for r in results)


def object_collectives_task(ctx):
    """Consolidate nested state and record any pickling collective it makes."""
    model = make_model()
    opt = OSS(model.parameters(), optim=ShampooLike, group=ctx.group)
    _train(model, opt, 1)
    called = []
    names = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
    real = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, lambda *a, _n=n, **k: called.append(_n) or real[_n](*a, **k))
    try:
        opt.state_dict(all_ranks=True)
        opt.consolidate_state_dict(recipient_rank=0)
    finally:
        for n in names:
            setattr(dist, n, real[n])
    return called


def test_consolidation_makes_no_object_collective(pool):
    assert pool.run(object_collectives_task, world_size=3) == [[], [], []]


class Opaque:
    pass


def unstorable_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), optim=ShampooLike, group=ctx.group)
    _train(model, opt, 1)
    if ctx.rank == 1:  # only rank 1 holds a value with no JSON form
        next(iter(opt.optim.state.values()))["odd"] = Opaque()
    try:
        opt.state_dict(all_ranks=True)
    except TypeError as exc:
        return str(exc)
    return None


def test_an_unstorable_state_value_raises_on_every_rank(pool):
    messages = pool.run(unstorable_task, world_size=2)
    assert "is a Opaque" in messages[1]
    assert "global rank(s) [1]" in messages[0] and "is a Opaque" in messages[0]
