"""A seeded fuzz of damaged and mismatched checkpoints: a clear error on every rank, or exact.

A small sharded checkpoint (2 ranks, an Embedding and an MLP in two param groups,
``OSS(AdamW)``, 3 steps) is mutated in every way issue 50 lists: bit flips in every file,
truncations, deleted, swapped, zero-filled and extra files, edits of the index's fields
(each written twice: as it is, which the index checksum must refuse, and with the
checksum recomputed, which the validation behind it must refuse), edits of the
safetensors headers, and checkpoints of another model and of other optimizers; a few
mutations of a consolidated save too. Each copy is loaded into a fresh ``OSS`` built with
other hyperparameters and stepped twice, at 2 ranks and (a seeded subset) at 1 and 3.

Every outcome must be an error raised by ``load_checkpoint`` on every rank, naming the
checkpoint, or an exact load: the state and params after the two steps equal those of
the plain unsharded ``AdamW`` that continued the saved run (an independent reference).
The loads of one world size run as one task of the shared worker pool.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from helpers import reseal
from test_checkpoint import diff

from oss_plus import OSS, load_checkpoint, save_checkpoint

SEED = 50
#: Loads at 1 and 3 ranks (a seeded sample of the mutations).
SUBSET = 16
SAVED = dict(lr=0.01, weight_decay=0.05)
#: The loading optimizer's own hyperparameters: a load that silently keeps one is wrong.
OTHER = dict(lr=0.5, weight_decay=0.3, betas=(0.5, 0.6), eps=1e-6)
#: Error types a clear refusal may have (a bare KeyError or AttributeError is not one).
CLEAR = {"ValueError", "FileNotFoundError", "NotADirectoryError", "RemoteRankError"}


class Net(torch.nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2)
        )

    def forward(self, step: int) -> torch.Tensor:
        idx = torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(step))
        return self.mlp(self.emb(idx)).pow(2).mean()


def groups(model: Net, lr: float) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [{"params": params[:3]}, {"params": params[3:], "lr": lr}]


def run(model: Net, opt: Any, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        model(step).backward()
        opt.step()


def save_task(ctx, root: str) -> None:
    """Save the good checkpoint (both layouts) and those of another model and optimizers."""
    cases = {
        "good": (8, torch.optim.AdamW, SAVED),
        "adam": (8, torch.optim.Adam, SAVED),
        "sgd": (8, torch.optim.SGD, dict(lr=0.01, momentum=0.9)),
        "wider": (9, torch.optim.AdamW, SAVED),
    }
    for name, (hidden, cls, kwargs) in cases.items():
        model = Net(hidden)
        opt = OSS(groups(model, 0.02), optim=cls, group=ctx.group, **kwargs)
        run(model, opt, range(3))
        save_checkpoint(opt, f"{root}/{name}")
        if name == "good":
            save_checkpoint(opt, f"{root}/consolidated", sharded=False)


def load_each_task(
    ctx, paths: list[str], extras: dict[str, dict[int, dict[str, Any]]]
) -> dict[str, tuple[str, str]]:
    """Load every path into a fresh OSS(AdamW) with other hyperparameters; step twice.

    Returns, per path: ("ok", difference from the plain AdamW reference or ""), or
    (error type, message) raised by the load, or ("step " + type, message) when the load
    passed and a step failed. ``extras``: per path, per group, keys an exact load adds to
    the reference's groups (an unknown key kept, as torch's ``load_state_dict`` keeps it).
    """
    ref_model = Net()
    ref = torch.optim.AdamW(groups(ref_model, 0.02), **SAVED)
    run(ref_model, ref, range(3))
    saved_params = [p.detach().clone() for p in ref_model.parameters()]
    run(ref_model, ref, range(3, 5))
    outcomes = {}
    for path in paths:
        model = Net()
        with torch.no_grad():
            for p, value in zip(model.parameters(), saved_params):
                p.copy_(value)
        opt = OSS(groups(model, 0.7), optim=torch.optim.AdamW, group=ctx.group, **OTHER)
        try:
            load_checkpoint(opt, path)
        except Exception as exc:  # noqa: BLE001 - the outcome is the data
            outcomes[path] = (type(exc).__name__, str(exc))
            continue
        try:
            run(model, opt, range(3, 5))
            opt.settle()
        except Exception as exc:  # noqa: BLE001
            outcomes[path] = (f"step {type(exc).__name__}", str(exc))
            continue
        expected = ref.state_dict()
        for g, keys in extras.get(path, {}).items():
            expected["param_groups"][int(g)].update(keys)
        pairs = zip(model.parameters(), ref_model.parameters())
        wrong = [i for i, (p, q) in enumerate(pairs) if not torch.equal(p, q)]
        problem = diff(opt.state_dict(all_ranks=True), expected) or (
            f"params {wrong} differ" if wrong else ""
        )
        outcomes[path] = ("ok", problem)
    return outcomes


# ------------------------------------------------------------------ the mutations
#: An index edit: (name, function editing the parsed index in place, reseal: what an exact
#: load adds to the reference's groups, or None when the resealed edit must be refused).
JsonEdit = tuple[str, Any, Any]


def _rename(mapping: dict[str, Any], old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


def _ref(data: dict[str, Any], i: str, key: str) -> dict[str, Any]:
    return data["state"][i][key]["tensor"]


JSON_EDITS: list[JsonEdit] = [
    ("lr renamed lb", lambda d: _rename(d["param_groups"][0], "lr", "lb"), None),
    (
        "weight_decay renamed",
        lambda d: _rename(d["param_groups"][1], "weight_decay", "weioht_decay"),
        None,
    ),
    ("lr removed", lambda d: d["param_groups"][0].pop("lr"), None),
    (
        "capturable renamed",
        lambda d: _rename(d["param_groups"][0], "capturable", "capturible"),
        {0: {"capturible": False}},
    ),
    ("exp_avg renamed", lambda d: _rename(d["state"]["4"], "exp_avg", "exp_a~g"), None),
    ("state[4][exp_avg] removed", lambda d: d["state"]["4"].pop("exp_avg"), None),
    ("state[4][step] removed", lambda d: d["state"]["4"].pop("step"), None),
    ("state[4] removed", lambda d: d["state"].pop("4"), None),
    ("state[0] removed", lambda d: d["state"].pop("0"), None),
    ("lr a string", lambda d: d["param_groups"][0].update(lr="0.01"), None),
    ("lr null", lambda d: d["param_groups"][1].update(lr=None), None),
    (
        "betas untagged",
        lambda d: d["param_groups"][0].update(betas=[{"float": 0.9}, {"float": 0.999}]),
        None,
    ),
    ("amsgrad an int", lambda d: d["param_groups"][0].update(amsgrad=0), None),
    ("eps removed", lambda d: d["param_groups"][1].pop("eps"), None),
    (
        "initial_lr added",
        lambda d: d["param_groups"][0].update(initial_lr={"float": 0.01}),
        {0: {"initial_lr": 0.01}},
    ),
    ("params[1][shape] removed", lambda d: d["params"][1].pop("shape"), None),
    ("params[0][shape] transposed", lambda d: d["params"][0].update(shape=[4, 10]), None),
    ("params[2][dtype] F16", lambda d: d["params"][2].update(dtype="F16"), None),
    ("num_params removed", lambda d: d.pop("num_params"), None),
    ("num_params 4", lambda d: d.update(num_params=4), None),
    ("state removed", lambda d: d.pop("state"), None),
    ("files[0][name] removed", lambda d: d["files"][0].pop("name"), None),
    ("files[1][bytes] + 8", lambda d: d["files"][1].update(bytes=d["files"][1]["bytes"] + 8), None),
    (
        "tensor crc32 + 1",
        lambda d: _ref(d, "1", "exp_avg").update(crc32=_ref(d, "1", "exp_avg")["crc32"] + 1),
        None,
    ),
    ("tensor dtype F16", lambda d: _ref(d, "3", "exp_avg_sq").update(dtype="F16"), None),
    (
        "tensor name of another key",
        lambda d: _ref(d, "2", "exp_avg").update(name="state.2.exp_avg_sq"),
        None,
    ),
    ("tensor shape field removed", lambda d: _ref(d, "0", "exp_avg").pop("shape"), None),
    ("param group moved", lambda d: d["param_groups"][1]["params"].pop(), None),
    ("save_id changed", lambda d: d.update(save_id="0" * 16), None),
    ("optimizer SGD", lambda d: d.update(optimizer="torch.optim.sgd.SGD"), None),
    ("layout unknown", lambda d: d.update(layout="striped"), None),
    ("format_version 3", lambda d: d.update(format_version=3), None),
    ("lr 0.01 -> 0.02", lambda d: d["param_groups"][0].update(lr={"float": 0.02}), "raw only"),
]


def _flip(file: Path, rng: random.Random, lo: int = 0, hi: int | None = None) -> str:
    raw = bytearray(file.read_bytes())
    at = rng.randrange(lo, min(hi or len(raw), len(raw)))
    bit = rng.randrange(8)
    raw[at] ^= 1 << bit
    file.write_bytes(raw)
    return f"{file.name} byte {at} bit {bit}"


def _header_end(file: Path) -> int:
    return 8 + int.from_bytes(file.read_bytes()[:8], "little")


def _edit_json(root: Path, edit: Any, resealed: bool) -> None:
    index = root / "index.json"
    data = json.loads(index.read_text())
    edit(data)
    index.write_text(json.dumps(data, indent=1) + "\n")  # the stale checksum stays in it
    if resealed:
        reseal(index)


def _edit_header(file: Path, rng: random.Random) -> str:
    """Change one digit or dtype letter inside the safetensors header (same length)."""
    raw = bytearray(file.read_bytes())
    end = _header_end(file)
    header = raw[8:end].decode()
    spots = [i for i, c in enumerate(header) if c.isdigit() or header[i : i + 3] in ("F32", "I64")]
    at = rng.choice(spots)
    c = header[at]
    new = str((int(c) + rng.randrange(1, 10)) % 10) if c.isdigit() else "B"
    raw[8 + at] = ord(new)
    file.write_bytes(raw)
    return f"{file.name} header char {at} {c!r} -> {new!r}"


class Mutations:
    """The mutations, each on a fresh copy of a saved checkpoint (seeded: reproducible)."""

    def __init__(self, saved: Path, out: Path) -> None:
        self.saved, self.out, self.rng = saved, out, random.Random(SEED)
        self.made: list[tuple[str, Path]] = []
        self.extras: dict[str, Any] = {}  # per resealed edit an exact load keeps: its keys

    def copy(self, name: str, source: str = "good") -> Path:
        target = self.out / f"m{len(self.made):03d}"
        shutil.copytree(self.saved / source, target)
        self.made.append((name, target))
        return target

    def named(self, describe: Any, source: str = "good") -> None:
        """A copy damaged by ``describe(root)``, which returns the mutation's name."""
        root = self.copy("", source)
        self.made[-1] = (describe(root), root)

    def file(self, root: Path, prefix: str) -> Path:
        return next(f for f in sorted(root.iterdir()) if f.name.startswith(prefix))

    def flips_and_truncations(self) -> None:
        rng = self.rng
        for _ in range(14):  # bit flips in the index: the checksum must refuse every one
            self.named(lambda root: f"flip {_flip(root / 'index.json', rng)}")
        for s, region, _ in itertools.product(range(2), ("header", "data"), range(5)):

            def flip(root: Path, s: int = s, region: str = region) -> str:
                shard = self.file(root, f"shard-0000{s}")
                end = _header_end(shard)
                lo, hi = (0, end) if region == "header" else (end, None)
                return f"flip {region} {_flip(shard, rng, lo, hi)}"

            self.named(flip)
        for target, _ in itertools.product(("index.json", "shard-00000", "shard-00001"), range(2)):

            def truncate(root: Path, target: str = target) -> str:
                file = self.file(root, target)
                size = rng.randrange(1, file.stat().st_size)
                file.write_bytes(file.read_bytes()[:size])
                return f"truncate {file.name} to {size}"

            self.named(truncate)

    def files(self) -> None:
        for target in ("index.json", "shard-00000", "shard-00001"):
            self.file(self.copy(f"delete {target}"), target).unlink()
            file = self.file(self.copy(f"zero-fill {target}"), target)
            file.write_bytes(bytes(file.stat().st_size))
        root = self.copy("swap the two shards")
        a, b = self.file(root, "shard-00000"), self.file(root, "shard-00001")
        a.rename(root / "tmp"), b.rename(a), (root / "tmp").rename(b)
        root = self.copy("a shard in place of the index")
        shutil.copy(self.file(root, "shard-00000"), root / "index.json")
        root = self.copy("an extra shard of another save (ignored)")
        shard = self.file(root, "shard-00001")
        shutil.copy(shard, root / shard.name.replace(shard.name.split(".")[1], "f" * 16))
        root = self.copy("an unrelated extra file (ignored)")
        (root / "notes.txt").write_text("not part of the checkpoint")
        root = self.copy("the shards of another save, under this save's names")
        for s in range(2):
            shutil.copy(
                self.file(self.saved / "adam", f"shard-0000{s}"), self.file(root, f"shard-0000{s}")
            )

    def json_edits(self, edits: list[JsonEdit], source: str = "good", raw: bool = True) -> None:
        prefix = "" if source == "good" else f"{source} "
        for name, edit, extra in edits:
            if raw:
                _edit_json(self.copy(f"{prefix}json {name}", source), edit, resealed=False)
            if extra != "raw only":
                root = self.copy(f"{prefix}json {name}, resealed", source)
                _edit_json(root, edit, resealed=True)
                if extra:
                    self.extras[str(root)] = extra

    def headers_and_others(self) -> None:
        for s, _ in itertools.product(range(2), range(3)):
            self.named(
                lambda root, s=s: (
                    f"header {_edit_header(self.file(root, f'shard-0000{s}'), self.rng)}"
                )
            )
        for other in ("adam", "sgd", "wider"):
            self.copy(f"the checkpoint of {other}", other)

    def consolidated(self) -> None:
        self.json_edits([JSON_EDITS[2], JSON_EDITS[7], JSON_EDITS[-1]], "consolidated")
        self.json_edits([JSON_EDITS[11]], "consolidated", raw=False)
        self.named(
            lambda root: f"consolidated flip {_flip(self.file(root, 'state.'), self.rng)}",
            "consolidated",
        )
        self.copy("unchanged (control)")
        self.copy("unchanged consolidated (control)", "consolidated")


