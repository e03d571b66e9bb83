"""``oss_plus.runtime.launch.run_local``: the fresh local ranks of the benches and the demo."""

from __future__ import annotations

import socket

import torch.distributed as dist

from oss_plus.runtime import launch as _launch


def _who(rank, world):
    return rank, dist.get_world_size(), dist.get_backend()


def test_the_ranks_do_not_need_a_port_to_stay_free_until_they_start(monkeypatch):
    # A port found free now and bound by rank 0 seconds later can be taken in between (a
    # connection's ephemeral port, another job). Hand out a port that is taken: the ranks
    # must still meet.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(_launch, "free_port", lambda: taken.getsockname()[1])
        assert _launch.run_local(_who, 2, threads=1) == [(0, 2, "gloo"), (1, 2, "gloo")]
