"""Tensor-subclass optimizer state: the allow-list, the JSON form, and the errors (issue 45).

``Scaled`` is a minimal traceable wrapper subclass (one inner tensor, a float and a dtype in
its context) that implements no op: anything but the flatten protocol raises, so a path that
touches it as a tensor (``cat``, ``clone``, a byte view) fails here as torchao's classes did.
``Opaque`` is a plain Python subclass, without the protocol. The paths with real optimizers
(torchao, bitsandbytes, torch) are ``tests/test_ecosystem_state.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch
from helpers import reseal
from torch.distributed.checkpoint.state_dict import get_state_dict

import oss_plus
from oss_plus import OSS, register_state_class
from oss_plus.checkpoint import load_checkpoint, save_checkpoint
from oss_plus.state import subclass as subclass_module
from oss_plus.state.dcp import SUBCLASS_KEY, from_dcp_form, to_dcp_form
from oss_plus.state.nested import (
    flatten_value,
    holds_subclass,
    tensor_paths,
    unflatten_value,
)
from oss_plus.state.pieces import slice_state
from oss_plus.state.subclass import class_name, clone_tensor, is_plain

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


class Scaled(torch.Tensor):
    """``payload * scale``, kept as its payload and scale (the flatten protocol only)."""

    @staticmethod
    def __new__(cls, payload, scale, dtype=None):
        return torch.Tensor._make_wrapper_subclass(
            cls, payload.shape, dtype=dtype or payload.dtype, device=payload.device
        )

    def __init__(self, payload, scale, dtype=None):
        self.payload = payload
        self.scale = scale

    def __tensor_flatten__(self):
        return ["payload"], [self.scale, self.dtype]

    @classmethod
    def __tensor_unflatten__(cls, inner, context, outer_size, outer_stride):
        return cls(inner["payload"], *context)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"Scaled does not implement {func}")


class Unlisted(Scaled):
    """The protocol, but never registered."""


class Opaque(torch.Tensor):
    """A plain Python subclass: no flatten protocol."""


register_state_class(Scaled)


def scaled(values, scale=0.5):
    return Scaled(torch.as_tensor(values, dtype=torch.float32), scale)


def same_scaled(a, b):
    """The same value: a Scaled of the same payload and scale, or an equal plain tensor."""
    if type(a) is not type(b):
        return False
    if isinstance(a, Scaled):
        return a.scale == b.scale and torch.equal(a.payload, b.payload)
    return torch.equal(a, b)


# ------------------------------------------------------------------ pure
def test_a_registered_subclass_round_trips_through_json_as_its_inner_tensors():
    value = {"m": scaled([1.0, 2.0, 3.0]), "step": 4}
    skeleton, tensors = flatten_value(value, "state[0]")
    assert all(is_plain(t) for t in tensors) and len(tensors) == 1
    assert tensors[0] is value["m"].payload  # not copied
    text = json.dumps(skeleton, allow_nan=False)
    body = json.loads(text)["dict"][0][1]["subclass"]
    assert body["class"] == class_name(Scaled) and body["size"] == [3]
    assert body["context"] == [{"float": 0.5}, {"dtype": "float32"}]
    rebuilt = unflatten_value(json.loads(text), tensors)
    assert same_scaled(rebuilt["m"], value["m"]) and rebuilt["step"] == 4
    assert tensor_paths(skeleton) == ["m/payload"]
    assert holds_subclass(skeleton) and not holds_subclass(flatten_value([torch.ones(1)])[0])


def test_dtypes_and_sizes_keep_their_types():
    value = (torch.float16, torch.Size([2, 3]), (2, 3))
    skeleton, _ = flatten_value(value)
    assert unflatten_value(json.loads(json.dumps(skeleton)), []) == value
    assert type(unflatten_value(skeleton, [])[1]) is torch.Size
    with pytest.raises(ValueError, match="unknown or malformed tag"):
        unflatten_value({"dtype": "Tensor"}, [])  # a torch name that is not a dtype


@pytest.mark.parametrize(
    "value, match",
    [
        (Unlisted(torch.ones(2), 1.0), "Unlisted, a tensor subclass that is not a known"),
        (torch.ones(2).as_subclass(Opaque), "Opaque, a tensor subclass without __tensor_flatten__"),
    ],
)
def test_a_subclass_that_cannot_travel_is_refused_naming_where_and_the_class(value, match):
    with pytest.raises(TypeError, match=match) as info:
        flatten_value({"exp_avg": value}, "state[7]")
    assert "state[7]['exp_avg']" in str(info.value)


def test_an_unknown_class_name_in_data_is_refused_by_name_and_never_imported():
    skeleton, tensors = flatten_value(scaled([1.0]))
    for name in ("os.system", "not_a_module_oss_plus_test.Evil", "torchao.optim.Evil"):
        skeleton["subclass"]["class"] = name
        with pytest.raises(ValueError, match=f"tensor subclass '{name}', which is not a known"):
            unflatten_value(skeleton, tensors, "state[0]['m']")
    assert "not_a_module_oss_plus_test" not in sys.modules


def test_register_state_class_takes_tensor_subclasses_with_the_protocol_only():
    for bad in (torch.Tensor, int, Opaque):
        with pytest.raises(TypeError):
            register_state_class(bad)
    assert "register_state_class" in oss_plus.__all__


def test_clone_tensor_shares_no_memory_and_slicing_refuses_a_subclass():
    value = scaled([1.0, 2.0])
    copy = clone_tensor(value)
    assert same_scaled(copy, value) and copy.payload.data_ptr() != value.payload.data_ptr()
    with pytest.raises(TypeError, match="block-quantized optimizer state"):
        slice_state({"m": value}, torch.Size([2]), 0, 1)


def test_the_dcp_form_holds_live_inner_tensors_and_rebuilds():
    state = {"m": scaled([1.0, 2.0]), "step": torch.tensor(3.0)}
    form = to_dcp_form(state, "state[0]")
    assert (
        set(form["m"]) == {SUBCLASS_KEY, "payload"} and form["m"]["payload"] is state["m"].payload
    )
    back = from_dcp_form(form, "fc.weight")
    assert same_scaled(back["m"], state["m"]) and back["step"] is state["step"]
    del form["m"]["payload"]
    with pytest.raises(ValueError, match="inner tensors \\['payload'\\] are missing"):
        from_dcp_form(form, "fc.weight")


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
def test_torchao_states_are_known_and_round_trip_exactly():
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    for cls, extra in (
        (OptimState8bit, {"signed": True}),
        (OptimState4bit, {"signed": False}),
        (OptimStateFp8, {}),
    ):
        value = cls.zeros((64, 128), block_size=128, **extra)
        value.copy_(torch.randn(64, 128))
        skeleton, tensors = flatten_value(value)
        rebuilt = unflatten_value(json.loads(json.dumps(skeleton)), tensors)
        assert type(rebuilt) is cls
        assert rebuilt.__tensor_flatten__()[1] == value.__tensor_flatten__()[1]
        assert torch.equal(rebuilt.dequantize(), value.dequantize())


def test_a_file_round_trip_needs_version_4_content_and_the_class_on_the_list(tmp_path, capsys):
    from oss_plus.checkpoint import read_state_dict, write_state_dict

    sd = {"state": {0: {"m": scaled([1.0, 2.0]), "step": 3}}, "param_groups": [{"params": [0]}]}
    write_state_dict(sd, tmp_path / "ck")
    index = json.loads((tmp_path / "ck" / "index.json").read_text())
    assert index["format_version"] == 5  # version-4 content, and the index checksum
    assert index["state"]["0"]["m"]["tensors"][0]["name"] == "state.0.m/payload"
    back = read_state_dict(tmp_path / "ck")
    assert same_scaled(back["state"][0]["m"], sd["state"][0]["m"])
    from oss_plus.cli import main

    assert main(["ckpt", "inspect", str(tmp_path / "ck")]) == 0  # shown, not rebuilt
    assert "m=Scaled(payload=F32[2])" in capsys.readouterr().out
    saved = subclass_module._REGISTERED.pop(class_name(Scaled))
    try:
        with pytest.raises(ValueError, match=f"tensor subclass '{class_name(Scaled)}'"):
            read_state_dict(tmp_path / "ck")
    finally:
        subclass_module._REGISTERED[class_name(Scaled)] = saved
    index["format_version"] = 3  # what a version-3 reader would misread
    (tmp_path / "ck" / "index.json").write_text(json.dumps(index))
    reseal(tmp_path / "ck" / "index.json")
    with pytest.raises(ValueError, match="a tensor subclass in a version-3 index"):
        read_state_dict(tmp_path / "ck")


# ------------------------------------------------------------------ every rank
def make_opt(ctx, rule="fairscale"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = OSS(
        model.parameters(), optim=torch.optim.Adam, lr=0.1, group=ctx.group, partition_rule=rule
    )
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


def put(opt, value):
    """Replace this rank's first state tensor ``exp_avg`` with ``value(old)``."""
    state = next(s for s in opt.optim.state.values() if s)
    state["exp_avg"] = value(state["exp_avg"])


