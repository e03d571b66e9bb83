"""Issue 54 on a GPU (marker ``gpu``): the cross-param probe over CUDA tensors, and
prodigyopt's ``fsdp_in_use`` route (its own all-reduce, on the GPU) under NCCL.

NCCL refuses two ranks on one GPU: the route runs at world size 1 in a fresh process
(:func:`oss_plus.runtime.launch.run_local`), against the unsharded ``Prodigy`` with the same
flag on the same device, bit for bit.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from test_probe_channels import PER_PARAM, REFUSED

from oss_plus import OSS
from oss_plus.step import coupling


def _cuda_groups():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return [{"params": list(model.to("cuda:0").parameters()), "lr": 0.1}]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_probe_gives_the_same_verdicts_on_cuda_tensors():
    for name, (cls, _, says) in REFUSED.items():
        found = coupling.probe(cls, {"lr": 0.1}, _cuda_groups(), coupling._hyper)
        assert found is not None and found.coupled, name
        assert says.replace("cpu", "cuda") in found.message(), (name, found.message())
    for name, cls in PER_PARAM.items():
        found = coupling.probe(cls, {"lr": 0.1}, _cuda_groups(), coupling._hyper)
        assert found is not None and not found.coupled, (name, found)


def prodigy_rank(rank: int, world: int) -> bool:
    """OSS over prodigyopt's Prodigy with ``fsdp_in_use=True`` against the plain one."""
    from prodigyopt import Prodigy

    device = f"cuda:{rank}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    plain.load_state_dict(model.state_dict())
    model, plain = model.to(device), plain.to(device)
    opt = OSS(model.parameters(), optim=Prodigy, lr=1.0, fsdp_in_use=True, allow_cross_param=True)
    ref = Prodigy(plain.parameters(), lr=1.0, fsdp_in_use=True)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(8):
        for m, o in ((model, opt), (plain, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    assert dist.get_backend() == "nccl"
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    d, ref_d = opt.optim.param_groups[0]["d"], ref.param_groups[0]["d"]
    return bool(same and torch.equal(torch.as_tensor(d).cpu(), torch.as_tensor(ref_d).cpu()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(importlib.util.find_spec("prodigyopt") is None, reason="prodigyopt (zoo)")
def test_nccl_prodigy_fsdp_in_use_route_at_world_size_1():
    from oss_plus.runtime.launch import run_local

    assert run_local(prodigy_rank, 1, backend="nccl", threads=1) == [True]
