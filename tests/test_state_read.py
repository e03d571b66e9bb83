"""``state_dict()`` wherever a framework calls it (issue 56): on one rank alone, or on every
rank with no consolidation first, and ``consolidate_state_dict(r)`` on rank ``r`` alone.

The other ranks make no call: their server thread (``oss_plus/state/serve.py``) hands their
shard over. Every result is compared with the unsharded ``torch.optim.Adam`` run on the same
data (the independent reference), never with oss_plus's own bookkeeping.
"""

import copy
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from helpers import catch, make_model, train

from oss_plus import OSS
from oss_plus.compat import fairscale
from oss_plus.compat import torch as torch_compat
from oss_plus.runtime.arrival import ARRIVAL_TIMEOUT_ENV
from oss_plus.state import pull, serve
from oss_plus.state.api import NOT_CONSOLIDATED

KINDS = ["oss", "fairscale", "torch"]
#: The classes whose state_dict() reads without a consolidation first (the fairscale adapter
#: keeps fairscale's contract: tests/test_collective_state_dict.py).
READING_KINDS = ["oss", "torch"]


def build(kind, model, ctx, **extra):
    params = model.parameters()
    if kind == "oss":
        return OSS(params, torch.optim.Adam, group=ctx.group, lr=0.01, **extra)
    if kind == "fairscale":
        return fairscale.OSS(params, torch.optim.Adam, group=ctx.group, lr=0.01, **extra)
    return torch_compat.ZeroRedundancyOptimizer(
        params, torch.optim.Adam, process_group=ctx.group, lr=0.01, **extra
    )


def reference_state(steps):
    """The unsharded Adam's state dict after ``steps`` steps (the independent reference)."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, steps)
    return opt.state_dict()


def assert_same_state(got, want):
    assert sorted(got["state"]) == sorted(want["state"])
    for index, state in want["state"].items():
        assert sorted(got["state"][index]) == sorted(state)
        for key, value in state.items():
            mine = got["state"][index][key]
            assert mine.device == torch.device("cpu"), (index, key)
            assert torch.equal(torch.as_tensor(mine), value), (index, key)
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]
    assert got["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]


# ------------------------------------------------------------------ one rank alone
def one_rank_task(ctx, kind, rule):
    model = make_model()
    extra = {} if rule is None else {"partition_rule": rule}
    opt = build(kind, model, ctx, **extra)
    train(model, opt, 3)
    # the saving rank alone (HF Trainer); a copy: as torch's, the dict holds the live tensors
    first = copy.deepcopy(opt.state_dict()) if ctx.rank == 0 else None
    dist.barrier(group=ctx.group)  # nobody steps before the save is done (DDP's backward)
    train(model, opt, 2, start=3)
    second = opt.state_dict() if ctx.rank == ctx.world_size - 1 else None  # another rank
    dist.barrier(group=ctx.group)
    return first, second


@pytest.mark.parametrize("rule", [None, "flat"])
@pytest.mark.parametrize("kind", READING_KINDS)
@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_on_one_rank_alone_is_the_unsharded_state(pool, kind, world, rule):
    if rule == "flat" and kind != "oss":
        pytest.skip("partition_rule is an OSS option")
    results = pool.run(one_rank_task, kind, rule, world_size=world)
    assert_same_state(results[0][0], reference_state(3))
    assert_same_state(results[-1][1], reference_state(5))
    assert all(first is None for first, _ in results[1:])


# ------------------------------------------------------------------ every rank
def every_rank_task(ctx, kind):
    model = make_model()
    opt = build(kind, model, ctx)
    opt.load_state_dict(opt.state_dict())  # Accelerate's prepare(), on every process
    train(model, opt, 3)
    got = opt.state_dict()  # Ignite's Checkpoint / save_state: every rank, nothing consolidated
    dist.barrier(group=ctx.group)
    return got


@pytest.mark.parametrize("kind", READING_KINDS)
def test_state_dict_on_every_rank_without_consolidation(pool, kind):
    want = reference_state(3)
    for got in pool.run(every_rank_task, kind, world_size=3):
        assert_same_state(got, want)


def odd_chunks_task(ctx, size):
    model = make_model()
    opt = build("oss", model, ctx)
    train(model, opt, 3)
    old = serve.CHUNK_BYTES
    serve.CHUNK_BYTES = size  # chunks end mid-element and mid-tensor; a tensor spans several
    os.environ[ARRIVAL_TIMEOUT_ENV] = "15"
    try:
        got = opt.state_dict()
        dist.barrier(group=ctx.group)
    finally:
        serve.CHUNK_BYTES = old
        del os.environ[ARRIVAL_TIMEOUT_ENV]
    return got


def test_the_reply_is_cut_and_counted_in_the_same_chunk_size(pool):
    """The server announces its chunk count and cuts the bytes with one size: the count once
    came from CHUNK_BYTES and the cut from a default bound when the module loaded, so any other
    size left the reader waiting for chunks that never came."""
    want = reference_state(3)
    for got in pool.run(odd_chunks_task, 61, world_size=2):
        assert_same_state(got, want)


# ------------------------------------------------------------------ every rank, many chunks
def big_model():
    torch.manual_seed(0)  # 3 x 1024 x 1024: each rank's Adam shard spans more than WINDOW chunks
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(3)])


def big_loss(model, step):
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(step))
    return model(x).pow(2).mean()


def big_every_rank_task(ctx, rounds):
    model = big_model()
    opt = OSS(model.parameters(), torch.optim.Adam, group=ctx.group, lr=0.01)
    found = serve.service()
    post = found.post
    if ctx.rank == 1:  # slow between its requests (a descheduled thread): rank 3's requests
        # reach rank 1's server while rank 1 still posts, after rank 1's reached rank 0's

        def slow_post(to, request):
            post(to, request)
            time.sleep(0.2)

        found.post = slow_post
    got = []
    os.environ[ARRIVAL_TIMEOUT_ENV] = "15"
    try:
        for step in range(rounds):
            train(model, opt, 1, start=step, loss_fn=big_loss)
            dist.barrier(group=ctx.group)  # every rank reads every other one at the same time
            if ctx.rank == 3:
                time.sleep(0.1)
            state = opt.state_dict()
            got.append({i: {k: v.clone() for k, v in s.items()} for i, s in state["state"].items()})
            dist.barrier(group=ctx.group)
    finally:
        del os.environ[ARRIVAL_TIMEOUT_ENV]
        found.__dict__.pop("post", None)
    return got


def test_every_rank_reading_shards_of_many_chunks_at_once_completes(pool):
    """Each server holds its rank's step lock while it sends a shard of several chunks. A
    reader that took its own lock after its requests were out waited on its own server, busy
    sending to a peer (3) that waited on a server (0) busy sending to this reader (1): a
    cycle, until the store's timeout. Rank 1 posts slowly and rank 3 starts late to make it."""
    rounds = 3
    shard_bytes = 3 * 1024 * 1024 * 2 * 4 // 4  # exp_avg and exp_avg_sq in fp32, on 4 ranks
    assert shard_bytes > serve.WINDOW * serve.CHUNK_BYTES
    model = big_model()
    ref = torch.optim.Adam(model.parameters(), lr=0.01)
    want = []
    for step in range(rounds):
        train(model, ref, 1, start=step, loss_fn=big_loss)
        want.append(copy.deepcopy(ref.state_dict()["state"]))
    for got in pool.run(big_every_rank_task, rounds, world_size=4):
        for mine, theirs in zip(got, want):
            assert sorted(mine) == sorted(theirs)
            for i in theirs:
                for key, value in theirs[i].items():
                    assert torch.equal(mine[i][key], value), (i, key)


