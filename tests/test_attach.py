"""The parameter sync overlapped with the next forward: ``OSS.attach(model)`` (issue 27).

``step()`` starts the sync and returns; the first call of a module waits for the transfers
of the buckets holding its params only; the library's next entry points wait for the rest.
Results must be bit-identical to the blocking sync (and to the unsharded optimizer).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers import catch, clone_model, flat_params, make_cut_model, make_model, transport
from test_step_failure import FailingSGD

import oss_plus.wire.inflight
from oss_plus import OSS

TIMEOUT = 60


@contextlib.contextmanager
def waits_logged():
    """Record every transfer that ``Pending.wait`` really waited for (the first call)."""
    seen: list[int] = []
    original = oss_plus.wire.inflight.Pending.wait

    def logged(self):
        if self.finish is not None:
            seen.append(id(self))
        return original(self)

    oss_plus.wire.inflight.Pending.wait = logged
    try:
        yield seen
    finally:
        oss_plus.wire.inflight.Pending.wait = original


def loss(model, step, rank=0):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * rank + step))
    return model(x).pow(2).mean()


def parity_task(ctx, via, wire, rule, optim_name):
    """Three training iterations through the overlapped sync, the blocking one and the
    unsharded optimizer, compared bit for bit after every iteration."""
    optim, kwargs = {
        "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        "adam": (torch.optim.Adam, {"lr": 0.01}),
    }[optim_name]
    model = make_cut_model() if rule == "flat_cut" else make_model(depth=4)
    rule = "flat" if rule == "flat_cut" else rule
    blocking, plain = clone_model(model), clone_model(model)
    with transport(via):
        opt = OSS(model.parameters(), optim=optim, group=ctx.group, partition_rule=rule,
                  broadcast_dtype=wire, **kwargs)  # fmt: skip
        ref = OSS(blocking.parameters(), optim=optim, group=ctx.group, partition_rule=rule,
                  broadcast_dtype=wire, **kwargs)  # fmt: skip
    unsharded = optim(plain.parameters(), **kwargs)
    opt.attach(model)
    same = []
    exact = wire is None or ctx.world_size == 1
    for step in range(4):
        losses = []
        for m, o in ((model, opt), (blocking, ref), (plain, unsharded)):
            o.zero_grad()
            losses.append(loss(m, step))  # the forward waits for what is in flight
        same.append(
            (
                torch.equal(flat_params(model), flat_params(blocking)),
                not exact or torch.equal(flat_params(model), flat_params(plain)),
            )
        )
        for value, o in zip(losses, (opt, ref, unsharded)):
            value.backward()
            o.step()
    opt.settle()
    return same[1:], flat_params(model)


@pytest.mark.parametrize(
    "world_size, via, wire, rule",
    [
        (2, "broadcast", None, "fairscale"),
        (3, "broadcast", torch.bfloat16, "fairscale"),
        (4, "all_gather", None, "fairscale"),
        (3, "broadcast", None, "flat"),
        (2, "broadcast", torch.float16, "flat"),
        (3, "broadcast", None, "flat_cut"),
        (2, "broadcast", torch.float16, "flat_cut"),
        (1, "broadcast", None, "fairscale"),
    ],
)
@pytest.mark.parametrize("optim_name", ["sgd", "adam"])
def test_the_overlapped_sync_is_bit_identical_to_the_blocking_one(
    pool, world_size, via, wire, rule, optim_name
):
    results = pool.run(parity_task, via, wire, rule, optim_name, world_size=world_size,
                       timeout=TIMEOUT)  # fmt: skip
    for same, params in results:
        assert same == [(True, True)] * 3
        assert torch.equal(params, results[0][1])


def layer_waits(model, seen):
    """Call each layer of ``model`` in turn: how many transfers each call waited for."""
    per_layer, x = [], torch.randn(5, 6)
    for m in model:
        before = len(seen)
        x = m(x)
        per_layer.append(len(seen) - before)
    return per_layer


def check_layers_wait_for_new(holders, per_layer):
    """Each layer waited for the holders of its params not waited for yet, and for nothing
    else; return every holder waited for."""
    waited: set[int] = set()
    for mine, count in zip(holders, per_layer):
        assert count == len(set(mine) - waited), (holders, per_layer)
        waited |= set(mine)
    return waited


def bucket_waits_task(ctx):
    """Which transfers step(), each layer's first call and settle() wait for."""
    model = make_model(depth=4)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    opt.attach(model)
    loss(model, 0).backward()
    owners = [sorted({opt.param_to_rank[p] for p in m.parameters()}) for m in model]
    with waits_logged() as seen:
        opt.step()
        at_step = len(seen)
        per_layer = layer_waits(model, seen)
        opt.zero_grad()
        after_zero_grad = len(seen)
        opt.settle()
    return owners, at_step, per_layer, after_zero_grad, len(seen), len(opt.sync.buckets)


def test_each_module_waits_for_its_own_buckets_only(pool):
    """3 ranks, one bucket per owner: step() waits for nothing; a layer waits, at its call,
    for the buckets of its params' owners not waited for yet, and for nothing else."""
    for owners, at_step, per_layer, zero_grad, total, buckets in pool.run(
        bucket_waits_task, world_size=3, timeout=TIMEOUT
    ):
        assert at_step == 0
        waited = check_layers_wait_for_new(owners, per_layer)
        assert buckets == len(waited) == 3 and sum(per_layer) == 3
        assert zero_grad == 3  # zero_grad waits for nothing
        assert total == 3  # nothing left for settle()


