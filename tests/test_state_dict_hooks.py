"""torch's optimizer state-dict hooks, honoured like ``torch.optim.Optimizer`` does.

The same hooks are registered on a plain ``torch.optim.Adam`` and on the sharded optimizer
(core and both adapters); the calls, their order, what the hooks see and what they change
must be the same.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import backward, make_model

from oss_plus import OSS
from oss_plus.compat.fairscale import OSS as FairscaleOSS
from oss_plus.compat.torch import ZeroRedundancyOptimizer

KINDS = {
    "core": lambda params, group: OSS(params, optim=torch.optim.Adam, group=group, lr=0.1),
    "fairscale": lambda params, group: FairscaleOSS(params, torch.optim.Adam, group, lr=0.1),
    "torch": lambda params, group: ZeroRedundancyOptimizer(params, torch.optim.Adam, group, lr=0.1),
}


def register(opt, calls):
    """Hooks that record, mutate the optimizer, and replace dicts."""

    def pre(o):
        calls.append(("pre", o is opt))
        o.param_groups[0]["lr"] = 0.5  # visible in the state dict being built

    def first(o):
        calls.append(("pre-prepended",))

    def post(o, sd):
        calls.append(("post", sorted(sd), sd["param_groups"][0]["lr"]))
        sd["extra"] = "added in place"

    def replace(o, sd):
        calls.append(("replace", sorted(sd)))
        return {**sd, "replaced": True}

    def load_pre(o, sd):
        calls.append(("load-pre", sorted(sd), sd["param_groups"][0]["lr"]))
        sd["mutated"] = 1  # a shallow copy: the caller's dict is untouched
        return {**sd, "param_groups": [dict(g, lr=0.25) for g in sd["param_groups"]]}

    def load_post(o):
        calls.append(("load-post", o.param_groups[0]["lr"]))

    handles = [
        opt.register_state_dict_pre_hook(pre),
        opt.register_state_dict_pre_hook(first, prepend=True),
        opt.register_state_dict_post_hook(post),
        opt.register_state_dict_post_hook(replace),
        opt.register_load_state_dict_pre_hook(load_pre),
        opt.register_load_state_dict_post_hook(load_post),
    ]
    return handles


def _full_state_dict(opt, kind):
    if kind == "torch":
        opt.consolidate_state_dict(to=-1)
        return opt.state_dict()
    return opt.state_dict(all_ranks=True)


def hooks_task(ctx, kind):
    ref_model, model = make_model(), make_model()
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.1)
    opt = KINDS[kind](model.parameters(), ctx.group)
    ref_calls, calls = [], []
    register(ref, ref_calls)
    handles = register(opt, calls)
    for m, o in ((ref_model, ref), (model, opt)):
        o.zero_grad()
        backward(m, 0)
        o.step()
    ref_sd, sd = ref.state_dict(), _full_state_dict(opt, kind)
    same_sd = (
        sorted(sd) == sorted(ref_sd)
        and sd["extra"] == ref_sd["extra"]
        and sd["replaced"] is ref_sd["replaced"] is True
        and sd["param_groups"][0]["lr"] == ref_sd["param_groups"][0]["lr"] == 0.5
        and all(
            torch.allclose(sd["state"][i][k], v, rtol=0, atol=1e-6)
            for i, s in ref_sd["state"].items()
            for k, v in s.items()
        )
    )
    saved = copy.deepcopy(ref_sd)
    ref.load_state_dict(saved)
    opt.load_state_dict(saved)
    untouched = "mutated" not in saved and saved["param_groups"][0]["lr"] == 0.5
    loaded_lr = (ref.param_groups[0]["lr"], opt.param_groups[0]["lr"])
    for handle in handles:  # removed hooks do not run any more
        handle.remove()
    before = len(calls)
    _full_state_dict(opt, kind)
    opt.load_state_dict(saved)
    return calls == ref_calls, same_sd, untouched, loaded_lr, len(calls) == before, calls


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_state_dict_hooks_run_as_in_torch(pool, kind):
    for same_calls, same_sd, untouched, loaded_lr, removed, calls in pool.run(
        hooks_task, kind, world_size=2
    ):
        assert same_calls, calls
        assert [c[0] for c in calls] == [
            "pre-prepended",
            "pre",
            "post",
            "replace",
            "load-pre",
            "load-post",
        ]
        assert same_sd and untouched and removed
        assert loaded_lr == (0.25, 0.25)
