"""Copies of an OSS raise TypeError at the call, saying what to do instead (issue 55, item 3).

A plain torch optimizer deep-copied or pickled together with its model steps exactly like
the original (checked here, so the comparison is with what users expect). An ``OSS`` holds
one rank's shard and its process group: ``copy.deepcopy``, ``copy.copy``, ``pickle`` and
``torch.save`` of it, or of either adapter, raise TypeError (:data:`NOT_COPYABLE`) instead of
returning the empty shell they gave before (no state, no ``optim``, an ``AttributeError`` at
its first ``state_dict()``), and the original goes on stepping as the plain optimizer does.
"""

from __future__ import annotations

import copy
import io
import pickle

import torch
from helpers import loss_of, make_model, params_equal

from oss_plus import OSS
from oss_plus.compat import fairscale
from oss_plus.compat import torch as torch_compat
from oss_plus.state.copies import NOT_COPYABLE

COPIES = {
    "copy.deepcopy": lambda obj: copy.deepcopy(obj),
    "copy.copy": lambda obj: copy.copy(obj),
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "torch.save": lambda obj: torch.save(obj, io.BytesIO()),
}


def step(model, opt, it):
    opt.zero_grad()
    loss_of(model, it).backward()
    opt.step()


def plain_task(ctx):
    """The plain optimizer: a deep copy and a pickled copy (with the model) step alike."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step(model, opt, 0)
    copies = [copy.deepcopy((model, opt)), pickle.loads(pickle.dumps((model, opt)))]
    for it in (1, 2):
        for m, o in [(model, opt), *copies]:
            step(m, o, it)
    return [params_equal(model, m) and len(o.state) == len(opt.state) for m, o in copies]


def test_a_plain_optimizer_copies_with_its_model(pool):
    assert pool.run(plain_task, world_size=1) == [[True, True]]


def build(ctx, kind, model):
    params = model.parameters()
    if kind == "fairscale":
        return fairscale.OSS(params, torch.optim.Adam, group=ctx.group, lr=0.01)
    if kind == "torch":
        return torch_compat.ZeroRedundancyOptimizer(
            params, torch.optim.Adam, process_group=ctx.group, lr=0.01
        )
    return OSS(params, torch.optim.Adam, group=ctx.group, lr=0.01)


def refused_task(ctx, kind):
    model, plain_model = make_model(), make_model()
    opt = build(ctx, kind, model)
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01)
    step(model, opt, 0)
    step(plain_model, plain, 0)
    raised = {}
    for name, make in COPIES.items():
        together = {"model": model, "optimizer": opt}  # a shallow copy.copy copies neither
        for label, obj in [("alone", opt)] + ([] if name == "copy.copy" else [("with", together)]):
            try:
                make(obj)
                raised[name, label] = "no error"
            except TypeError as exc:
                raised[name, label] = str(exc)
    step(model, opt, 1)  # the original is untouched
    step(plain_model, plain, 1)
    return raised, params_equal(model, plain_model)


def test_an_oss_and_both_adapters_refuse_to_be_copied_and_say_what_to_do(pool):
    for kind, name in [("oss", "OSS"), ("fairscale", "OSS"), ("torch", "ZeroRedundancyOptimizer")]:
        for raised, same in pool.run(refused_task, kind, world_size=2):
            assert same, kind
            assert {name for name, _ in raised} == set(COPIES) and len(raised) == 7
            for how, text in raised.items():
                assert text.startswith(f"{name} cannot be "), (kind, how, text)
                assert "consolidate_state_dict()" in text and "save_checkpoint" in text, text


def test_the_message_names_every_way_to_keep_the_state():
    text = NOT_COPYABLE.format(kind="OSS", how="deep-copied")
    for way in ("state_dict()", "save_checkpoint(opt, path)", "load that state"):
        assert way in text
