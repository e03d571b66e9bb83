"""Checkpoints of optimizers whose flat partition rule cuts params into pieces (format v3):
every rank writes its own pieces, loads work at any world size and across partition rules
(flat <-> fairscale / torch), compared exactly with an unsharded torch optimizer."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import (
    WORLD_IDS,
    WORLDS,
    catch,
    clone_model,
    groups_of,
    make_cut_model,
    make_model,
    params_equal,
    reseal,
)
from helpers import backward as backward_of
from safetensors.torch import load_file, save_file
from test_checkpoint import diff

from oss_plus import OSS, load_checkpoint, save_checkpoint
from oss_plus.checkpoint import assemble, read_state_dict
from oss_plus.checkpoint.entries import PiecesValue, TensorRef, check_pieces
from oss_plus.checkpoint.format import Index, shard_file
from oss_plus.checkpoint.plan import merge_entries, split_state, tensor_slots
from oss_plus.cli import main

#: The optimizer of every scenario: AdamW keeps a 0-dim ``step`` and two per-element tensors.
LR = 0.01
RULES = ("flat", "fairscale", "torch")


def model_and_ref():
    model = make_model(depth=4)
    return model, clone_model(model)


def oss_of(model, ctx, rule, lr=LR):
    return OSS(
        groups_of(model, True), optim=torch.optim.AdamW, group=ctx.group, partition_rule=rule, lr=lr
    )


def train_pair(model, opt, ref_model, ref, steps, start=0):
    """Train OSS and the unsharded reference on the same batches; whether params stay equal."""
    exact = []
    for step in range(start, start + steps):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            backward_of(m, step)
            o.step()
        exact.append(params_equal(model, ref_model))
    return exact


# ------------------------------------------------------------------ pure: the v3 entry
def test_split_state_cuts_piece_tensors_and_keeps_the_step_on_the_first_piece_only():
    step, m = torch.tensor(2.0), torch.arange(4.0)
    states = {3: {"step": step, "exp_avg": m}, 5: {"step": step, "exp_avg": torch.ones(6)}}
    lead = split_state(states, {3: (0, 4, (2, 5))})
    other = split_state({3: {"step": step, "exp_avg": torch.arange(6.0)}}, {3: (4, 10, (2, 5))})
    assert list(lead[3]) == ["step", "exp_avg"] and lead[3]["step"] is step
    assert lead[3]["exp_avg"] == PiecesValue((2, 5), ((0, 4, m),))
    assert list(other[3]) == ["exp_avg"]  # the step is stored once
    assert lead[5]["exp_avg"].shape == (6,)  # a whole param stays a plain tensor
    merged = merge_entries([other, lead])  # any rank order
    assert list(merged[3]) == ["step", "exp_avg"]
    assert [(a, b) for a, b, _ in merged[3]["exp_avg"].parts] == [(0, 4), (4, 10)]
    names = [name for _, name, _ in tensor_slots(merged)]
    assert "state.3.exp_avg@0" in names and "state.3.exp_avg@4" in names


def _ref(start, end, dtype="F32"):
    return TensorRef("f", f"state.0.m@{start}", dtype, (end - start,), 0)


@pytest.mark.parametrize(
    ("parts", "words"),
    [
        ([(0, 4), (5, 10)], "element 4 was expected"),  # a gap: a missing piece
        ([(0, 4), (4, 8)], "end at element 8"),  # short
        ([(4, 10)], "element 0 was expected"),
        ([(0, 4), (2, 10)], "element 4 was expected"),  # overlap
    ],
)
def test_pieces_that_do_not_cover_the_tensor_are_refused(parts, words):
    value = PiecesValue((2, 5), tuple((a, b, _ref(a, b)) for a, b in parts))
    with pytest.raises(ValueError, match="do not make the tensor") as info:
        check_pieces(value, "index.json: state 0 key 'm'")
    assert words in str(info.value) and "index.json" in str(info.value)
    good = PiecesValue((2, 5), ((0, 4, _ref(0, 4)), (4, 10, _ref(4, 10))))
    check_pieces(good, "ok")
    bad_dtype = PiecesValue((2, 5), ((0, 4, _ref(0, 4)), (4, 10, _ref(4, 10, "F16"))))
    with pytest.raises(ValueError, match="F16"):
        check_pieces(bad_dtype, "x")


def test_pieces_need_version_3_and_round_trip_through_json():
    files = {"f": {"rank": 0, "bytes": 0}}
    groups = [{"lr": 0.1, "params": [0]}]
    plain = Index("sharded", "0" * 16, groups, files, {0: {"m": _ref(0, 10)}})
    assert plain.content_version == 1 and plain.to_json()["format_version"] == 5
    pieces = PiecesValue((2, 5), ((0, 4, _ref(0, 4)), (4, 10, _ref(4, 10))))
    index = Index("sharded", "0" * 16, groups, files, {0: {"m": pieces}})
    data = json.loads(index.dumps())
    assert index.content_version == 3 and data["format_version"] == 5
    assert data["state"]["0"]["m"]["shape"] == [2, 5]
    assert [p["start"] for p in data["state"]["0"]["m"]["pieces"]] == [0, 4]
    assert Index.from_json(data, "index.json").state == index.state
    del data["state"]["0"]["m"]["pieces"][1]  # a missing piece
    with pytest.raises(ValueError, match="do not make the tensor"):
        Index.from_json(data, "index.json")
    data = json.loads(index.dumps())
    data["format_version"] = 2  # pieces need version 3
    with pytest.raises(ValueError, match="version-2"):
        Index.from_json(data, "index.json")


# ------------------------------------------------------------------ saving pieces
def save_task(ctx, root, rule="flat", blocking=True):
    """Train OSS (``rule``) and the unsharded AdamW 2 steps; save in both layouts."""
    model, ref_model = model_and_ref()
    opt = oss_of(model, ctx, rule)
    ref = torch.optim.AdamW(groups_of(ref_model, True), lr=LR)
    exact = train_pair(model, opt, ref_model, ref, 2)
    problems = {}
    for n, layout in enumerate(("sharded", "consolidated")):
        expected = copy.deepcopy(ref.state_dict())
        everywhere = copy.deepcopy(opt.state_dict(all_ranks=True))  # torch's aliases live state
        path = f"{root}/{rule}-{layout}"
        result = save_checkpoint(opt, path, sharded=layout == "sharded", blocking=blocking)
        if not blocking:  # training goes on while the save is written
            exact += train_pair(model, opt, ref_model, ref, 1, start=2 + n)
            assert result.result(timeout=60) == path
        problems[layout] = (
            diff(read_state_dict(path), expected),
            diff(read_state_dict(path), everywhere),
        )
    if ctx.rank == 0:
        save_file(
            {k: v.clone() for k, v in model.state_dict().items()}, f"{root}/model.safetensors"
        )
    pieces = [
        (p.index, p.start, p.end, p.owner) for p in opt.plan.pieces if p.index in opt.plan.split
    ]
    dist.barrier(group=ctx.group)
    return {"exact": exact, "problems": problems, "pieces": pieces, "world": opt.world_size}


def _pieces_in(path):
    index = json.loads((Path(path) / "index.json").read_text())
    return index, {
        (int(i), k): [
            (p["start"], p["end"], p["tensor"]["file"], p["tensor"]["name"]) for p in e["pieces"]
        ]
        for i, entries in index["state"].items()
        for k, e in entries.items()
        if "pieces" in e
    }


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory):
    """A flat AdamW checkpoint at every world size, and fairscale / torch ones at 2 and 3."""
    root = tmp_path_factory.mktemp("pieces")
    reports = {}
    for world, wid in zip(WORLDS, WORLD_IDS):
        (root / wid).mkdir()
        reports[wid] = pool.run(save_task, str(root / wid), **world)
    for rule, world in (("fairscale", 2), ("torch", 3)):
        (root / f"{rule}{world}").mkdir()
        reports[f"{rule}{world}"] = pool.run(
            save_task, str(root / f"{rule}{world}"), rule, world_size=world
        )
    return root, reports


@pytest.mark.parametrize("wid", WORLD_IDS)
def test_every_rank_writes_its_own_pieces_and_read_state_dict_is_the_unsharded_state(saved, wid):
    root, reports = saved
    results = reports[wid]
    for rank, r in enumerate(results):
        assert all(r["exact"]), f"rank {rank}: flat training diverged from torch"
        for layout, (vs_ref, vs_state_dict) in r["problems"].items():
            assert vs_ref is None, f"{layout}: read_state_dict differs from torch's: {vs_ref}"
            assert vs_state_dict is None, f"{layout}: differs from state_dict: {vs_state_dict}"
    world, pieces = results[0]["world"], results[0]["pieces"]
    index, stored = _pieces_in(root / wid / "flat-sharded")
    if world == 1:
        assert index["format_version"] == 5 and not stored and not pieces
        return
    assert pieces and index["format_version"] == 5 and index["partition_rule"] == "flat"
    split = {i for i, _, _, _ in pieces}
    assert {i for i, _ in stored} == split and {k for _, k in stored} == {"exp_avg", "exp_avg_sq"}
    for (i, key), parts in stored.items():  # each piece in the shard of the rank that owns it
        expected = [(a, b, owner) for j, a, b, owner in pieces if j == i]
        assert [(a, b) for a, b, _, _ in parts] == [(a, b) for a, b, _ in expected]
        for (a, _, file, name), (_, _, owner) in zip(parts, expected):
            assert file.startswith(shard_file(owner, world, "x")[: -len("x.safetensors")])
            assert name == f"state.{i}.{key}@{a}"
        step = index["state"][str(i)]["step"]["tensor"]  # stored once, by the first piece's rank
        assert step["file"] == parts[0][2]
    _, consolidated = _pieces_in(root / wid / "flat-consolidated")
    assert {k: [(a, b) for a, b, _, _ in v] for k, v in consolidated.items()} == {
        k: [(a, b) for a, b, _, _ in v] for k, v in stored.items()
    }
    # exactly one tensor per stored piece and step, nothing gathered into one rank's file
    for file in (root / wid / "flat-sharded").glob("shard-*"):
        rank = int(file.name[6:11])
        names = set(load_file(str(file)))
        mine = {
            f"state.{i}.{k}@{a}"
            for (i, k), ps in stored.items()
            for a, _, f, _ in ps
            if f == file.name
        }
        assert {n for n in names if "@" in n} == mine
        owned = {j for j, _, _, owner in pieces if owner == rank}
        assert {int(n.split(".")[1]) for n in names if "@" in n} == owned


def traffic_task(ctx, root):
    """A flat sharded save with every collective spied on: what travelled between ranks."""
    model, ref_model = model_and_ref()
    opt = oss_of(model, ctx, "flat")
    train_pair(model, opt, ref_model, torch.optim.AdamW(groups_of(ref_model, True), lr=LR), 2)
    names = ("send", "recv", "isend", "irecv", "broadcast", "all_gather", "gather", "all_reduce")
    originals = {n: getattr(dist, n) for n in names}
    sent = []

    def spy(name):
        def call(tensor, *args, **kwargs):
            first = tensor if isinstance(tensor, torch.Tensor) else args[0]
            sent.append((name, first.dtype))
            return originals[name](tensor, *args, **kwargs)

        return call

    try:
        for name in originals:
            setattr(dist, name, spy(name))
        save_checkpoint(opt, root)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return sent, len(opt.plan.split), diff(read_state_dict(root), opt.state_dict(all_ranks=True))


def test_a_sharded_save_of_pieces_moves_no_tensor_between_ranks(pool, tmp_path):
    for sent, split, problem in pool.run(traffic_task, str(tmp_path / "c"), world_size=3):
        assert split > 0 and problem is None
        assert {name for name, _ in sent} <= {"all_reduce", "all_gather", "gather", "broadcast"}
        assert all(dtype in (torch.uint8, torch.int32, torch.int64) for _, dtype in sent), sent


# ------------------------------------------------------------------ loading anywhere
def load_and_continue(ctx, path, model_file, rule, partial=False):
    """Load ``path`` into OSS(``rule``) and into a plain AdamW that loaded read_state_dict;
    continue both; return the first problem (None: identical)."""
    model = make_model(depth=4)
    model.load_state_dict(load_file(model_file))
    ref_model = clone_model(model)
    opt = oss_of(model, ctx, rule, lr=123.0)  # the checkpoint's hyperparameters must win
    original = assemble.PARTIAL_READ_BYTES
    assemble.PARTIAL_READ_BYTES = 0 if partial else original
    try:
        load_checkpoint(opt, path)
    finally:
        assemble.PARTIAL_READ_BYTES = original
    ref = torch.optim.AdamW(groups_of(ref_model, True), lr=123.0)
    saved = read_state_dict(path)
    ref.load_state_dict(saved)
    problem = diff(opt.state_dict(all_ranks=True), saved, "loaded")
    exact = train_pair(model, opt, ref_model, ref, 2, start=5)
    return problem or (None if all(exact) else f"params differ from torch after loading: {exact}")


def loads_of(load):
    """What load world ``load`` loads: (saved world, file, rule loaded into)."""
    other, third = WORLD_IDS[(load + 1) % 5], WORLD_IDS[(load + 3) % 5]
    cases = [(other, "flat-sharded", rule) for rule in RULES]
    cases += [(third, "flat-consolidated", rule) for rule in RULES]
    cases += [("fairscale2", "fairscale-sharded", "flat"), ("torch3", "torch-consolidated", "flat")]
    return cases


def load_all_task(ctx, root, load, partial=False):
    problems = {}
    for wid, name, rule in loads_of(load):
        problem = load_and_continue(
            ctx, f"{root}/{wid}/{name}", f"{root}/{wid}/model.safetensors", rule, partial
        )
        if problem:
            problems[f"{wid}/{name} into {rule}"] = problem
    return problems


@pytest.mark.parametrize("load", range(5), ids=WORLD_IDS)
def test_loads_at_any_world_size_across_rules_continue_like_torch(pool, saved, load):
    root, _ = saved
    for rank, problems in enumerate(
        pool.run(load_all_task, str(root), load, timeout=120, **WORLDS[load])
    ):
        assert not problems, f"rank {rank}: {problems}"


CASES_PARTIAL = (("ws2", "flat-sharded"), ("fairscale2", "fairscale-sharded"))


def partial_task(ctx, root):
    """Load with partial reads forced: the loads continue like torch; what each load read."""
    ranges, full = [], []
    original_range, original_tensor = assemble._read_range, assemble._read_tensor

    def spy_range(handle, file, ref, lo, hi):
        ranges.append((ref.name, lo, hi))
        return original_range(handle, file, ref, lo, hi)

    def spy_tensor(handle, file, ref):
        full.append(ref.name)
        return original_tensor(handle, file, ref)

    opt = oss_of(make_model(depth=4), ctx, "flat")
    assemble._read_range, assemble._read_tensor = spy_range, spy_tensor
    assemble.PARTIAL_READ_BYTES = 0
    try:
        for wid, name in CASES_PARTIAL:
            load_checkpoint(opt, f"{root}/{wid}/{name}")
    finally:
        assemble._read_range, assemble._read_tensor = original_range, original_tensor
        assemble.PARTIAL_READ_BYTES = 16 << 20
    problems = {
        name: load_and_continue(
            ctx, f"{root}/{wid}/{name}", f"{root}/{wid}/model.safetensors", "flat", True
        )
        for wid, name in CASES_PARTIAL
    }
    held = sum(p.numel for p in opt.plan.pieces if p.owner == ctx.rank)
    return problems, ranges, full, held


def test_a_rank_reads_only_the_elements_of_its_pieces_when_partial_reads_are_on(pool, saved):
    root, _ = saved
    for problems, ranges, full, held in pool.run(partial_task, str(root), world_size=3):
        assert problems == {"flat-sharded": None, "fairscale-sharded": None}
        moments = [hi - lo for name, lo, hi in ranges if ".exp_avg" in name]
        assert sum(moments) == 2 * 2 * held  # 2 keys, 2 checkpoints: exactly this rank's elements
        partial = {name for name, lo, hi in ranges if name not in full}
        assert partial, "no stored tensor was read in part"


# ------------------------------------------------------------------ asynchronous saves
def test_an_asynchronous_save_of_pieces_holds_the_state_at_the_call(pool, tmp_path):
    for world in (WORLDS[1], WORLDS[2]):  # 3 ranks after 2: the order that once hung
        root = tmp_path / str(world)
        root.mkdir()
        for rank, r in enumerate(pool.run(save_task, str(root), "flat", False, **world)):
            assert all(r["exact"]), rank
            for layout, problems in r["problems"].items():
                assert problems == (None, None), (rank, layout, problems)
        index, stored = _pieces_in(root / "flat-sharded")
        assert index["format_version"] == 5 and stored


# ------------------------------------------------------------------ bad pieces
def load_each_task(ctx, paths):
    out = {}
    for path in paths:
        opt = oss_of(make_model(depth=4), ctx, "flat", lr=1.0)
        out[path] = catch(load_checkpoint, opt, path)
    return out


def _damage(root: Path, how: str) -> None:
    index_file = root / "index.json"
    index = json.loads(index_file.read_text())
    key = next((i, k) for i, e in index["state"].items() for k, v in e.items() if "pieces" in v)
    entry = index["state"][key[0]][key[1]]
    if how == "corrupted piece":
        piece = entry["pieces"][-1]["tensor"]
        file = root / piece["file"]
        header = json.loads(
            file.read_bytes()[8 : 8 + int.from_bytes(file.read_bytes()[:8], "little")]
        )
        start = (
            8
            + int.from_bytes(file.read_bytes()[:8], "little")
            + header[piece["name"]]["data_offsets"][0]
        )
        data = bytearray(file.read_bytes())
        data[start] ^= 0xFF
        file.write_bytes(data)
        return
    if how == "missing piece":
        del entry["pieces"][-1]
    elif how == "pieces not covering":
        entry["pieces"][0]["end"] -= 1
    index_file.write_text(json.dumps(index))
    reseal(index_file)  # what the validation behind the checksum refuses


BAD = {
    "corrupted piece": "checksum",
    "missing piece": "do not make the tensor",
    "pieces not covering": "do not make the tensor",
}


def test_bad_pieces_raise_a_clear_value_error_on_every_rank(pool, saved, tmp_path):
    root, _ = saved
    paths = []
    for how in BAD:
        target = tmp_path / how.replace(" ", "_")
        shutil.copytree(root / "ws2" / "flat-sharded", target)
        _damage(target, how)
        paths.append(str(target))
        with pytest.raises(ValueError, match=BAD[how]):
            read_state_dict(target)
    for rank, results in enumerate(pool.run(load_each_task, paths, world_size=2)):
        for path, how in zip(paths, BAD):
            kind, text = results[path]
            assert kind == "ValueError" and BAD[how] in text, (rank, how, text)


# ------------------------------------------------------------------ the CLI
def test_inspect_shows_the_stitched_shapes_and_the_pieces(saved, capsys):
    root, _ = saved
    assert main(["ckpt", "inspect", "--verify", str(root / "ws3" / "flat-sharded")]) == 0
    out = capsys.readouterr().out
    assert "format v5" in out and "partition rule flat" in out
    assert "checksum:   index.json crc32 " in out
    assert "pieces" in out and "verified:" in out
    index, stored = _pieces_in(root / "ws3" / "flat-sharded")
    (i, key), parts = next(iter(stored.items()))
    shape = "x".join(map(str, index["params"][i]["shape"]))
    assert f"{key}:F32[{shape}]/{len(parts)}pieces" in out


# ------------------------------------------------------------------ ranges with slots
def cut_oss_of(model, ctx, lr):
    """A flat AdamW over one group (flat order as in the model: a param is cut)."""
    return OSS(
        model.parameters(), optim=torch.optim.AdamW, group=ctx.group, partition_rule="flat", lr=lr
    )


def cut_save_task(ctx, root):
    """Train a flat OSS whose ranges carry slots (a cut param keeps a copy of its own) and
    AdamW 2 steps; save sharded, and the model."""
    model = make_cut_model()
    ref_model = clone_model(model)
    opt = cut_oss_of(model, ctx, LR)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR)
    exact = train_pair(model, opt, ref_model, ref, 2)
    save_checkpoint(opt, f"{root}/flat-sharded", sharded=True)
    if ctx.rank == 0:
        save_file(
            {k: v.clone() for k, v in model.state_dict().items()}, f"{root}/model.safetensors"
        )
    dist.barrier(group=ctx.group)
    return exact, opt.sync.status.vector is None, len(opt.plan.split)


def cut_load_task(ctx, root):
    """A fresh flat OSS (ranges with slots) on a fresh model: the model's weights are loaded
    in place after the optimizer was built (cut params included), then the checkpoint;
    both continue like AdamW that loaded the same."""
    model = make_cut_model(seed=1)
    opt = cut_oss_of(model, ctx, 123.0)
    model.load_state_dict(load_file(f"{root}/model.safetensors"))
    load_checkpoint(opt, f"{root}/flat-sharded")
    ref_model = make_cut_model(seed=1)
    ref_model.load_state_dict(load_file(f"{root}/model.safetensors"))
    ref = torch.optim.AdamW(ref_model.parameters(), lr=123.0)
    ref.load_state_dict(read_state_dict(f"{root}/flat-sharded"))
    exact = train_pair(model, opt, ref_model, ref, 2, start=5)
    return exact, opt.sync.status.vector is None, len(opt.plan.split)


def test_ranges_with_slots_save_and_load_at_another_world_size_like_torch(pool, tmp_path):
    """Saved from 3 ranks, loaded into 2, the flat rule's ranges carrying slots both times."""
    for exact, slotted, split in pool.run(cut_save_task, str(tmp_path), world_size=3):
        assert all(exact) and slotted and split >= 1
    for exact, slotted, split in pool.run(cut_load_task, str(tmp_path), world_size=2):
        assert all(exact) and slotted and split >= 1
