"""Optimizers from the ecosystem inside OSS, through every state path, against the same
optimizer unsharded (issue 45).

torchao's ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8`` keep their moments as tensor
subclasses (block-quantized codes, scales and a lookup table); bitsandbytes' ``Adam8bit`` and
``AdamW8bit`` keep plain uint8 codes and fp32 block maxima; torch's fused and foreach
Adam/AdamW and ``Adafactor`` keep plain tensors. For each, the unsharded optimizer trains
:data:`SAVED` steps and then :data:`MORE` (the reference). OSS must match it bit for bit:

* training;
* the consolidated state (to one rank and to all), compared value by value, inner tensor by
  inner tensor, with the plain optimizer's ``state_dict()``;
* every resume, :data:`MORE` steps after the state went through: ``torch.save`` of the
  consolidated dict into the plain class, ``load_state_dict`` into OSS, sharded,
  consolidated and asynchronous safetensors checkpoints, torch DCP with default options and
  with ``full_state_dict=True``, and the saves loaded at other world sizes.

The model's two weights hold 8192 elements each (quantized: at least 4096, a multiple of
the blocks), its biases stay fp32 in every low-bit optimizer. torchao compiles its step;
the tasks run it eagerly (``torch._dynamo`` disabled) to keep the suite quick: the state and
its paths are the same.

"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import os
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from state_paths import same, same_params
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from oss_plus import OSS
from oss_plus.checkpoint import load_checkpoint, save_checkpoint

SAVED, MORE = 3, 2
#: torch DCP's state-dict options the saves and loads go through, by checkpoint name.
DCP_OPTIONS = {
    "dcp": {},
    "dcp-full": {"full_state_dict": True},
    "dcp-flat-keys": {"flatten_optimizer_state_dict": True},
}


def _torchao(name: str):
    import torchao.optim

    return getattr(torchao.optim, name), {"lr": 1e-2}


def _bnb(name: str):
    import bitsandbytes

    return getattr(bitsandbytes.optim, name), {"lr": 1e-2}


#: name -> (the package it needs, a function returning (class, kwargs)).
CASES = {
    "torchao-AdamW8bit": ("torchao", lambda: _torchao("AdamW8bit")),
    "torchao-AdamW4bit": ("torchao", lambda: _torchao("AdamW4bit")),
    "torchao-AdamWFp8": ("torchao", lambda: _torchao("AdamWFp8")),
    "bnb-Adam8bit": ("bitsandbytes", lambda: _bnb("Adam8bit")),
    "bnb-AdamW8bit": ("bitsandbytes", lambda: _bnb("AdamW8bit")),
    "torch-Adam-fused": (None, lambda: (torch.optim.Adam, {"lr": 1e-2, "fused": True})),
    "torch-AdamW-fused": (None, lambda: (torch.optim.AdamW, {"lr": 1e-2, "fused": True})),
    "torch-Adam-foreach-amsgrad": (
        None,
        lambda: (torch.optim.Adam, {"lr": 1e-2, "foreach": True, "amsgrad": True}),
    ),
    "torch-AdamW-foreach": (None, lambda: (torch.optim.AdamW, {"lr": 1e-2, "foreach": True})),
    "torch-Adafactor": ("torch.optim.Adafactor", lambda: (torch.optim.Adafactor, {"lr": 1e-2})),
}


def _available(need: str | None) -> bool:
    if need is None:
        return True
    if need.startswith("torch."):
        return hasattr(torch.optim, need.rsplit(".", 1)[-1])
    return importlib.util.find_spec(need) is not None


def case_params(names=None):
    return [
        pytest.param(
            name,
            id=name,
            marks=pytest.mark.skipif(not _available(need), reason=f"{need} is not installed"),
        )
        for name, (need, _) in CASES.items()
        if names is None or name in names
    ]


# ------------------------------------------------------------------ model, data, comparisons
@contextlib.contextmanager
def eager():
    """torchao's compiled step, run eagerly (the same state; seconds instead of minutes):
    torchao calls ``torch.compile`` at every step, which here returns the function."""
    with mock.patch.object(torch, "compile", lambda fn, **_: fn):
        yield


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))


def train(model, opt, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def reference(case: str):
    """The unsharded optimizer after SAVED steps (its model, the state it holds by param
    index, its own ``state_dict()``), and after MORE (its model and the state it holds)."""
    cls, kwargs = CASES[case][1]()
    with eager():
        model = make_model()
        opt = cls(model.parameters(), **kwargs)
        train(model, opt, SAVED)
        saved = copy.deepcopy(model), held(opt), _state_copy(opt.state_dict())
        train(model, opt, MORE, start=SAVED)
    return saved, (model, held(opt))


def held(opt):
    """The state ``opt`` holds, by param index, copied: what its ``step()`` reads.
    bitsandbytes' ``state_dict()`` wraps its quantization state in a nested dict (for FSDP);
    the state itself is compared here, and both forms are loaded."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return _state_copy({"state": {i: opt.state[p] for i, p in enumerate(params) if opt.state[p]}})


