"""Run every ```python block of README.md, docs/migration.md, overlap.md, zero2.md,
partition.md, checkpoints.md, performance.md, lowbit.md and optimizers.md.

Each page runs as ONE script under torchrun on 2 gloo ranks, in the test's tmp_path: this file
is also that script (``python -m torch.distributed.run ... tests/test_doc_blocks.py PAGE``). It
execs the page's blocks in order in one namespace and, after each block, runs that block's
check from ``CHECKS``, which asserts what the block produced (the class it built, identical
replicas, printed losses equal to a reference, checkpoint files and their contents). A failed
check exits non-zero and fails the test.

docs/quickstart.md and docs/amp.md are run by tests/test_examples.py and tests/test_amp.py;
``test_every_python_block_in_docs_is_run`` makes sure no page's blocks escape.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import flat_params, state_equal
from test_examples import python_blocks

from oss_plus.runtime.launch import _drain

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: Pages whose python blocks other tests run, with their block counts.
RUN_ELSEWHERE = {"quickstart.md": 2, "amp.md": 1}  # test_examples.py, test_amp.py
#: Seconds a rank may run a page before it exits with its stack (so a hang fails the test).
RANK_TIMEOUT = 120
#: Values the checks of a page pass to the checks of later blocks.
memo: dict[str, Any] = {}


# ------------------------------------------------------------------ helpers used on the ranks
def rank() -> int:
    return int(os.environ["RANK"])


def same_on_every_rank(tensor: torch.Tensor) -> bool:
    copies = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, tensor)
    return all(torch.equal(c, tensor) for c in copies)


def reference_losses(optim: Any, steps: int, skip: int = 0, lr_lambda: Any = None) -> str:
    """What the overlap recipe prints, computed in one process with the unsharded optimizer.

    Both ranks draw the same batches (same seed), so DDP's average is the gradient itself.
    The first ``skip`` iterations do not step (torch's warm-up).
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    opt = optim(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    lines = []
    for step in range(steps):
        x = torch.randn(32, 64)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        if step >= skip:
            opt.step()
        if sched is not None:
            sched.step()
        lines.append(f"{step} {loss.item()}\n")
    return "".join(lines)


# ------------------------------------------------------------------ docs/migration.md
def check_setup(ns: dict, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    assert dist.get_world_size() == 2 and isinstance(ns["ddp"], DistributedDataParallel)
    memo["initial"] = flat_params(ns["model"])


def check_fairscale_before(ns: dict, out: str) -> None:
    import fairscale.optim.oss

    assert type(ns["opt"]) is fairscale.optim.oss.OSS  # the real class, before install()


def check_fairscale_after(ns: dict, out: str) -> None:
    import oss_plus.compat.fairscale

    adapter = oss_plus.compat.fairscale.OSS
    assert ns["OSS"] is adapter and type(ns["opt"]) is adapter, ns["OSS"]
    ns["opt"].zero_grad()
    ns["ddp"](torch.randn(8, 16, device=ns["device"])).sum().backward()
    ns["opt"].step()  # the adapter trains: replicas updated and identical
    params = flat_params(ns["model"])
    assert same_on_every_rank(params) and not torch.equal(params, memo["initial"])


def check_scaler(ns: dict, out: str) -> None:
    import oss_plus

    assert type(ns["scaler"]) is oss_plus.ShardedGradScaler


def check_zero_before(ns: dict, out: str) -> None:
    import torch.distributed.optim

    assert type(ns["opt"]) is torch.distributed.optim.ZeroRedundancyOptimizer


def check_zero_after(ns: dict, out: str) -> None:
    import oss_plus.compat.torch

    assert type(ns["opt"]) is oss_plus.compat.torch.ZeroRedundancyOptimizer
    memo["before_join"] = flat_params(ns["model"])


def check_join(ns: dict, out: str) -> None:
    assert len(ns["my_batches"]) == 2 + rank()  # uneven inputs
    params = flat_params(ns["model"])
    assert same_on_every_rank(params) and not torch.equal(params, memo["before_join"])


def check_pt(ns: dict, out: str) -> None:
    opt, sd = ns["opt"], ns["sd"]
    assert Path("optim.pt").is_file() and len(sd["state"]) == 2  # weight and bias
    opt.consolidate_state_dict(0)
    if rank() == 0:
        assert state_equal(opt.state_dict(), sd)  # loaded exactly what was saved


def check_checkpoint_migration(ns: dict, out: str) -> None:
    from oss_plus.checkpoint import read_state_dict

    sd = ns["sd"]
    assert Path("ckpt/migrated/index.json").is_file()
    assert len(list(Path("ckpt/step_1000").glob("shard-*.safetensors"))) == 2
    assert state_equal(read_state_dict("ckpt/migrated"), sd)
    assert state_equal(read_state_dict("ckpt/step_1000"), sd)  # loaded, then saved unchanged
    assert state_equal(ns["legacy_opt"].state_dict(), sd)


# ------------------------------------------------------------------ docs/overlap.md
def check_overlap_recipe(ns: dict, out: str) -> None:
    # bit-identical to the unsharded optimizer, as the page says; only rank 0 prints
    expected = reference_losses(torch.optim.AdamW, 10, lr_lambda=lambda step: 0.9**step)
    assert out == (expected if rank() == 0 else ""), f"printed:\n{out}expected:\n{expected}"


def check_overlap_torch(ns: dict, out: str) -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ns["train"](steps=4)  # the block replaces the recipe's train(): run it
    out = printed.getvalue()
    expected = reference_losses(torch.optim.Adam, 4, skip=2)  # torch's 2 warm-up iterations
    assert out == (expected if rank() == 0 else ""), f"printed:\n{out}expected:\n{expected}"


# ------------------------------------------------------------------ docs/zero2.md
def check_zero2_recipe(ns: dict, out: str) -> None:
    from oss_plus import ShardedDataParallel

    model, opt = ns["model"], ns["opt"]
    assert isinstance(model, ShardedDataParallel)
    params = list(model.module.parameters())
    held = [p.grad is not None for p in params]
    assert held == [opt.param_to_rank[p] == rank() for p in params]  # owned grads only
    # DDP + the unsharded AdamW in one process: each rank's batch, gradients averaged as
    # DDP averages them (times 1/2, summed), torch's clip, then the step
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(5):
        grads = []
        for r in range(2):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(100 * step + r))
            ref.zero_grad()
            ref(x).pow(2).mean().backward()
            grads.append([p.grad * 0.5 for p in ref.parameters()])
        for p, g0, g1 in zip(ref.parameters(), *grads):
            p.grad = g0 + g1
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
    assert torch.equal(flat_params(model.module), flat_params(ref))  # bit-identical, 2 ranks


# ------------------------------------------------------------------ docs/partition.md
def check_partition_rules(ns: dict, out: str) -> None:
    # what the page says rank 0 prints: the ```text block after the python block
    text = (DOCS / "partition.md").read_text()
    shown = text.split("Rank 0 prints:\n\n```text\n", 1)[1].split("```", 1)[0]
    assert out == (shown if rank() == 0 else ""), f"printed:\n{out}page:\n{shown}"
    loads = ns["opt"].plan.rank_loads()  # the flat rule's: equal up to the alignment
    assert sum(loads) == sum(p.numel() for p in ns["model"].parameters())
    assert max(loads) - min(loads) <= 2 * 16


def check_muon_pair(ns: dict, out: str) -> None:
    """The Muon + AdamW pair under the muon rule steps like the two plain optimizers."""
    model, muon = ns["model"], ns["muon"]
    assert [len(g["params"]) for g in muon.optim.param_groups] == [1]  # one matrix per rank
    torch.manual_seed(0)  # the page's model, built again
    ref = torch.nn.Sequential(
        torch.nn.Embedding(1000, 64),
        torch.nn.Linear(64, 256, bias=False),
        torch.nn.Linear(256, 64, bias=False),
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 1000, bias=False),
    )
    hidden = [ref[1].weight, ref[2].weight]
    rest = [p for p in ref.parameters() if all(p is not q for q in hidden)]
    plain = (torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-4))
    x = ns["x"]
    for _ in range(3):
        for o in plain:
            o.zero_grad()
        torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), x.flatten()).backward()
        for o in plain:
            o.step()
    assert torch.equal(flat_params(model), flat_params(ref))  # bit-identical, 2 ranks
    assert same_on_every_rank(flat_params(model))


