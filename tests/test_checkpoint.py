"""Multi-process tests of oss_plus checkpoints: round trips at any world size, atomicity,
bad files raised on every rank, no tensor gathered by a sharded save, bounded streaming.

The helpers at the top (strict comparison, the custom optimizer, the scenarios) are shared
with the other ``test_checkpoint_*`` modules.
"""

from __future__ import annotations

import copy
import errno
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import WORLD_IDS, WORLDS, catch, make_model, params_equal, reseal, train
from safetensors.torch import load_file, save_file

from oss_plus import OSS, load_checkpoint, save_checkpoint
from oss_plus.checkpoint import assemble, read_state_dict, storage

# ------------------------------------------------------------------ shared helpers


def diff(a: Any, b: Any, where: str = "sd") -> str | None:
    """Describe the first difference between a and b, types included (None if identical)."""
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} {a!r:.60} vs {type(b).__name__} {b!r:.60}"
    if isinstance(a, torch.Tensor):
        if (
            a.dtype != b.dtype
            or a.shape != b.shape
            or a.device != b.device
            or not torch.equal(a, b)
        ):
            shapes = f"{a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
            return f"{where}: tensors differ ({shapes})"
        return None
    if isinstance(a, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        return next((d for k in a if (d := diff(a[k], b[k], f"{where}[{k!r}]"))), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        return next(
            (d for i, (x, y) in enumerate(zip(a, b)) if (d := diff(x, y, f"{where}[{i}]"))), None
        )
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if a == b else f"{where}: {a!r} vs {b!r}"


class TallySGD(torch.optim.Optimizer):
    """SGD with momentum whose state holds every kind of value a checkpoint must keep:
    python int/bool/float(inf)/None/tuple, and uint8, bool, int64, bf16 and fp32 tensors."""

    def __init__(self, params, lr=0.1, momentum=0.5, schedule=(1, 2.5, None), limits=None):
        limits = {"low": -math.inf, "high": 2, 3: [True, None]} if limits is None else limits
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "schedule": schedule,
            "limits": limits,
            "tag": "tally",
        }
        super().__init__(params, defaults)
        # torch's load_state_dict casts all state to the param dtype: restore ours after it
        self.register_load_state_dict_post_hook(TallySGD._restore_dtypes)

    _DTYPES = {"mask": torch.uint8, "seen": torch.bool, "hist": torch.int64, "half": torch.bfloat16}

    @staticmethod
    def _restore_dtypes(optimizer: torch.optim.Optimizer) -> None:
        for st in optimizer.state.values():
            for key, dtype in TallySGD._DTYPES.items():
                if key in st:
                    st[key] = st[key].to(dtype)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(
                        count=0,
                        flag=False,
                        last=None,
                        best=math.inf,
                        trace=(0, 0.0),
                        mask=torch.zeros_like(p, dtype=torch.uint8),
                        seen=torch.zeros_like(p, dtype=torch.bool),
                        hist=torch.zeros(1, 1, 3, dtype=torch.int64),
                        half=torch.zeros_like(p, dtype=torch.bfloat16),
                        buf=torch.zeros_like(p),
                    )
                st["count"] += 1
                st["flag"] = not st["flag"]
                st["mask"] += (p.grad > 0).to(torch.uint8)
                st["seen"] |= p.grad < 0
                st["hist"][0, 0, st["count"] % 3] += 1
                st["buf"].mul_(group["momentum"]).add_(p.grad)
                st["half"].copy_(st["buf"])
                st["last"] = st["count"] if st["flag"] else None
                norm = float(p.grad.norm())
                st["best"] = min(st["best"], norm)
                st["trace"] = (st["count"], norm)
                scale = group["lr"] * (1.0 + 0.01 * st["count"]) * (0.5 if st["flag"] else 1.0)
                update = st["buf"] + 1e-3 * st["mask"].float() - 1e-3 * st["seen"].float()
                p.add_(update + 1e-4 * st["half"].float(), alpha=-scale)


OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "Adam": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "Adamax": (torch.optim.Adamax, {"lr": 0.01}),
    "ASGD": (torch.optim.ASGD, {"lr": 0.01, "t0": 1}),
    "NAdam": (torch.optim.NAdam, {"lr": 0.01}),
    "RAdam": (torch.optim.RAdam, {"lr": 0.01}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    "Rprop": (torch.optim.Rprop, {"lr": 0.01}),
    "Tally": (TallySGD, {"lr": 0.05}),
}
#: (scenario, optimizer): every optimizer on a plain model; frozen params; a 2-param model
#: (empty shards at 3 and 4 ranks); a param group added after the first step.
CASES = [("plain", name) for name in OPTIMIZERS] + [
    (scenario, name) for scenario in ("frozen", "tiny", "added") for name in ("Adam", "Tally")
]
LAYOUTS = ("sharded", "consolidated")


def build(scenario: str) -> torch.nn.Module:
    """The model of a scenario, identical for a given scenario."""
    if scenario == "tiny":
        torch.manual_seed(0)
        return torch.nn.Linear(6, 1)
    model = make_model()
    if scenario == "frozen":
        for i in (2, 5):
            list(model.parameters())[i].requires_grad_(False)
    return model


def groups_of(scenario: str, model: torch.nn.Module) -> list[dict[str, Any]]:
    params = list(model.parameters())
    if scenario == "added":
        return [{"params": params[:4]}, {"params": params[4:], "lr": 0.02}]
    return [{"params": params}]


def trained_oss(scenario: str, name: str, group: Any) -> tuple[torch.nn.Module, OSS]:
    """Build a scenario's model and OSS and train it for two steps."""
    cls, kwargs = OPTIMIZERS[name]
    model = build(scenario)
    groups = groups_of(scenario, model)
    if scenario == "added":
        opt = OSS(groups[:1], optim=cls, group=group, **kwargs)
        train(model, opt, 1)
        opt.add_param_group(groups[1])
        train(model, opt, 1, start=1)
    else:
        opt = OSS(groups, optim=cls, group=group, **kwargs)
        train(model, opt, 2)
    return model, opt


# ------------------------------------------------------------------ round trips
def save_all_task(ctx, root):
    problems = {}
    for scenario, name in CASES:
        model, opt = trained_oss(scenario, name, ctx.group)
        expected = opt.state_dict(all_ranks=True)
        for layout in LAYOUTS:
            path = f"{root}/{scenario}-{name}-{layout}"
            save_checkpoint(opt, path, sharded=layout == "sharded")
            problems[path] = diff(read_state_dict(path), expected)
        if ctx.rank == 0:
            state = {k: v.clone() for k, v in model.state_dict().items()}
            save_file(state, f"{root}/{scenario}-{name}-model.safetensors")
    dist.barrier(group=ctx.group)
    return problems


def load_and_continue(ctx, root: str, scenario: str, name: str, layout: str) -> str | None:
    """Load a checkpoint into a fresh OSS and a plain optimizer; continue; compare exactly."""
    cls, kwargs = OPTIMIZERS[name]
    path = f"{root}/{scenario}-{name}-{layout}"
    model = build(scenario)
    model.load_state_dict(load_file(f"{root}/{scenario}-{name}-model.safetensors"))
    ref_model = copy.deepcopy(model)
    other = {**kwargs, "lr": 123.0}  # the checkpoint's hyperparameters must win
    opt = OSS(groups_of(scenario, model), optim=cls, group=ctx.group, **other)
    load_checkpoint(opt, path)
    ref = cls(groups_of(scenario, ref_model), **other)
    ref.load_state_dict(read_state_dict(path))
    problem = diff(opt.state_dict(all_ranks=True), read_state_dict(path), "loaded")
    train(model, opt, 2, start=2)
    train(ref_model, ref, 2, start=2)
    if not params_equal(model, ref_model):
        problem = problem or "params differ from the plain optimizer after continuing"
    return problem


def plan_loads(load_world: int) -> list[tuple[str, int]]:
    """(saved world id, layout index) pairs each case loads at load world ``load_world``.

    A Latin square instead of the full product: as the load world varies, every case is
    loaded from every save world, and at every load world in both layouts.
    """
    return [(WORLD_IDS[(load_world + c) % 5], c % 2) for c in range(len(CASES))]


def load_all_task(ctx, root, load_world):
    problems = {}
    for c, (scenario, name) in enumerate(CASES):
        wid, first = plan_loads(load_world)[c]
        for offset, layout in ((0, LAYOUTS[first]), (2, LAYOUTS[1 - first])):
            saved_at = WORLD_IDS[(WORLD_IDS.index(wid) + offset) % 5]
            problem = load_and_continue(ctx, f"{root}/{saved_at}", scenario, name, layout)
            if problem:
                problems[f"saved {saved_at}: {scenario}-{name}-{layout}"] = problem
    return problems


def test_the_load_plan_covers_every_case_world_pair_and_layout():
    covered = set()
    for m in range(5):
        for c, (wid, first) in enumerate(plan_loads(m)):
            for offset, layout in ((0, first), (2, 1 - first)):
                covered.add((c, m, WORLD_IDS[(WORLD_IDS.index(wid) + offset) % 5], layout))
    for c in range(len(CASES)):
        assert {n for cc, _, n, _ in covered if cc == c} == set(WORLD_IDS)  # every save world
        assert {(m, lay) for cc, m, _, lay in covered if cc == c} == {
            (m, lay) for m in range(5) for lay in (0, 1)
        }  # every load world, both layouts


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory):
    """Every case saved in both layouts at every world size; the save tasks' reports."""
    root = tmp_path_factory.mktemp("saved")
    reports = {}
    for world, wid in zip(WORLDS, WORLD_IDS):
        (root / wid).mkdir()
        reports[wid] = pool.run(save_all_task, str(root / wid), timeout=120, **world)
    return root, reports