def _state_copy(sd):
    """A state dict whose tensors are copies (torchao's classes have no clone: rebuild)."""
    from oss_plus.state.nested import map_tensors
    from oss_plus.state.subclass import clone_tensor

    copied = {"state": {i: map_tensors(dict(s), clone_tensor) for i, s in sd["state"].items()}}
    if "param_groups" in sd:
        copied["param_groups"] = copy.deepcopy(sd["param_groups"])
    return copied


def fresh(case: str, group, params_of=None):
    """A new model (the saved run's params when ``params_of`` is given) and OSS over it."""
    cls, kwargs = CASES[case][1]()
    model = make_model(seed=1)
    if params_of is not None:
        with torch.no_grad():
            for p, q in zip(model.parameters(), params_of.parameters()):
                p.copy_(q)
    return model, OSS(model.parameters(), optim=cls, group=group, **kwargs)


def check_resumed(model, opt, want) -> None:
    """MORE steps from the loaded state end where the reference did (params and state)."""
    ref_model, ref_sd = want
    train(model, opt, MORE, start=SAVED)
    same_params(model, ref_model)
    same(opt.state_dict(all_ranks=True)["state"], ref_sd["state"])
    opt.drop_consolidated()


# ------------------------------------------------------------------ tasks
def paths_task(ctx, case, root):
    """Train, consolidate, and resume through every path at this world size."""
    (saved_model, saved_sd, own_sd), want = reference(case)
    with eager():
        model, opt = fresh(case, ctx.group, params_of=make_model())
        train(model, opt, SAVED)
        same_params(model, saved_model)

        opt.consolidate_state_dict(recipient_rank=0)
        if ctx.rank == 0:
            one = opt.state_dict()
            same(one["state"], saved_sd["state"])
            buffer = io.BytesIO()
            torch.save(one, buffer)  # into the plain class, through torch.save
            buffer.seek(0)
            plain_model = copy.deepcopy(saved_model)
            cls, kwargs = CASES[case][1]()
            plain = cls(plain_model.parameters(), **kwargs)
            plain.load_state_dict(torch.load(buffer, weights_only=True))
            train(plain_model, plain, MORE, start=SAVED)
            same_params(plain_model, want[0])
            same(held(plain)["state"], want[1]["state"])
        everyone = _state_copy(opt.state_dict(all_ranks=True))  # as torch's, it is live
        same(everyone["state"], saved_sd["state"])

        sharded, consolidated = os.path.join(root, "sharded"), os.path.join(root, "consolidated")
        save_checkpoint(opt, sharded)
        save_checkpoint(opt, consolidated, sharded=False)
        future = save_checkpoint(opt, os.path.join(root, "async"), blocking=False)
        train(model, opt, 1, start=SAVED)  # the async save holds the state at the call
        future.result(timeout=60)
        for name, options in DCP_OPTIONS.items():
            m, o = fresh(case, ctx.group, params_of=make_model())
            train(m, o, SAVED)  # the state opt had at the other saves
            model_sd, optim_sd = get_state_dict(m, o, options=StateDictOptions(**options))
            dcp.save(
                {"optim": optim_sd}, checkpoint_id=os.path.join(root, name), process_group=ctx.group
            )

        resumed = {"load_state_dict": fresh(case, ctx.group, params_of=saved_model)}
        resumed["load_state_dict"][1].load_state_dict(everyone)
        resumed["the plain class's state_dict"] = fresh(case, ctx.group, params_of=saved_model)
        resumed["the plain class's state_dict"][1].load_state_dict(own_sd)
        for name in ("sharded", "consolidated", "async"):
            resumed[name] = fresh(case, ctx.group, params_of=saved_model)
            load_checkpoint(resumed[name][1], os.path.join(root, name))
        for name, (model_, opt_) in resumed.items():
            try:
                check_resumed(model_, opt_, want)
            except AssertionError as exc:
                raise AssertionError(f"resumed from {name}: {exc}") from exc
        load_everywhere(ctx, case, root, saved_model, want)
    return sorted(resumed)