# ------------------------------------------------------------------ README.md
def check_readme(ns: dict, out: str) -> None:
    from oss_plus import OSS

    opt, model = ns["opt"], ns["model"]
    assert isinstance(opt, OSS) and same_on_every_rank(flat_params(model))
    dist.barrier()  # rank 0 saved
    saved = torch.load("optim.pt", weights_only=True)
    plain = torch.optim.Adam(model.parameters(), lr=1e-3)
    plain.load_state_dict(saved)  # the plain torch.optim format
    assert len(saved["state"]) == 2 and int(saved["state"][0]["step"]) == 3


# ------------------------------------------------------------------ docs/checkpoints.md
def check_checkpoint_api(ns: dict, out: str) -> None:
    from oss_plus.checkpoint import read_state_dict

    opt, sd = ns["opt"], ns["sd"]
    dist.barrier()  # rank 0 converted old.pt
    assert len(list(Path("ckpt/step_1000").glob("shard-*.safetensors"))) == 2
    assert len(list(Path("ckpt/final").glob("state.*.safetensors"))) == 1
    opt.consolidate_state_dict(-1)
    assert len(sd["state"]) == 2 and state_equal(opt.state_dict(all_ranks=True), sd)
    assert state_equal(read_state_dict("ckpt/final"), sd)
    assert state_equal(read_state_dict("ckpt/migrated"), sd)


