"""What fairscale's ``ShardedDataParallel`` and Lightning 1.9's ``ddp_sharded`` read of
``OSS``, on the real ``fairscale.optim.OSS`` and on ``oss_plus.compat.fairscale.OSS`` side by
side (issue 36, item 1): the same calls on both, on the same ranks, results compared.

The surface (fairscale 0.4.13, pytorch-lightning 1.9.5):

* fairscale's SDP: ``_per_device_params`` (its constructor lists every param from it; its
  ``refresh_trainable`` walks it), ``_param_to_rank`` and ``refresh_trainable()`` (called in
  its first forward and whenever ``requires_grad`` changed, inside Lightning's closure);
* Lightning 1.9 (``strategies/sharded.py``, ``overrides/fairscale.py``,
  ``strategies/strategy.py``, ``plugins/precision/sharded_native_amp.py``,
  ``lightning_fabric/utilities/optimizer.py``): the rebuild ``OSS(params=opt.param_groups,
  optim=type(opt), **opt.defaults)`` (which keeps the group dicts, so the schedulers built
  on the user's optimizer drive the OSS), ``isinstance(x, OSS)``, ``broadcast_fp16 = ...``,
  ``step(closure=...)``, ``zero_grad()``, ``param_groups`` (schedulers, lr logging),
  ``defaults``, ``state`` (``.items()`` and ``state[p] = ...``), ``consolidate_state_dict()``
  then ``state_dict()`` on rank 0, ``load_state_dict()``, ``clip_grad_norm(value)``;
* fairscale's attributes the adapter documents: ``optim``, ``buckets``, ``_param_to_index``,
  ``_local_params``, ``_all_states``, ``_default_device``, ``_local_to_global_rank``,
  ``global_rank``, ``rank``, ``world_size``, ``backend``, ``partition_parameters()``,
  ``_sync_param_groups``, ``_clear_cache()``, ``add_param_group``.

Differences by design (``docs/migration.md``), not compared here: ``refresh_trainable()``
after a freeze repartitions (fairscale keeps the first partition: compared through the
training it gives instead, ``test_fairscale_sdp_lightning.py``), ``clip_grad_norm`` is
computed in float32/float64 (fairscale rounds each rank's partial: compared to 1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("fairscale")

from fairscale.nn.data_parallel import ShardedDataParallel as FairscaleSDP  # noqa: E402
from fairscale.optim import OSS as FairscaleOSS  # noqa: E402
from helpers import batch, make_diff_model, same_value  # noqa: E402

from oss_plus.compat import fairscale as compat_fairscale  # noqa: E402

pytestmark = pytest.mark.compat

OPTIMIZERS = {
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
}


def _loss(net, step, rank):
    return net(batch(step, width=8, n=6, rank=rank)).pow(2).mean()


def probe(ctx, cls, name):
    """Every read of the surface on one class; tensors and params as flat indices."""
    optim, kwargs = OPTIMIZERS[name]
    model = make_diff_model()
    index = {id(p): i for i, p in enumerate(model.parameters())}

    def ix(params):
        return [index[id(p)] for p in params]

    plain = optim(model.parameters(), **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    opt = cls(params=plain.param_groups, optim=type(plain), group=ctx.group, **plain.defaults)
    opt.broadcast_fp16 = False  # what Lightning sets on one node
    r = {
        "isinstance torch Optimizer": isinstance(opt, torch.optim.Optimizer),
        "param_groups are the given dicts": [
            a is b for a, b in zip(opt.param_groups, plain.param_groups)
        ],
        "defaults": sorted(opt.defaults.items()),
        "rank, world_size, global_rank, backend": (
            opt.rank,
            opt.world_size,
            opt.global_rank,
            str(opt.backend),
        ),
        "_local_to_global_rank": list(opt._local_to_global_rank),
        "group": opt.group is ctx.group,
        "_default_device": str(opt._default_device),
        "partition_parameters()": [
            [(ix(g["params"]), sorted((k, v) for k, v in g.items() if k != "params")) for g in gs]
            for gs in opt.partition_parameters()
        ],
        "_param_to_rank": sorted((index[id(p)], r) for p, r in opt._param_to_rank.items()),
        "_param_to_index": sorted(opt._param_to_index.values()),
        "_per_device_params": {
            str(d): [ix(ps) for ps in per_rank] for d, per_rank in opt._per_device_params.items()
        },
        "optim": (type(opt.optim).__name__, [ix(g["params"]) for g in opt.optim.param_groups]),
        "buckets": {
            str(d): {rank: b.buffer.clone() for rank, b in per.items()}
            for d, per in opt.buckets.items()
        },
        "state before a step": len(opt.state),
    }
    net = FairscaleSDP(model, opt, ctx.group, reduce_buffer_size=0)
    losses = []
    for step in range(3):

        def closure(step=step):
            opt.zero_grad()
            loss = _loss(net, step, ctx.rank)
            loss.backward()
            return loss

        losses.append(float(opt.step(closure=closure)))
        scheduler.step()
    r["step(closure=) returns the loss"] = losses
    r["lr set by a scheduler of the given optimizer"] = [g["lr"] for g in opt.param_groups]
    r["params after the steps"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    opt.zero_grad()
    _loss(net, 3, ctx.rank).backward()
    r["_local_params after a backward"] = ix(opt._local_params)
    if ctx.world_size == dist.get_world_size():  # fairscale's clip reduces over WORLD
        r["clip_grad_norm(0.01)"] = float(opt.clip_grad_norm(0.01))
        r["gradients after the clip"] = [
            None if p.grad is None else p.grad.clone() for p in model.parameters()
        ]
    opt.zero_grad(set_to_none=False)
    r["zero_grad(set_to_none=False)"] = [
        None if p.grad is None else bool((p.grad == 0).all()) for p in model.parameters()
    ]
    opt.zero_grad()
    r["zero_grad()"] = [p.grad is None for p in model.parameters()]
    opt.consolidate_state_dict()
    r["_all_states after consolidate_state_dict()"] = opt._all_states
    saved = opt.state_dict() if ctx.rank == 0 else None
    r["state_dict() on rank 0"] = saved
    r["_sync_param_groups"] = _sync_param_groups(cls)
    opt._clear_cache()  # fairscale's code calls it; nothing changes
    r["_param_to_rank after _clear_cache()"] = sorted(
        (index[id(p)], r) for p, r in opt._param_to_rank.items()
    )
    extra = torch.nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [extra], "lr": 0.1})
    extra.grad = torch.full((3,), 0.5)
    opt.step()
    r["add_param_group, then a step"] = extra.detach().clone()
    return r


def _sync_param_groups(cls):
    source = [{"params": [1], "lr": 0.5, "momentum": 0.1}]
    destination = [{"params": [2], "lr": 1.0}]
    cls._sync_param_groups(source, destination)
    return destination


def surface_task(ctx, name):
    return {
        "theirs": probe(ctx, FairscaleOSS, name),
        "ours": probe(ctx, compat_fairscale.OSS, name),
    }


def close(a, b, key):
    if key == "clip_grad_norm(0.01)":
        return abs(a - b) <= 1e-6 * max(abs(a), 1.0)
    if key == "gradients after the clip":
        return all(
            (x is None and y is None) or (x is not None and y is not None and torch.allclose(x, y))
            for x, y in zip(a, b)
        )
    return same_value(a, b)


@pytest.mark.parametrize("world", [2, 3, 4])  # 4: the pool's WORLD, where the clip runs
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_read_of_the_surface_matches_fairscale(pool, name, world):
    for result in pool.run(surface_task, name, world_size=world, timeout=120):
        theirs, ours = result["theirs"], result["ours"]
        assert sorted(theirs) == sorted(ours)
        differ = [k for k in theirs if not close(theirs[k], ours[k], k)]
        assert not differ, {k: (theirs[k], ours[k]) for k in differ}
        assert theirs["param_groups are the given dicts"] == [True]
        assert theirs["_per_device_params"]  # the comparison is not vacuous


class SGDWithStepKWArg(torch.optim.SGD):
    """fairscale's own ``test_step_with_kwargs`` optimizer: a step that takes a keyword and
    ignores its ``closure`` argument."""

    def step(self, closure=None, kwarg=None):
        super().step()
        kwarg.append(closure)


def step_kwargs_task(ctx, cls):
    x = torch.tensor([1.0], requires_grad=True)
    opt = cls([x], SGDWithStepKWArg, group=ctx.group, lr=0.1)
    x.backward()
    seen = []
    opt.step(0, kwarg=seen)  # a closure that is not callable goes to the inner step as it is
    return seen, x.detach().clone()


def both_step_kwargs_task(ctx):
    return step_kwargs_task(ctx, FairscaleOSS), step_kwargs_task(ctx, compat_fairscale.OSS)


@pytest.mark.parametrize("world", [1, 2])
def test_a_step_passes_a_non_callable_closure_and_keywords_through_as_fairscale(pool, world):
    """fairscale's ``test_step_with_kwargs`` (``o.step(0, kwarg=kwarg)``), on both classes."""
    for theirs, ours in pool.run(both_step_kwargs_task, world_size=world):
        assert theirs[0] == ours[0] == [0]
        assert torch.equal(theirs[1], ours[1]) and not torch.equal(ours[1], torch.ones(1))
