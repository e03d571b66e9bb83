"""Pure tests of the checkpoint format: value tags, dtype strings, safetensors headers, index
parsing and model checks. No processes, no process group."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from safetensors import safe_open

from oss_plus.checkpoint import storage
from oss_plus.checkpoint.format import (
    Index,
    NestedValue,
    PlainValue,
    TensorRef,
    nested_names,
    safetensors_header,
    tensor_name,
)
from oss_plus.checkpoint.plan import split_state
from oss_plus.checkpoint.validate import check_fits
from oss_plus.checkpoint.values import decode_value, dtype_name, encode_value, torch_dtype
from oss_plus.runtime.dist import message_plan
from oss_plus.state.nested import flatten_value

VALUES = [
    None,
    True,
    False,
    0,
    -3,
    2**80,
    0.0,
    -0.0,
    1.5,
    1e-300,
    math.inf,
    -math.inf,
    "lr",
    (0.9, 0.999),
    (1e-06, 50),
    (),
    [],
    [1, (2, 3.0), None],
    {"a": 1, 2: (3.0,), None: [True]},
    {"nested": {"deeper": (math.inf, [False])}},
]


def same(a, b) -> bool:
    """Equal with the same types all the way down (nan equals nan)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_values_round_trip_through_strict_json_with_their_types(value):
    text = json.dumps(encode_value(value, "v"), allow_nan=False)  # strict JSON: no NaN literal
    assert same(decode_value(json.loads(text), "v"), value)


def test_nan_and_tags_are_explicit():
    assert encode_value(math.nan, "v") == {"float": "nan"}
    assert math.isnan(decode_value({"float": "nan"}, "v"))
    assert encode_value((1, 2.0), "v") == {"tuple": [1, {"float": 2.0}]}
    assert encode_value({"k": [1]}, "v") == {"dict": [["k", [1]]]}


def test_numpy_like_scalars_become_python_numbers():
    import numpy as np

    assert same(decode_value(encode_value(np.int64(3), "v"), "v"), 3)
    assert same(decode_value(encode_value(np.float64(0.5), "v"), "v"), 0.5)
    assert same(decode_value(encode_value(np.float32(0.5), "v"), "v"), 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64])
def test_small_tensors_in_param_groups_are_stored_inline_exactly(dtype):
    value = torch.tensor([[1.5, -2.0, 0.0]]).to(dtype)
    assert same(decode_value(json.loads(json.dumps(encode_value(value, "lr"))), "lr"), value)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({torch.ones(1)}, ["where[0] item", "Tensor", "set items"]),
        (object(), ["object", "where"]),
        (1j, ["complex"]),
        (torch.zeros(1 << 19), ["bytes", "limited"]),
    ],
    ids=["tensor in a set", "object", "complex", "big tensor"],
)
def test_values_that_cannot_be_stored_are_refused_with_their_location(value, words):
    with pytest.raises(TypeError) as info:
        encode_value([value], "where")
    assert all(w in str(info.value) for w in words)


@pytest.mark.parametrize(
    "data", [{"bogus": 1}, {"float": "fast"}, {"tuple": 3}, {"a": 1, "b": 2}, {"dict": [[[1], 2]]}]
)
def test_malformed_tags_are_rejected_naming_the_place(data):
    with pytest.raises(ValueError, match="somewhere"):
        decode_value(data, "somewhere")


def test_dtype_strings_round_trip_and_unsupported_dtypes_are_named():
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    ):
        assert torch_dtype(dtype_name(dtype, "x"), "x") is dtype
    assert dtype_name(torch.float32, "x") == "F32" and dtype_name(torch.bool, "x") == "BOOL"
    with pytest.raises(TypeError, match="state 'z'.*complex128"):
        dtype_name(torch.complex128, "state 'z'")
    with pytest.raises(ValueError, match="F99"):
        torch_dtype("F99", "here")


def test_tensor_names():
    assert tensor_name(12, "exp_avg") == "state.12.exp_avg"


