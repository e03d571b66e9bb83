"""The demo's numbers come from what its ranks ran: the whole iteration is timed, and the state
bytes are those of the optimizers' own state tensors (``python -m oss_plus demo``)."""

from __future__ import annotations

import time

import pytest
import torch

#: What the sleeping layer adds to each forward and to each backward (seconds).
NAP = 0.02


class Nap(torch.nn.Module):
    """Sleeps :data:`NAP` in forward and again when backward reaches it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(NAP)
        y = x * 1.0
        y.register_hook(lambda grad: time.sleep(NAP))
        return y


def demo_task(ctx, nap: bool):
    """The demo's rank function on the pool's group, with the optimizers it made recorded (and
    a layer that sleeps in forward and backward when ``nap``)."""
    from oss_plus import demo

    real_adam, real_model = torch.optim.Adam, demo._model
    made: list[torch.optim.Optimizer] = []

    class RecordedAdam(real_adam):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    def napping_model(width, depth):
        return torch.nn.Sequential(real_model(width, depth), Nap())

    torch.optim.Adam = RecordedAdam  # OSS's inner optimizer and the reference
    if nap:
        demo._model = napping_model
    try:
        log = demo.rank_main(ctx.rank, ctx.world_size, 4, 16, 2, group=ctx.group)
    finally:
        torch.optim.Adam, demo._model = real_adam, real_model

    def numels(opt):
        return [p.numel() for group in opt.param_groups for p in group["params"]]

    # the reference holds every param; OSS's inner Adam only this rank's
    made = [opt for opt in made if not getattr(opt, "oss_plus_probe", False)]  # the probe's
    ref = max(made, key=lambda opt: sum(numels(opt)))
    (inner,) = [opt for opt in made if opt is not ref]
    log["tensor_bytes"] = {
        side: sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
        for side, opt in (("oss", inner), ("ref", ref))
    }
    log["owned"], log["all"] = numels(inner), numels(ref)
    return log


def test_state_bytes_are_the_state_tensors_each_rank_holds(pool):
    from oss_plus.demo import format_bytes, format_report

    results = pool.run(demo_task, False, world_size=2, timeout=60)
    for r in results:
        assert r["state"] == r["tensor_bytes"]["oss"] and r["ref_state"] == r["tensor_bytes"]["ref"]
        # Adam's exp_avg and exp_avg_sq (fp32) and a 4-byte step per param this rank owns
        assert r["state"] == sum(8 * n + 4 for n in r["owned"]) > 0
        assert r["ref_state"] == sum(8 * n + 4 for n in r["all"])
    # each param's state lives on exactly one rank, and the shares are not equal here (a
    # formula such as ref / world would print the same number twice)
    assert sum(r["state"] for r in results) == results[0]["ref_state"]
    assert results[0]["state"] != results[1]["state"]
    report = format_report(results, 4)
    for rank, r in enumerate(results):
        share = r["state"] / r["ref_state"]
        row = [line for line in report.splitlines() if f"optimizer state, rank {rank}" in line]
        assert row and row[0].split()[-5:] == [
            *format_bytes(r["state"]).split(),
            *format_bytes(r["ref_state"]).split(),
            f"{share:.2f}x",
        ]
    assert "bit-identical to unsharded Adam on every rank: yes" in report


def test_the_iteration_time_covers_forward_backward_and_step(pool):
    from oss_plus.demo import format_report, iteration_seconds

    results = pool.run(demo_task, True, world_size=2, timeout=60)
    for r in results:
        assert len(r["times"]) == len(r["ref_times"]) == 4
        # the napping layer sleeps in forward and in backward: both are inside the timing
        assert min(r["times"]) >= 2 * NAP and min(r["ref_times"]) >= 2 * NAP
    ours, theirs = iteration_seconds(results), iteration_seconds(results, "ref_times")
    row = [line for line in format_report(results, 4).splitlines() if "training iteration" in line]
    assert row[0].split()[-5:] == [f"{ours * 1e3:.2f}", "ms", f"{theirs * 1e3:.2f}", "ms",
                                   f"{ours / theirs:.2f}x"]  # fmt: skip


def test_iteration_seconds_is_the_median_of_the_slowest_rank_after_the_first_step():
    from oss_plus.demo import iteration_seconds

    results = [{"times": [9.0, 1.0, 5.0, 2.0]}, {"times": [0.1, 3.0, 1.0, 2.5]}]
    assert iteration_seconds(results) == 3.0  # slowest per step: 9, 3, 5, 2.5; median of 3, 5, 2.5
    assert iteration_seconds([{"times": [4.0]}]) == 4.0


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (3 * 2**19, "1.50 MiB"),
        (2**31, "2.00 GiB"),
    ],
)
def test_format_bytes(n, text):
    from oss_plus.demo import format_bytes

    assert format_bytes(n) == text


def fake_results(ours: float, theirs: float, steps: int = 20) -> list[dict]:
    """Two ranks' logs as rank_main returns them: fixed times, rank 0 holding 3/8 of the state."""
    return [
        {
            "losses": [0.5 + i + rank for i in range(steps)],
            "ref_losses": [0.5 + i + rank for i in range(steps)],
            "times": [ours] * steps,
            "ref_times": [theirs] * steps,
            "identical": True,
            "state": (3 if rank == 0 else 5) * 1024,
            "ref_state": 8 * 1024,
            "params": 1000,
            "ranks": "gloo ranks (cpu)",
        }
        for rank in range(2)
    ]