def test_read_state_dict_equals_the_consolidated_state_dict_exactly(saved):
    _, reports = saved
    for wid, per_rank in reports.items():
        for rank, problems in enumerate(per_rank):
            bad = {p: d for p, d in problems.items() if d}
            assert not bad, f"saved at {wid}, rank {rank}: {bad}"
        assert len(per_rank[0]) == len(CASES) * len(LAYOUTS)


@pytest.mark.parametrize("world", range(5), ids=WORLD_IDS)
def test_every_optimizer_round_trips_to_any_world_size(pool, saved, world):
    root, _ = saved
    results = pool.run(load_all_task, str(root), world, timeout=240, **WORLDS[world])
    for rank, problems in enumerate(results):
        assert not problems, f"rank {rank}: {problems}"


def adapter_save_task(ctx, root, adapter):
    model = build("plain")
    if adapter == "fairscale":
        from oss_plus.compat.fairscale import OSS as FairscaleOSS

        opt = FairscaleOSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    else:
        from oss_plus.compat.torch import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.Adam, process_group=ctx.group, lr=0.01
        )
    train(model, opt, 2)
    save_checkpoint(opt, f"{root}/plain-Adam-sharded")
    if ctx.rank == 0:
        state = {k: v.clone() for k, v in model.state_dict().items()}
        save_file(state, f"{root}/plain-Adam-model.safetensors")


