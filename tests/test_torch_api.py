"""The private torch APIs oss_plus relies on, checked on the installed torch.

The torch range that setup.cfg declares is tested at both ends (tox -e torch-oldest,
torch-newest; docs/portability.md), and this file runs there. Each API in
:data:`PRIVATE` is called the way the library calls it and must give what the library reads
from it. Where the library has a fallback, the fallback is exercised too. docs/portability.md
lists the same APIs, and a test keeps that table and :data:`PRIVATE` in step.
"""

from __future__ import annotations

import mmap
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.nn.parallel import DistributedDataParallel

from oss_plus.amp import norms as _norms
from oss_plus.runtime import arrival as _arrival
from oss_plus.runtime import exit as _exit

DOC = Path(__file__).resolve().parents[1] / "docs" / "portability.md"
#: Each private API -> the module of oss_plus that uses it.
PRIVATE = {
    "Tensor._use_count": "oss_plus/runtime/dist.py",
    "torch._C._nn.unflatten_dense_tensors": "oss_plus/data_parallel/buckets.py",
    "Variable._execution_engine.queue_callback": "oss_plus/data_parallel/reducer.py",
    "distributed_c10d._get_default_store": "oss_plus/runtime/positions.py",
    "torch._foreach_norm": "oss_plus/amp/norms.py",
    "torch._foreach_mul_": "oss_plus/amp/norms.py",
    "torch._foreach_copy_": "oss_plus/data_parallel/reducer.py",
    "torch._amp_foreach_non_finite_check_and_unscale_": "oss_plus/amp/scaler.py",
    "Optimizer._step_supports_amp_scaling": "oss_plus/amp/scaler.py",
    "GradScaler._unscale_grads_": "oss_plus/amp/scaler.py",
    "GradScaler._per_optimizer_states": "oss_plus/amp/scaler.py",
    "Optimizer._optimizer_state_dict_pre_hooks": "oss_plus/state/api.py",
    "DistributedDataParallel._has_rebuilt_buckets": "oss_plus/compat/ddp_zero_hook.py",
    "Module._parameters": "oss_plus/data_parallel/wiring.py",
    "torch.autograd._profiler_enabled": "oss_plus/runtime/trace.py",
    "torch._C._tensors_data_ptrs_at_indices_equal": "oss_plus/wire/changes.py",
    "torch._disable_dynamo": "oss_plus/data_parallel/sharded_ddp.py",
    "ProcessGroupGloo.pt_gloo_runloop": "oss_plus/runtime/exit.py",
    "state_dict._init_optim_state": "oss_plus/state/torch_callers.py",
    "state_dict._get_optim_state_dict": "oss_plus/state/torch_callers.py",
    "state_dict._load_optim_state_dict": "oss_plus/state/torch_callers.py",
    "ShardedTensor._init_from_local_shards_and_global_metadata": "oss_plus/state/sharded_tensor.py",
}
#: Read with ``getattr`` and a fallback where a build lacks them (CPU builds lack this one).
OPTIONAL = {"torch._C._tensors_data_ptrs_at_indices_equal"}
#: Set by an optimizer and read by torch (no attribute to find on torch's side): its effect
#: is checked instead (test_grad_scaler_hands_its_scale_over).
CONTRACTS = {"Optimizer._step_supports_amp_scaling"}
ROOT = DOC.parents[1]


def test_the_docs_list_every_private_api_and_each_is_still_used():
    table = DOC.read_text()
    for name, module in PRIVATE.items():
        assert f"`{name}`" in table, f"docs/portability.md does not list {name}"
        attribute = re.escape(name.rsplit(".", 1)[-1])  # a whole name: not named_parameters
        used = re.search(rf"(?<!\w){attribute}(?!\w)", (ROOT / module).read_text())
        assert used, f"{module} no longer uses {name}"
    section = table[table.index("## Private torch APIs") :]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    listed = set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))
    assert listed == set(PRIVATE), sorted(listed ^ set(PRIVATE))


def test_use_count_counts_the_references_held_outside_python():
    """What ``_dist.await_release`` waits on: a C++ holder (here autograd's saved tensors,
    there a gloo work object) raises the count, and dropping it brings the count back."""
    t = torch.ones(3, requires_grad=True)
    before = t._use_count()
    y = t * t  # autograd saves t for backward
    assert isinstance(before, int) and t._use_count() > before
    del y
    assert t._use_count() == before