@pytest.mark.parametrize("ours, theirs", [(0.006, 0.004), (0.003, 0.004)])
def test_the_report_explains_its_ratio_its_time_and_where_sharding_pays(ours, theirs):
    from oss_plus.demo import RATIO, format_report

    report = format_report(fake_results(ours, theirs), 20)
    lines = report.splitlines()
    assert max(len(line) for line in lines) <= 100
    # one ratio column, the OSS figure over the Adam one in every row
    assert lines[2].split()[-1] == RATIO == "OSS/Adam" and "ratio" not in lines[2]
    ratios = [line.split()[-1] for line in lines[3:6]]
    assert ratios == [f"{ours / theirs:.2f}x", "0.38x", "0.62x"]
    assert f"{RATIO}: the OSS figure over the Adam figure, in every row" in report
    # why the time is what it is: the words follow the measurement
    words = " ".join(report.split())  # the paragraphs without their line breaks
    longer = "OSS takes longer here: at 1,000 params, stepping 1/2 of them" in words
    assert longer == (ours > theirs)
    assert ("OSS takes no longer here" in words) == (ours <= theirs)
    # where sharding pays: Llama-2 7B's 6,738,415,616 params x Adam's 8 bytes, over 8 ranks
    assert "Adam state is 53.91 GB per rank unsharded, 6.74 GB over 8 ranks:" in words
    assert "  oss-plus plan --model llama2-7b --nodes 1 --per-node 8" in lines


def test_the_loss_table_names_its_rank_and_steps():
    from oss_plus.demo import format_report

    lines = format_report(fake_results(0.001, 0.001), 20).splitlines()
    head = lines.index("step    loss (OSS)   loss (Adam)  same")
    assert lines[head - 1].startswith("rank 0's loss, steps 0, 2, ..., 18 of 20;")
    shown = [line.split() for line in lines[head + 1 : head + 11]]
    assert [int(cells[0]) for cells in shown] == list(range(0, 20, 2))
    assert [float(cells[1]) for cells in shown] == [0.5 + i for i in range(0, 20, 2)]  # rank 0's
    few = format_report(fake_results(0.001, 0.001, steps=4), 4).splitlines()
    assert any(line.startswith("rank 0's loss, steps 0-3 of 4;") for line in few)