def test_header_layout_matches_the_safetensors_spec():
    header = safetensors_header([("a", "F32", [2, 3], 24), ("b", "BOOL", [], 1)], {"k": "v"})
    (length,) = struct.unpack("<Q", header[:8])
    assert len(header) == 8 + length and len(header) % 8 == 0
    parsed = json.loads(header[8:])
    assert parsed["a"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert parsed["b"]["data_offsets"] == [24, 25] and parsed["__metadata__"] == {"k": "v"}


TENSORS = {
    "f64": torch.randn(3, dtype=torch.float64),
    "f32": torch.randn(2, 3),
    "f16": torch.randn(5).half(),
    "bf16": torch.randn(4).bfloat16(),
    "i64": torch.arange(3),
    "u8": torch.arange(7, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(4.0),
    "empty": torch.zeros(0, 3),
    "strided": torch.randn(4, 6)[:, ::2],
}


def test_written_files_load_with_safe_open_exactly_and_aligned(tmp_path):
    entries = {i: {key: value} for i, (key, value) in enumerate(TENSORS.items())}
    entries[0]["count"] = PlainValue(3)
    size, written = storage.write_file(tmp_path / "f.safetensors", entries, "0" * 16)
    assert size == (tmp_path / "f.safetensors").stat().st_size
    assert written[0]["count"] == PlainValue(3) and isinstance(written[1]["f32"], TensorRef)
    raw = (tmp_path / "f.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    with safe_open(str(tmp_path / "f.safetensors"), framework="pt") as handle:
        assert handle.metadata()["oss_plus.save_id"] == "0" * 16
        for i, (key, value) in enumerate(TENSORS.items()):
            loaded = handle.get_tensor(tensor_name(i, key))
            assert loaded.dtype == value.dtype and torch.equal(loaded, value), key
            begin = header[tensor_name(i, key)]["data_offsets"][0]
            assert begin % value.element_size() == 0, key  # aligned to its element size


def _index(**changes) -> Index:
    files = {"shard-00000-of-00001.0123456789abcdef.safetensors": {"rank": 0, "bytes": 100}}
    ref = TensorRef(next(iter(files)), "state.1.exp_avg", "F32", (3, 2), 7)
    fields = dict(
        layout="sharded",
        save_id="0123456789abcdef",
        files=files,
        param_groups=[{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}, {"params": [2]}],
        state={1: {"exp_avg": ref, "n": PlainValue((1, None))}},
        params=[{"shape": s, "dtype": "F32", "trainable": True} for s in ([2], [3, 2], [])],
        optimizer="torch.optim.adam.Adam",
        world_size=1,
        partition=[[0, 0], [0]],
        partition_rule="fairscale",
        created_by="oss_plus test",
    )
    fields.update(changes)
    return Index(**fields)


def test_the_index_round_trips_through_its_json_text():
    index = _index()
    assert Index.from_json(json.loads(index.dumps()), "index.json") == index


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "other"}, "not an oss_plus checkpoint index"),
        ({"format_version": 7}, "format version 7.*reads versions 1, 2, 3, 4, 5, 6 only.*upgrade"),
        ({"format_version": True}, "format version True.*damaged"),
        ({"format_version": "1"}, "format version '1'.*damaged"),
        ({"layout": "striped"}, "unknown layout"),
        ({"num_params": 4}, "flat indices"),
        ({"files": []}, "does not list"),
        ({"state": {"9": {}}}, "state for param 9"),
        ({"param_groups": [{"params": [0, 1, 2], "lr": {"bogus": 1}}]}, "group 0 key 'lr'"),
        (
            {"params": None, "state": {"0": {"m": {"tensor": {"name": "x"}}}}},
            "key 'm'.*field 'file' is missing",
        ),
        ({"num_params": None}, "field 'num_params' is None, expected a int"),
        ({"params": [{"dtype": "F32", "trainable": True}] * 3}, r"params\[0\].*'shape'"),
    ],
)
def test_bad_indexes_raise_naming_the_file_and_the_problem(change, message):
    data = {**json.loads(_index().dumps()), **change}
    with pytest.raises(ValueError, match=message) as info:
        Index.from_json(data, "/ckpt/index.json")
    assert "/ckpt/index.json" in str(info.value)


