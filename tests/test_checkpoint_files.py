"""Single-process tests of checkpoint files: write_state_dict/read_state_dict round trips,
bad files, atomic replacement (including killed processes), stale temporary siblings, and
the absence of pickle from the package."""

from __future__ import annotations

import copy
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ShampooLike, make_model, params_equal, reseal, train
from test_checkpoint import OPTIMIZERS, diff

import oss_plus
from oss_plus import load_checkpoint, save_checkpoint
from oss_plus.checkpoint import read_state_dict, storage, write_state_dict

REPO = Path(oss_plus.__file__).resolve().parent.parent


def trained(name: str, steps: int = 2):
    cls, kwargs = OPTIMIZERS[name]
    model = make_model()
    opt = cls(
        [
            {"params": list(model.parameters())[:3]},
            {"params": list(model.parameters())[3:], "lr": 0.02},
        ],
        **kwargs,
    )
    train(model, opt, steps)
    return model, opt


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_plain_torch_state_dict_round_trips_exactly_and_training_continues(tmp_path, name):
    model, opt = trained(name)
    original = opt.state_dict()
    snapshot = copy.deepcopy(original)
    write_state_dict(original, tmp_path / "c")
    assert diff(original, snapshot) is None  # the input is not modified
    assert diff(read_state_dict(tmp_path / "c"), snapshot) is None
    clone = copy.deepcopy(model)
    cls, kwargs = OPTIMIZERS[name]
    other = cls(
        [{"params": list(clone.parameters())[:3]}, {"params": list(clone.parameters())[3:]}],
        **kwargs,
    )
    other.load_state_dict(read_state_dict(tmp_path / "c"))
    train(model, opt, 2, start=2)
    train(clone, other, 2, start=2)
    assert params_equal(model, clone)


def test_nested_state_round_trips_exactly_and_training_continues(tmp_path):
    """A Shampoo-like state dict (tensors in a dict of a list, a tuple, int/bool/None, 0-dim
    tensors) through write_state_dict/read_state_dict; a fresh optimizer resumes from it in
    lockstep with the original."""
    model = make_model()
    opt = ShampooLike(model.parameters())
    train(model, opt, 2)
    original = opt.state_dict()
    write_state_dict(original, tmp_path / "c")
    back = read_state_dict(tmp_path / "c")
    assert diff(back, original) is None
    assert (
        back["state"][0]["pre"]["mats"][1].data_ptr()
        != original["state"][0]["pre"]["mats"][1].data_ptr()
    )
    clone = copy.deepcopy(model)
    other = ShampooLike(clone.parameters(), lr=123.0)
    other.load_state_dict(back)
    train(model, opt, 2, start=2)
    train(clone, other, 2, start=2)
    assert params_equal(model, clone) and diff(other.state_dict(), opt.state_dict()) is None


def test_state_ids_that_are_not_flat_indices_are_renumbered(tmp_path):
    sd = {
        "state": {10: {"m": torch.ones(2)}, 30: {"m": torch.zeros(1)}},
        "param_groups": [{"lr": 0.1, "params": [10, 20]}, {"lr": 0.2, "params": [30]}],
    }
    back = read_state_dict(tmp_path / "c") if write_state_dict(sd, tmp_path / "c") is None else None
    assert back["param_groups"] == [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}]
    assert diff(back["state"], {0: {"m": torch.ones(2)}, 2: {"m": torch.zeros(1)}}) is None


@pytest.mark.parametrize(
    ("sd", "error", "words"),
    [
        ({"state": {}}, ValueError, "keys"),
        ([1, 2], ValueError, "list"),
        ({"state": {5: {}}, "param_groups": [{"params": [0]}]}, ValueError, "torch.optim format"),
        (
            {
                "state": {0: {"m": torch.zeros(2, dtype=torch.complex128)}},
                "param_groups": [{"params": [0]}],
            },
            TypeError,
            "complex128",
        ),
        (
            {
                "state": {
                    0: {"m": {"pre": [torch.zeros(2), torch.zeros(1, dtype=torch.complex128)]}}
                },
                "param_groups": [{"params": [0]}],
            },
            TypeError,
            "key 'm' at state.0.m/pre/1 has dtype torch.complex128",
        ),
        (
            {"state": {0: {"m": [torch.zeros(2), {print}]}}, "param_groups": [{"params": [0]}]},
            TypeError,
            r"key 'm'\[1\] item is a builtin_function_or_method",
        ),
        ({"state": {}, "param_groups": [{"params": [0], "hook": print}]}, TypeError, "'hook'"),
    ],
    ids=[
        "no groups",
        "not a dict",
        "unknown id",
        "complex",
        "nested complex",
        "function in a nested set",
        "function",
    ],
)
def test_bad_state_dicts_are_refused_before_anything_is_written(tmp_path, sd, error, words):
    with pytest.raises(error, match=words):
        write_state_dict(sd, tmp_path / "c")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ bad files
@pytest.fixture
def good(tmp_path):
    _, opt = trained("Adam")
    write_state_dict(opt.state_dict(), tmp_path / "good")
    return tmp_path / "good"


