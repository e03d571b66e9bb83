"""What an inner optimizer's ``state_dict()`` holds beyond per-param state and param groups,
on every state path (issue 54, item 4).

One small optimizer per kind, written here so the suite does not depend on third-party
packages alone (pytorch_optimizer's ``Ranger21``, ``SPAM`` and ``Lookahead`` run the same
harness in tests/test_zoo.py):

* :class:`ExtraKeySGD`: extra top-level keys (``ticks``, read back by its own
  ``load_state_dict``), which scale its step;
* :class:`KeyedStateSGD`: state not keyed by a param (``state["count"]``, a tensor
  ``state["decay"]``);
* :class:`NestedSGD`: a wrapper whose ``state_dict()`` nests its base SGD's and keys its own
  per-param state by ``(group, position)`` pairs;
* :class:`ShareSGD`: a group value that differs between ranks (each rank's share of a sum
  over its own params, as dadaptation's ``DAdaptAdam(fsdp_in_use=True)`` keeps
  ``numerator_weighted``).

The first three run every path of tests/state_paths.py against the unsharded optimizer. For
the last (and for ``DAdaptAdam`` itself) the sharded checkpoint resumes at the same world
size exactly as the run that was not interrupted, and everything that would keep one value
(consolidation, a consolidated checkpoint, DCP, a load at another partition,
``read_state_dict``) raises on every rank, before anything is written.
"""

from __future__ import annotations

import importlib.util
import os
from collections import defaultdict
from unittest import mock

import pytest
import torch
from state_paths import Case, every_path_task, expected_paths, make_inputs, make_model, train
from torch.distributed.checkpoint.state_dict import get_state_dict

from oss_plus import OSS
from oss_plus.checkpoint import load_checkpoint, read_state_dict, save_checkpoint
from oss_plus.checkpoint.extras import PER_RANK
from oss_plus.state.agreement import RANKS_DIFFER
from oss_plus.state.extras import Extras, attach, detach
from tests.helpers import catch


# ------------------------------------------------------------------ the optimizers
class ExtraKeySGD(torch.optim.SGD):
    """SGD with momentum whose step shrinks with a count it keeps on itself and writes as a
    top-level key of its ``state_dict()`` (as Ranger21 keeps ``lookahead_step``)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, lr=lr, momentum=0.9)
        self.ticks = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.ticks += 1
        for group in self.param_groups:
            group["lr"] /= self.ticks
        try:
            return super().step(closure)
        finally:
            for group in self.param_groups:
                group["lr"] *= self.ticks

    def state_dict(self):
        return {**super().state_dict(), "ticks": self.ticks}

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.ticks = state_dict.get("ticks", 0)


class KeyedStateSGD(torch.optim.SGD):
    """SGD whose ``state`` also holds entries not keyed by a param (as SPAM's
    ``total_step``): a count and a 0-dim tensor that decays the step. Like SPAM's masks, each
    param has state from the constructor on (``born``), so torch's DCP does not step a fresh
    one to make its template: OSS must (it would miss the momentum otherwise)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, lr=lr, momentum=0.9)
        self.state["count"] = 0
        self.state["decay"] = torch.tensor(1.0, dtype=torch.float64)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["born"] = torch.zeros(())

    @torch.no_grad()
    def step(self, closure=None):
        self.state["count"] += 1
        self.state["decay"].mul_(0.5)
        scale = float(self.state["decay"])
        for group in self.param_groups:
            group["lr"] *= scale
        try:
            return super().step(closure)
        finally:
            for group in self.param_groups:
                group["lr"] /= scale