def check_async_save(ns: dict, out: str) -> None:
    from oss_plus.checkpoint import read_state_dict

    assert out.strip().endswith(str(Path("ckpt/async").resolve()))
    assert state_equal(read_state_dict("ckpt/async"), ns["sd"])  # the state at the call
    opt = ns["opt"]
    opt.consolidate_state_dict(-1)
    assert not state_equal(opt.state_dict(all_ranks=True), ns["sd"])  # the step went on


def check_dcp(ns: dict, out: str) -> None:
    opt, opt2 = ns["opt"], ns["opt2"]
    assert Path("ckpt/dcp/.metadata").is_file()
    assert opt2.plan.rule.value == "flat" and opt.plan.rule.value == "fairscale"
    saved = opt.state_dict(all_ranks=True)
    assert len(saved["state"]) == 2 and state_equal(opt2.state_dict(all_ranks=True), saved)
    assert torch.equal(flat_params(ns["model2"]), flat_params(ns["model"]))


def check_zero2(ns: dict, out: str) -> None:
    from oss_plus import ShardedDataParallel

    assert isinstance(ns["zero2"], ShardedDataParallel)
    owners = ns["zero2_opt"].param_to_rank
    assert ns["held"] == [owners[p] == rank() for p in ns["net"].parameters()]
    assert same_on_every_rank(flat_params(ns["net"]))


