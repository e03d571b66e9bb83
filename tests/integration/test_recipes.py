"""Each framework trains a model sharded by oss_plus on 2 gloo ranks, saves through its own
checkpointing, resumes in fresh processes and ends equal to an unsharded run (issue 15).

The recipes are ``recipes/*.py`` (``docs/integrations.md`` shows them). A framework that is
not installed skips its test: ``pip install -e ".[integration]"`` installs them all.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file


def test_lightning_2_ddp_with_model_checkpoint_and_ckpt_path(run_recipe):
    pytest.importorskip("lightning", reason="pip install lightning (the integration extra)")
    run_recipe("lightning2")


def test_lightning_2_clips_amp_gradients_of_oss_as_of_the_plain_optimizer(run_recipe_once):
    """A GradScaler and gradient_clip_val: Lightning refuses to clip an optimizer that
    declares torch's loss-scaling contract, which OSS does only under ShardedDataParallel."""
    pytest.importorskip("lightning", reason="pip install lightning (the integration extra)")
    run_recipe_once("lightning2_amp")


@pytest.mark.parametrize("kind", ["torch", "oss"])
def test_ignite_checkpoint_handler(run_recipe, kind, monkeypatch):
    pytest.importorskip("ignite", reason="pip install pytorch-ignite (the integration extra)")
    monkeypatch.setenv("RECIPE_OPTIMIZER", kind)
    run_recipe("ignite_recipe")


def test_accelerate_save_state_and_load_state(run_recipe):
    pytest.importorskip("accelerate", reason="pip install accelerate (the integration extra)")
    run_recipe("accelerate_recipe")


def test_hf_trainer_with_a_consolidating_callback(run_recipe):
    """transformers <= 5.17 fails the resume of a multi-process CPU run whatever the optimizer
    (docs/integrations.md): the plain-AdamW control then turns the failure into a skip."""
    pytest.importorskip("transformers", reason="pip install transformers (the integration extra)")
    run_recipe("hf_trainer", control={"RECIPE_OPTIMIZER": "plain"})


def test_lightning_1_9_ddp_sharded_through_install(run_recipe):
    pl = pytest.importorskip("pytorch_lightning", reason="pip install pytorch-lightning==1.9.5")
    if not pl.__version__.startswith("1.9"):
        pytest.skip(
            f"needs pytorch-lightning 1.9, found {pl.__version__}: tox -e integration-lightning19"
        )
    run_recipe("lightning_1_9")


def test_mmengine_runner_with_the_optimizer_and_hook_named_in_its_config(run_recipe):
    """mmengine saves from rank 0 only: OssConsolidateHook consolidates on every rank first.
    The resume needs TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD on torch >= 2.6 whatever the
    optimizer (mmengine 0.10.7's own pickled checkpoints; the recipe sets it)."""
    pytest.importorskip("mmengine", reason="pip install mmengine (the integration extra)")
    run_recipe("mmengine_recipe")


def test_hf_trainer_saves_the_eval_point_of_a_schedule_free_optimizer(launch_recipe, tmp_path):
    """Trainer calls train()/eval() on OSS as on the plain schedule-free optimizer: the model
    it saves after evaluate() is the unsharded optimizer's eval point, bit for bit."""
    pytest.importorskip("transformers", reason="pip install transformers (the integration extra)")
    pytest.importorskip("schedulefree", reason="pip install schedulefree (the integration extra)")
    launch_recipe("hf_trainer_schedulefree", "train", tmp_path)
    saved = {k: load_file(tmp_path / k / "model.safetensors") for k in ("reference", "sharded")}
    assert sorted(saved["sharded"]) == sorted(saved["reference"])
    for key, value in saved["reference"].items():
        assert torch.equal(saved["sharded"][key], value), key
    trained = torch.load(tmp_path / "reference" / "y.pt", weights_only=True)
    assert any(not torch.equal(trained[k], saved["reference"][k]) for k in saved["reference"])