def load_everywhere(ctx, case, root, saved_model, want):
    """Resume from every save of :func:`paths_task` at this world size."""
    for name in ("sharded", "consolidated", "async"):
        model, opt = fresh(case, ctx.group, params_of=saved_model)
        load_checkpoint(opt, os.path.join(root, name))
        check_resumed(model, opt, want)
    for name, options in DCP_OPTIONS.items():
        model, opt = fresh(case, ctx.group, params_of=saved_model)
        sd_options = StateDictOptions(**options)
        model_sd, optim_sd = get_state_dict(model, opt, options=sd_options)
        dcp.load(
            {"optim": optim_sd}, checkpoint_id=os.path.join(root, name), process_group=ctx.group
        )
        set_state_dict(
            model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=sd_options
        )
        try:
            check_resumed(model, opt, want)
        except AssertionError as exc:
            raise AssertionError(f"resumed from {name}: {exc}") from exc


def reshard_task(ctx, case, root):
    (saved_model, _, _), want = reference(case)
    with eager():
        load_everywhere(ctx, case, root, saved_model, want)
    return True


@pytest.mark.parametrize("case", case_params())
def test_every_state_path_matches_the_unsharded_optimizer(pool, tmp_path, case):
    assert (
        pool.run(paths_task, case, str(tmp_path), world_size=2, timeout=180)
        == [["async", "consolidated", "load_state_dict", "sharded", "the plain class's state_dict"]]
        * 2
    )
    assert pool.run(reshard_task, case, str(tmp_path), world_size=1, timeout=120) == [True]
    assert pool.run(reshard_task, case, str(tmp_path), world_size=3, timeout=120) == [True] * 3


def repartition_task(ctx, case):
    """A trainability change repartitions (state moves between ranks): freeze the first
    weight for a step, then train it again, as the unsharded optimizer does (no grad: no
    update, its state kept)."""
    cls, kwargs = CASES[case][1]()
    with eager():
        ref_model = make_model()
        ref = cls(ref_model.parameters(), **kwargs)
        model, opt = fresh(case, ctx.group, params_of=make_model())
        for m, o in ((ref_model, ref), (model, opt)):
            train(m, o, 2)
            m[0].weight.requires_grad_(False)
            m[0].weight.grad = None
            train(m, o, 1, start=2)
            m[0].weight.requires_grad_(True)
            train(m, o, 2, start=3)
        same_params(model, ref_model)
        same(opt.state_dict(all_ranks=True)["state"], held(ref)["state"])
    return True


def adapters_task(ctx, case):
    """The fairscale and torch adapters load the plain class's state dict and consolidate the
    state it holds."""
    from oss_plus.compat.fairscale import OSS as FairscaleOSS
    from oss_plus.compat.torch import ZeroRedundancyOptimizer

    (saved_model, saved_sd, own_sd), _ = reference(case)
    cls, kwargs = CASES[case][1]()
    with eager():
        for kind in ("fairscale", "torch"):
            model = copy.deepcopy(saved_model)
            if kind == "fairscale":
                opt = FairscaleOSS(model.parameters(), optim=cls, group=ctx.group, **kwargs)
            else:
                opt = ZeroRedundancyOptimizer(model.parameters(), cls, ctx.group, **kwargs)
            opt.load_state_dict(own_sd)  # the plain class's own state dict
            opt.consolidate_state_dict(0)
            if ctx.rank == 0:
                same(opt.state_dict()["state"], saved_sd["state"])
            train(model, opt, 1, start=SAVED)
    return True


@pytest.mark.parametrize("case", case_params())
def test_state_moves_exactly_when_trainability_changes(pool, case):
    assert pool.run(repartition_task, case, world_size=2) == [True, True]


@pytest.mark.parametrize("case", case_params(["torchao-AdamW8bit", "bnb-AdamW8bit"]))
def test_the_adapters_carry_low_bit_state(pool, case):
    assert pool.run(adapters_task, case, world_size=2) == [True, True]