def adapter_load_task(ctx, root):
    return load_and_continue(ctx, root, "plain", "Adam", "sharded")


@pytest.mark.parametrize("adapter", ["fairscale", "torch"])
def test_checkpoints_of_the_drop_in_adapters_load_into_oss(pool, tmp_path, adapter):
    pytest.importorskip(f"oss_plus.compat.{adapter}")
    pool.run(adapter_save_task, str(tmp_path), adapter, world_size=2)
    assert pool.run(adapter_load_task, str(tmp_path), world_size=3) == [None] * 3


def hyperparameter_types_task(ctx, root):
    model, opt = trained_oss("plain", "Tally", ctx.group)
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    save_checkpoint(opt, root)
    fresh = OSS(build("plain").parameters(), optim=TallySGD, group=ctx.group, lr=1)
    load_checkpoint(fresh, root)
    group = fresh.param_groups[0]
    state = read_state_dict(root)["state"]
    first = state[min(state)]
    return (
        {k: type(v).__name__ for k, v in group.items() if k != "params"},
        group["limits"],
        {k: (type(v).__name__, getattr(v, "dtype", None)) for k, v in first.items()},
    )


def test_hyperparameter_and_state_types_are_restored_exactly(pool, tmp_path):
    kinds, limits, state = pool.run(hyperparameter_types_task, str(tmp_path / "c"))[1]
    assert kinds == {
        "lr": "float",
        "momentum": "float",
        "schedule": "tuple",
        "limits": "dict",
        "tag": "str",
        "betas": "tuple",
    }
    assert limits == {"low": -math.inf, "high": 2, 3: [True, None]}
    assert type(limits["high"]) is int
    assert state == {
        "count": ("int", None),
        "flag": ("bool", None),
        "last": ("NoneType", None),
        "best": ("float", None),
        "trace": ("tuple", None),
        "mask": ("Tensor", torch.uint8),
        "seen": ("Tensor", torch.bool),
        "hist": ("Tensor", torch.int64),
        "half": ("Tensor", torch.bfloat16),
        "buf": ("Tensor", torch.float32),
    }


