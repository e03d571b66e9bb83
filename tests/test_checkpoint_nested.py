"""Checkpoints of optimizer state with tensors inside containers (Shampoo-style).

``helpers.ShampooLike`` keeps, per param, a dict holding a list of preconditioner tensors
and a tuple, an int, a bool, None, a 0-dim tensor and a ``(3,)`` histogram. It is saved on
2 ranks in both layouts, blocking and asynchronously (a step changes the nested tensors in
place while each asynchronous save is held in flight), and loaded on 1 and 3 ranks and on a group
without global rank 0. The reference is the same optimizer run unsharded: the checkpoint, the
loaded state and the training that continues from it are compared with it exactly (fp32).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers import WORLD_IDS, WORLDS, ShampooLike, make_model, params_equal, train
from test_checkpoint import diff
from test_checkpoint_async import Gate

from oss_plus import OSS, load_checkpoint, save_checkpoint
from oss_plus.checkpoint import read_state_dict

#: Every save by directory name: (sharded, blocking, the step count it holds). Each
#: asynchronous save is held in flight while a step changes the nested tensors in place.
SAVES = {
    "sharded-sync": (True, True, 2),
    "consolidated-sync": (False, True, 2),
    "consolidated-async": (False, False, 2),
    "sharded-async": (True, False, 3),
}
#: Where the 2-rank save is loaded: 1 and 3 ranks, and ranks (2, 3) of 4.
LOAD_WORLDS = [WORLDS[WORLD_IDS.index(w)] for w in ("ws1", "ws3", "offset23")]


def reference(steps: int) -> tuple[torch.nn.Module, ShampooLike]:
    """The unsharded optimizer after ``steps`` steps."""
    model = make_model()
    opt = ShampooLike(model.parameters())
    train(model, opt, steps)
    return model, opt


def save_task(ctx, root: str) -> dict[str, str | None]:
    """Train sharded and save as :data:`SAVES` says; compare each with the unsharded state."""
    model = make_model()
    opt = OSS(model.parameters(), optim=ShampooLike, group=ctx.group)
    done, pending = 0, []
    for name, (sharded, blocking, steps) in SAVES.items():
        train(model, opt, steps - done, start=done)
        done = steps
        if blocking:
            save_checkpoint(opt, f"{root}/{name}", sharded=sharded)
            continue
        with Gate() as gate:  # the write waits until a step changed the state in place
            future = save_checkpoint(opt, f"{root}/{name}", sharded=sharded, blocking=False)
            pending.append(not future.done())
            train(model, opt, 1, start=done)  # mats[0].addcmul_, scale.mul_, hist.add_...
            done += 1
            gate.open()
            future.result(timeout=60)
    assert all(pending)
    return {
        name: diff(read_state_dict(f"{root}/{name}"), reference(steps)[1].state_dict(), name)
        for name, (_, _, steps) in SAVES.items()
    }


def load_task(ctx, root: str) -> dict[str, str | None]:
    """Load each save into a fresh OSS; compare with the unsharded optimizer, then continue."""
    problems: dict[str, str | None] = {}
    for name, (_, _, steps) in SAVES.items():
        ref_model, ref = reference(steps)
        model = copy.deepcopy(ref_model)
        opt = OSS(model.parameters(), optim=ShampooLike, group=ctx.group, lr=123.0)
        load_checkpoint(opt, f"{root}/{name}")
        problem = diff(opt.state_dict(all_ranks=True), ref.state_dict(), f"{name} loaded")
        train(model, opt, 2, start=steps)
        train(ref_model, ref, 2, start=steps)
        if not problem and not params_equal(model, ref_model):
            problem = f"{name}: params differ from the unsharded optimizer after continuing"
        problem = problem or diff(
            opt.state_dict(all_ranks=True), ref.state_dict(), f"{name} continued"
        )
        problems[name] = problem
    return problems


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory) -> tuple[Path, list[dict[str, str | None]]]:
    root = tmp_path_factory.mktemp("nested")
    return root, pool.run(save_task, str(root), world_size=2, timeout=120)


def test_both_layouts_sync_and_async_hold_the_unsharded_state_exactly(saved):
    _, reports = saved
    for rank, problems in enumerate(reports):
        assert list(problems) == list(SAVES)
        assert not any(problems.values()), f"rank {rank}: {problems}"


def test_read_state_dict_returns_the_nested_structure_with_its_types(saved):
    root, _ = saved
    state = read_state_dict(root / "sharded-sync")["state"]
    first = state[0]
    assert {k: type(v).__name__ for k, v in first.items()} == {
        "pre": "dict",
        "count": "int",
        "warm": "bool",
        "none": "NoneType",
        "scale": "Tensor",
        "hist": "Tensor",
    }
    assert type(first["pre"]["mats"]) is list and type(first["pre"]["k"]) is tuple
    assert first["scale"].dim() == 0 and first["hist"].shape == (3,)


def test_the_index_keeps_structure_in_json_and_tensors_in_safetensors(saved):
    root, _ = saved
    for name in ("sharded-sync", "consolidated-sync"):
        index = json.loads((root / name / "index.json").read_text())
        assert index["format_version"] == 5
        pre = index["state"]["0"]["pre"]
        assert pre["nested"]["dict"][0] == ["mats", [{"tensor": 0}, {"tensor": 1}]]
        assert [t["name"] for t in pre["tensors"]] == ["state.0.pre/mats/0", "state.0.pre/mats/1"]
        assert all(t["file"].endswith(".safetensors") for t in pre["tensors"])


@pytest.mark.parametrize("world", LOAD_WORLDS, ids=["ws1", "ws3", "offset23"])
def test_a_2_rank_save_loads_at_another_world_size_exactly(pool, saved, world):
    root, _ = saved
    for rank, problems in enumerate(pool.run(load_task, str(root), timeout=120, **world)):
        assert list(problems) == list(SAVES)
        assert not any(problems.values()), f"rank {rank}: {problems}"


def test_inspect_shows_the_structure_with_dtypes_and_shapes(saved, capsys):
    from oss_plus.cli import main

    root, _ = saved
    assert main(["ckpt", "inspect", "--verify", str(root / "consolidated-async")]) == 0
    out = capsys.readouterr().out
    assert "format v5, consolidated layout" in out
    params = list(make_model().parameters())
    shape = "x".join(map(str, params[0].shape))
    row = next(line for line in out.splitlines() if line.startswith("0 "))
    assert f"pre={{'mats': [F32[{shape}], F32[{shape}]], 'k': (3, 0.625)}}" in row  # 2 steps
    assert "count=2 warm=True none=None scale:F32[scalar] hist:F32[3]" in row
    nbytes = sum(2 * p.numel() * 4 + 4 + 12 for p in params[:1])
    assert row.split()[6:8] == [str(nbytes), "B"]
    assert f"verified:   {4 * len(params)} tensors match their checksums" in out
