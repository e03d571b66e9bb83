"""Differential suite, torch ZeroRedundancyOptimizer against oss_plus.compat.torch's: the
inputs torch rejects (mixed dtypes, bad params) and uneven inputs under Join.
"""

from __future__ import annotations

import pytest
import torch
from helpers import caught, clones, diff_loss, flat_params, make_diff_model, mixed_dtype_training
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch_cases import CLASSES, MODE_IDS, MODES, build

from oss_plus.compat.torch import ZeroRedundancyOptimizer
from oss_plus.testing import PoolError, PoolTimeout, RemoteError

pytestmark = pytest.mark.compat


# ------------------------------------------------------------------ inputs
def dtype_task(ctx):
    def make(kind, params):
        if kind == "reference":
            return torch.optim.Adam(params, lr=0.1)
        return build(kind, params, ctx, True, lr=0.1)

    return mixed_dtype_training(make, (*CLASSES, "reference"))


def test_mixed_dtypes(pool):
    """torch #5: mixed dtypes raise ValueError; ours trains them like the plain optimizer."""
    for r in pool.run(dtype_task, world_size=2):
        assert r["torch"] == ("constructor", "ValueError")
        status, params = r["ours"]
        assert status == "ok"
        assert all(torch.equal(a, b) for a, b in zip(params, r["reference"][1]))


def _bad_params():
    p = torch.nn.Parameter(torch.zeros(2))
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (2,), requires_grad=True)
    return {
        "tensor": p,
        "not_iterable": 3,
        "empty": [],
        "tensors_and_dicts": [p, {"params": [torch.nn.Parameter(torch.zeros(1))]}],
        "group_without_params": [{"lr": 0.1}],
        "non_tensor": [p, 5],
        "sparse": [p, sparse],
        "named_parameters": list(torch.nn.Linear(2, 2).named_parameters()),
        "non_leaf": [torch.zeros(2, requires_grad=True) * 2],
        "in_two_groups": [{"params": [p]}, {"params": [p]}],
        "set_in_group": [{"params": {p}}],
        "duplicate_in_group": [p, p],
    }


def bad_params_task(ctx):
    out = {}
    for name in _bad_params():
        for kind in CLASSES:
            params = _bad_params()[name]
            out[(name, kind)] = caught(ctx, lambda ctx, k=kind, p=params: build(k, p, ctx, False))[
                0
            ]
    out[("functional", "torch")] = caught(
        ctx,
        lambda ctx: TorchZero(
            [torch.nn.Parameter(torch.zeros(1))], _functional_adam(), process_group=ctx.group
        ),
    )[0]
    out[("functional", "ours")] = caught(
        ctx,
        lambda ctx: ZeroRedundancyOptimizer(
            [torch.nn.Parameter(torch.zeros(1))], _functional_adam(), process_group=ctx.group
        ),
    )[0]
    return out


def _functional_adam():
    from torch.distributed.optim.utils import functional_optim_map

    return functional_optim_map[torch.optim.Adam]


def test_bad_params_raise_the_exception_types_torch_raises(pool):
    """The same exception type for every bad input, but for a param listed twice in a group:
    torch only warns and then applies its update twice; ours raises ValueError."""
    (r,) = pool.run(bad_params_task, world_size=1)
    names = sorted({name for name, _ in r} - {"duplicate_in_group"})
    for name in names:
        assert r[(name, "ours")] == r[(name, "torch")] != "ok", name
    assert r[("duplicate_in_group", "torch")] == "ok"
    assert r[("duplicate_in_group", "ours")] == "ValueError"


# ------------------------------------------------------------------ Join
def join_task(ctx, bucket_view, scaled=False):
    """``scaled``: under a plain torch.amp.GradScaler, which steps torch's class the classic
    way (the adapter too: its Join shadow step could not join OSS's agreement on the flag)."""
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for kind, m in zip(CLASSES, clones(make_diff_model(), 2)):
        ddp = DistributedDataParallel(m, process_group=ctx.group)
        opt = build(kind, ddp.parameters(), ctx, bucket_view)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
        with Join([ddp, opt]):
            for step in range(2 + 2 * ctx.rank):  # uneven inputs
                opt.zero_grad()
                scaler.scale(diff_loss(ddp, step, rank=ctx.rank)).backward()
                scaler.step(opt)
                scaler.update()
        out[kind] = flat_params(m)
    return out


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "grad-scaler"])
@pytest.mark.parametrize("bucket_view", MODES, ids=MODE_IDS)
def test_join_with_ddp_and_uneven_inputs(pool, bucket_view, scaled):
    """No rank hangs; the result equals torch ZeRO's, bit for bit."""
    results = pool.run(join_task, bucket_view, scaled, world_size=3, timeout=60)
    for r in results:
        assert torch.equal(r["torch"], r["ours"])
        assert torch.equal(r["ours"], results[0]["ours"])


class _Notifier(Joinable):
    """A joinable that only notifies the join context: put first, it makes torch's ZeRO a
    second joinable, whose own notification is then a no-op (the reference setting)."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def join_hook(self, **kwargs):
        return JoinHook()

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return self.group


def join_alone_task(ctx, kind):
    """Uneven inputs with the optimizer as the only joinable; ``reference``: torch's ZeRO
    behind a :class:`_Notifier`."""
    m = make_diff_model()
    opt = build(
        "torch" if kind == "reference" else kind,
        m.parameters(),
        ctx,
        False,
        torch.optim.SGD,
        lr=0.1,
    )
    notifier = _Notifier(ctx.group)
    with Join([notifier, opt] if kind == "reference" else [opt]):
        for step in range(1 + ctx.rank):
            if kind == "reference":
                Join.notify_join_context(notifier)
            opt.zero_grad()
            diff_loss(m, step).backward()
            opt.step()
    return flat_params(m)


def _failed_in_the_join_hook(error):
    """Whether torch failed the way its join hook does: a hang, or every rank either died
    (gloo aborts on the extra all_reduce) or raised from inside the hook's ``step()``."""
    if isinstance(error, PoolTimeout):
        return True
    return isinstance(error, RemoteError) and all(
        text.startswith("worker process died") or "in main_hook" in text
        for text in error.failures.values()
    )


def test_join_with_the_optimizer_as_first_joinable(pool):
    """torch's join hook calls step(), which notifies the join context once more: with ZeRO
    as the first (or only) joinable the joined rank makes one all_reduce too many (gloo
    aborts, or a hang). Ours shadows the step without notifying, and ends where torch's
    ZeRO ends when another joinable comes first."""
    with pytest.raises(PoolError) as failure:
        pool.run(join_alone_task, "torch", world_size=2, timeout=10)
    assert _failed_in_the_join_hook(failure.value), failure.value
    expected = pool.run(join_alone_task, "reference", world_size=2)
    results = pool.run(join_alone_task, "ours", world_size=2)
    assert not torch.equal(expected[0], flat_params(make_diff_model()))  # it trained
    for got, ref in zip(results, expected):
        assert torch.equal(got, ref), "differs from torch's ZeRO behind another joinable"