def adam_step_task(ctx, root):
    model, opt = trained_oss("plain", "Adam", ctx.group)
    save_checkpoint(opt, root, sharded=False)
    fresh = OSS(build("plain").parameters(), optim=torch.optim.Adam, group=ctx.group, lr=1)
    load_checkpoint(fresh, root)
    steps = [s["step"] for s in fresh.optim.state.values()]
    return [(s.dim(), s.dtype, s.device.type, float(s)) for s in steps]


def test_adam_step_stays_a_0_dim_float32_tensor(pool, tmp_path):
    for steps in pool.run(adam_step_task, str(tmp_path / "c"), world_size=3):
        assert steps and set(steps) == {(0, torch.float32, "cpu", 2.0)}


# ------------------------------------------------------------------ what travels and what is read
def traffic_task(ctx, root, sharded, chunk):
    model, opt = trained_oss("plain", "Adam", ctx.group)
    sent: list[tuple[str, torch.dtype, int]] = []
    names = ("send", "recv", "isend", "irecv", "broadcast", "all_gather", "gather", "all_reduce")
    originals = {n: getattr(dist, n) for n in names}

    def spy(name):
        def call(tensor, *args, **kwargs):
            first = tensor if isinstance(tensor, torch.Tensor) else args[0]
            sent.append((name, first.dtype, first.numel() * first.element_size()))
            return originals[name](tensor, *args, **kwargs)

        return call

    old_chunk = storage.CHUNK_BYTES
    try:
        storage.CHUNK_BYTES = chunk
        for name in originals:
            setattr(dist, name, spy(name))
        save_checkpoint(opt, root, sharded=sharded)
    finally:
        storage.CHUNK_BYTES = old_chunk
        for name, fn in originals.items():
            setattr(dist, name, fn)
    state_bytes = sum(
        v.numel() * v.element_size()
        for s in opt.export_local_state().values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    return sent, state_bytes, diff(read_state_dict(root), opt.state_dict(all_ranks=True))


def test_a_sharded_save_moves_no_tensor_between_ranks(pool, tmp_path):
    for sent, _, problem in pool.run(traffic_task, str(tmp_path / "c"), True, 1 << 20):
        assert problem is None
        assert {name for name, _, _ in sent} <= {"all_reduce", "all_gather", "gather", "broadcast"}
        assert all(dtype in (torch.uint8, torch.int32, torch.int64) for _, dtype, _ in sent), sent


def test_a_consolidated_save_streams_in_bounded_chunks(pool, tmp_path):
    chunk = 64  # bytes: every state tensor travels in several chunks
    results = pool.run(traffic_task, str(tmp_path / "c"), False, chunk, world_size=3)
    for rank, (sent, state_bytes, problem) in enumerate(results):
        assert problem is None
        moved = [n for name, _, n in sent if name in ("send", "recv", "isend", "irecv")]
        assert max(moved) <= chunk
        if rank > 0:  # each sender sent exactly its own state, nothing else
            assert sum(n for name, _, n in sent if name in ("send", "isend")) == state_bytes > 0


def reads_task(ctx, root):
    fresh = OSS(build("plain").parameters(), optim=torch.optim.Adam, group=ctx.group, lr=1)
    names: list[str] = []
    original = assemble._read_tensor

    def spy(handle, file, ref):
        names.append(ref.name)
        return original(handle, file, ref)

    assemble._read_tensor = spy
    try:
        load_checkpoint(fresh, root)
    finally:
        assemble._read_tensor = original
    return names, fresh.plan.owned(fresh.rank)


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "consolidated"])
def test_load_reads_only_the_tensors_this_rank_owns(pool, tmp_path, sharded):
    pool.run(save_task, str(tmp_path / "c"), sharded=sharded, world_size=2)
    everything = []
    for names, owned in pool.run(reads_task, str(tmp_path / "c"), world_size=3):
        assert {int(name.split(".")[1]) for name in names} == set(owned)
        everything += names
    assert len(everything) == len(set(everything)) == 8 * 4  # each tensor read once, by its owner


