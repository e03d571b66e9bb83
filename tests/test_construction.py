"""Construction: optimizers that cannot be sharded, keyword handling, errors on every rank.

* An optimizer whose update is not per parameter (``torch.optim.LBFGS``) is refused.
* ``OSS(params=opt.param_groups, optim=type(opt), **opt.defaults)`` (PyTorch Lightning's
  pattern) works for every ``torch.optim`` class, and steps exactly like ``opt``.
* A wrong keyword, or an error of the inner optimizer's constructor on one rank only, raises
  on every rank (no rank left waiting).
"""

from __future__ import annotations

import functools

import pytest
import torch

from oss_plus import OSS
from oss_plus.compat.fairscale import OSS as FairscaleOSS
from oss_plus.compat.torch import ZeroRedundancyOptimizer
from oss_plus.runtime.dist import peer_failed
from oss_plus.step.params import (
    FIXED_KEYWORD,
    NOT_PER_PARAM,
    UNKNOWN_KEYWORD,
    split_defaults,
)

#: Every optimizer class torch.optim exports.
TORCH_OPTIMIZERS = sorted(
    (
        cls
        for cls in vars(torch.optim).values()
        if isinstance(cls, type)
        and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer
    ),
    key=lambda cls: cls.__name__,
)

KINDS = {
    "core": lambda params, optim, group, **kw: OSS(params, optim=optim, group=group, **kw),
    "fairscale": lambda params, optim, group, **kw: FairscaleOSS(params, optim, group, **kw),
    "torch": lambda params, optim, group, **kw: ZeroRedundancyOptimizer(params, optim, group, **kw),
}


def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return type(exc).__name__, str(exc)
    return None


def matrices(seed: int = 0) -> torch.nn.Module:
    """Only 2-D params (Muon steps matrices only)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 1, bias=False)
    )


def _step(model, opt, step):
    opt.zero_grad()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
    model(x).pow(2).mean().backward()
    opt.step()


# ------------------------------------------------------------------ item 6
#: torch >= 2.7's AdamW keeps ``decoupled_weight_decay=True`` in its defaults, a keyword its
#: constructor does not take (older AdamW has no such entry).
ADAMW_FIXES_A_DEFAULT = "decoupled_weight_decay" in torch.optim.AdamW([torch.zeros(1)]).defaults


class FixedDefault(torch.optim.Optimizer):
    """Like torch >= 2.7's AdamW on any torch: a default the constructor does not take."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr, "fixed": True})


def test_split_defaults_keeps_what_the_constructor_takes():
    taken, others = split_defaults(FixedDefault, FixedDefault([torch.zeros(1)]).defaults)
    assert others == {"fixed": True} and taken == {"lr": 0.1}
    taken, others = split_defaults(torch.optim.AdamW, torch.optim.AdamW([torch.zeros(1)]).defaults)
    assert others == ({"decoupled_weight_decay": True} if ADAMW_FIXES_A_DEFAULT else {})
    assert "lr" in taken
    kwargs = lambda params, **kw: torch.optim.SGD(params, **kw)  # noqa: E731
    assert split_defaults(kwargs, {"lr": 1, "x": 2}) == ({"lr": 1, "x": 2}, {})
    partial = functools.partial(torch.optim.Adam, lr=0.1)
    assert split_defaults(partial, {"eps": 1e-6, "nope": 1}) == ({"eps": 1e-6}, {"nope": 1})


def rebuild_task(ctx, kind):
    """For every torch.optim class: rebuild from a plain optimizer's groups and defaults."""
    results = {}
    for cls in TORCH_OPTIMIZERS:
        if cls is torch.optim.LBFGS:
            continue
        ref_model, model = matrices(), matrices()
        ref = cls(ref_model.parameters(), lr=0.01)
        template = cls(model.parameters(), lr=0.01)
        opt = KINDS[kind](template.param_groups, type(template), ctx.group, **template.defaults)
        if cls is torch.optim.SparseAdam:  # steps sparse gradients only
            results[cls.__name__] = type(opt.optim) is cls
            continue
        for step in range(2):
            _step(ref_model, ref, step)
            _step(model, opt, step)
        atol = 0.0 if kind == "core" else 1e-6  # the adapters' unaligned layout
        same = all(
            torch.allclose(p, q, rtol=0, atol=atol) and not torch.equal(p, q0)
            for p, q, q0 in zip(model.parameters(), ref_model.parameters(), matrices().parameters())
        )
        results[cls.__name__] = same and type(opt.optim) is cls
    return results


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_torch_optimizer_rebuilds_from_groups_and_defaults(pool, kind):
    results = pool.run(rebuild_task, kind, world_size=2)
    expected = {c.__name__ for c in TORCH_OPTIMIZERS} - {"LBFGS"}
    for rank_results in results:
        assert set(rank_results) == expected
        assert all(rank_results.values()), rank_results