def test_unflatten_dense_tensors_returns_views_of_the_flat_buffer():
    members = [torch.empty(2, 3), torch.empty(4)]
    flat = torch.arange(10.0)
    views = torch._C._nn.unflatten_dense_tensors(flat, members)
    assert [v.shape for v in views] == [m.shape for m in members]
    assert torch.equal(torch.cat([v.reshape(-1) for v in views]), flat)
    views[1].fill_(-1)  # views, not copies: the bucket is written through them
    assert torch.equal(flat[6:], torch.full((4,), -1.0))


def test_queue_callback_runs_at_the_end_of_backward():
    order: list[str] = []
    x = torch.ones(2, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        Variable._execution_engine.queue_callback(lambda: order.append("callback"))
        order.append("hook")
        return grad

    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    order.append("returned")
    assert order == ["hook", "callback", "returned"]


def test_foreach_kernels_take_the_arguments_the_library_passes():
    tensors = [torch.tensor([3.0, 4.0], dtype=torch.bfloat16), torch.tensor([1.0])]
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)  # the dtype= of torch >= 2.4
    assert [n.dtype for n in norms] == [torch.float32] * 2
    assert [n.item() for n in norms] == [5.0, 1.0]
    torch._foreach_mul_(tensors, torch.tensor(2.0))  # a tensor factor: no host read
    assert tensors[0].tolist() == [6.0, 8.0]
    into = [torch.zeros(2), torch.zeros(1)]
    torch._foreach_copy_(into, [torch.ones(2), torch.full((1,), 7.0)])
    assert into[0].tolist() == [1.0, 1.0] and into[1].tolist() == [7.0]


def test_clip_falls_back_to_a_loop_off_the_foreach_devices(monkeypatch):
    """On a device without foreach kernels clip loops over tensors: same norms and scaling."""
    grads = [torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    fast = [g.clone() for g in grads]
    fast_norms = _norms.tensor_norms(fast, 2.0)
    fast_coef = _norms.scale_grads_(fast, 1.0, torch.stack(fast_norms).norm())
    monkeypatch.setattr(_norms, "_FOREACH_DEVICES", ())
    slow = [g.clone() for g in grads]
    slow_norms = _norms.tensor_norms(slow, 2.0)
    slow_coef = _norms.scale_grads_(slow, 1.0, torch.stack(slow_norms).norm())
    assert torch.allclose(torch.stack(fast_norms), torch.stack(slow_norms), rtol=1e-6, atol=0)
    assert fast_coef < 1 and torch.allclose(fast_coef, slow_coef, rtol=1e-6, atol=0)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(fast, slow))
    assert not any(torch.equal(a, g) for a, g in zip(slow, grads))  # the loop did scale


def test_amp_unscale_kernel_flags_inf_and_unscales():
    grads = [torch.tensor([2.0, float("inf")]), torch.tensor([4.0])]
    found = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.tensor(0.5))
    assert found.item() == 1.0 and grads[1].item() == 2.0


def test_optimizer_hook_dicts_hold_what_the_public_registration_added():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    hooks = {
        "register_state_dict_pre_hook": "_optimizer_state_dict_pre_hooks",
        "register_state_dict_post_hook": "_optimizer_state_dict_post_hooks",
        "register_load_state_dict_pre_hook": "_optimizer_load_state_dict_pre_hooks",
        "register_load_state_dict_post_hook": "_optimizer_load_state_dict_post_hooks",
    }
    for register, private in hooks.items():

        def hook(*args: object) -> None:
            return None

        getattr(opt, register)(hook)
        assert list(getattr(opt, private).values()) == [hook], private


def test_module_parameters_dict_holds_the_direct_params():
    layer = torch.nn.Linear(2, 2)
    assert list(layer._parameters.values()) == [layer.weight, layer.bias]


def store_and_ddp_task(ctx):
    """The default store (the arrival check's), and DDP's rebuilt-buckets flag."""
    store = _arrival._store()
    ddp = DistributedDataParallel(torch.nn.Linear(4, 4), process_group=ctx.group)
    before = ddp._has_rebuilt_buckets
    for _ in range(2):  # DDP rebuilds its buckets after the first iteration
        ddp(torch.randn(2, 4)).sum().backward()
    return store is not None and isinstance(store, dist.Store), before, ddp._has_rebuilt_buckets