# ------------------------------------------------------------------ consolidate
def consolidate_task(ctx, kind, everywhere):
    model = make_model()
    opt = build(kind, model, ctx)
    train(model, opt, 3)
    if ctx.rank == 1 or everywhere:  # mmengine's ZeRO class: on the saving rank only
        opt.consolidate_state_dict(1)
    got = copy.deepcopy(opt.state_dict()) if ctx.rank == 1 else opt.consolidated_state
    if not everywhere:
        dist.barrier(group=ctx.group)  # nobody steps before the save is done (DDP's backward)
    train(model, opt, 1, start=3)  # every rank: the shard was read before it moved on
    return got


@pytest.mark.parametrize("everywhere", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_consolidate_on_the_recipient_alone_or_everywhere(pool, kind, everywhere):
    results = pool.run(consolidate_task, kind, everywhere, world_size=3)
    assert_same_state(results[1], reference_state(3))
    assert results[0] is None and results[2] is None


def non_recipient_alone_task(ctx):
    os.environ[ARRIVAL_TIMEOUT_ENV] = "2"
    try:
        model = make_model()
        opt = OSS(model.parameters(), torch.optim.Adam, group=ctx.group, lr=0.01)
        train(model, opt, 1)
        start = time.monotonic()
        got = catch(opt.consolidate_state_dict, 0) if ctx.rank == 1 else None
        took = time.monotonic() - start
        dist.barrier(group=ctx.group)
        return got, took
    finally:
        del os.environ[ARRIVAL_TIMEOUT_ENV]


def test_consolidate_on_a_rank_the_recipient_never_reads_raises_in_time(pool):
    (_, _), (got, took) = pool.run(non_recipient_alone_task, world_size=2)
    assert got[0] == "RuntimeError"
    assert "consolidate_state_dict(recipient_rank=0) on this rank waits until" in got[1]
    assert took < 2 + 10  # the arrival timeout, and the grace to name where the ranks are


# ------------------------------------------------------------------ consistency
def stepped_on_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), torch.optim.Adam, group=ctx.group, lr=0.01)
    train(model, opt, 2)
    store = serve.positions.default_store()
    key = f"test_state_read/stepped/{time.time_ns() if ctx.rank == 1 else 0}"
    if ctx.rank == 1:
        opt.optim.register_step_post_hook(lambda *_: store.set("stepped", key))
        train(model, opt, 1, start=2)  # its local step runs, then its sync waits for rank 0
        return None
    store.wait(["stepped"])
    got = catch(opt.state_dict)
    store.delete_key("stepped")
    train(model, opt, 1, start=2)  # the step rank 1 waits for
    return got


