"""A second process group in the same processes, after ``destroy_process_group()``.

Root cause (torch, not oss_plus; see ``docs/migration.md``, "Re-initialising"): a new default
group that rendezvouses through the same store keys as the destroyed one (the same
``tcp://`` address, or torchrun's store) can read the old group's keys and connect to the
old gloo context. While anything holds the old group (an ``OSS``, a DDP module, or just
``dist.group.WORLD`` kept in a variable), that context still listens and the new group's
first collective hangs; when nothing holds it, the connection is reset instead (also
without oss_plus, intermittently). The workaround: give every generation of groups its own
keys, ``init_process_group(store=PrefixStore(f"generation-{i}", store), ...)`` over one store
created once. This test runs that recipe, with the previous generation's ``OSS`` and DDP
module still alive, in fresh processes with a hard timeout.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=20)
GENERATIONS = 3


def _worker(rank: int, world_size: int, port: int, repo: str, out: str) -> None:
    sys.path.insert(0, repo)
    from oss_plus import OSS

    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=TIMEOUT)
    alive = []
    for generation in range(GENERATIONS):
        prefixed = dist.PrefixStore(f"generation-{generation}", store)
        dist.init_process_group(
            "gloo", store=prefixed, rank=rank, world_size=world_size, timeout=TIMEOUT
        )
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.1)
        model(torch.ones(2, 4) * (rank + 1)).sum().backward()
        opt.step()
        gathered = [torch.zeros(3) for _ in range(world_size)]
        dist.all_gather(gathered, model.module.bias.detach().clone())
        assert all(torch.equal(g, gathered[0]) for g in gathered)
        alive.append((model, opt))  # the previous generation stays alive
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(f"{GENERATIONS} generations")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_new_group_after_destroy_works_with_a_fresh_prefix_while_oss_is_alive(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), str(_free_port()), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": repo},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        assert (tmp_path / f"rank{rank}").read_text() == f"{GENERATIONS} generations"


if __name__ == "__main__":
    import torch.multiprocessing as mp

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mp.spawn(_worker, args=(2, int(sys.argv[1]), root, sys.argv[2]), nprocs=2)
