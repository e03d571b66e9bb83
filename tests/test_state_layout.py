"""State that ``torch.save`` carries, through every state path of OSS (issue 49): sets and
frozensets, keys other than strings in nested per-param state, each tensor's strides and,
within a state value, its storage sharing and offset (:mod:`oss_plus.state.layout`).

The optimizers: pytorch_optimizer's ``SOAP`` (its eigenbases ``Q`` are transposed views),
heavyball's ``AdamW`` (each param's state nested under ``0``, ``is_initialized`` sets) and
:class:`LayoutSGD`, hand-built to hold all of it at once, with a step that reads it (a
view that lost its storage sharing would change the run). Each runs through every path of
:mod:`state_paths` (one pool task at 3 ranks) against ``torch.save`` of the unsharded
optimizer's state and against its run.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from state_paths import (
    Case,
    every_path_task,
    expected_paths,
    make_model,
    pickled,
    same,
    sharing,
    train,
)

from oss_plus.state.dcp_form import VALUE_KEY, dcp_native, from_dcp_form, to_dcp_form
from oss_plus.state.nested import (
    NEW_IN_5,
    flatten_param_state,
    flatten_value,
    map_storages,
    tags_in,
    unflatten_value,
)


class LayoutSGD(torch.optim.Optimizer):
    """SGD with momentum whose state holds what ``torch.save`` carries and JSON does not: a
    transposed view (2-D params) or a strided slice (1-D), two tensors sharing a storage,
    a set, a frozenset and keys that are an int, a tuple, None and a float."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    n = p.numel()
                    flipped = torch.zeros(tuple(reversed(p.shape))).t()
                    state["buf"] = flipped if p.dim() == 2 else torch.zeros(2 * n)[::2]
                    whole = torch.zeros(2 * n)
                    state["pair"] = (whole, whole[1::2])
                    state[0] = {
                        "seen": set(),
                        (1, "a"): frozenset({2, (3, 4)}),
                        None: True,
                        2.5: None,
                    }
                seen = state[0]["seen"]
                seen.add(len(seen))
                state["buf"].mul_(0.9).add_(p.grad)
                whole, odd = state["pair"]
                whole.mul_(0.5).add_(p.grad.reshape(-1).repeat(2))  # odd follows: a view
                update = state["buf"] + 0.1 * odd.reshape(p.shape)
                p.sub_(group["lr"] * update / len(seen))


def _layout_sgd():
    return LayoutSGD, {"lr": 0.1}


#: The cases, with the package each needs.
#: pytorch_optimizer's SOAP (transposed views) and heavyball's AdamW (sets, int keys) run
#: through every path in tests/test_zoo.py, under each partition rule.
CASES = {
    "LayoutSGD": (None, Case("LayoutSGD", _layout_sgd)),
}


def _params():
    return [
        pytest.param(
            case,
            id=name,
            marks=pytest.mark.skipif(
                need is not None and importlib.util.find_spec(need) is None,
                reason=f"{need} is not installed",
            ),
        )
        for name, (need, case) in CASES.items()
    ]


@pytest.mark.parametrize("case", _params())
def test_every_state_path_keeps_what_torch_save_keeps(pool, tmp_path, case):
    got = pool.run(every_path_task, case, str(tmp_path), world_size=3, timeout=300)
    assert got == expected_paths()


# ------------------------------------------------------------------ pure: the encoding
def _layout_value():
    """What torch.save keeps and JSON does not, in one state value."""
    base = torch.arange(24.0).reshape(4, 6)
    whole = torch.arange(10.0)
    return {
        "Q": [base.t(), base[1:, ::2]],  # a transposed view and a strided slice, one storage
        "pair": (whole, whole[1::2]),  # two tensors sharing a storage, one at offset 1
        "plain": torch.ones(3),
        0: {"seen": {3, 1, 2}, (1, "a"): frozenset({2, (3, 4)}), None: True, 2.5: None},
        torch.float16: frozenset(),
    }


def test_views_sets_and_keys_round_trip_through_json_as_torch_save_keeps_them():
    value = _layout_value()
    skeleton, tensors = flatten_value(value, "state[0]")
    assert [tuple(t.shape) for t in tensors] == [(24,), (10,), (3,)]  # one span per storage
    rebuilt = unflatten_value(json.loads(json.dumps(skeleton)), [t.clone() for t in tensors])
    reference = pickled(value)
    same(rebuilt, reference)
    for key in ("Q", "pair"):
        assert sharing(rebuilt[key]) == sharing(reference[key]) == sharing(value[key])
    assert rebuilt["Q"][1].stride() == (6, 2) and rebuilt["Q"][1].storage_offset() == 6


