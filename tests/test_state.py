"""Pure tests of index translation and state-dict validation (no processes)."""

import pytest
import torch

from oss_plus.state.index import (
    PER_ELEMENT_KEYS,
    group_offsets,
    local_view,
    pack_param_groups,
    per_element_keys,
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
        validate_state_dict(sd({1: {"m": torch.zeros(4)}}, [[0, 1], [2]]), SHAPES, frozenset({"m"}))


def test_unknown_state_id():
    with pytest.raises(ValueError, match="param id 7"):
        validate_state_dict(sd({7: {}}, [[0, 1], [2]]), SHAPES)


def test_not_a_state_dict():
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        validate_state_dict({"foo": 1}, SHAPES)


def test_factored_state_is_accepted():
    assert state_shape_error(0, "row", torch.zeros(2, 1), torch.Size([2, 3])) is None
    assert state_shape_error(0, "step", torch.zeros(()), torch.Size([2, 3])) is None


def test_fixed_size_state_with_the_params_ndim_is_accepted():
    """A (3,) histogram on a bias of shape (5,) is legal state (issue 13, item 4)."""
    hist = {0: {"hist": torch.zeros(3), "step": torch.tensor(1.0)}}
    validate_state_dict(sd(hist, [[0]]), [[torch.Size([5])]])
    validate_state_dict(sd(hist, [[0]]), [[torch.Size([5])]], per_element_keys(torch.optim.Adam))


def test_per_element_state_of_another_shape_is_still_caught():
    """A torch optimizer's per-element state must have the param's exact shape."""
    moments = {0: {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(5)}}
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] has shape \(3,\) but"):
        validate_state_dict(
            sd(moments, [[0]]), [[torch.Size([5])]], per_element_keys(torch.optim.Adam)
        )
    transposed = {0: {"momentum_buffer": torch.zeros(3, 2)}}
    with pytest.raises(ValueError, match="different model"):
        validate_state_dict(
            sd(transposed, [[0]]), [[torch.Size([2, 3])]], per_element_keys(torch.optim.SGD)
        )

    class Custom(torch.optim.SGD):  # a subclass may give the key another meaning
        pass

    assert per_element_keys(Custom) == frozenset()


#: Options under which each torch optimizer creates every state key it has.
FULL_OPTIONS = {
    torch.optim.Adam: {"amsgrad": True},
    torch.optim.AdamW: {"amsgrad": True},
    torch.optim.RMSprop: {"momentum": 0.9, "centered": True},
    torch.optim.SGD: {"momentum": 0.9},
}


@pytest.mark.parametrize("cls", sorted(PER_ELEMENT_KEYS, key=lambda c: c.__name__))
@pytest.mark.parametrize("shape", [(3, 4), (5,)])
def test_per_element_keys_are_exactly_the_state_torch_keeps_per_element(cls, shape):
    """Run the real optimizer: every tensor of the param's shape is listed, and only those."""
    if cls.__name__ == "Muon" and len(shape) != 2:
        pytest.skip("Muon steps 2-D params only")
    param = torch.nn.Parameter(torch.randn(shape))
    opt = cls([param], **FULL_OPTIONS.get(cls, {}))
    for _ in range(2):
        grad = torch.randn(shape)
        param.grad = grad.to_sparse() if cls is torch.optim.SparseAdam else grad
        opt.step()
    state = opt.state[param]
    same_shape = {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == shape}
    assert same_shape == per_element_keys(cls) & set(state)
    if len(shape) == 1 or cls.__name__ != "Adafactor":  # Adafactor: factored on matrices
        assert per_element_keys(cls) <= set(state)


def test_saved_ids_map_by_position_and_input_is_untouched():
    state = {10: {"m": torch.ones(1)}, 30: {"m": torch.zeros(1)}}
    saved = {"state": state, "param_groups": [{"params": [10, 20]}, {"params": [30]}]}
    flat = saved_state_by_flat_index(saved)
    assert sorted(flat) == [0, 2]
    flat[0]["x"] = 1
    assert "x" not in state[10]