class NestedSGD(torch.optim.Optimizer):
    """A wrapper (as pytorch_optimizer's Lookahead): it steps a base SGD, keeps an average of
    each param, and every second step moves the param to it. Its ``state_dict()`` nests the
    base's, keys its own state by (group, position) and adds a top-level count."""

    def __init__(self, params, lr=0.1):
        self.base = torch.optim.SGD(params, lr=lr, momentum=0.9)
        super().__init__(self.base.param_groups, self.base.defaults)  # the same group dicts
        self.merges = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.base.step(closure)
        self.merges += 1
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                avg = state.setdefault("avg", p.detach().clone())
                avg.lerp_(p, 0.5)
                if self.merges % 2 == 0:
                    p.copy_(avg)
        return loss

    def state_dict(self):
        mine = {
            (g, i): {"avg": self.state[p]["avg"]}
            for g, group in enumerate(self.param_groups)
            for i, p in enumerate(group["params"])
            if "avg" in self.state.get(p, {})
        }
        return {"base": self.base.state_dict(), "avg": mine, "merges": self.merges}

    def load_state_dict(self, state_dict):
        self.base.load_state_dict(state_dict["base"])
        self.state = defaultdict(dict)
        for (g, i), entry in state_dict["avg"].items():
            p = self.param_groups[g]["params"][i]
            self.state[p] = {"avg": entry["avg"].to(p).clone()}
        self.merges = state_dict["merges"]