def _outcome(fn):
    try:
        fn()
    except (TypeError, RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def refused_task(ctx, kind, root):
    """Rank 1 holds state that cannot travel: every path raises on every rank, and the
    group is still in step afterwards (no rank left inside a collective)."""
    model, opt = make_opt(ctx)
    if ctx.rank == 1:
        if kind == "unlisted":
            put(opt, lambda t: Unlisted(t, 2.0))
        else:
            put(opt, lambda t: t.as_subclass(Opaque))
    torch.distributed.barrier(group=ctx.group)  # rank 0 reads rank 1's shard (issue 56) after
    outcomes = {
        "consolidate": _outcome(lambda: opt.consolidate_state_dict(0)),
        "all_ranks": _outcome(lambda: opt.state_dict(all_ranks=True)),
        "sharded": _outcome(lambda: save_checkpoint(opt, os.path.join(root, "s"))),
        "consolidated": _outcome(
            lambda: save_checkpoint(opt, os.path.join(root, "c"), sharded=False)
        ),
        "dcp": _outcome(lambda: get_state_dict(model, opt)),
    }
    torch.distributed.barrier(group=ctx.group)
    return outcomes


@pytest.mark.parametrize("kind", ["unlisted", "opaque"])
def test_state_that_cannot_travel_raises_on_every_rank_before_anything_moves(pool, tmp_path, kind):
    outcomes = pool.run(refused_task, kind, str(tmp_path), world_size=2, timeout=60)
    name = "Unlisted" if kind == "unlisted" else "Opaque"
    for rank, got in enumerate(outcomes):
        for path, text in got.items():
            assert text.startswith("TypeError"), (rank, path, text)
            assert name in text and "exp_avg" in text, (rank, path, text)
            if rank == 0:
                assert "global rank(s) [1]" in text, (path, text)
    assert not os.path.exists(tmp_path / "s") and not os.path.exists(tmp_path / "c")


def registered_task(ctx, root, forget, sharded):
    """A registered subclass consolidates and checkpoints exactly; a load that does not
    know the class (``forget``) raises ValueError naming it, on every rank."""
    model, opt = make_opt(ctx)
    put(opt, lambda t: Scaled(t.clone(), 0.25))
    mine = {k: dict(v) for k, v in opt.export_local_state().items()}
    whole = opt.state_dict(all_ranks=True)["state"]
    for i, state in mine.items():
        assert same_scaled(whole[i]["exp_avg"], state["exp_avg"])
    path = os.path.join(root, "ck")
    save_checkpoint(opt, path, sharded=sharded)
    with open(os.path.join(path, "index.json")) as f:
        version = json.load(f)["format_version"]
    _, fresh = make_opt(ctx)
    if forget:
        saved = subclass_module._REGISTERED.pop(class_name(Scaled))
        try:
            return version, _outcome(lambda: load_checkpoint(fresh, path))
        finally:
            subclass_module._REGISTERED[class_name(Scaled)] = saved
    load_checkpoint(fresh, path)
    for i, state in mine.items():
        assert same_scaled(fresh.export_local_state()[i]["exp_avg"], state["exp_avg"])
    return version, "ok"


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "consolidated"])
def test_a_registered_class_travels_and_an_unknown_one_is_named_on_load(pool, tmp_path, sharded):
    ok = pool.run(registered_task, str(tmp_path / "a"), False, sharded, world_size=2)
    assert ok == [(5, "ok")] * 2
    outcomes = pool.run(registered_task, str(tmp_path / "b"), True, sharded, world_size=2)
    for version, text in outcomes:
        assert version == 5
        assert text.startswith("ValueError") and class_name(Scaled) in text, text