def test_tensors_of_the_default_layout_stay_plain_placeholders():
    skeleton, tensors = flatten_value({"m": torch.zeros(2, 3), "s": torch.zeros(())})
    assert skeleton == {"dict": [["m", {"tensor": 0}], ["s", {"tensor": 1}]]}
    assert tags_in(skeleton) & NEW_IN_5 == set()


def test_sharing_is_kept_within_a_key_of_a_param_and_not_across_keys():
    whole = torch.arange(4.0)
    skeleton, tensors = flatten_param_state(
        {"a": whole, "b": whole[1:], "c": [whole, whole[::2]]}, "s"
    )
    state = unflatten_value(skeleton, [t.clone() for t in tensors])
    assert sharing(state["c"]) == [(0, 0), (0, 0)] and state["c"][1].stride() == (2,)
    assert state["a"].untyped_storage().data_ptr() != state["b"].untyped_storage().data_ptr()
    same(state["b"], whole[1:].clone())


def test_map_storages_keeps_strides_and_sharing_through_a_copy():
    value = _layout_value()
    copied = map_storages(value, torch.Tensor.clone)
    same(copied, pickled(value))
    assert sharing(copied["pair"]) == sharing(value["pair"])
    assert copied["pair"][0].untyped_storage().data_ptr() != whole_ptr(value["pair"][0])


def whole_ptr(tensor):
    return tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"k": {torch.ones(1): 1}}, ["['k'] key", "Tensor"]),
        ({"k": {(1, torch.ones(1)): 1}}, ["['k'] key", "Tensor"]),
        ({"k": {object()}}, ["['k'] item", "object"]),
        ({"k": frozenset({object()})}, ["['k'] item", "object"]),
    ],
)
def test_keys_and_set_items_that_cannot_travel_are_refused_naming_where(bad, words):
    with pytest.raises(TypeError) as info:
        flatten_param_state(bad, "state[0]")
    assert all(w in str(info.value) for w in ["state[0]", *words]), str(info.value)


@pytest.mark.parametrize(
    "body",
    [
        {"of": {"tensor": 0}, "size": [3], "stride": [2], "offset": 0},  # reaches element 4
        {"of": {"tensor": 0}, "size": [2], "stride": [1], "offset": 3},
        {"of": {"tensor": 0}, "size": [2], "stride": [-1], "offset": 0},
    ],
)
def test_a_view_past_its_storage_is_refused(body):
    with pytest.raises(ValueError, match="the state is damaged"):
        unflatten_value({"view": body}, [torch.zeros(4)])


def test_the_index_needs_version_5_for_sets_views_and_keys_and_refuses_them_in_older():
    from oss_plus.checkpoint.format import Index, PlainValue, TensorRef

    ref = TensorRef("state.0123456789abcdef.safetensors", "state.0.m", "F32", (2,), 0)
    files = {ref.file: {"rank": 0, "bytes": 8}}
    groups = [{"params": [0], "lr": 0.1}]
    plain = Index("consolidated", "0123456789abcdef", groups, files, {0: {"m": ref}})
    assert plain.content_version == 1  # every save writes 5 (the index checksum)
    keyed = TensorRef(ref.file, "state.0.0", "F32", (2,), 0)  # the name its key gives
    for state in ({0: {0: keyed}}, {0: {"done": PlainValue({1, 2})}}):
        index = Index("consolidated", "0123456789abcdef", groups, files, state)
        assert index.content_version == 5
        data = json.loads(index.dumps())
        assert data["format_version"] == 5
        assert Index.from_json(data, "index.json") == index
        data["format_version"] = 4
        with pytest.raises(ValueError, match="version-4 index"):
            Index.from_json(data, "index.json")


def test_a_non_string_key_gets_a_label_that_no_string_key_has():
    from oss_plus.checkpoint.entries import PlainValue, decode_state, encode_state

    state = {0: {"#0": PlainValue(1), 0: PlainValue(2), (1, 2): PlainValue(3)}}
    encoded = encode_state(state)
    assert sorted(encoded["0"]) == ["#0", "#0~", '#{"tuple":[1,2]}']
    assert decode_state(json.loads(json.dumps(encoded)), "index", {}) == state


# ------------------------------------------------------------------ pure: the DCP form
@pytest.mark.parametrize("flat, full", [(False, False), (True, False), (False, True)])
def test_the_dcp_form_carries_what_torch_does_not(flat, full):
    value = _layout_value()
    state = {"step": torch.tensor(3.0), "m": torch.ones(2), "0": torch.zeros(1), **value}
    form = to_dcp_form(state, "fc.weight", flat=flat, full=full)
    assert all(isinstance(k, str) for k in form)
    assert all(dcp_native(v, flat, full) for v in form.values())
    assert form["m"] is state["m"] and form["step"] is state["step"]
    assert "#0" in form  # the name "0" is taken by a string key
    same(from_dcp_form(form, "fc.weight"), pickled(state))


