"""Issue 55's device checks, run by ``tests/test_out_of_step.py`` (``gpu`` marker): the step
count on NCCL at world size 1; over gloo with CUDA tensors at 2 ranks, steps like the plain
optimizer (also after ``attach``), then a skipped step raises clearly on both ranks.

Prints one JSON line for world size 1, then one per rank of the 2-rank run."""

import copy
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    ).cuda()


def loss(m, it):
    g = torch.Generator().manual_seed(it)
    return m(torch.randn(8, 32, generator=g).cuda()).pow(2).mean()


def lockstep(m, opt, ref, plain, steps=3):
    """``steps`` iterations of ``m`` under ``opt`` and of ``ref`` under ``plain``, alike."""
    for it in range(steps):
        for mm, o in ((m, opt), (ref, plain)):
            o.zero_grad()
            loss(mm, it).backward()
            o.step()


def part_a():
    from oss_plus import OSS

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    dist.init_process_group("nccl", rank=0, world_size=1)
    m, ref = model(), model()
    opt = OSS(m.parameters(), torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(ref.parameters(), lr=0.01)
    lockstep(m, opt, ref, plain)
    same = all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
    try:
        copy.deepcopy(opt)
        copied = "no error"
    except TypeError as e:
        copied = str(e)[:60]
    dist.destroy_process_group()
    return {"nccl_ws1_step_count": opt.step_count, "equal_to_plain": same, "deepcopy": copied}


def rank_b(rank, q):
    os.environ["OSS_PLUS_ARRIVAL_TIMEOUT"] = "3"
    dist.init_process_group(
        "gloo",
        init_method="tcp://127.0.0.1:29562",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    from oss_plus import OSS

    out = {}
    for kind in ("oss", "attach"):
        m, ref = model(), model()
        opt = OSS(m.parameters(), torch.optim.Adam, lr=0.01)
        if kind == "attach":
            opt.attach(m)
        plain = torch.optim.Adam(ref.parameters(), lr=0.01)
        lockstep(m, opt, ref, plain)
        opt.settle()
        out[kind + "_equal_to_plain"] = all(
            torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters())
        )
        out[kind + "_step_count"] = opt.step_count
    m = model()
    opt = OSS(m.parameters(), torch.optim.Adam, lr=0.01)
    begin = time.monotonic()
    try:
        for it in range(3):
            opt.zero_grad()
            loss(m, it).backward()
            if not (rank == 1 and it == 1):
                opt.step()
        opt.consolidate_state_dict()
        out["skip"] = "no error"
    except RuntimeError as e:
        out["skip"] = str(e)[:330]
    out["skip_s"] = round(time.monotonic() - begin, 2)
    q.put((rank, out))
    time.sleep(1)
    os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    print(json.dumps(part_a()), flush=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=rank_b, args=(r, q)) for r in range(2)]
    [p.start() for p in ps]
    got = dict(q.get(timeout=150) for _ in range(2))
    for r in (0, 1):
        print(r, json.dumps(got[r]), flush=True)
    [p.join(10) for p in ps]
