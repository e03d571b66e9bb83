"""Pure tests of argument validation (no processes)."""

import functools

import pytest
import torch

from oss_plus.step.params import (
    check_optim_class,
    describe_params,
    fingerprint,
    first_difference,
    normalize_params,
)


def test_accepts_tensors_generators_groups_and_named():
    model = torch.nn.Linear(2, 3)
    assert len(normalize_params(model.parameters())[0]["params"]) == 2
    assert len(normalize_params(list(model.parameters()))[0]["params"]) == 2
    groups = normalize_params([{"params": model.weight, "lr": 1.0}, {"params": [model.bias]}])
    assert [len(g["params"]) for g in groups] == [1, 1]
    assert normalize_params(model.named_parameters())[0]["params"][0][0] == "weight"


def test_empty():
    with pytest.raises(ValueError, match="empty parameter list"):
        normalize_params([])


def test_single_tensor():
    with pytest.raises(TypeError, match="single tensor"):
        normalize_params(torch.zeros(1))


def test_non_tensor():
    with pytest.raises(TypeError, match="param 1 of group 0 is a str"):
        normalize_params([torch.zeros(1), "x"])


def test_sparse():
    with pytest.raises(ValueError, match="sparse"):
        normalize_params([torch.zeros(2, 2).to_sparse()])


def test_duplicate_names_both_positions():
    p = torch.zeros(1)
    with pytest.raises(
        ValueError, match="param 0 of group 1 is the same tensor as param 0 of group 0"
    ):
        normalize_params([{"params": [p]}, {"params": [p]}])


def test_set_rejected():
    with pytest.raises(TypeError, match="set"):
        normalize_params([{"params": {torch.zeros(1)}}])


def test_mixed_groups_and_tensors():
    with pytest.raises(TypeError, match="mixes"):
        normalize_params([{"params": [torch.zeros(1)]}, torch.zeros(1)])


def test_optim_checks():
    check_optim_class(torch.optim.Adam)
    check_optim_class(functools.partial(torch.optim.SGD, momentum=0.9))
    with pytest.raises(TypeError, match="not a subclass|subclass of torch.optim.Optimizer"):
        check_optim_class(torch.nn.Linear)
    with pytest.raises(TypeError, match="an instance of SGD"):
        check_optim_class(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1))
    with pytest.raises(TypeError, match="optimizer class"):
        check_optim_class("adam")


def test_fingerprint_and_difference():
    a = describe_params([{"params": [torch.zeros(2, 3), torch.zeros(3)]}])
    b = describe_params([{"params": [torch.zeros(2, 3), torch.zeros(4)]}])
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a) == fingerprint(
        describe_params([{"params": [torch.ones(2, 3), torch.ones(3)]}])
    )
    assert first_difference(a, b) == "param 1 of group 0 is (3,):float32 here, (4,):float32 there"
