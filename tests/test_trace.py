"""The hot paths' profiler labels: present while a profiler records, free otherwise
(:mod:`oss_plus.runtime.trace`)."""

from __future__ import annotations

import pytest
import torch
from sdp_utils import batch, pair
from torch.profiler import ProfilerActivity, profile

#: The ranges one ZeRO-2 iteration with a clip opens (buckets launched, backward's end,
#: the local step, the parameter sync and its wait, the clip).
ITERATION_LABELS = {
    "oss_plus::sdp::forward",
    "oss_plus::sdp::reduce_bucket",
    "oss_plus::sdp::flush",
    "oss_plus::clip_grad_norm",
    "oss_plus::local_step",
    "oss_plus::sync",
    "oss_plus::sync.wait",
}


def _iteration(sdp, opt, step, rank):
    opt.zero_grad()
    sdp(batch(step, rank)).pow(2).mean().backward()
    opt.clip_grad_norm(1.0)
    opt.step()


def labels_task(ctx):
    sdp, opt, _, _ = pair(ctx, 64)
    _iteration(sdp, opt, 0, ctx.rank)
    entered = []
    real = torch.profiler.record_function

    def counting(name, *args):
        entered.append(name)
        return real(name, *args)

    torch.profiler.record_function = counting  # what every label would enter
    try:
        _iteration(sdp, opt, 1, ctx.rank)  # no profiler: nothing entered
        plain = list(entered)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _iteration(sdp, opt, 2, ctx.rank)
    finally:
        torch.profiler.record_function = real
    names = sorted({e.name for e in prof.events() if e.name.startswith("oss_plus::")})
    return plain, entered, names


def test_labels_are_recorded_under_a_profiler_and_cost_nothing_without(pool):
    for plain, entered, names in pool.run(labels_task, world_size=2):
        assert plain == []  # no range entered without a profiler
        assert set(names) >= ITERATION_LABELS, names
        assert set(entered) == set(names), (entered, names)  # each through record_function


@pytest.mark.parametrize("recording", [False, True])
def test_label_opens_a_range_only_while_a_profiler_records(monkeypatch, recording):
    from oss_plus.runtime import trace as _trace

    opened = []
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: opened.append(name))
    monkeypatch.setattr(_trace, "_recording", lambda: recording)
    _trace.label("oss_plus::x")
    assert opened == (["oss_plus::x"] if recording else [])