def make_mutations(saved: Path, out: Path) -> tuple[list[tuple[str, Path]], dict[str, Any]]:
    """Every mutation, each on a fresh copy of a saved checkpoint; (name, path) and extras."""
    mutations = Mutations(saved, out)
    mutations.flips_and_truncations()
    mutations.files()
    mutations.json_edits(JSON_EDITS)
    mutations.headers_and_others()
    mutations.consolidated()
    return mutations.made, mutations.extras


def check(outcomes: dict[str, tuple[str, str]], name: str, path: Path) -> str:
    """Classify the per-rank outcomes of one load: "error", "exact" or a failure text."""
    kinds = {o[0] for o in outcomes}
    if kinds == {"ok"}:
        problems = {o[1] for o in outcomes}
        return "exact" if problems == {""} else f"{name}: a wrong load ({problems})"
    if "ok" in kinds or any(k.startswith("step") for k in kinds):
        return f"{name}: not an error on every rank at load: {outcomes}"
    for kind, message in outcomes:
        bare = any(
            f"{prefix}{error}" in message
            for error in ("KeyError", "TypeError", "AttributeError")
            for prefix in ("(", "raised ")
        )
        if kind not in CLEAR or str(path) not in message or bare:
            return f"{name}: an unclear error {kind}: {message[:300]}"
    return "error"