def check_lowbit(ns: dict, out: str) -> None:
    from torchao.optim import AdamW8bit
    from torchao.optim.subclass_8bit import OptimState8bit

    from oss_plus.state.nested import flatten_value

    def same(a: Any, b: Any) -> bool:  # the same skeleton (classes, contexts), equal tensors
        (sa, ta), (sb, tb) = flatten_value(a), flatten_value(b)
        return sa == sb and len(ta) == len(tb) and all(map(torch.equal, ta, tb))

    opt, resumed = ns["opt"], ns["resumed"]
    assert any(isinstance(v, OptimState8bit) for s in opt.optim.state.values() for v in s.values())
    whole = opt.state_dict(all_ranks=True)["state"]
    assert sum(isinstance(v, OptimState8bit) for s in whole.values() for v in s.values()) == 4
    assert same(resumed.state_dict(all_ranks=True)["state"], whole)
    assert json.loads(Path("ckpt/lowbit/index.json").read_text())["format_version"] == 5
    if rank() == 0:
        plain = AdamW8bit(copy.deepcopy(ns["model"].module).parameters(), lr=1e-3)
        plain.load_state_dict(torch.load("optim.pt", weights_only=True))
        params = [p for g in plain.param_groups for p in g["params"]]
        assert same({i: plain.state[p] for i, p in enumerate(params)}, whole)


def check_cross_param(ns: dict, out: str) -> None:
    from pytorch_optimizer import Prodigy

    assert out == "Prodigy cannot be sharded as it is\n", out
    assert isinstance(ns["opt"].optim, Prodigy) and ns["opt"].allow_cross_param is True


def check_auto_refresh_off(ns: dict, out: str) -> None:
    opt, model = ns["opt"], ns["model"]
    assert opt.auto_refresh is False and opt.plan.trainable == (False, True)
    assert opt.sync.is_intact() and model.bias.dtype == torch.float64
    assert same_on_every_rank(flat_params(model))


Check = Callable[[dict, str], None]
#: One check per python block of each page, in order.
CHECKS: dict[str, list[Check]] = {
    "migration.md": [
        check_setup,
        check_fairscale_before,
        check_fairscale_after,
        check_scaler,
        check_zero_before,
        check_zero_after,
        check_join,
        check_pt,
        check_checkpoint_migration,
        check_zero2,
    ],
    "overlap.md": [check_overlap_recipe, check_overlap_torch],
    "zero2.md": [check_zero2_recipe],
    "partition.md": [check_partition_rules, check_muon_pair],
    "checkpoints.md": [check_checkpoint_api, check_async_save, check_dcp],
    "README.md": [check_readme],
    "performance.md": [check_auto_refresh_off],
    "lowbit.md": [check_lowbit],
    "optimizers.md": [check_cross_param],
}
#: Pages whose blocks use a package oss_plus does not depend on (skipped without it).
NEEDS = {"migration.md": "fairscale", "lowbit.md": "torchao", "optimizers.md": "pytorch_optimizer"}
#: Files each page must have written, relative to its working directory (the tmp_path).
WRITES = {
    "migration.md": ["optim.pt", "ckpt/migrated/index.json", "ckpt/step_1000/index.json"],
    "overlap.md": [],
    "zero2.md": [],
    "partition.md": [],
    "checkpoints.md": [
        "old.pt",
        "ckpt/final/index.json",
        "ckpt/step_1000/index.json",
        "ckpt/async/index.json",
        "ckpt/dcp/.metadata",
    ],
    "README.md": ["optim.pt"],
    "performance.md": [],
    "lowbit.md": ["ckpt/lowbit/index.json", "optim.pt"],
    "optimizers.md": [],
}
#: Pages that call torch.compile through a library (torchao's step): run eagerly, the same
#: state in seconds instead of a compile per tensor shape (tens of seconds on a CPU).
EAGER = {"lowbit.md"}


def page_path(page: str) -> Path:
    """docs/PAGE, or the README at the repository root."""
    return ROOT / page if page == "README.md" else DOCS / page


def fence_line(text: str, block: str) -> int:
    """The line number of a block's opening fence (so tracebacks point into the page)."""
    start = text.find(f"```python\n{block}\n```")
    return text.count("\n", 0, start) + 1 if start >= 0 else 0


