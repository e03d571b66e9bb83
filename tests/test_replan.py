"""A ``requires_grad`` change detected at ``step()`` (issues 27 and 29).

The rank whose trainability changed does not repartition alone: it runs the same sync as
every rank with the status :data:`~oss_plus.wire.status.REPLAN` and, on this rare path only,
reads every rank's status at once. Every rank changed: they repartition together and step.
Some ranks only: nothing hangs; every rank raises
:data:`~oss_plus.wire.status.TRAINABILITY_DIFFERS` at the same later call (the check after the
step that saw it: an unfreeze at the next step, a freeze within
:data:`~oss_plus.wire.changes.WINDOWS` steps). Before issue 29, the
changed ranks entered the repartition's agreement while the others waited in the sync: a
hang until the timeout (the short task timeout makes that fail fast).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import backward, catch, flat_params, make_cut_model, make_model

from oss_plus import OSS
from oss_plus.step.params import PLANS_DIFFER
from oss_plus.wire.changes import WINDOWS
from oss_plus.wire.status import replan_message

#: Seconds a task may take: a hang fails the test fast.
TIMEOUT = 30
RULES = ["fairscale", "flat"]


def some_ranks_task(ctx, changed: list[int], rule: str, how: str) -> dict:
    """Change the first layer's trainability on the ``changed`` ranks only, then step until
    a rank raises: an unfrozen param at the next step, a frozen one within WINDOWS steps (a
    freeze only unbalances the plan: the trainable params are read a slice per step)."""
    model = make_model()
    if how == "unfreeze":
        model[0].weight.requires_grad_(False)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1, momentum=0.9, partition_rule=rule)
    backward(model, 0)
    opt.step()
    if ctx.rank in changed:
        model[0].weight.requires_grad_(how == "unfreeze")
    outcomes, params = [], []
    for step in range(1, WINDOWS + 3):
        opt.zero_grad()
        backward(model, step)
        outcomes.append(catch(opt.step))
        params.append(flat_params(model))
        if outcomes[-1] != ("ok", None):
            break
    settled = catch(opt.settle)  # raised once: nothing pending any more
    model[0].weight.requires_grad_(how != "unfreeze")  # the same trainability everywhere
    opt.zero_grad()
    backward(model, 99)
    opt.step()
    return {"outcomes": outcomes, "settled": settled, "params": params, "later": flat_params(model)}


@pytest.mark.parametrize("how", ["unfreeze", "freeze"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("world_size, changed", [(2, [1]), (3, [0, 2])])
def test_a_change_on_some_ranks_raises_on_every_rank_at_the_same_call(
    pool, how, rule, world_size, changed
):
    results = pool.run(some_ranks_task, changed, rule, how, world_size=world_size,
                       timeout=TIMEOUT)  # fmt: skip
    codes = [2 if r in changed else 0 for r in range(world_size)]
    raised_at = {len(r["outcomes"]) for r in results}
    assert len(raised_at) == 1  # every rank raised at the same step() call...
    at = raised_at.pop()
    assert at == 2 if how == "unfreeze" else 2 <= at <= WINDOWS + 1  # ...soon enough
    for r in results:
        assert r["outcomes"][-1] == ("ValueError", replan_message(codes))
        assert r["settled"] == ("ok", None)
        for mine, first in zip(r["params"], results[0]["params"]):
            assert torch.equal(mine, first)  # replicas stayed identical at every step
        assert torch.equal(r["later"], results[0]["later"])  # and go on together


def every_rank_task(ctx, rule: str, how: str) -> tuple[bool, tuple[str, str], bool]:
    """Change the trainability of a param on every rank (``freeze`` or ``unfreeze`` the same
    one, or ``differ``: unfreeze a rank-dependent one), then step; compare with plain SGD
    with the same changes, and say whether the plan followed. Every param is written in
    place before every step: the unstepped sync of the change sends what was written
    (``flat_cut``: the flat rule with params cut by range boundaries that carry slots)."""
    model = make_cut_model() if rule == "flat_cut" else make_model()
    rule = "flat" if rule == "flat_cut" else rule
    if how != "freeze":
        for i in (0, 2):
            model[i].weight.requires_grad_(False)
    ref_model = copy.deepcopy(model)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1, momentum=0.9, partition_rule=rule)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for step in range(WINDOWS + 4):
        for m in (model, ref_model):
            with torch.no_grad():
                for p in m.parameters():
                    p.mul_(0.875)  # exact in binary: the same on both sides
        if step == 2:
            which = 2 * ctx.rank if how == "differ" else 0
            for m in (model, ref_model):
                m[which].weight.requires_grad_(how != "freeze")
                m[which].weight.grad = None
        outcome = ("ok", None)
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            backward(m, step)
            outcome = catch(o.step) if o is opt else (o.step(), outcome)[1]
        if outcome != ("ok", None):
            return False, outcome, False
    followed = opt.plan.trainable == tuple(p.requires_grad for p in model.parameters())
    return flat_params(model).equal(flat_params(ref_model)), ("ok", None), followed


@pytest.mark.parametrize("rule", [*RULES, "flat_cut"])
@pytest.mark.parametrize("how", ["freeze", "unfreeze"])
def test_the_same_change_on_every_rank_repartitions_and_steps_exactly(pool, rule, how):
    results = pool.run(every_rank_task, rule, how, world_size=3, timeout=TIMEOUT)
    for same, outcome, followed in results:
        assert outcome == ("ok", None) and same and followed


def test_different_changes_on_every_rank_raise_plans_differ_on_every_rank(pool):
    results = pool.run(every_rank_task, "fairscale", "differ", world_size=2, timeout=TIMEOUT)
    for _, (kind, message), _ in results:
        assert kind == "ValueError"
        assert message.startswith(PLANS_DIFFER.split("{")[0]), message


def clip_task(ctx, rule: str) -> bool:
    """Unfreeze a param on every rank, then clip and step: the new owner steps with a
    clipped gradient (the rank that detects the change at clip scales every gradient)."""
    model = make_model()
    model[2].weight.requires_grad_(False)
    ref_model = copy.deepcopy(model)
    opt = OSS(model.parameters(), group=ctx.group, lr=0.1, partition_rule=rule)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for step in range(3):
        if step == 1:
            for m in (model, ref_model):
                m[2].weight.requires_grad_(True)
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            backward(m, step)
        total = opt.clip_grad_norm(0.05)
        ref_total = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
        assert torch.allclose(total, ref_total, rtol=1e-6), (total, ref_total)
        opt.step()
        ref.step()
    return torch.allclose(flat_params(model), flat_params(ref_model), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rule", RULES)
def test_clip_after_a_change_on_every_rank_clips_what_the_new_owners_step(pool, rule):
    assert all(pool.run(clip_task, rule, world_size=3, timeout=TIMEOUT))


def closure_replans_task(ctx, rule: str, how: str) -> bool:
    """A closure that re-plans the optimizer it is passed to (fairscale's
    ``ShardedDataParallel`` calls ``refresh_trainable()`` in its forward, inside Lightning
    1.9's closure): the step steps and broadcasts what the closure installed (issue 36).
    ``none``: a plain closure (under the flat rule the pieces of cut params took their
    gradients before the closure computed them, before issue 36)."""
    model = make_model()
    reference = copy.deepcopy(model)
    opt = OSS(model.parameters(), torch.optim.AdamW, group=ctx.group, lr=0.01, partition_rule=rule)
    plain = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for step in range(4):
        for net, optimizer in ((model, opt), (reference, plain)):

            def closure(net=net, optimizer=optimizer, step=step) -> torch.Tensor:
                if how == "freeze" and step == 2:  # owners move inside the closure
                    net[0].weight.requires_grad_(False)
                if optimizer is opt and how == "install_sync":
                    opt.install_sync()
                elif optimizer is opt and how != "none":
                    opt.refresh_trainable()
                optimizer.zero_grad()
                return backward(net, step)

            optimizer.step(closure)
    return torch.equal(flat_params(model), flat_params(reference))


@pytest.mark.parametrize("how", ["none", "install_sync", "refresh_trainable", "freeze"])
@pytest.mark.parametrize("rule", RULES)
def test_a_closure_that_replans_steps_what_it_installed(pool, rule, how):
    for world in (2, 3):
        assert all(pool.run(closure_replans_task, rule, how, world_size=world)), world
