"""Optimizers whose constructor takes ``(name, param)`` pairs (issue 54, item 5).

OSS hands them the names it was given; one that keeps OSS's groups is sharded exactly; one
that builds groups of its own from the names (adam-mini's ``Adam_mini``), or that is given
no names, is refused on every rank with what it wants, never adam_mini's own unpacking error.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from oss_plus import OSS
from oss_plus.step.named import NEEDS_NAMES, OWN_GROUPS


class NamedSGD(torch.optim.SGD):
    """SGD that takes ``named_parameters`` (pairs, or groups of pairs) and keeps its groups."""

    def __init__(self, named_parameters, lr=0.1):
        items = list(named_parameters)
        if items and isinstance(items[0], dict):
            groups = [{**g, "params": [p for _, p in g["params"]]} for g in items]
        else:
            groups = [p for _, p in items]
        super().__init__(groups, lr=lr, momentum=0.9)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def exact_task(ctx):
    model, plain = _model(), _model()
    opt = OSS(model.named_parameters(), optim=NamedSGD, group=ctx.group, lr=0.1)
    ref = NamedSGD(plain.named_parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for m, o in ((model, opt), (plain, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


def test_a_named_constructor_that_keeps_the_groups_is_sharded_exactly(pool):
    assert pool.run(exact_task, world_size=2) == [True, True]


def refused_task(ctx, named, which):
    if which == "adam_mini":
        from adam_mini import Adam_mini as cls
    else:
        cls = NamedSGD
    model = _model()
    params = model.named_parameters() if named else model.parameters()
    try:
        OSS(params, optim=cls, group=ctx.group, lr=1e-3)
    except TypeError as exc:
        return str(exc)
    return None


def test_no_names_for_a_named_constructor_says_what_it_wants(pool):
    want = NEEDS_NAMES.format(name="NamedSGD", arg="named_parameters")
    assert pool.run(refused_task, False, "sgd", world_size=2) == [want, want]


@pytest.mark.skipif(importlib.util.find_spec("adam_mini") is None, reason="adam-mini (zoo extra)")
def test_adam_mini_s_own_groups_are_refused_on_every_rank(pool):
    results = pool.run(refused_task, True, "adam_mini", world_size=2)
    want = OWN_GROUPS.format(name="Adam_mini", built=4, given=1)
    assert results == [want, want]