def bad_keyword_task(ctx, kind):
    model = matrices()
    return [
        _catch(lambda: KINDS[kind](model.parameters(), torch.optim.Adam, ctx.group, lrr=0.1)),
        _catch(
            lambda: KINDS[kind](
                model.parameters(), torch.optim.AdamW, ctx.group, decoupled_weight_decay=False
            )
        ),
        _catch(lambda: KINDS[kind](model.parameters(), torch.optim.AdamW, ctx.group, lr=0.1)),
    ]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_wrong_keyword_still_raises_on_every_rank(pool, kind):
    for unknown, fixed, fine in pool.run(bad_keyword_task, kind, world_size=2):
        assert unknown[0] == "TypeError" and "unexpected keyword argument 'lrr'" in unknown[1]
        expected = UNKNOWN_KEYWORD.format(name="Adam", key="lrr", accepted="X").split(" (")[0]
        assert unknown[1].startswith(expected)
        if ADAMW_FIXES_A_DEFAULT:
            expected = FIXED_KEYWORD.format(
                name="AdamW", key="decoupled_weight_decay", fixed=True, value=False
            )
            assert fixed == ("TypeError", expected)
        else:  # an unknown keyword of that AdamW, refused like any other
            assert fixed[0] == "TypeError"
            assert "unexpected keyword argument 'decoupled_weight_decay'" in fixed[1]
        assert fine is None


# ------------------------------------------------------------------ item 2
class MyLBFGS(torch.optim.LBFGS):
    pass


def lbfgs_task(ctx, kind, which):
    model = torch.nn.Linear(2, 1)  # 2 params on 3 ranks: one rank owns nothing
    optim = {
        "class": torch.optim.LBFGS,
        "subclass": MyLBFGS,
        "factory": lambda params, **kw: torch.optim.LBFGS(params, **kw),
    }[which]
    return _catch(lambda: KINDS[kind](model.parameters(), optim, ctx.group, lr=0.1))


@pytest.mark.parametrize("which", ["class", "subclass", "factory"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_lbfgs_is_refused_on_every_rank(pool, kind, which):
    if kind == "fairscale" and which == "factory":
        pytest.skip("fairscale's OSS takes optimizer classes only")
    for error in pool.run(lbfgs_task, kind, which, world_size=3):
        assert error is not None and error[0] == "ValueError"
        name = "MyLBFGS" if which == "subclass" else "LBFGS"
        assert NOT_PER_PARAM.format(name=name, base="LBFGS")[:60] in error[1]


# ------------------------------------------------------------------ one rank's constructor fails
def muon_task(ctx):
    model = torch.nn.Linear(4, 3)  # Muon refuses the bias, owned by one rank only
    return _catch(lambda: OSS(model.parameters(), optim=torch.optim.Muon, group=ctx.group))


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch without Muon")
def test_an_inner_constructor_error_on_one_rank_raises_on_every_rank(pool):
    errors = pool.run(muon_task, world_size=2)
    assert all(e is not None and e[0] == "ValueError" for e in errors)
    own = [
        e for e in errors if "Muon only supports 2D parameters" in e[1] and "rank(s)" not in e[1]
    ]
    assert len(own) == 1, errors
    failed = errors.index(own[0])
    peers = [e for e in errors if e[1].startswith(peer_failed([0, 1], [failed], 1 - failed))]
    assert len(peers) == 1, errors
    assert "Muon only supports 2D parameters" in peers[0][1]