def test_the_dcp_form_carries_0_dim_tensors_in_its_description():
    form = to_dcp_form({0: {"step": torch.tensor(7, dtype=torch.int64), "m": torch.ones(2)}}, "s")
    assert sorted(form["0"]) == ["m", VALUE_KEY]
    back = from_dcp_form(form, "s")
    same(back, {0: {"step": torch.tensor(7), "m": torch.ones(2)}})


def test_a_damaged_dcp_description_is_refused_naming_the_value():
    """Issue 50, item 5: oss_plus's own metadata inside a DCP checkpoint (the description of a
    form) carries its CRC-32; every single-bit flip of its JSON text is refused, naming the
    param and the key, never decoded into another value."""
    form = to_dcp_form({0: {"done": {1, 2}, "m": torch.ones(2)}}, "fc.weight")
    number = form["0"][VALUE_KEY]
    raw = number.to_bytes((number.bit_length() + 7) // 8, "big")
    for bit in range(8, 8 * len(raw)):  # after the leading 1 byte
        flipped = int.from_bytes(raw, "big") ^ (1 << (8 * len(raw) - 1 - bit))
        damaged = {"0": {**form["0"], VALUE_KEY: flipped}}
        with pytest.raises(ValueError, match=r"fc.weight\['0'\].*DCP checkpoint is damaged"):
            from_dcp_form(damaged, "fc.weight")
    same(from_dcp_form(form, "fc.weight"), {0: {"done": {1, 2}, "m": torch.ones(2)}})


# ------------------------------------------------------------------ refused on every rank
class Opaque:
    """An object with no JSON form."""


#: Values rank 1 puts into its state, by name.
BAD = {
    "object in a set": lambda: {"seen": {Opaque()}},
    "tensor key": lambda: {torch.ones(1): 1},
    "object key": lambda: {Opaque(): 1},
}


def refused_task(ctx, kind, root):
    """Rank 1 holds a value that cannot travel: every path raises on every rank, and the
    group is still in step afterwards."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from oss_plus import OSS
    from oss_plus.checkpoint import save_checkpoint

    model = make_model()
    opt = OSS(model.parameters(), optim=LayoutSGD, group=ctx.group, lr=0.1)
    train(model, opt, 1)
    if ctx.rank == 1:
        next(iter(opt.optim.state.values()))[0]["bad"] = BAD[kind]()
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


def _outcome(fn):
    try:
        fn()
    except (TypeError, RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@pytest.mark.parametrize("kind", sorted(BAD))
def test_state_that_cannot_travel_raises_on_every_rank_before_anything_moves(pool, tmp_path, kind):
    outcomes = pool.run(refused_task, kind, str(tmp_path), world_size=2, timeout=60)
    word = "Tensor" if kind == "tensor key" else "Opaque"
    for rank, got in enumerate(outcomes):
        for path, text in got.items():
            assert text.startswith("TypeError"), (rank, path, text)
            assert word in text and "['bad']" in text, (rank, path, text)
            if rank == 0:
                assert "rank(s) [1]" in text, (path, text)
    assert not os.path.exists(tmp_path / "s") and not os.path.exists(tmp_path / "c")


def test_a_per_element_view_stored_whole_is_read_as_a_piece(tmp_path):
    """A state tensor shaped like its param but stored as a view (version 5) is cut into this
    rank's piece under the flat rule, as a stored tensor is."""
    from pathlib import Path

    from oss_plus.checkpoint import write_state_dict
    from oss_plus.checkpoint.assemble import read_states
    from oss_plus.checkpoint.validate import read_index

    momentum = torch.arange(12.0).reshape(3, 4).t()  # (4, 3), stride (1, 4)
    sd = {"state": {0: {"momentum_buffer": momentum}}, "param_groups": [{"params": [0]}]}
    write_state_dict(sd, tmp_path / "c")
    root = Path(tmp_path / "c")
    index = read_index(root)
    assert index.to_json()["format_version"] == 5
    whole = read_states(root, index, [0])[0]["momentum_buffer"]
    assert whole.stride() == (1, 4) and torch.equal(whole, momentum)
    piece = read_states(root, index, [0], pieces={0: (2, 7)}, shapes=[(4, 3)])
    assert torch.equal(piece[0]["momentum_buffer"], momentum.reshape(-1)[2:7])
