"""Models trained with any oss_plus class save and load with safetensors (issue 15).

The params live in flat sync buckets; each one has a storage object of its own over that
memory, so safetensors does not take them for tied weights.
"""

import pytest
import torch
from helpers import make_model, train
from safetensors.torch import _find_shared_tensors, load_file, load_model, save_file, save_model

from oss_plus import OSS
from oss_plus.compat import fairscale
from oss_plus.compat import torch as torch_compat
from oss_plus.wire.layout import own_storage

#: The fairscale adapter keeps fairscale's unpadded buckets: bit-identical to the unsharded
#: model only with reproducible BLAS (conftest.py, docs/portability.md).
LAYOUTS = [
    "oss",
    pytest.param("fairscale", marks=pytest.mark.reproducible_blas),
    "torch_bucket_view",
    "torch_per_param",
]


def build(kind, model, ctx):
    params = model.parameters()
    if kind == "oss":
        return OSS(params, torch.optim.Adam, group=ctx.group, lr=0.01)
    if kind == "fairscale":
        return fairscale.OSS(params, torch.optim.Adam, group=ctx.group, lr=0.01)
    return torch_compat.ZeroRedundancyOptimizer(
        params,
        torch.optim.Adam,
        process_group=ctx.group,
        parameters_as_bucket_view=kind == "torch_bucket_view",
        lr=0.01,
    )


def reference_params(steps):
    model = make_model()
    train(model, torch.optim.Adam(model.parameters(), lr=0.01), steps)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_task(ctx, kind, directory):
    model = make_model()
    opt = build(kind, model, ctx)
    train(model, opt, 3)
    shared = _find_shared_tensors(model.state_dict())
    model_file = f"{directory}/model-{ctx.rank}.safetensors"
    dict_file = f"{directory}/dict-{ctx.rank}.safetensors"
    save_model(model, model_file)
    save_file(model.state_dict(), dict_file)
    # load back into the sharded model itself: values land in the buckets, sync intact
    missing, unexpected = load_model(model, model_file)
    intact = opt.sync_buckets.is_intact()
    train(model, opt, 1, start=3)
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return shared, model_file, dict_file, (missing, unexpected), intact, after


@pytest.mark.parametrize("kind", LAYOUTS)
def test_a_sharded_model_saves_and_loads_with_safetensors(pool, tmp_path, kind):
    want, want_after = reference_params(3), reference_params(4)
    for shared, model_file, dict_file, load_result, intact, after in pool.run(
        save_task, kind, str(tmp_path), world_size=2
    ):
        assert all(len(names) == 1 for names in shared), shared
        fresh = make_model(seed=1)
        assert load_model(fresh, model_file) == (set(), [])
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, want[name]), name
        loaded = load_file(dict_file)
        assert sorted(loaded) == sorted(want)
        assert all(torch.equal(loaded[k], want[k]) for k in want)
        assert load_result == (set(), []) and intact
        assert all(torch.equal(after[k], want_after[k]) for k in want_after)


def test_own_storage_aliases_the_memory_with_a_storage_of_its_own():
    buffer = torch.zeros(10)
    view = buffer[4:10].view(2, 3)
    own = own_storage(view)
    assert own.data_ptr() == view.data_ptr() and own.shape == view.shape
    assert own.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    assert own.untyped_storage().nbytes() == view.nbytes
    buffer.fill_(2.0)
    assert torch.equal(own, torch.full((2, 3), 2.0))  # writes to the bucket show through
    del buffer, view
    own.add_(1.0)  # the bucket memory stays alive with the param
    assert torch.equal(own, torch.full((2, 3), 3.0))