def test_every_mutation_is_a_clear_error_on_every_rank_or_an_exact_load(pool, tmp_path):
    start = time.perf_counter()
    pool.run(save_task, str(tmp_path / "saved"), world_size=2, timeout=60)
    mutations, extras = make_mutations(tmp_path / "saved", tmp_path / "mutated")
    subset = random.Random(SEED).sample(mutations, SUBSET)
    counts: dict[str, int] = {}
    failures = []
    for world, chosen in ((2, mutations), (1, subset), (3, subset)):
        paths = [str(path) for _, path in chosen]
        results = pool.run(load_each_task, paths, extras, world_size=world, timeout=120)
        for name, path in chosen:
            outcome = check([r[str(path)] for r in results], name, path)
            if outcome in ("error", "exact"):
                counts[f"{outcome} at {world}"] = counts.get(f"{outcome} at {world}", 0) + 1
            else:
                failures.append(f"world size {world}: {outcome}")
    loads = len(mutations) + 2 * SUBSET
    print(
        f"{len(mutations)} mutations, {loads} loads: {counts}, {len(failures)} failures, "
        f"{time.perf_counter() - start:.1f} s"
    )
    assert not failures, "\n".join(failures)
    assert counts.get("exact at 2", 0) >= 6  # the controls, the ignored files, kept keys