def flat_waits_task(ctx, cut):
    """Under the flat rule, which ranges each layer's first call waits for, against the ranks
    holding a piece of its params (``opt.plan``); whether the ranges carry slots. No biases:
    a layer's only param is the one cut by a range boundary (``cut``: 32 x 36 elements, 2 of
    them cut, slots; else 48, 80, 120 and 12 elements, 2 cut, back to back)."""
    torch.manual_seed(0)
    widths = [6] * 33 if cut else [6, 8, 10, 12, 1]
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b, bias=False), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1, partition_rule="flat")
    opt.attach(model)
    loss(model, 0).backward()
    index = {id(p): i for i, p in enumerate(model.parameters())}
    holders = [
        sorted({piece.owner for p in m.parameters() for piece in opt.plan.pieces_of(index[id(p)])})
        for m in model
    ]
    with waits_logged() as seen:
        opt.step()
        per_layer = layer_waits(model, seen)
        opt.settle()
    slotted = opt.sync.status.vector is None
    return holders, per_layer, len(opt.plan.split), slotted


@pytest.mark.parametrize("cut", [True, False], ids=["slotted", "back_to_back"])
def test_under_the_flat_rule_each_module_waits_for_the_ranges_of_its_pieces(pool, cut):
    """3 ranks: a layer waits, at its call, for every range holding a piece of its params
    not waited for yet (a param cut by a range boundary: each range of its pieces)."""
    for holders, per_layer, split, slotted in pool.run(
        flat_waits_task, cut, world_size=3, timeout=TIMEOUT
    ):
        assert split >= 1 and slotted == cut
        assert any(len(h) > 1 for h in holders)  # a layer whose params span two ranges
        check_layers_wait_for_new(holders, per_layer)


def entry_points_task(ctx, call):
    """After a step with the sync in flight, ``call`` must wait for every transfer."""
    model = make_model()
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1)
    opt.attach(model)
    loss(model, 0).backward()
    with waits_logged() as seen:
        opt.step()
        {
            "step": opt.step,
            "consolidate": lambda: opt.consolidate_state_dict(0),
            "export": opt.export_local_state,
            "clip": lambda: opt.clip_grad_norm(1.0),
            "refresh": opt.refresh_trainable,
        }[call]()
    return len(seen) >= len(opt.sync.buckets)


@pytest.mark.parametrize("call", ["step", "consolidate", "export", "clip", "refresh"])
def test_the_library_waits_before_anything_else(pool, call):
    assert all(pool.run(entry_points_task, call, world_size=2, timeout=TIMEOUT))


def uncovered_task(ctx):
    """A param of the optimizer that the attached model does not own is waited for before
    step() returns (its users cannot be hooked)."""
    model = make_model()
    extra = torch.nn.Parameter(torch.ones(7))
    opt = OSS([*model.parameters(), extra], group=ctx.group, lr=0.1)
    opt.attach(model)
    loss(model, 0).backward()
    extra.grad = torch.full_like(extra, float(ctx.rank + 1))
    opt.step()
    value = extra.detach().clone()  # read right after step(), no settle
    opt.settle()
    return torch.equal(value, extra.detach())


def test_params_outside_the_attached_model_are_waited_for_at_step(pool):
    assert all(pool.run(uncovered_task, world_size=3, timeout=TIMEOUT))


def failure_task(ctx):
    """A failing local step with the sync in flight raises on every rank at settle()."""
    model = make_model()
    opt = OSS(model.parameters(), optim=FailingSGD, group=ctx.group, lr=0.1)
    handle = opt.attach(model)
    loss(model, 0).backward()
    opt.optim.fail = ctx.rank == 1
    stepped = catch(opt.step)
    settled = catch(opt.settle)
    opt.optim.fail = False
    handle.remove()
    loss(model, 1).backward()
    opt.step()
    return stepped, settled, flat_params(model), len(handle.handles)


def test_a_failure_with_the_sync_in_flight_raises_on_every_rank(pool):
    results = pool.run(failure_task, world_size=2, timeout=TIMEOUT)
    for rank, (stepped, settled, params, hooks) in enumerate(results):
        assert stepped == ("ok", None)
        assert settled[0] == "IndexError" and "boom" in settled[1]
        assert rank == 1 or "global rank(s) [1]" in settled[1]
        assert torch.equal(params, results[0][2]) and hooks == 0


def ddp_task(ctx):
    """Under DDP, attached to the DDP module: as DDP + the blocking OSS, bit for bit."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(depth=4)
    nets = [DDP(copy.deepcopy(model), process_group=ctx.group) for _ in range(2)]
    opts = [OSS(n.parameters(), group=ctx.group, lr=0.1, momentum=0.9) for n in nets]
    opts[0].attach(nets[0])
    for step in range(3):
        for n, o in zip(nets, opts):
            o.zero_grad()
            loss(n, step, ctx.rank).backward()
            o.step()
    opts[0].settle()
    return torch.equal(flat_params(nets[0].module), flat_params(nets[1].module))


def test_under_ddp_as_the_blocking_sync(pool):
    assert all(pool.run(ddp_task, world_size=3, timeout=TIMEOUT))