def test_default_store_and_ddp_rebuilt_buckets(pool):
    for has_store, before, after in pool.run(store_and_ddp_task, world_size=2):
        assert has_store and before is False and after is True


def arrival_without_store_task(ctx):
    """Without ``_get_default_store`` the arrival check is skipped (returns at once)."""
    getter = dist.distributed_c10d._get_default_store
    del dist.distributed_c10d._get_default_store
    try:
        store = _arrival._store()
        _arrival.check_arrival(ctx.group, "portability test")
    finally:
        dist.distributed_c10d._get_default_store = getter
    return store


def test_arrival_check_falls_back_when_torch_has_no_default_store_getter(pool):
    assert pool.run(arrival_without_store_task, world_size=2) == [None, None]


#: The APIs reachable without a process group (DDP's flag: the pool test above).
WITHOUT_GROUP = sorted(
    n
    for n in PRIVATE
    if not n.startswith(("DistributedDataParallel.", "ProcessGroupGloo."))
    and n not in OPTIONAL | CONTRACTS
)


@pytest.mark.parametrize("name", WITHOUT_GROUP)
def test_every_listed_api_exists_on_this_torch(name):
    owners = {
        "Tensor": torch.Tensor,
        "torch": torch,
        "Variable": Variable,
        "distributed_c10d": dist.distributed_c10d,
        "Optimizer": torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
        "Module": torch.nn.Linear(1, 1),
        "state_dict": torch_state_dict,
        "ShardedTensor": ShardedTensor,
        "GradScaler": torch.amp.GradScaler("cpu"),
    }
    owner, *path = name.split(".")
    obj = owners[owner]
    for part in path:
        obj = getattr(obj, part)
    assert obj is not None


def test_the_declared_floor_is_the_torch_that_tox_tests():
    """setup.cfg's ``torch>=X.Y`` is the minor version of tox -e torch-oldest's pin."""
    import configparser

    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    requires = setup["options"]["install_requires"]
    floor = re.search(r"torch>=(\d+\.\d+)\b", requires)
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    pin = re.fullmatch(r"torch==(\d+\.\d+)\.\d+", tox["testenv:torch-oldest"]["deps"].strip())
    assert floor and pin and floor.group(1) == pin.group(1), (requires, pin)
    assert f"`torch>={floor.group(1)},<3`" in DOC.read_text()


def test_own_storage_keeps_the_views_strides():
    """``_layout.own_storage`` re-wraps bucket views through DLPack, whose import in torch 2.6
    normalizes the strides of size-1 dims: the param must keep the unsharded layout."""
    from oss_plus.wire.layout import own_storage

    buffer = torch.arange(32.0)
    for view in (buffer[16:28].view(1, 12), buffer[4:16].view(12, 1), buffer[:6].view(2, 1, 3)):
        owned = own_storage(view)
        assert owned.stride() == view.stride() and torch.equal(owned, view)
        assert owned.untyped_storage().data_ptr() == view.data_ptr()  # its own storage, same memory
        owned.add_(1)
        assert torch.equal(owned, view)  # written through


def test_the_profiler_flag_is_set_only_while_a_profiler_records():
    from torch.profiler import ProfilerActivity, profile

    assert torch.autograd._profiler_enabled() is False
    with profile(activities=[ProfilerActivity.CPU]):
        assert torch.autograd._profiler_enabled() is True
    assert torch.autograd._profiler_enabled() is False


@pytest.mark.parametrize("loop", ["torch", "fallback"])
def test_the_address_check_sees_a_replaced_data_with_either_loop(monkeypatch, loop):
    from oss_plus.wire import changes

    if loop == "torch" and changes._ptrs_equal is None:
        pytest.skip("this torch build has no _tensors_data_ptrs_at_indices_equal")
    if loop == "fallback":
        monkeypatch.setattr(changes, "_ptrs_equal", None)
    base = torch.zeros(6)
    params = [base[:2], base[2:], torch.zeros(3)]
    kept = changes.Addresses(params)
    assert kept.intact()
    params[1].data = torch.zeros(4)  # re-allocated, the old storage still alive in base
    assert not kept.intact()