# ------------------------------------------------------------------ nested state (version 2)
PRE = {"mats": [torch.randn(3, 2), torch.ones(3, 2)], "k": (1, 2.5), 7: {"deep": torch.tensor(2.0)}}
PRE_SKELETON = flatten_value(PRE)[0]


def test_nested_values_are_split_into_a_skeleton_and_named_tensors():
    entries = split_state({4: {"pre": PRE, "plain": [1, (2.0, None)], "m": torch.zeros(2)}})
    nested = entries[4]["pre"]
    assert isinstance(nested, NestedValue) and entries[4]["plain"] == PlainValue([1, (2.0, None)])
    assert [t is u for t, u in zip(nested.tensors, [*PRE["mats"], PRE[7]["deep"]])] == [True] * 3
    assert json.loads(json.dumps(nested.skeleton)) == nested.skeleton  # plain JSON
    assert nested_names(4, "pre", nested.skeleton) == [
        "state.4.pre/mats/0",
        "state.4.pre/mats/1",
        "state.4.pre/7/deep",
    ]


def test_nested_values_are_written_under_their_paths_and_read_back_exactly(tmp_path):
    entries = split_state({0: {"pre": PRE, "top": torch.arange(3)}, 2: {"pre": [torch.ones(1)]}})
    _, written = storage.write_file(tmp_path / "f.safetensors", entries, "0" * 16)
    assert [r.name for r in written[0]["pre"].tensors] == nested_names(0, "pre", PRE_SKELETON)
    with safe_open(str(tmp_path / "f.safetensors"), framework="pt") as handle:
        assert sorted(handle.keys()) == sorted(
            ["state.0.top", "state.2.pre/0", *nested_names(0, "pre", PRE_SKELETON)]
        )
        assert torch.equal(handle.get_tensor("state.0.pre/mats/0"), PRE["mats"][0])
        assert torch.equal(handle.get_tensor("state.0.pre/7/deep"), PRE[7]["deep"])
    files = {"f.safetensors": {"rank": 0, "bytes": 1}}
    index = _index(files=files, state=written, params=None, partition=None)
    assert index.format_version == 5 and index.content_version == 2
    text = index.dumps()
    assert json.loads(text)["format_version"] == 5
    assert Index.from_json(json.loads(text), "index.json") == index


def test_a_name_a_param_already_uses_is_made_unique(tmp_path):
    top, inner = torch.ones(1), torch.zeros(1)
    entries = split_state({0: {"a/0": top, "a": [inner]}})  # both would be "state.0.a/0"
    _, written = storage.write_file(tmp_path / "f.safetensors", entries, "0" * 16)
    assert written[0]["a/0"].name == "state.0.a/0"
    assert written[0]["a"].tensors[0].name == "state.0.a/0~"
    with safe_open(str(tmp_path / "f.safetensors"), framework="pt") as handle:
        assert torch.equal(handle.get_tensor("state.0.a/0"), top)
        assert torch.equal(handle.get_tensor("state.0.a/0~"), inner)


def test_indexes_are_written_as_version_5_and_older_versions_still_parse():
    assert json.loads(_index().dumps())["format_version"] == 5
    assert _index().content_version == 1  # what a version-1 reader could hold
    data = json.loads(_index().dumps())
    assert Index.from_json({**data, "format_version": 2}, "index.json") == _index()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"nested": [{"tensor": 0}, {"tensor": 1}], "tensors": []}, "2 tensor placeholders for 0"),
        ({"nested": [1], "tensors": ["REF"]}, "0 tensor placeholders for 1 tensors"),
        ({"nested": {"bogus": 1}, "tensors": []}, "unknown or malformed tag"),
        ({"nested": [{"tensor": 0}], "tensors": ["OTHER FILE"]}, "which the index does not list"),
    ],
    ids=["missing tensor", "unused tensor", "bad tag", "unlisted file"],
)
def test_malformed_nested_entries_are_refused_naming_the_param_and_key(entry, message):
    data = json.loads(_index().dumps())
    ref = data["state"]["1"]["exp_avg"]["tensor"]
    other = {**ref, "file": "elsewhere.safetensors"}
    entry = {
        **entry,
        "tensors": [{"REF": ref, "OTHER FILE": other}[t] for t in entry["tensors"]],
    }
    data["state"]["1"]["pre"] = entry
    with pytest.raises(ValueError, match=message) as info:
        Index.from_json(data, "/ckpt/index.json")
    assert "/ckpt/index.json: state 1 key 'pre'" in str(info.value)


