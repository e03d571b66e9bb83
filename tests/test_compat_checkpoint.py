"""oss_plus checkpoints (save_checkpoint / load_checkpoint) work with both adapters."""

import pytest
import torch
from helpers import flat_params, make_model, train

from oss_plus.checkpoint import load_checkpoint, read_state_dict, save_checkpoint
from oss_plus.compat.fairscale import OSS
from oss_plus.compat.torch import ZeroRedundancyOptimizer


def _build(kind, model, ctx):
    if kind == "fairscale":
        return OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    return ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.Adam,
        process_group=ctx.group,
        parameters_as_bucket_view=True,
        lr=0.01,
    )


def _full_state(opt):
    opt.consolidate_state_dict(-1)  # every rank: recipient_rank=-1 / to=-1
    return opt.state_dict()


def save_task(ctx, kind, path):
    model = make_model()
    opt = _build(kind, model, ctx)
    train(model, opt, 2)
    save_checkpoint(opt, path)
    return flat_params(model), _full_state(opt)


def load_task(ctx, kind, path, values):
    model = make_model()
    torch.nn.utils.vector_to_parameters(values.clone(), model.parameters())
    opt = _build(kind, model, ctx)
    load_checkpoint(opt, path)
    return _full_state(opt)


@pytest.mark.parametrize("saver,loader", [("fairscale", "torch"), ("torch", "fairscale")])
def test_checkpoint_saved_by_one_adapter_loads_into_the_other(pool, tmp_path, saver, loader):
    path = str(tmp_path / "ckpt")
    values, saved = pool.run(save_task, saver, path, world_size=2)[0]
    assert read_state_dict(path)["state"].keys() == saved["state"].keys()
    for loaded in pool.run(load_task, loader, path, values, world_size=3):
        assert loaded["state"].keys() == saved["state"].keys()
        for index, state in saved["state"].items():
            for key, value in state.items():
                assert torch.equal(loaded["state"][index][key], value), (index, key)
