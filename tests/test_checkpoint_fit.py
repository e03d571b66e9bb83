"""The saved param groups against the loading optimizer, and checkpoints of other optimizers.

References: torch's own ``AdamW.load_state_dict`` of a plain ``Adam`` state dict (what
``allow_other_optimizer=True`` must equal), and the hyperparameters of torch's classes.
"""

from __future__ import annotations

import pytest
import torch
from helpers import catch
from test_checkpoint import diff
from test_checkpoint_fuzz import SAVED, Net, groups, run

from oss_plus import OSS, load_checkpoint, save_checkpoint
from oss_plus.checkpoint.fit import group_problems

OTHER = dict(lr=0.5, weight_decay=0.3)


def adamw() -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.zeros(2)], lr=0.5, weight_decay=0.3)


def saved_group(**changes) -> dict:
    group = {k: v for k, v in adamw().param_groups[0].items() if k != "params"}
    group.update(lr=0.01, params=[0])
    for key, value in changes.items():
        if value is KeyError:
            del group[key]
        else:
            group[key] = value
    return group


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"lr": KeyError}, "param group 0 has no 'lr', a hyperparameter of AdamW (yours is 0.5)"),
        ({"weight_decay": KeyError}, "has no 'weight_decay'"),
        ({"lr": "0.01"}, "key 'lr' is '0.01' (str), but AdamW expects a value like 0.5"),
        ({"lr": None}, "key 'lr' is None (NoneType)"),
        ({"betas": [0.9, 0.999]}, "key 'betas' is [0.9, 0.999] (list)"),
        ({"betas": (0.9,)}, "key 'betas' is (0.9,)"),
        ({"amsgrad": 0}, "key 'amsgrad' is 0 (int)"),
    ],
)
def test_a_missing_or_mistyped_hyperparameter_is_named_with_its_group(changes, words):
    problems, _ = group_problems([saved_group(**changes)], adamw(), adamw().param_groups)
    assert len(problems) == 1 and words in problems[0], problems


def test_unknown_keys_are_kept_and_keys_the_class_fills_in_are_filled_as_torch_does():
    group = saved_group(initial_lr=0.01, capturable=KeyError, decoupled_weight_decay=KeyError)
    problems, (completed,) = group_problems([group], adamw(), adamw().param_groups)
    assert problems == []
    reference = adamw()  # torch's load_state_dict completes a saved group the same way
    reference.load_state_dict({"state": {}, "param_groups": [group]})
    assert completed == reference.param_groups[0] | {"params": [0]}
    assert completed["initial_lr"] == 0.01 and completed["capturable"] is False
    assert completed["lr"] == 0.01 and completed["decoupled_weight_decay"] is True


def test_an_int_lr_and_a_tensor_lr_fit_a_float_default():
    for lr in (1, torch.tensor(0.01)):
        assert group_problems([saved_group(lr=lr)], adamw(), adamw().param_groups)[0] == []


# ------------------------------------------------------------------ other optimizer classes
def save_task(ctx, root: str) -> None:
    for name, cls, kwargs in (
        ("adam", torch.optim.Adam, SAVED),
        ("sgd", torch.optim.SGD, dict(lr=0.01, momentum=0.9)),
    ):
        model = Net()
        opt = OSS(groups(model, 0.02), optim=cls, group=ctx.group, **kwargs)
        run(model, opt, range(3))
        save_checkpoint(opt, f"{root}/{name}", sharded=name == "adam")


def other_task(ctx, root: str) -> dict:
    """Adam and SGD checkpoints into OSS(AdamW): refused, and Adam's loaded when asked for,
    compared with torch's AdamW.load_state_dict of the plain Adam's state dict."""
    out = {}

    def fresh() -> tuple[Net, OSS]:
        model = Net()
        return model, OSS(groups(model, 0.7), optim=torch.optim.AdamW, group=ctx.group, **OTHER)

    for name in ("adam", "sgd"):
        _, opt = fresh()
        out[name] = catch(load_checkpoint, opt, f"{root}/{name}")
        out[f"{name} allowed"] = catch(
            load_checkpoint, opt, f"{root}/{name}", allow_other_optimizer=True
        )
    plain_model = Net()
    plain = torch.optim.Adam(groups(plain_model, 0.02), **SAVED)
    run(plain_model, plain, range(3))
    ref_model = Net()
    ref_model.load_state_dict(plain_model.state_dict())
    ref = torch.optim.AdamW(groups(ref_model, 0.7), **OTHER)
    ref.load_state_dict(plain.state_dict())
    run(ref_model, ref, range(3, 5))
    model, opt = fresh()
    model.load_state_dict(plain_model.state_dict())
    load_checkpoint(opt, f"{root}/adam", allow_other_optimizer=True)
    run(model, opt, range(3, 5))
    out["exact"] = diff(opt.state_dict(all_ranks=True), ref.state_dict()) or all(
        torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())
    )
    return out


def test_another_optimizer_is_refused_naming_both_classes_unless_compatible_and_asked(
    pool, tmp_path
):
    pool.run(save_task, str(tmp_path), world_size=2)
    for world in (2, 3):
        for out in pool.run(other_task, str(tmp_path), world_size=world):
            assert out["exact"] is True, out["exact"]
            for case in ("adam", "sgd", "sgd allowed"):
                kind, text = out[case]
                assert kind in ("ValueError", "RemoteRankError"), out[case]
                assert str(tmp_path / case.split()[0] / "index.json") in text
                assert "torch.optim.adamw.AdamW" in text, text
            assert "torch.optim.adam.Adam optimizer" in out["adam"][1]
            assert "allow_other_optimizer=True" in out["adam"][1]
            assert "weight_decay: 0.3 -> 0.05" in out["adam"][1]  # what would change
            assert "torch.optim.sgd.SGD optimizer and cannot be loaded" in out["sgd allowed"][1]
            assert "has no 'betas'" in out["sgd"][1]
            assert out["adam allowed"] == ("ok", None)