# ------------------------------------------------------------------ replacing a checkpoint
def repeated_saves_task(ctx, root, layouts):
    _, opt = trained_oss("plain", "Adam", ctx.group)
    listings = []
    for sharded in layouts:
        save_checkpoint(opt, root, sharded=sharded)
        listings.append(sorted(os.listdir(root)))  # no barrier: complete when save returns
    return listings


def test_every_save_leaves_exactly_its_own_files(pool, tmp_path):
    root = str(tmp_path / "c")
    pool.run(repeated_saves_task, root, [True, False, True], world_size=2)
    for world in (3, 4):
        for listings in pool.run(
            repeated_saves_task, root, [True, True, False, True], world_size=world
        ):
            counts = [
                (len(files), sum(f.startswith("shard-") for f in files)) for files in listings
            ]
            assert counts == [(world + 1, world), (world + 1, world), (2, 0), (world + 1, world)]
            assert all(files[0] == "index.json" for files in listings)


def rank0_only_task(ctx, root):
    _, opt = trained_oss("plain", "Adam", ctx.group)
    path = root if ctx.rank == 0 else "/proc/no-such-dir/ckpt"  # e.g. a disk of rank 0's node
    save_checkpoint(opt, path, sharded=False)
    save_checkpoint(opt, path, sharded=False)
    expected = opt.state_dict(all_ranks=True)
    return diff(read_state_dict(root), expected) if ctx.rank == 0 else None


def test_a_consolidated_save_touches_the_filesystem_on_rank_0_only(pool, tmp_path):
    assert pool.run(rank0_only_task, str(tmp_path / "c"), world_size=3) == [None] * 3
    assert len(os.listdir(tmp_path / "c")) == 2


# ------------------------------------------------------------------ atomicity
def inject(point: str):
    """Return (module, attribute, replacement) that makes ``point`` fail."""

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def failing_bytes(*args, **kwargs):
        raise OSError(errno.EIO, "I/O error while reading state (injected)")

    return {
        "open_writer": (storage, "open_writer", disk_full),
        "byte_view": (storage, "byte_view", failing_bytes),
        "commit": (storage, "commit", disk_full),
    }[point]


