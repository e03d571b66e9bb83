"""Muon on the matrices and AdamW on the rest, as two OSS instances, against the same pair
unsharded (issue 49): training, and a resume through torch DCP with both optimizers in one
``get_state_dict(model, [muon, adamw])`` (default options, ``full_state_dict=True`` and
``flatten_optimizer_state_dict=True``) and through each optimizer's sharded checkpoint,
loaded at 2 ranks and resharded at 3 and 1."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from oss_plus import OSS
from oss_plus.checkpoint import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch without Muon")

SAVED, MORE = 3, 2
OPTIONS = {
    "dcp": {},
    "dcp-full": {"full_state_dict": True},
    "dcp-flat-keys": {"flatten_optimizer_state_dict": True},
}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 12), torch.nn.Tanh(),
        torch.nn.Linear(12, 4),
    )  # fmt: skip


def _split(model):
    matrices = [p for p in model.parameters() if p.ndim == 2]
    return matrices, [p for p in model.parameters() if p.ndim != 2]


def _pair(model, group=None):
    matrices, rest = _split(model)
    if group is None:
        return torch.optim.Muon(matrices, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2)
    return (
        OSS(matrices, optim=torch.optim.Muon, group=group, lr=2e-2),
        OSS(rest, optim=torch.optim.AdamW, group=group, lr=1e-2),
    )


def _train(model, opts, steps, start=0):
    for step in range(start, start + steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for o in opts:
            o.zero_grad()
        model(x).pow(2).mean().backward()
        for o in opts:
            o.step()


def _reference():
    model = _model()
    opts = _pair(model)
    _train(model, opts, SAVED + MORE)
    return [p.detach().clone() for p in model.parameters()]


def _fresh(group):
    model = _model(seed=1)
    saved = _model()
    _train(saved, _pair(saved), SAVED)  # the params at the save
    with torch.no_grad():
        for p, q in zip(model.parameters(), saved.parameters()):
            p.copy_(q)
    return model, _pair(model, group)


def _exact(model, want) -> bool:
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), want))


def save_task(ctx, root):
    want = _reference()
    model = _model()
    opts = _pair(model, ctx.group)
    _train(model, opts, SAVED)
    for name, options in OPTIONS.items():
        _, optim_sd = get_state_dict(model, list(opts), options=StateDictOptions(**options))
        dcp.save(
            {"optim": optim_sd}, checkpoint_id=os.path.join(root, name), process_group=ctx.group
        )
    for n, opt in enumerate(opts):
        save_checkpoint(opt, os.path.join(root, f"sharded-{n}"))
    _train(model, opts, MORE, start=SAVED)
    return _exact(model, want)


def load_task(ctx, root):
    want, exact = _reference(), {}
    for name, options in OPTIONS.items():
        model, opts = _fresh(ctx.group)
        sd_options = StateDictOptions(**options)
        model_sd, optim_sd = get_state_dict(model, list(opts), options=sd_options)
        dcp.load(
            {"optim": optim_sd}, checkpoint_id=os.path.join(root, name), process_group=ctx.group
        )
        set_state_dict(
            model, list(opts), model_state_dict=model_sd, optim_state_dict=optim_sd,
            options=sd_options,
        )  # fmt: skip
        _train(model, opts, MORE, start=SAVED)
        exact[name] = _exact(model, want)
    model, opts = _fresh(ctx.group)
    for n, opt in enumerate(opts):
        load_checkpoint(opt, os.path.join(root, f"sharded-{n}"))
    _train(model, opts, MORE, start=SAVED)
    exact["sharded"] = _exact(model, want)
    return exact


def test_muon_and_adamw_as_two_oss_match_the_unsharded_pair_through_dcp(pool, tmp_path):
    assert pool.run(save_task, str(tmp_path), world_size=2, timeout=120) == [True, True]
    every = dict.fromkeys([*OPTIONS, "sharded"], True)
    for world in (2, 3, 1):
        assert pool.run(load_task, str(tmp_path), world_size=world, timeout=120) == [every] * world
