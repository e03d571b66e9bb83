"""The 0.2 module paths keep importing until 0.4, with a ``DeprecationWarning`` that names the
new path (issue 44; ``oss_plus._moved``).

The expectations are written here, not read from the alias table: the modules 0.2.0's
``docs/api.rst`` documented, with a name each documented, and the whole 0.2 root.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import oss_plus

ROOT = Path(__file__).resolve().parents[1]

#: 0.2.0's documented modules -> (a name it documented, the module that defines it now).
DOCUMENTED = {
    "oss_plus.plan": ("make_plan", "oss_plus.planning.plan"),
    "oss_plus.plan_report": ("balance_rows", "oss_plus.planning.report"),
    "oss_plus.scale_report": ("scale_rows", "oss_plus.planning.scale"),
    "oss_plus.model_specs": ("llama_shapes", "oss_plus.planning.model_specs"),
    "oss_plus.partition": ("assign_owners", "oss_plus.planning.partition"),
    "oss_plus.clip": ("ShardedClip", "oss_plus.amp.clip"),
    "oss_plus.dcp": ("LocalState", "oss_plus.state.dcp"),
    "oss_plus.sharded_tensor": ("to_sharded", "oss_plus.state.sharded_tensor"),
    "oss_plus.torch_callers": ("torch_options", "oss_plus.state.torch_callers"),
    "oss_plus.sync": ("BucketSync", "oss_plus.wire.sync"),
    "oss_plus.layout_choice": ("build_sync", "oss_plus.wire.factory"),
    "oss_plus.consolidate": ("whole_states", "oss_plus.state.consolidate"),
    "oss_plus._nested": ("flatten_value", "oss_plus.state.nested"),
}
#: The two whose names are packages now: their names resolve through the package.
SHADOWED = {
    "oss_plus.state": ("local_state_dict", "oss_plus.state.index"),
    "oss_plus.amp": ("ScalerContract", "oss_plus.amp.scaler"),
}
#: Every module at the root of 0.2.0, and the modules still there.
ROOT_02 = [
    "__main__",
    "_arrival",
    "_dist",
    "_exit",
    "_launch",
    "_layout",
    "_nested",
    "_norms",
    "_params",
    "_trace",
    "amp",
    "changes",
    "cli",
    "clip",
    "consolidate",
    "dcp",
    "demo",
    "hybrid",
    "inflight",
    "layout_choice",
    "main_copies",
    "main_copy",
    "main_step",
    "model_specs",
    "optimizer",
    "partition",
    "pieces",
    "plan",
    "plan_report",
    "plan_views",
    "policy",
    "replan",
    "scale_report",
    "shard",
    "sharded_tensor",
    "split_params",
    "state",
    "state_dict",
    "status",
    "stepping",
    "sync",
    "testing",
    "torch_callers",
    "transport",
]
STAYED = {"__main__", "cli", "demo", "hybrid", "optimizer", "testing"}

PROBE = textwrap.dedent(
    """
    import importlib, json, sys, warnings
    warnings.simplefilter("always")
    cases, shadowed = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    out = {}
    for old, (name, new) in cases.items():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            # an import statement of this file: the line the warning must name
            space = {}
            exec(compile(f"import {old} as module", __file__, "exec"), space)
            module = space["module"]
        out[old] = {
            "same": getattr(module, name) is getattr(importlib.import_module(new), name),
            "warnings": [(w.category.__name__, str(w.message), w.filename) for w in seen],
        }
    for old, (name, new) in shadowed.items():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            value = getattr(importlib.import_module(old), name)
        out[old] = {
            "same": value is getattr(importlib.import_module(new), name),
            "warnings": [(w.category.__name__, str(w.message), w.filename) for w in seen],
        }
    import oss_plus
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        attr = oss_plus.policy.ShardPolicy  # no import statement: the package's __getattr__
    out["attribute"] = {"same": attr is importlib.import_module("oss_plus.planning").ShardPolicy,
                        "warnings": [(w.category.__name__, w.filename) for w in seen]}
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """A fresh interpreter (nothing imported yet), importing every old path once."""
    script = tmp_path_factory.mktemp("moved") / "probe.py"
    script.write_text(PROBE)
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(DOCUMENTED), json.dumps(SHADOWED)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=True,
    )
    return json.loads(done.stdout), str(script)


@pytest.mark.parametrize("old", sorted(DOCUMENTED) + sorted(SHADOWED))
def test_a_documented_old_path_imports_the_same_objects_and_warns(probed, old):
    out, script = probed
    new = {**DOCUMENTED, **SHADOWED}[old][1]
    assert out[old]["same"]
    assert out[old]["warnings"], f"no warning for {old}"
    for category, message, filename in out[old]["warnings"]:
        assert category == "DeprecationWarning"
        assert f"{old} moved to {new}" in message and "0.4" in message
        assert filename == script  # the warning names the importing line, not importlib


def test_an_old_module_as_an_attribute_of_the_package(probed):
    """``oss_plus.policy.X`` with no import statement: warned once, at the caller's line (so
    Python's default filters show it in ``__main__``)."""
    out, script = probed
    assert out["attribute"]["same"]
    assert out["attribute"]["warnings"] == [["DeprecationWarning", script]]


#: 0.2 names that 0.3 moved to another module than their module's new home: still answered
#: by the old module's path (``oss_plus.partition.rank_loads`` was removed, CHANGELOG).
MOVED_NAMES = {
    "oss_plus.state": (("group_offsets", "local_view"), "oss_plus.planning.partition"),
    "oss_plus._layout": (("Transport",), "oss_plus.planning.policy"),
    "oss_plus._layout ": (("padded",), "oss_plus.planning.partition"),
    "oss_plus.transport": (
        ("LAUNCH_BYTES", "auto_gathers", "owner_key_elements"),
        "oss_plus.planning.transport",
    ),
    "oss_plus.pieces": (("slice_state", "stitch_state"), "oss_plus.state.pieces"),
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("old", sorted(MOVED_NAMES))
def test_names_that_moved_module_still_answer_at_the_old_path(old):
    names, home = MOVED_NAMES[old]
    module, new = importlib.import_module(old.strip()), importlib.import_module(home)
    for name in names:
        assert getattr(module, name) is getattr(new, name), f"{old.strip()}.{name}"


def test_every_module_of_the_02_root_still_imports():
    moved = {name for name in ROOT_02 if name not in STAYED}
    assert moved == set(oss_plus._moved.MOVED)
    for name in STAYED:
        assert (ROOT / "oss_plus" / f"{name}.py").exists()


def test_the_root_is_small():
    """Issue 44: at most 12 modules at the root, none over ~400 lines in the package; the OSS
    class's module, the public surface with its docstrings, up to 450 (issue 55)."""
    package = ROOT / "oss_plus"
    assert len(list(package.glob("*.py"))) <= 12
    bound = {"optimizer.py": 450}
    long = {
        name: n
        for p in package.rglob("*.py")
        if (n := len(p.read_text().splitlines()))
        > bound.get(name := str(p.relative_to(package)), 400)
    }
    assert not long, long


def test_an_unknown_name_still_raises_attribute_error():
    with pytest.raises(AttributeError, match="no_such_module"):
        oss_plus.no_such_module  # noqa: B018
    with pytest.raises(AttributeError):
        oss_plus.state.no_such_name  # noqa: B018
