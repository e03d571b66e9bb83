"""oss_plus.compat.fairscale.install() with fairscale absent or broken (simulated).

Each scenario runs in a fresh interpreter, where an import hook placed first on
``sys.meta_path`` hides the installed fairscale (or makes it fail to import). The case with a
working fairscale is in compat/test_fairscale_diff.py.
"""

import textwrap
from pathlib import Path

import pytest
from helpers import run_python

from oss_plus.runtime.launch import free_port

ROOT = Path(__file__).resolve().parent.parent

PRELUDE = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, importlib.util, sys

    class Hide(importlib.abc.MetaPathFinder):
        '''fairscale is not installed'''
        def find_spec(self, name, path, target=None):
            if name == "fairscale" or name.startswith("fairscale."):
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

    class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        '''fairscale is installed but fails to import (e.g. built for another torch)'''
        def find_spec(self, name, path, target=None):
            if name == "fairscale" or name.startswith("fairscale."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
        def create_module(self, spec):
            return None
        def exec_module(self, module):
            raise ImportError("fairscale is broken")

    sys.meta_path.insert(0, {finder}())
    """
)

SCENARIO = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    import oss_plus.compat.fairscale as compat
    import oss_plus.compat.torch
    assert not any(m == "fairscale" or m.startswith("fairscale.") for m in sys.modules), "imported"

    assert compat.install() == "shim" and compat.install() == "shim"
    assert compat.is_installed() == "shim"
    from fairscale.optim import OSS
    from fairscale.optim.oss import OSS as OSS2
    import fairscale
    assert OSS is OSS2 is compat.OSS
    assert fairscale.__version__ == "0.4.13"
    assert importlib.util.find_spec("fairscale") is not None
    import oss_plus
    from fairscale.nn import ShardedDataParallel as SDP1
    from fairscale.nn.data_parallel import ShardedDataParallel as SDP2
    from fairscale.nn.data_parallel.sharded_ddp import ShardedDataParallel as SDP3
    from fairscale.optim.grad_scaler import ShardedGradScaler
    assert SDP1 is SDP2 is SDP3 is oss_plus.ShardedDataParallel
    assert ShardedGradScaler is oss_plus.ShardedGradScaler
    try:
        import fairscale.nn.model_parallel  # not served by the stand-in
    except ImportError:
        pass
    else:
        raise AssertionError("fairscale.nn.model_parallel should not import")

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(torch.ones(3, 4) * step).pow(2).sum().backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    opt.consolidate_state_dict()
    assert sorted(opt.state_dict()["state"]) == [0, 1]
    dist.destroy_process_group()

    compat.uninstall()
    assert compat.is_installed() is None
    assert "fairscale" not in sys.modules
    try:
        import fairscale
    except ImportError:
        print("OK")
    """
)


def _run_ok(script: str) -> None:
    """Run ``script`` in a fresh interpreter; it must exit 0 and print OK last."""
    assert run_python(["-c", script], timeout=120).stdout.strip().endswith("OK")


@pytest.mark.parametrize("finder", ["Hide", "Broken"])
def test_install_serves_fairscale_imports_without_a_working_fairscale(finder):
    """The adapters import without fairscale; install() makes both import paths resolve to
    the adapter, which trains; uninstall() restores the previous state."""
    script = PRELUDE.format(finder=finder) + SCENARIO.format(port=free_port())
    _run_ok(script)


PATCHED = textwrap.dedent(
    """
    import oss_plus, oss_plus.compat.fairscale as compat
    import fairscale.nn.data_parallel as fdp
    import fairscale.optim.grad_scaler as fgs
    real_sdp, real_scaler = fdp.ShardedDataParallel, fgs.ShardedGradScaler
    assert compat.install() == "patched"  # default: only OSS is replaced
    import fairscale.optim
    assert fairscale.optim.OSS is compat.OSS
    assert fdp.ShardedDataParallel is real_sdp and fgs.ShardedGradScaler is real_scaler
    compat.uninstall()
    assert fairscale.optim.OSS is not compat.OSS
    assert compat.install(data_parallel=True) == "patched"
    import fairscale.nn
    ours = oss_plus.ShardedDataParallel
    assert fdp.ShardedDataParallel is fairscale.nn.ShardedDataParallel is ours
    assert fgs.ShardedGradScaler is oss_plus.ShardedGradScaler
    compat.uninstall()
    assert fdp.ShardedDataParallel is real_sdp and fgs.ShardedGradScaler is real_scaler
    print("OK")
    """
)


def test_install_with_fairscale_replaces_data_parallel_only_when_asked():
    pytest.importorskip("fairscale")
    _run_ok(PATCHED)


TORCH_INSTALL = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    import torch.distributed.optim as tdo
    import torch.distributed.optim.zero_redundancy_optimizer as tzero
    real = tdo.ZeroRedundancyOptimizer
    import oss_plus.compat.torch as compat
    assert tdo.ZeroRedundancyOptimizer is real  # importing the adapter changes nothing
    assert compat.install() is True and compat.install() is False and compat.is_installed()
    from torch.distributed.optim import ZeroRedundancyOptimizer as Z
    assert Z is tzero.ZeroRedundancyOptimizer is compat.ZeroRedundancyOptimizer
    # code imported after install() (as mmengine subclasses torch's class at import)
    namespace = {{}}
    later = "import torch.distributed.optim as o\\nclass Sub(o.ZeroRedundancyOptimizer): pass"
    exec(later, namespace)
    assert issubclass(namespace["Sub"], compat.ZeroRedundancyOptimizer)

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    opt = namespace["Sub"](model.parameters(), "SGD", lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(torch.ones(3, 4) * step).pow(2).sum().backward()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    dist.destroy_process_group()

    compat.uninstall()
    assert not compat.is_installed()
    assert tdo.ZeroRedundancyOptimizer is tzero.ZeroRedundancyOptimizer is real
    print("OK")
    """
)


def test_torch_install_makes_torchs_name_resolve_to_the_adapter_until_uninstall():
    """compat.torch.install(): both of torch's import paths, and a subclass defined after it
    (as mmengine defines its own), give the adapter, which trains as the plain optimizer it
    names; uninstall() gives torch's class back."""
    _run_ok(TORCH_INSTALL.format(port=free_port()))


def test_install_registers_the_exit_handler_at_once():
    """A process that installs the adapter may train with torch's collectives only (no
    ``OSS``, so no oss_plus collective ever registers the handler): ``install()`` does
    (``oss_plus.runtime.exit``; issue 36)."""
    code = (
        "import oss_plus.runtime.exit as e, oss_plus.compat.fairscale as f\n"
        "assert not e._registered\n"
        "f.install()\n"
        "assert e._registered\n"
    )
    run_python(["-c", code])
