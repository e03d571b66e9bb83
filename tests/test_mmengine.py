"""oss_plus.integrations.mmengine's pieces on their own (skipped without mmengine).

The Runner recipe (train, save, resume, exact) is tests/integration/recipes/mmengine_recipe.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import catch, clone_model, make_model, params_equal, state_equal, train

pytestmark = pytest.mark.integration  # tox -e integration runs it; skipped without mmengine
pytest.importorskip("mmengine", reason="pip install mmengine (the integration extra)")


def test_the_names_resolve_in_mmenginess_registries():
    from mmengine.registry import HOOKS, OPTIMIZERS

    from oss_plus.integrations import mmengine as integration

    assert OPTIMIZERS.get("OssZeroRedundancyOptimizer") is integration.OssZeroRedundancyOptimizer
    assert HOOKS.get("OssConsolidateHook") is integration.OssConsolidateHook
    # before CheckpointHook on the same event (a lower number runs first)
    from mmengine.hooks import CheckpointHook
    from mmengine.runner import get_priority

    assert get_priority(integration.OssConsolidateHook.priority) < get_priority(
        CheckpointHook.priority
    )


def built_task(ctx, kwargs, other=None):
    """Build through mmengine's registry as a config would; ``other`` on rank 1."""
    from mmengine.registry import OPTIMIZERS

    import oss_plus.integrations.mmengine  # noqa: F401 - registers the names

    torch.manual_seed(0)
    model = make_model()
    ref = clone_model(model)
    cfg = dict(type="OssZeroRedundancyOptimizer", lr=0.01, process_group=ctx.group)
    cfg.update(other if other is not None and ctx.rank == 1 else kwargs)
    made = catch(OPTIMIZERS.build, dict(cfg, params=model.parameters()))
    if made[0] != "ok":
        return made
    opt = made[1]
    train(model, opt, 3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    train(ref, ref_opt, 3)
    # no consolidation, no hook: rank 0 alone reads the other shards (issue 56)
    saved = opt.state_dict() if ctx.rank == 0 else None
    torch.distributed.barrier(group=ctx.group)
    same = saved is None or state_equal(saved, ref_opt.state_dict())
    return type(opt.optim).__name__, params_equal(model, ref), same


def test_optimizer_type_names_the_local_optimizer_as_mmengines_own(pool):
    """Trains as the plain AdamW; state_dict() on rank 0 alone is the plain AdamW's."""
    results = pool.run(built_task, {"optimizer_type": "AdamW"}, world_size=2)
    for result in results:
        assert result == ("AdamW", True, True)


@pytest.mark.parametrize(
    "other",
    [{"optimizer_type": "AdamW", "optimizer_class": "AdamW"}, {"optimizer_type": "Adamw"}],
    ids=["both_names", "unknown_name"],
)
def test_bad_optimizer_names_on_one_rank_raise_on_every_rank(pool, other):
    results = pool.run(built_task, {"optimizer_type": "AdamW"}, other, world_size=2, timeout=30)
    assert [r[0] for r in results] == ["ValueError", "ValueError"], results
    assert "[1]" in results[0][1]  # rank 0 names the rank that failed