SHAPES = [[torch.Size([2]), torch.Size([3, 2])], [torch.Size([])]]
DTYPES = [torch.float32] * 3


def test_check_fits_accepts_the_same_model():
    check_fits(_index(), SHAPES, DTYPES, "index.json")
    check_fits(_index(params=None), SHAPES, DTYPES, "index.json")


@pytest.mark.parametrize(
    ("shapes", "dtypes", "index", "message"),
    [
        ([SHAPES[0]], DTYPES[:2], _index(), "2 param groups with \\[2, 1\\] params.*1 groups"),
        ([SHAPES[0] + [torch.Size([1])], []], DTYPES, _index(), "\\[3, 0\\] params"),
        (
            [[torch.Size([2]), torch.Size([2, 3])], SHAPES[1]],
            DTYPES,
            _index(),
            "param 1 has shape \\(3, 2\\) in the checkpoint but \\(2, 3\\).*different model",
        ),
        (
            SHAPES,
            [torch.float32, torch.float64, torch.float32],
            _index(),
            "param 1 has dtype F32 in the checkpoint but F64",
        ),
        (
            [[torch.Size([2]), torch.Size([4, 2])], SHAPES[1]],
            DTYPES,
            _index(params=None),
            "state\\[1\\]\\['exp_avg'\\] has shape \\(3, 2\\).*\\(4, 2\\)",
        ),
    ],
    ids=["groups", "counts", "shape", "dtype", "state shape without params"],
)
def test_check_fits_names_the_mismatch(shapes, dtypes, index, message):
    with pytest.raises(ValueError, match=message) as info:
        check_fits(index, shapes, dtypes, "/ckpt/index.json", {"exp_avg"})
    assert "/ckpt/index.json" in str(info.value)


def test_check_fits_checks_only_per_element_state_like_load_state_dict():
    """Any other key may have any shape (a (3, 2) statistic on a (4, 2) param is legal)."""
    shapes = [[torch.Size([2]), torch.Size([4, 2])], SHAPES[1]]
    check_fits(_index(params=None), shapes, DTYPES, "index.json", {"exp_avg_sq"})
    with pytest.raises(ValueError, match="exp_avg"):
        check_fits(_index(params=None), shapes, DTYPES, "index.json", {"exp_avg"})


def test_message_plan_packs_small_tensors_and_chunks_big_ones():
    plan = message_plan(
        [4, 30, 0, 250, 50, 40, 20, 8], pack_bytes=100, alone_bytes=60, chunk_bytes=100
    )
    assert plan == [
        [(0, 0, 4), (1, 0, 30)],  # small ones packed
        [(3, 0, 100)],
        [(3, 100, 100)],
        [(3, 200, 50)],  # a big one alone, in chunks
        [(4, 0, 50), (5, 0, 40)],  # a run never exceeds CHUNK_BYTES...
        [(6, 0, 20), (7, 0, 8)],  # ...and empty tensors send nothing
    ]
    for message in plan:
        assert sum(n for _, _, n in message) <= 100
    covered = sorted((i, s, n) for message in plan for i, s, n in message)
    sizes = [4, 30, 0, 250, 50, 40, 20, 8]
    assert [sum(n for j, _, n in covered if j == i) for i in range(len(sizes))] == sizes


def test_message_plan_keeps_kinds_apart_and_big_items_whole_without_chunks():
    """The state exchange's use: a change of (src, dst, dtype) starts a message; big items
    travel whole."""
    kinds = ["a", "a", "b", "b", "b"]
    plan = message_plan([10, 10, 10, 500, 10], pack_bytes=100, alone_bytes=60, kinds=kinds)
    assert plan == [[(0, 0, 10), (1, 0, 10)], [(2, 0, 10)], [(3, 0, 500)], [(4, 0, 10)]]