def test_disable_dynamo_skips_the_frame_and_with_recursive_false_only_that_frame():
    """What ShardedDataParallel's forward relies on under torch.compile: its own frame (and,
    recursively, its pre-forward work) runs eagerly, while a frame it calls is compiled."""
    seen: dict[str, bool] = {}

    def inner(x: torch.Tensor) -> torch.Tensor:
        seen["inner"] = torch.compiler.is_compiling()
        return x * 2

    @torch._disable_dynamo
    def skipped() -> None:
        seen["skipped"] = torch.compiler.is_compiling()
        inner(torch.ones(1))

    @torch._disable_dynamo(recursive=False)
    def outer(x: torch.Tensor) -> torch.Tensor:
        seen["outer"] = torch.compiler.is_compiling()
        skipped()
        return inner(x)

    try:
        assert torch.equal(
            torch.compile(outer, backend="eager")(torch.ones(2)), torch.full((2,), 2.0)
        )
        assert seen == {"outer": False, "skipped": False, "inner": True}
    finally:
        torch._dynamo.reset()


def test_dcp_callers_are_the_functions_oss_plus_recognises():
    """oss_plus.state.torch_callers recognises torch's DCP functions by their code objects and
    reads the ``info`` local of the get/load ones: both must still be there, in that shape."""
    for name in ("_get_optim_state_dict", "_load_optim_state_dict"):
        fn = getattr(torch_state_dict, name)
        code = getattr(fn, "__wrapped__", fn).__code__
        assert "info" in code.co_varnames and "_init_optim_state" in code.co_names, name
        assert "_state_dict_fn" in code.co_names, name


def gloo_worker_names_task(ctx):
    """The names of this process's threads after a gloo collective (Linux)."""
    dist.all_reduce(torch.ones(2), group=ctx.group)
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as comm:
            names.append(comm.read().strip())
    time.sleep(0.05)
    return names, _exit.busy_gloo_workers()


def torch_library_names_gloo_workers() -> bool:
    """Whether the installed torch's own library carries the thread name (torch 2.6 leaves
    gloo's workers unnamed; later builds call them ``pt_gloo_runloop``)."""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not lib.exists():
        pytest.skip(f"no {lib.name} to read the thread names from")
    needle = _exit.GLOO_WORKER_NAMES[0].encode()
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(needle) >= 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
def test_gloo_worker_threads_carry_the_name_the_exit_handler_waits_for(pool):
    """``oss_plus.runtime.exit`` waits at exit while threads named so are runnable. Where this
    torch names them (its library has the string), they must be found; where it does not,
    none is counted and only the fixed pause applies (docs/portability.md)."""
    named = torch_library_names_gloo_workers()
    for names, busy in pool.run(gloo_worker_names_task, world_size=2):
        found = set(_exit.GLOO_WORKER_NAMES) <= set(names)
        assert found == named, (named, sorted(set(names)))
        assert busy == 0  # idle after the collective, or none found


class _Recording(torch.optim.Optimizer):
    """Records what a GradScaler hands to a step (torch's fused optimizers' contract)."""

    _step_supports_amp_scaling = True

    def __init__(self, params):
        super().__init__(params, {})
        self.seen = []

    def step(self, closure=None):
        self.seen.append((getattr(self, "grad_scale", None), self.found_inf.clone()))


@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale-step"])
def test_grad_scaler_hands_its_scale_over(unscale):
    """oss_plus.amp.scaler.ScalerContract relies on it: with ``_step_supports_amp_scaling``,
    ``GradScaler.step`` calls ``step()`` with ``grad_scale`` (the scale; None after
    ``unscale_``) and ``found_inf`` set, leaves the gradients scaled unless ``unscale_`` ran,
    records the found flag for ``update()`` and removes both attributes after the step."""
    param = torch.nn.Parameter(torch.ones(3))
    opt = _Recording([param])
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale((param * torch.tensor([1.0, 2.0, float("inf")])).sum()).backward()
    if unscale:
        scaler.unscale_(opt)
    scaler.step(opt)
    ((grad_scale, found),) = opt.seen
    assert found.item() == 1.0
    if unscale:
        assert grad_scale is None and param.grad[:2].tolist() == [1.0, 2.0]
    else:
        assert grad_scale.item() == 8.0 and param.grad[:2].tolist() == [8.0, 16.0]
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    scaler.update()
    assert scaler.get_scale() == 4.0  # the recorded flag backed the scale off