def test_a_shard_from_another_step_is_refused(pool):
    got, _ = pool.run(stepped_on_task, world_size=2)
    assert got[0] == "RuntimeError"
    assert "as of this rank's step 2" in got[1] and "as of its step 3" in got[1]


def busy_peer_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), torch.optim.Adam, group=ctx.group, lr=0.01)
    train(model, opt, 2)
    if ctx.rank == 1:  # its main thread waits in another collective meanwhile
        dist.barrier(group=ctx.group)
        return None
    time.sleep(0.3)
    got = opt.state_dict()
    dist.barrier(group=ctx.group)
    return got


def test_a_peer_waiting_in_a_collective_still_serves_its_shard(pool):
    got, _ = pool.run(busy_peer_task, world_size=2)
    assert_same_state(got, reference_state(2))


def silent_peer_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), torch.optim.Adam, group=ctx.group, lr=0.01)
    train(model, opt, 1)
    if ctx.rank == 1:
        found = serve.service()
        found.stop()  # as if its process were gone: nobody reads its mailbox
        dist.barrier(group=ctx.group)
        dist.barrier(group=ctx.group)
        serve.service()  # a new server for the next tests
        return None
    dist.barrier(group=ctx.group)
    os.environ[ARRIVAL_TIMEOUT_ENV] = "2"
    try:
        start = time.monotonic()
        got = catch(opt.state_dict)
        took = time.monotonic() - start
    finally:
        del os.environ[ARRIVAL_TIMEOUT_ENV]
    dist.barrier(group=ctx.group)
    return got, took


def test_a_peer_that_does_not_answer_raises_within_the_arrival_timeout(pool):
    (got, took), _ = pool.run(silent_peer_task, world_size=2)
    assert got[0] == "RuntimeError"
    assert "did not answer within 2s" in got[1] and "global rank 1" in got[1]
    assert took < 2 + 5


def collected_peer_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), torch.optim.Adam, group=ctx.group, lr=0.01)
    train(model, opt, 1)
    if ctx.rank == 1:
        del opt
    dist.barrier(group=ctx.group)
    got = catch(opt.state_dict) if ctx.rank == 0 else None
    dist.barrier(group=ctx.group)
    return got


def test_a_peer_without_the_optimizer_refuses_the_read(pool):
    got, _ = pool.run(collected_peer_task, world_size=2)
    assert got[0] == "RuntimeError" and "holds no such optimizer" in got[1]


def idle_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), torch.optim.Adam, group=ctx.group, lr=0.01)
    thread = serve.service().thread
    ticks = _thread_cpu(thread.native_id)
    time.sleep(1.0)
    used = _thread_cpu(thread.native_id) - ticks
    del opt
    return used


def test_the_server_thread_uses_no_cpu_while_idle(pool):
    for used in pool.run(idle_task, world_size=2):
        assert used <= 1  # clock ticks (1/100 s) over one second idle


def _thread_cpu(tid):
    """CPU clock ticks (user + system) of thread ``tid`` of this process (Linux)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def threads_task(ctx):
    opts = [
        OSS(make_model().parameters(), torch.optim.Adam, group=ctx.group, lr=0.01) for _ in range(3)
    ]
    names = [t.name for t in threading.enumerate()]
    del opts
    return names.count("oss_plus-serve")


def test_one_server_thread_per_process_whatever_the_optimizers(pool):
    assert pool.run(threads_task, world_size=2) == [1, 1]


def test_messages_name_what_to_do():
    assert "consolidate_state_dict() on every rank" in pull.STEPS_DIFFER
    assert "OSS_PLUS_ARRIVAL_TIMEOUT" in pull.NO_ANSWER
    assert "state_dict(all_ranks=True)" in pull.NO_SERVICE


def unrecognised_checkpoint_task(ctx):
    model = make_model()
    opt = OSS(model.parameters(), torch.optim.Adam, group=ctx.group, lr=0.01)
    train(model, opt, 1)
    # a function of torch.distributed.checkpoint that oss_plus does not recognise (a torch
    # whose DCP functions differ): it would take a whole state for this rank's shard
    caller = {"__name__": "torch.distributed.checkpoint.state_dict"}
    exec("def get(opt):\n    return opt.state_dict()\n", caller)  # noqa: S102 - its module name
    got = catch(caller["get"], opt)
    mine = catch(lambda: len(opt.state_dict()["state"]))  # a user's call still reads
    dist.barrier(group=ctx.group)
    return got, mine


def test_an_unrecognised_checkpoint_caller_is_refused_not_given_the_whole_state(pool):
    for rank, (got, mine) in enumerate(pool.run(unrecognised_checkpoint_task, world_size=2)):
        assert got == ("RuntimeError", NOT_CONSOLIDATED.format(rank=rank))
        assert mine == ("ok", len(reference_state(1)["state"]))