def run_page(page: str) -> None:
    """Exec the page's blocks in order in one namespace, each followed by its check.

    ``destroy_process_group()`` is deferred to the end of the page, so that later blocks and
    checks can use the group of a complete script (initializing a second one can hang).
    """
    faulthandler.dump_traceback_later(RANK_TIMEOUT, exit=True)  # a hang fails, with stacks
    path = page_path(page)
    text, blocks, checks = path.read_text(), python_blocks(path), CHECKS[page]
    assert len(blocks) == len(checks), f"{page}: {len(blocks)} blocks, {len(checks)} checks"
    ns: dict[str, Any] = {"__name__": "__main__"}
    destroy, dist.destroy_process_group = dist.destroy_process_group, lambda group=None: None
    if page in EAGER:
        torch.compile = lambda model=None, **_: model  # type: ignore[assignment]
    for block, check in zip(blocks, checks):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile("\n" * fence_line(text, block) + block, str(path), "exec"), ns)
        check(ns, out.getvalue())
    # the checks' own collectives (same_on_every_rank's all_gather) do not wait for gloo's
    # worker to drop their tensors: one that does, last, keeps the exit from aborting
    # ("terminate called without an active exception", docs/reliability.md "Process exit")
    _drain()
    destroy()
    sys.stdout.write(f"{page}: {len(blocks)} python block(s) ran and checked on rank {rank()}\n")
    sys.stdout.flush()


# ------------------------------------------------------------------ the tests
#: Pages whose setup block picks the rank's device as the examples do.
DEVICE_RULE_PAGES = ["README.md", "quickstart.md", "migration.md"]


def device_rule(page: str) -> str:
    """The lines of the page's setup block that decide ``device`` (and ``on_gpu``)."""
    lines = page_path(page).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("local_rank, local_ranks"))
    return "\n".join(lines[start : start + 3])


@pytest.mark.parametrize("page", DEVICE_RULE_PAGES)
def test_doc_pages_choose_the_device_like_the_examples(page, monkeypatch):
    """The rule users copy from the page gives :func:`choose_device`'s answer for every device
    count (simulated), and every page shows the same rule."""
    from oss_plus.runtime.launch import choose_device

    rule = device_rule(page)
    assert rule == device_rule(DEVICE_RULE_PAGES[0])
    for gpus, ranks in [(g, r) for g in range(4) for r in range(1, 4)]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        for local_rank in range(ranks):
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
            ns: dict[str, Any] = {"os": os, "torch": torch}
            exec(rule, ns)
            choice = choose_device("auto", local_rank, ranks, gpus=gpus)
            assert (ns["device"], "nccl" if ns["on_gpu"] else "gloo") == (
                choice.device,
                choice.backend,
            ), (gpus, ranks, local_rank)


def test_every_python_block_in_docs_is_run():
    counts = {p.name: len(python_blocks(p)) for p in [*DOCS.glob("*.md"), ROOT / "README.md"]}
    run = {**RUN_ELSEWHERE, **{page: len(checks) for page, checks in CHECKS.items()}}
    assert {page: n for page, n in counts.items() if n} == run


@pytest.mark.parametrize("page", sorted(CHECKS))
def test_doc_page_python_blocks_run_under_torchrun(page, tmp_path):
    if page in NEEDS:
        pytest.importorskip(NEEDS[page], reason=f"{page} shows {NEEDS[page]}'s own classes")
    # the checks build and compare CPU tensors: hide the GPUs, so that the pages take their
    # CPU branch (gloo) on any machine; their device rule is checked above
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, page]
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,  # the blocks write to relative paths
        env=env,
        capture_output=True,
        text=True,
        timeout=RANK_TIMEOUT + 60,
    )
    assert proc.returncode == 0, f"{page} failed:\n{proc.stdout}\n{proc.stderr}"
    for r in range(2):
        assert f"{page}: {len(CHECKS[page])} python block(s) ran and checked on rank {r}" in (
            proc.stdout
        )
    assert all((tmp_path / name).is_file() for name in WRITES[page]), sorted(tmp_path.rglob("*"))


if __name__ == "__main__":
    run_page(sys.argv[1])
