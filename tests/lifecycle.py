"""The full lifecycle of a training process, run in fresh 2-rank process pairs, many times.

    python tests/lifecycle.py --runs 20                  # the driver: 20 fresh rank pairs
    python tests/lifecycle.py --runs 20 --skip sdp,async # bisect: leave components out
    python tests/lifecycle.py --runs 20 --spawn          # fairscale's mp.spawn + file store
    python tests/lifecycle.py --runs 20 --sdp-backward   # SDP only, exit right after backward
    python tests/lifecycle.py --runs 20 --torch-last     # end with torch's own all_gathers
    python tests/lifecycle.py --runs 20 --install-only   # install(), then plain DDP only

Each run starts ``--world`` fresh interpreters (no launcher in between, so an exit status is
the rank's own). Every rank: ``init_process_group`` (gloo, TCP store), an ``OSS`` under
``ShardedDataParallel`` trained (and clipped) a few steps, a second ``OSS`` stepped inside
DDP's comm hook (``overlap_with_ddp``) a few steps, a blocking and an asynchronous
``save_checkpoint`` (its future waited for, unless ``--skip wait``),
``destroy_process_group()``, exit. The
driver counts the runs where some rank did not exit 0 and how (SIGABRT, the C++ "terminate
called without an active exception", a timeout). ``--skip`` drops components, to bisect;
``--cores DIR`` keeps the core dump of a rank that crashed (open it with gdb);
``--sdp-backward`` runs the ZeRO-2-only script instead: ``ShardedDataParallel`` + ``OSS``,
a few steps, then one more forward and ``backward()`` with no step, and exit (the reducer's
collectives are the last ones); ``--torch-last`` steps an ``OSS`` and ends with plain
``dist.all_gather`` calls of temporaries and no ``destroy_process_group()``, as fairscale's
test suites end (torch's collectives last: only the exit handler of ``oss_plus.runtime.exit``
covers them); ``--install-only`` calls ``oss_plus.compat.fairscale.install()`` and trains
plain DDP + Adam, no ``OSS`` (the DDP reference run of a script that installs the adapter,
issue 36). ``LIFECYCLE_SWITCH_S`` raises the interpreter's switch
interval, so a non-Python thread that needs the GIL waits that long (it widens the window of
a GIL race at exit).
tests/test_lifecycle.py runs it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

COMPONENTS = ("sdp", "overlap", "ckpt", "async", "wait")
#: ``--skip`` value that selects the ZeRO-2-only script ending in a backward.
SDP_BACKWARD = "sdp_backward"
#: ``--skip`` value that selects the script ending in torch's own collectives (no oss_plus
#: collective last): the pattern of fairscale's test suites.
TORCH_LAST = "torch_last"
#: ``--skip`` value that selects the script that only calls
#: ``oss_plus.compat.fairscale.install()`` and trains with plain DDP (no oss_plus collective,
#: no ``OSS``): the reference run of a script that installs the adapter (issue 36).
INSTALL_ONLY = "install_only"
ABORT = "terminate called without an active exception"


def rank_main(
    rank: int, world: int, port: int, directory: str, skip: set[str], store: str | None = None
) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from oss_plus import OSS, ShardedDataParallel, save_checkpoint
    from oss_plus.overlap import overlap_with_ddp

    torch.set_num_threads(1)
    if os.environ.get("LIFECYCLE_SWITCH_S"):  # a starved non-Python thread waits this long
        sys.setswitchinterval(float(os.environ["LIFECYCLE_SWITCH_S"]))
    if INSTALL_ONLY in skip:
        import oss_plus.compat.fairscale

        oss_plus.compat.fairscale.install()
    init = f"file://{store}" if store else f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(16, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 1),
        )

    def data(step: int) -> torch.Tensor:
        return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))

    net = model()
    if INSTALL_ONLY in skip:  # DDP + torch's Adam: torch's collectives only, then exit
        reference = DDP(net)
        plain = torch.optim.Adam(net.parameters(), lr=1e-3)
        for step in range(4):
            plain.zero_grad()
            reference(data(step)).pow(2).mean().backward()
            plain.step()
        return  # no destroy_process_group(), as Lightning 1.9
    opt = OSS(net.parameters(), optim=torch.optim.Adam, lr=1e-3)
    if SDP_BACKWARD in skip:  # ZeRO-2 only; the last collectives are the reducer's
        sdp = ShardedDataParallel(net, opt, reduce_buffer_size=200)
        for step in range(3):
            opt.zero_grad()
            sdp(data(step)).pow(2).mean().backward()
            opt.step()
        sdp(data(3)).pow(2).mean().backward()
        dist.destroy_process_group()
        return
    if TORCH_LAST in skip:  # oss_plus used, then torch's plain collectives last
        for step in range(2):
            opt.zero_grad()
            net(data(step)).pow(2).mean().backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        for _ in range(3):  # as fairscale's check_same_models_across_ranks: temporaries
            dist.all_gather([torch.empty_like(flat) for _ in range(world)], flat * 1)
        return  # no destroy_process_group(), as the test functions of fairscale's suites
    if "sdp" not in skip:
        net = ShardedDataParallel(net, opt)
        for step in range(3):
            opt.zero_grad()
            net(data(step)).pow(2).mean().backward()
            opt.clip_grad_norm(1.0)  # the examples that aborted clip (amp_clip, fairscale_port)
            opt.step()
    if "overlap" not in skip:
        other = model()
        ddp = DDP(other, bucket_cap_mb=0.001)
        opt2 = OSS(other.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
        overlap_with_ddp(ddp, opt2)
        for step in range(3):
            opt2.zero_grad()
            ddp(data(step)).pow(2).mean().backward()
    if "ckpt" not in skip:
        save_checkpoint(opt, os.path.join(directory, "blocking"))
    if "async" not in skip:
        future = save_checkpoint(opt, os.path.join(directory, "async"), blocking=False)
        if "wait" not in skip:
            assert future is not None
            future.result()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, directory: str, skip: set[str]) -> None:
    rank_main(rank, world, 0, directory, skip, store=os.path.join(directory, "store"))


def spawn_run(world: int, skip: set[str]) -> list[str]:
    """fairscale's test pattern: ``mp.spawn`` of the ranks, a file store (run in a fresh
    interpreter by the driver, so every rank is a fresh spawned interpreter too)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as directory:
        try:
            mp.spawn(_spawned, args=(world, directory, skip), nprocs=world, join=True)
        except mp.ProcessExitedException as exc:
            return [f"{exc}"]
        except mp.ProcessRaisedException as exc:
            return [f"raised: {exc}"]
    return ["ok"] * world


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _allow_cores() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def one_run(world: int, skip: set[str], timeout: float, cores: str | None) -> list[str]:
    """Start ``world`` fresh ranks; return per rank "ok" or how it failed.

    With ``cores``, rank ``r`` runs in ``cores/rank<r>`` with core dumps allowed (for gdb).
    """
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    with tempfile.TemporaryDirectory() as directory:
        dirs = [os.path.join(cores, f"rank{r}") if cores else None for r in range(world)]
        for d in dirs:
            if d:
                os.makedirs(d, exist_ok=True)
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--rank",
                    str(r),
                    "--world",
                    str(world),
                    "--port",
                    str(port),
                    "--dir",
                    directory,
                    "--skip",
                    ",".join(sorted(skip)),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=dirs[r],
                preexec_fn=_allow_cores if cores else None,
            )
            for r in range(world)
        ]
        outcomes = []
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                outcomes.append("timeout")
                continue
            if proc.returncode == 0:
                outcomes.append("ok")
            elif proc.returncode < 0:
                name = signal.Signals(-proc.returncode).name
                outcomes.append(f"{name}{' (terminate)' if ABORT in err else ''}: {err[-1500:]}")
            else:
                outcomes.append(f"exit {proc.returncode}: {err[-1500:]}")
    return outcomes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--skip", default="", help=f"comma-separated, of {COMPONENTS}")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--cores", default=None, help="keep core dumps of failed ranks here")
    p.add_argument("--spawn", action="store_true", help="fairscale's mp.spawn + file store")
    p.add_argument("--sdp-backward", action="store_true", help="SDP only, exit after backward")
    p.add_argument("--torch-last", action="store_true", help="end with torch's all_gathers")
    p.add_argument("--install-only", action="store_true", help="install(), then plain DDP")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    skip = {s for s in args.skip.split(",") if s} | ({SDP_BACKWARD} if args.sdp_backward else set())
    skip |= {TORCH_LAST} if args.torch_last else set()
    skip |= {INSTALL_ONLY} if args.install_only else set()
    if args.rank is not None:
        rank_main(args.rank, args.world, args.port, args.dir, skip)
        return
    failed = 0
    start = time.perf_counter()
    for run in range(args.runs):
        cores = os.path.join(args.cores, f"run{run}") if args.cores else None
        if args.spawn:
            outcomes = spawn_run(args.world, skip)
        else:
            outcomes = one_run(args.world, skip, args.timeout, cores)
        bad = [o for o in outcomes if o != "ok"]
        failed += bool(bad)
        for rank, o in enumerate(outcomes):
            if o != "ok":
                print(f"run {run} rank {rank}: {o}", flush=True)
    seconds = time.perf_counter() - start
    print(f"lifecycle runs {args.runs}, failed {failed}, skip {sorted(skip)}, {seconds:.0f}s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