class ShareSGD(torch.optim.SGD):
    """SGD that keeps in its param group the sum of its own gradients' absolute values and
    shrinks its step by it: sharded, each rank keeps its own share (so OSS needs
    ``allow_cross_param=True``)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, lr=lr, momentum=0.9)
        for group in self.param_groups:
            group["seen"] = 0.0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            group["seen"] += sum(float(g.abs().sum()) for g in grads)
            group["lr"] /= 1.0 + group["seen"]
        try:
            return super().step(closure)
        finally:
            for group in self.param_groups:
                group["lr"] *= 1.0 + group["seen"]


def extra_key_sgd():
    return ExtraKeySGD, {"lr": 0.1}


def keyed_state_sgd():
    return KeyedStateSGD, {"lr": 0.1}


def nested_sgd():
    return NestedSGD, {"lr": 0.1}


#: What torch's ``flatten_optimizer_state_dict=True`` cannot carry, refused at the save.
FLAT = {"dcp-flat-keys": "flatten_optimizer_state_dict=True rebuilds only"}

CASES = {
    "extra top-level key": Case("ExtraKeySGD", extra_key_sgd, refused=FLAT),
    "state not keyed by a param": Case("KeyedStateSGD", keyed_state_sgd, refused=FLAT),
    "nested base state dict": Case("NestedSGD", nested_sgd, refused=FLAT),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_every_state_path_carries_what_state_dict_holds(pool, tmp_path, kind):
    case = CASES[kind]
    got = pool.run(every_path_task, case, str(tmp_path), world_size=3, timeout=300)
    assert got == expected_paths(case.refused)


# ------------------------------------------------------------------ pure: detach / attach
def test_detach_and_attach_give_the_class_s_own_format_back():
    opt = NestedSGD(make_model().parameters())
    train(make_model(), opt, 0)
    model = make_model()
    opt = NestedSGD(model.parameters())
    model(make_inputs(0)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    form, extras = detach(sd)
    assert sorted(form["state"]) == [0, 1, 2, 3]
    assert set(form["state"][0]) == {"oss_plus.sd/base", "oss_plus.sd/avg"}
    assert extras.parts == (("base", "node"), ("avg", "pairs"))
    back = attach(form, Extras.from_value(extras.to_value()))
    assert list(back) == list(sd) and back["merges"] == 1
    assert back["avg"].keys() == sd["avg"].keys()
    assert back["base"]["state"].keys() == sd["base"]["state"].keys()
    assert detach(torch.optim.SGD(model.parameters()).state_dict())[1].empty


def test_a_state_dict_without_param_groups_anywhere_is_refused_by_name():
    with pytest.raises(ValueError, match="cannot tell which params"):
        detach({"weights": {0: 1}})


# ------------------------------------------------------------------ values that differ by rank
def _model4(params_of=None):
    """The harness's model (four params: each of 4 ranks owns one), with the params of
    ``params_of`` when given."""
    model = make_model(0)
    if params_of is not None:
        with torch.no_grad():
            for p, q in zip(model.parameters(), params_of.parameters()):
                p.copy_(q)
    return model


#: The group value each rank keeps its own share of, by case.
SHARED = {"ShareSGD": "seen", "dadaptation-DAdaptAdam": "numerator_weighted"}


def _share(ctx, root, kind):
    """The rank-differing run: 3 steps, every refused path, a sharded save, 2 more steps; a
    fresh optimizer over the params at the save resumes it for the 2 steps. Returns the
    refusals, whether the resume is the uninterrupted run bit for bit (params and the
    group value), and whether the refused consolidated save left anything."""
    cls, kwargs = (ShareSGD, {"lr": 0.1}) if kind == "ShareSGD" else _dadapt()

    def oss(model, **extra):
        return OSS(model.parameters(), optim=cls, group=ctx.group, allow_cross_param=True,
                   **extra, **kwargs)  # fmt: skip

    model = _model4()
    opt = oss(model)
    train(model, opt, 3)
    at_save = _model4(params_of=model)
    refusals = [
        catch(opt.consolidate_state_dict),
        catch(opt.state_dict, all_ranks=True),
        catch(save_checkpoint, opt, os.path.join(root, "consolidated"), sharded=False),
        catch(get_state_dict, model, opt),
    ]
    save_checkpoint(opt, os.path.join(root, "sharded"))
    train(model, opt, 2, start=3)

    resumed_model = _model4(params_of=at_save)
    resumed = oss(resumed_model)
    load_checkpoint(resumed, os.path.join(root, "sharded"))
    train(resumed_model, resumed, 2, start=3)
    key = SHARED[kind]
    exact = resumed.param_groups[0][key] == opt.param_groups[0][key] and all(
        torch.equal(p, q) for p, q in zip(resumed_model.parameters(), model.parameters())
    )
    other = oss(_model4(params_of=at_save), partition_rule="torch")  # another partition
    refusals.append(catch(load_checkpoint, other, os.path.join(root, "sharded")))
    refusals.append(catch(read_state_dict, os.path.join(root, "sharded")))
    return refusals, exact, os.path.exists(os.path.join(root, "consolidated"))


def _dadapt():
    import dadaptation

    return dadaptation.DAdaptAdam, {"lr": 1.0, "fsdp_in_use": True}


@pytest.mark.parametrize(
    "kind",
    [
        "ShareSGD",
        pytest.param(
            "dadaptation-DAdaptAdam",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("dadaptation") is None, reason="needs dadaptation"
            ),
        ),
    ],
)
def test_values_that_differ_by_rank_resume_exactly_or_raise_on_every_rank(pool, tmp_path, kind):
    # dadaptation reduces over the default group (4 ranks in the pool) on a tensor it puts on
    # the GPU: kept on the CPU here (as tests/test_cross_param.py does)
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self):
        results = pool.run(_share_task, str(tmp_path), kind, world_size=4, timeout=120)
    for refusals, exact, written in results:
        assert exact  # the sharded checkpoint resumes at the same world size, bit for bit
        assert not written  # the consolidated save was refused before anything was written
        kinds = [kind for kind, _ in refusals]
        assert kinds == ["ValueError"] * 6, refusals
        messages = [message for _, message in refusals]
        for message in messages[:4]:
            assert "hold different values of param group 0's" in message, message
        assert "keeps a value of its own for each of the 4 ranks" in messages[4]
        assert "hold different values of" in messages[5]
    assert len({str(r[0]) for r in results}) == 1  # the same errors on every rank


def _share_task(ctx, root, kind):
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self):
        return _share(ctx, root, kind)


def test_the_messages_name_what_to_do():
    assert "save a sharded checkpoint" in RANKS_DIFFER
    assert "same world size, partition rule and partition" in PER_RANK