def failing_save_task(ctx, root, sharded, point, fail_rank):
    model, opt = trained_oss("plain", "Adam", ctx.group)
    save_checkpoint(opt, root, sharded=sharded)
    before = read_state_dict(root)
    train(model, opt, 1, start=2)
    module, attribute, replacement = inject(point)
    original = getattr(module, attribute)
    if ctx.rank == fail_rank:
        setattr(module, attribute, replacement)
    try:
        outcome = catch(save_checkpoint, opt, root, sharded=sharded)
    finally:
        setattr(module, attribute, original)
    dist.barrier(group=ctx.group)
    fresh = OSS(build("plain").parameters(), optim=torch.optim.Adam, group=ctx.group, lr=1)
    loaded = catch(load_checkpoint, fresh, root)
    siblings = sorted(p.name for p in Path(root).parent.iterdir() if p.name != Path(root).name)
    return outcome, diff(read_state_dict(root), before), loaded, siblings


FAILURES = [  # (layout, failure point, failing rank)
    ("sharded", "open_writer", 1),
    ("sharded", "byte_view", 1),
    ("sharded", "commit", 0),
    ("consolidated", "open_writer", 0),
    ("consolidated", "byte_view", 1),
    ("consolidated", "byte_view", 0),
    ("consolidated", "commit", 0),
]


@pytest.mark.parametrize(
    ("layout", "point", "fail_rank"), FAILURES, ids=[f"{a}-{b}-rank{c}" for a, b, c in FAILURES]
)
def test_a_save_failing_on_one_rank_raises_everywhere_and_keeps_the_old_checkpoint(
    pool, tmp_path, layout, point, fail_rank
):
    root = tmp_path / "ckpt"
    results = pool.run(failing_save_task, str(root), layout == "sharded", point, fail_rank)
    for rank, (outcome, problem, loaded, siblings) in enumerate(results):
        assert outcome[0] == "OSError", (rank, outcome)
        assert "(injected)" in outcome[1]
        if rank != fail_rank:
            assert f"global rank {fail_rank} raised OSError" in outcome[1]
        assert problem is None  # the previous checkpoint is intact...
        assert loaded == ("ok", None)  # ...and loadable
        assert siblings == []  # no temporary sibling left behind


def bad_state_task(ctx, root):
    model, opt = trained_oss("plain", "SGD", ctx.group)
    if ctx.rank == 1:
        param = next(iter(opt.optim.state))
        opt.optim.state[param]["bad"] = {1, print}  # a function in a set: JSON cannot store it
    outcome = catch(save_checkpoint, opt, root)
    return outcome, os.path.exists(root), sorted(os.listdir(Path(root).parent))


def test_unstorable_state_on_one_rank_fails_every_rank_before_writing(pool, tmp_path):
    for outcome, exists, listing in pool.run(bad_state_task, str(tmp_path / "c")):
        assert outcome[0] == "TypeError" and "key 'bad' item" in outcome[1], outcome
        assert "builtin_function_or_method" in outcome[1], outcome
        assert not exists and listing == []


# ------------------------------------------------------------------ bad files on every rank
def save_task(ctx, root, scenario="plain", name="Adam", sharded=True):
    _, opt = trained_oss(scenario, name, ctx.group)
    save_checkpoint(opt, root, sharded=sharded)


def load_each_task(ctx, paths, width=6, depth=3, dtype=torch.float32, name="Adam"):
    results = {}
    for path in paths:
        model = make_model(width=width, depth=depth).to(dtype)
        opt = OSS(model.parameters(), optim=OPTIMIZERS[name][0], group=ctx.group, lr=1)
        results[path] = catch(load_checkpoint, opt, path)
    return results


