"""oss_plus.integrations.mmengine's pieces on their own (skipped without mmengine).

The Runner recipe (train, save, resume, exact) is tests/integration/recipes/mmengine_recipe.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import catch, clone_model, make_model, params_equal, train

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
    train(ref, torch.optim.AdamW(ref.parameters(), lr=0.01), 3)
    saved = catch(opt.state_dict)  # no consolidation: the error names the hook
    return type(opt.optim).__name__, params_equal(model, ref), saved


def test_optimizer_type_names_the_local_optimizer_as_mmengines_own(pool):
    """Trains as the plain AdamW; a state_dict() with no consolidation names the hook."""
    from oss_plus.integrations.mmengine import NOT_CONSOLIDATED_MMENGINE

    results = pool.run(built_task, {"optimizer_type": "AdamW"}, world_size=2)
    for rank, result in enumerate(results):
        unsaved = ("RuntimeError", NOT_CONSOLIDATED_MMENGINE.format(rank=rank))
        assert result == ("AdamW", True, unsaved)
    assert "custom_hooks=[dict(type='OssConsolidateHook')]" in NOT_CONSOLIDATED_MMENGINE


@pytest.mark.parametrize(
    "other",
    [{"optimizer_type": "AdamW", "optimizer_class": "AdamW"}, {"optimizer_type": "Adamw"}],
    ids=["both_names", "unknown_name"],
)
def test_bad_optimizer_names_on_one_rank_raise_on_every_rank(pool, other):
    results = pool.run(built_task, {"optimizer_type": "AdamW"}, other, world_size=2, timeout=30)
    assert [r[0] for r in results] == ["ValueError", "ValueError"], results
    assert "[1]" in results[0][1]  # rank 0 names the rank that failed