def data_file(root: Path) -> Path:
    return next(p for p in root.iterdir() if p.suffix == ".safetensors")


def damage(root: Path, how: str) -> str:
    """Damage the checkpoint at root; return the file name the error must contain."""
    file, index = data_file(root), root / "index.json"
    raw = bytearray(file.read_bytes())
    if how == "truncated":
        file.write_bytes(raw[:-1])
    elif how == "flipped byte":
        raw[-1] ^= 1
        file.write_bytes(raw)
    elif how == "damaged header":
        raw[9] = ord("[")
        file.write_bytes(raw)
    elif how == "missing file":
        file.unlink()
    elif how in ("other version", "garbage index", "no index"):
        text = index.read_text()
        if how == "no index":
            index.unlink()
            return str(root)
        index.write_text(
            text.replace('"format_version": 5', '"format_version": 0')
            if how == "other version"
            else text[: len(text) // 2]
        )
        if how == "other version":
            reseal(index)  # the version check, behind the checksum
        return "index.json"
    elif how == "file of another save":
        other = root.parent / "other"
        write_state_dict(read_state_dict(root), other)
        os.replace(data_file(other), file)
        os.truncate(file, file.stat().st_size)
        info = re.search(rf'"name": "{file.name}", "rank": 0, "bytes": \d+', index.read_text())
        size = file.stat().st_size
        index.write_text(
            index.read_text().replace(
                info.group(0), f'"name": "{file.name}", "rank": 0, "bytes": {size}'
            )
        )
        reseal(index)
    elif how == "renamed tensor":
        at = raw.index(b"state.0.exp_avg")
        raw[at : at + 5] = b"stat_"
        file.write_bytes(raw)
    return file.name


DAMAGE = {
    "truncated": (ValueError, "truncated"),
    "flipped byte": (ValueError, "checksum"),
    "damaged header": (ValueError, "truncated or corrupted"),
    "missing file": (FileNotFoundError, "missing"),
    "other version": (ValueError, "format version 0"),
    "garbage index": (ValueError, "not valid JSON"),
    "no index": (FileNotFoundError, "holds no index.json"),
    "file of another save": (ValueError, "mixes files of two saves"),
    "renamed tensor": (ValueError, "no tensor 'state.0.exp_avg'"),
}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_bad_files_raise_a_clear_error_naming_the_file(good, how):
    name = damage(good, how)
    error, words = DAMAGE[how]
    with pytest.raises(error) as info:
        read_state_dict(good)
    assert words in str(info.value) and name in str(info.value)
    assert "restore" in str(info.value) or "re-save" in str(info.value) or how == "no index"


def test_no_checkpoint_at_all(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_state_dict(tmp_path / "nothing")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(NotADirectoryError, match="a_file is a file, not a checkpoint directory"):
        read_state_dict(tmp_path / "a_file")


# ------------------------------------------------------------------ atomicity
def siblings(root: Path) -> list[str]:
    return sorted(p.name for p in root.parent.iterdir() if p.name != root.name)


def test_a_failed_write_keeps_the_previous_checkpoint_and_cleans_up(good, monkeypatch):
    before = read_state_dict(good)
    listing = sorted(os.listdir(good))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage, "open_writer", disk_full)
    with pytest.raises(OSError, match="No space"):
        write_state_dict({"state": {}, "param_groups": [{"params": [0]}]}, good)
    assert diff(read_state_dict(good), before) is None
    assert sorted(os.listdir(good)) == listing and siblings(good) == []


def test_a_completed_save_replaces_the_files_of_the_previous_one(good):
    _, opt = trained("SGD")
    (good / "notes.txt").write_text("mine")
    write_state_dict(opt.state_dict(), good)
    assert diff(read_state_dict(good), opt.state_dict()) is None
    names = sorted(os.listdir(good))
    assert len(names) == 3 and names[0] == "index.json" and names[1] == "notes.txt"


def test_refuses_a_file_or_a_foreign_index(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        write_state_dict({"state": {}, "param_groups": []}, tmp_path / "file")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "index.json").write_text('{"something": "else"}')
    with pytest.raises(ValueError, match="refusing to replace"):
        write_state_dict({"state": {}, "param_groups": []}, tmp_path / "dir")
    with pytest.raises(ValueError, match="choose a subdirectory"):
        write_state_dict({"state": {}, "param_groups": []}, "/")


def test_relative_paths_are_normalized(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    write_state_dict({"state": {}, "param_groups": [{"params": [0]}]}, "a/../c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "c"]
    assert read_state_dict(tmp_path / "c")["param_groups"] == [{"params": [0]}]


@pytest.mark.parametrize("fn", [save_checkpoint, load_checkpoint])
def test_a_plain_torch_optimizer_is_pointed_to_the_dict_functions(tmp_path, fn):
    with pytest.raises(TypeError, match="expects an oss_plus.OSS.*read_state_dict"):
        fn(torch.optim.SGD(make_model().parameters(), lr=0.1), tmp_path / "c")


#: A 1-rank script: one Adam step, a save, a second step (shared with test_checkpoint_async).
SCRIPT_HEAD = """
import os, signal, sys, tempfile, time
import torch, torch.distributed as dist
sys.path[:0] = [{repo!r}, {tests!r}]
from helpers import make_model, train
from oss_plus import OSS, save_checkpoint
from oss_plus.checkpoint import storage
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = make_model()
opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
train(model, opt, 1)
save_checkpoint(opt, {path!r}, sharded={sharded})
train(model, opt, 1, start=1)
"""
KILL_SCRIPT = (
    SCRIPT_HEAD
    + """kill = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
if {point!r} == "before commit":
    storage.commit = kill
else:  # after the data files moved in, before index.json is replaced
    real_replace = os.replace
    os.replace = lambda a, b: kill() if str(b).endswith("index.json") else real_replace(a, b)
save_checkpoint(opt, {path!r}, sharded={sharded})
"""
)


@pytest.mark.parametrize(("point", "sharded"), [("before commit", True), ("inside commit", False)])
def test_a_save_killed_before_its_commit_leaves_the_previous_checkpoint(tmp_path, point, sharded):
    root = tmp_path / "ckpt"
    script = KILL_SCRIPT.format(
        repo=str(REPO), tests=str(REPO / "tests"), path=str(root), sharded=sharded, point=point
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    state = read_state_dict(root)  # complete and loadable: the first save
    assert {float(s["step"]) for s in state["state"].values()} == {1.0}
    stale = siblings(root)
    assert len(stale) == 1 and stale[0].startswith(".ckpt.tmp-")
    orphans = len(os.listdir(root)) > 2  # the second save's file moved in, not committed
    assert orphans == (point == "inside commit")
    write_state_dict(state, root)  # a later save cleans the stale sibling and the orphans
    assert siblings(root) == [] and len(os.listdir(root)) == 2


# ------------------------------------------------------------------ no pickle
#: Modules allowed to pickle: the test harness only (IPC between the pytest process and its
#: workers; never imported by the checkpoint load path, checked at runtime in
#: test_checkpoint.py). Consolidation sends its metadata as JSON.
PICKLE_ALLOWED = {"testing.py"}
#: Code that uses the pickle module (or a drop-in for it).
PICKLE = r"^\s*(import|from)\s+(pickle|cPickle|_pickle|dill)\b|\bpickle\.[A-Za-z_]+"
#: What else pickles: torch.save and the object collectives of torch.distributed.
OBJECTS = r"torch\.save\(|\b(all_gather|broadcast|gather|scatter)_object(_list)?\("


def pickle_offenders(name: str, text: str) -> list[str]:
    offenders = []
    if name not in PICKLE_ALLOWED and re.search(PICKLE, text, re.MULTILINE):
        offenders.append(f"{name}: pickle")
    for call in re.finditer(r"torch\.load\(", text):
        if "weights_only=True" not in call_arguments(text, call.end()):
            offenders.append(f"{name}: torch.load without weights_only=True")
    return offenders


def call_arguments(text: str, start: int) -> str:
    """The text from ``start`` (just after a call's opening parenthesis) to its closing one."""
    depth = 1
    for end in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            return text[start:end]
    return text[start:]


def test_the_pickle_scan_finds_what_it_looks_for():
    assert pickle_offenders("x.py", "import pickle\n") == ["x.py: pickle"]
    assert pickle_offenders("x.py", "y = pickle.loads(b)\n") == ["x.py: pickle"]
    assert pickle_offenders("x.py", "torch.load(f, map_location='cpu')") != []
    assert pickle_offenders("x.py", "torch.load(f, weights_only=True)\n# no pickle here") == []
    assert pickle_offenders("x.py", "torch.load(join(a, b), weights_only=True)") == []
    assert pickle_offenders("x.py", "torch.load(join(a, b))\nf(weights_only=True)") != []


def test_no_pickle_and_no_unsafe_torch_load_in_the_package():
    files = sorted((REPO / "oss_plus").rglob("*.py"))
    assert len(files) > 10
    assert [o for f in files for o in pickle_offenders(f.name, f.read_text())] == []


def test_the_checkpoint_modules_use_no_object_collectives():
    modules = sorted((REPO / "oss_plus" / "checkpoint").glob("*.py"))
    assert len(modules) >= 9
    for module in modules:
        text = module.read_text()
        assert not re.search(PICKLE, text, re.MULTILINE), module.name
        assert not re.search(OBJECTS, text), module.name
        assert not re.search(r"^\s*(from|import)\s+oss_plus\.consolidate", text, re.MULTILINE)


def test_read_state_dict_unpickles_nothing(good, monkeypatch):
    import pickle

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickled")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    assert len(read_state_dict(good)["state"]) == 8


def test_stale_siblings_of_other_checkpoints_are_left_alone(good, tmp_path):
    (tmp_path / ".other.tmp-0123").mkdir()
    (tmp_path / ".good.tmp-dead").mkdir()
    write_state_dict(read_state_dict(good), good)
    assert siblings(good) == [".other.tmp-0123"]
    shutil.rmtree(tmp_path / ".other.tmp-0123")