def corrupt(root: Path, how: str) -> str:
    """Damage a copy of a 2-rank sharded checkpoint; return the name the error must contain."""
    shard = next(p for p in sorted(root.iterdir()) if p.name.startswith("shard-00001"))
    data = bytearray(shard.read_bytes())
    if how == "truncated":
        shard.write_bytes(data[:-7])
    elif how == "flipped byte":
        data[-3] ^= 0xFF
        shard.write_bytes(data)
    elif how == "damaged header":
        data[8:16] = b"garbage!"
        shard.write_bytes(data)
    elif how == "missing shard":
        shard.unlink()
    elif how == "other version":
        index = root / "index.json"
        index.write_text(index.read_text().replace('"format_version": 5', '"format_version": 7'))
        reseal(index)  # the version check, behind the checksum
        return "index.json"
    return shard.name


BAD_FILES = {
    "truncated": ("ValueError", "truncated"),
    "flipped byte": ("ValueError", "checksum"),
    "damaged header": ("ValueError", "truncated or corrupted"),
    "missing shard": ("FileNotFoundError", "missing"),
    "other version": ("ValueError", "format version 7"),
}


def test_bad_files_raise_a_clear_error_on_every_rank(pool, tmp_path):
    pool.run(save_task, str(tmp_path / "good"))
    paths, names = [], {}
    for how in BAD_FILES:
        target = tmp_path / how.replace(" ", "_")
        shutil.copytree(tmp_path / "good", target)
        names[str(target)] = corrupt(target, how)
        paths.append(str(target))
    for rank, results in enumerate(pool.run(load_each_task, paths, timeout=60)):
        for path, how in zip(paths, BAD_FILES):
            kind, text = results[path]
            assert kind == BAD_FILES[how][0], (rank, how, results[path])
            assert BAD_FILES[how][1] in text and names[path] in text, (rank, how, text)


DIFFERENT_MODELS = {
    "wider": ({"width": 7}, "shape"),
    "deeper": ({"depth": 4}, "params"),
    "double": ({"dtype": torch.float64}, "dtype"),
}


def test_a_checkpoint_of_a_different_model_raises_on_every_rank(pool, tmp_path):
    pool.run(save_task, str(tmp_path / "c"), sharded=False)
    for what, (kwargs, word) in DIFFERENT_MODELS.items():
        for results in pool.run(load_each_task, [str(tmp_path / "c")], world_size=3, **kwargs):
            kind, text = results[str(tmp_path / "c")]
            assert kind == "ValueError" and word in text and "index.json" in text, (what, text)
            assert "different model" in text or "same model" in text


# ------------------------------------------------------------------ no pickle on the load path
def no_pickle_task(ctx, root):
    import pickle

    names = ("loads", "load", "Unpickler")
    originals = {n: getattr(pickle, n) for n in names}
    objects = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
    dist_originals = {n: getattr(dist, n) for n in objects}
    c10d = dist.distributed_c10d
    tensor_to_object = c10d._tensor_to_object

    def forbidden(*args, **kwargs):
        raise AssertionError("the checkpoint load path unpickled something")

    save_task(ctx, root)
    fresh = OSS(build("plain").parameters(), optim=torch.optim.Adam, group=ctx.group, lr=1)
    try:
        for n in names:
            setattr(pickle, n, forbidden)
        for n in objects:
            setattr(dist, n, forbidden)
        c10d._tensor_to_object = forbidden
        load_checkpoint(fresh, root)
        state = read_state_dict(root)
    finally:
        for n, fn in originals.items():
            setattr(pickle, n, fn)
        for n, fn in dist_originals.items():
            setattr(dist, n, fn)
        c10d._tensor_to_object = tensor_to_object
    return len(state["state"])


def test_the_load_path_unpickles_nothing(pool, tmp_path):
    assert pool.run(no_pickle_task, str(tmp_path / "c")) == [8, 8]
