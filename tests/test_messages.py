"""Messages no other test named: each triggered as a user would, checked exactly, on every rank.

``checkpoint.assemble.OTHER_SAVE``, ``checkpoint.cli.NO_STATE_DICT``, ``plan.PLAN_MISMATCH``,
``compat.torch.OVERLAP_BUCKET_VIEW``, ``compat.ddp_zero_hook.BUCKETS_CHANGED`` and
``UNKNOWN_PARAM`` (see docs/reliability.md for where each is raised).
"""

from __future__ import annotations

import json
import shutil

import torch
from helpers import catch, ddp_of, logged, make_model, make_overlap_model, overlap_loss, train
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from oss_plus import OSS, load_checkpoint, save_checkpoint
from oss_plus.checkpoint.assemble import OTHER_SAVE
from oss_plus.checkpoint.cli import NO_STATE_DICT
from oss_plus.cli import main
from oss_plus.compat.ddp_zero_hook import BUCKETS_CHANGED, UNKNOWN_PARAM, plan_overlap
from oss_plus.compat.torch import (
    OVERLAP_BUCKET_VIEW,
    ZeroRedundancyOptimizer,
    hook_with_zero_step,
)
from oss_plus.planning.plan import PLAN_MISMATCH, ParamSpec, make_plan
from oss_plus.runtime.dist import peer_failed


def _oss(ctx, lr=0.01):
    model = make_model()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=lr)
    return model, opt


# ------------------------------------------------------------------ OTHER_SAVE
def two_saves_task(ctx, first, second):
    model, opt = _oss(ctx)
    train(model, opt, 1)
    save_checkpoint(opt, first)
    train(model, opt, 1, start=1)
    save_checkpoint(opt, second)


def load_task(ctx, path):
    _, opt = _oss(ctx, lr=1.0)
    return catch(load_checkpoint, opt, path)


def test_a_shard_restored_from_another_save_raises_other_save_on_every_rank(pool, tmp_path):
    """A user "repairs" rank 1's shard by copying the one of an older save under the name the
    index expects: the load refuses the mix, on both ranks."""
    first, second = tmp_path / "first", tmp_path / "second"
    pool.run(two_saves_task, str(first), str(second))
    ids = [json.loads((p / "index.json").read_text())["save_id"] for p in (first, second)]
    old = next(p for p in sorted(first.iterdir()) if p.name.startswith("shard-00001"))
    new = next(p for p in sorted(second.iterdir()) if p.name.startswith("shard-00001"))
    shutil.copyfile(old, new)
    expected = OTHER_SAVE.format(
        file=new, found=ids[0], index=second / "index.json", expected=ids[1]
    )
    results = pool.run(load_task, str(second))
    assert results[1] == ("ValueError", expected)
    kind, text = results[0]
    assert kind == "ValueError" and peer_failed([0, 1], [1], 0) in text and expected in text


# ------------------------------------------------------------------ NO_STATE_DICT
def test_converting_a_file_without_a_state_dict_names_its_keys(tmp_path, capsys):
    """``ckpt convert`` of a model checkpoint (a single process: the CLI has no ranks)."""
    source = tmp_path / "model.pt"
    torch.save({"epoch": 3, "model": make_model().state_dict()}, source)
    code = main(["ckpt", "convert", str(source), str(tmp_path / "out")])
    err = capsys.readouterr().err
    message = NO_STATE_DICT.format(file=source, where="", keys=["epoch", "model"])
    assert code == 2 and message in err and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ PLAN_MISMATCH
def wrong_plan_task(ctx):
    _, opt = _oss(ctx)
    other = torch.nn.Linear(3, 2)
    plan = make_plan([[ParamSpec(p.numel()) for p in other.parameters()]], ctx.world_size)
    return catch(opt.repartition, plan)


def test_a_plan_of_another_model_raises_plan_mismatch_on_every_rank(pool):
    expected = PLAN_MISMATCH.format(given=[2], world=2, actual=[8], ours=2)
    assert pool.run(wrong_plan_task) == [("ValueError", expected)] * 2


# ------------------------------------------------------------------ OVERLAP_BUCKET_VIEW
def bucket_view_task(ctx):
    model = make_overlap_model()
    with logged("oss_plus.compat.torch") as messages:
        ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.SGD,
            process_group=ctx.group,
            overlap_with_ddp=True,
            parameters_as_bucket_view=True,
            lr=0.1,
        )
    return messages


def test_bucket_view_with_overlap_warns_on_every_rank(pool):
    """torch warns that ``parameters_as_bucket_view`` is ignored under ``overlap_with_ddp``."""
    for messages in pool.run(bucket_view_task):
        assert messages == [OVERLAP_BUCKET_VIEW]


# ------------------------------------------------------------------ BUCKETS_CHANGED
def rewrapped_task(ctx):
    """One ZeRO optimizer, its hook registered on a second DDP of the same module (other
    buckets) after the first one initialized it."""
    model = make_overlap_model()
    first = ddp_of(ctx, model)
    zero = ZeroRedundancyOptimizer(
        first.parameters(), torch.optim.SGD, process_group=ctx.group, overlap_with_ddp=True, lr=0.1
    )
    first.register_comm_hook(None, hook_with_zero_step(allreduce_hook, first, zero))
    for it in range(3):
        zero.zero_grad()
        overlap_loss(first, it, ctx.rank).backward()
    second = torch.nn.parallel.DistributedDataParallel(
        model, process_group=ctx.group, bucket_cap_mb=25
    )
    second.register_comm_hook(None, hook_with_zero_step(allreduce_hook, second, zero))
    zero.zero_grad()
    return catch(lambda: overlap_loss(second, 3, ctx.rank).backward())


def test_a_hook_on_another_ddp_raises_buckets_changed_on_every_rank(pool):
    for kind, text in pool.run(rewrapped_task, timeout=60):
        assert kind == "RuntimeError" and BUCKETS_CHANGED.format(index=0) in text, text


# ------------------------------------------------------------------ UNKNOWN_PARAM
def test_a_bucket_param_the_optimizer_lacks_raises_unknown_param():
    """Through the public API the pairing check raises first (``PARAM_NOT_IN_OPTIMIZER``, on
    every rank: tests/test_overlap.py); the planner keeps torch's own message for a bucket
    holding a param the optimizer was not given."""
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    assert catch(plan_overlap, params[:2], [params], 2, False) == ("ValueError", UNKNOWN_PARAM)
