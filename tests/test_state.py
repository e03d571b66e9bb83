"""Pure tests of index translation and state-dict validation (no processes)."""

import pytest
import torch

from oss_plus.state import (
    group_offsets,
    local_view,
    pack_param_groups,
    saved_state_by_flat_index,
    state_shape_error,
    validate_state_dict,
)


def test_group_offsets():
    assert group_offsets([2, 0, 3]) == [0, 2, 2]


def test_local_view_respects_order():
    owners = [[0, 1, 0], [1, 0]]
    assert local_view(owners, 0, [[2, 1, 0], [0, 1]]) == [[2, 0], [4]]
    assert local_view(owners, 1, [[0, 1, 2], [0, 1]]) == [[1], [3]]


def test_pack_param_groups_deep_copies_hyperparameters():
    betas = [0.9, 0.99]
    groups = [
        {"params": [torch.zeros(1)] * 2, "lr": 1.0, "betas": betas},
        {"params": [torch.zeros(1)], "lr": 2.0, "betas": betas},
    ]
    packed = pack_param_groups(groups)
    assert [g["params"] for g in packed] == [[0, 1], [2]]
    packed[0]["betas"].append(0)
    assert betas == [0.9, 0.99]


def sd(state, groups):
    return {"state": state, "param_groups": [{"params": g, "lr": 0.1} for g in groups]}


SHAPES = [[torch.Size([2, 3]), torch.Size([3])], [torch.Size([4])]]


def test_valid_state_dict_passes():
    validate_state_dict(
        sd(
            {0: {"m": torch.zeros(2, 3), "step": torch.tensor(1.0)}, 2: {"m": torch.zeros(4)}},
            [[0, 1], [2]],
        ),
        SHAPES,
    )


def test_wrong_group_count():
    with pytest.raises(ValueError, match="1 param groups but the optimizer has 2"):
        validate_state_dict(sd({}, [[0, 1, 2]]), SHAPES)


def test_wrong_param_count_names_the_group():
    with pytest.raises(ValueError, match="param group 1 of the state dict has 2 params"):
        validate_state_dict(sd({}, [[0, 1], [2, 3]]), SHAPES)


def test_wrong_shape_names_index_key_and_shapes():
    with pytest.raises(
        ValueError, match=r"state\[1\]\['m'\] has shape \(4,\) but parameter 1 has shape \(3,\)"
    ):
        validate_state_dict(sd({1: {"m": torch.zeros(4)}}, [[0, 1], [2]]), SHAPES)


def test_unknown_state_id():
    with pytest.raises(ValueError, match="param id 7"):
        validate_state_dict(sd({7: {}}, [[0, 1], [2]]), SHAPES)


def test_not_a_state_dict():
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        validate_state_dict({"foo": 1}, SHAPES)


def test_factored_state_is_accepted():
    assert state_shape_error(0, "row", torch.zeros(2, 1), torch.Size([2, 3])) is None
    assert state_shape_error(0, "step", torch.zeros(()), torch.Size([2, 3])) is None


def test_saved_ids_map_by_position_and_input_is_untouched():
    state = {10: {"m": torch.ones(1)}, 30: {"m": torch.zeros(1)}}
    saved = {"state": state, "param_groups": [{"params": [10, 20]}, {"params": [30]}]}
    flat = saved_state_by_flat_index(saved)
    assert sorted(flat) == [0, 2]
    flat[0]["x"] = 1
    assert "x" not in state[10]