def flat_task(ctx):
    import torchao.optim

    model = torch.nn.Linear(64, 128)
    try:
        OSS(
            model.parameters(),
            optim=torchao.optim.AdamW8bit,
            group=ctx.group,
            partition_rule="flat",
        )
    except ValueError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
def test_the_flat_rule_refuses_block_quantized_optimizers(pool):
    for text in pool.run(flat_task, world_size=2):
        assert "AdamW8bit is not known to be" in text and "quantization blocks" in text, text


def odd_dtypes_task(ctx):
    """State of dtypes gloo cannot move (float8, int16, uint16/32/64) consolidates bit for bit."""
    _, opt = make_opt(ctx)
    names = ["float8_e4m3fn", "float8_e5m2", "int16", "uint16", "uint32", "uint64"]
    dtypes = [getattr(torch, n) for n in names if hasattr(torch, n)]
    values = torch.arange(-8, 8, dtype=torch.float32) * 0.37
    extra = {}
    for dtype in dtypes:
        source = values.abs() * 1000 if not dtype.is_floating_point else values
        extra[str(dtype)] = (
            source.to(dtype) if dtype.is_floating_point else source.to(torch.int64).to(dtype)
        )
    for state in opt.optim.state.values():
        state.update({k: v.clone() for k, v in extra.items()})
    whole = opt.state_dict(all_ranks=True)["state"]
    for state in whole.values():
        for key, value in extra.items():
            got = state[key]
            assert got.dtype == value.dtype and torch.equal(
                got.view(torch.uint8), value.view(torch.uint8)
            ), key
    return len(whole), len(dtypes)


def test_state_of_dtypes_gloo_cannot_move_consolidates_bit_for_bit(pool):
    (n, kinds), _ = pool.run(odd_dtypes_task, world_size=2)
    assert n == 4 and kinds >= 3
