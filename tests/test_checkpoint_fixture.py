"""Checkpoints written by an earlier oss_plus still load: the format-v1 fixture.

``tests/fixtures/checkpoint_v1`` was written by main's checkpoint code before the checkpoint
modules became a package (see ``tests/fixtures/checkpoint_v1.py``). Its content is checked
against two independent references: the plain unsharded torch Adam replaying the same run,
and ``expected.json`` (the state dict recorded when the fixture was written).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import WORLD_IDS, WORLDS
from test_checkpoint import diff

from oss_plus import OSS, load_checkpoint
from oss_plus.checkpoint import read_state_dict
from oss_plus.checkpoint.values import decode_value

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import checkpoint_v1 as fixture  # noqa: E402

LAYOUTS = ("sharded", "consolidated")


def expected() -> dict:
    return decode_value(json.loads((fixture.HERE / "expected.json").read_text()), "expected")


def test_the_recorded_state_is_that_of_the_unsharded_adam():
    """The tensors exactly; of the hyperparameters, those the installed torch's Adam keeps
    (torch 2.13 recorded ``decoupled_weight_decay``, which Adam before 2.7 does not have)."""
    recorded, known = expected(), set(torch.optim.Adam([torch.zeros(1)]).defaults) | {"params"}
    for group in recorded["param_groups"]:
        for key in set(group) - known:
            del group[key]
    assert diff(recorded, fixture.reference_state_dict()) is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_state_dict_reads_the_old_checkpoint_exactly(layout):
    state = read_state_dict(fixture.HERE / layout)
    assert diff(state, expected()) is None
    dtypes = {v.dtype for s in state["state"].values() for v in s.values()}
    assert dtypes == {torch.float32, torch.bfloat16, torch.float64}


def load_fixture_task(ctx, layout: str) -> tuple[str | None, str | None]:
    """Load the fixture into a fresh OSS; step once; compare with the plain Adam doing so."""
    params = fixture.make_params()
    opt = OSS(fixture.groups_of(params), optim=torch.optim.Adam, group=ctx.group, lr=0.5)
    load_checkpoint(opt, fixture.HERE / layout)
    loaded = diff(opt.state_dict(all_ranks=True), expected())
    ref_params = fixture.make_params()
    ref = torch.optim.Adam(fixture.groups_of(ref_params), lr=0.5)
    ref.load_state_dict(expected())
    for p, q in zip(params, ref_params):
        if p.requires_grad:
            p.grad = q.grad = torch.full_like(p, 0.25)
    opt.step()
    ref.step()
    stepped = next(
        (f"param {i}" for i, (p, q) in enumerate(zip(params, ref_params)) if not torch.equal(p, q)),
        None,
    )
    return loaded, stepped


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_load_checkpoint_loads_the_old_checkpoint_at_any_world_size(pool, world, layout):
    for loaded, stepped in pool.run(load_fixture_task, layout, **world):
        assert loaded is None and stepped is None, (loaded, stepped)
