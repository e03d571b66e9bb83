"""ShardedDataParallel under torch.compile, against the same compile of DDP + the plain optimizer.

* Whole-model compile (``torch.compile(ShardedDataParallel(...))``, both partition rules):
  no graph break in oss_plus's files, counted from torch's own graph-break log; the wrapped
  model is still compiled (the backend receives its layers); results bit-identical to
  ``torch.compile(DDP(...))`` with the plain optimizer.
* Per-block compile (``block.compile()``): results bit-identical to DDP's with the same
  blocks, and reductions launched while backward still runs (before autograd reaches the
  first block), counted against a gradient hook of the first block's output.

The backend is ``aot_eager``: the graphs and their compiled backward nodes as inductor gets
them, without generating code (graph breaks are decided before the backend is called).
Selected with ``-m compile``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from sdp_utils import Net, batch, flat, same_everywhere
from torch.nn.parallel import DistributedDataParallel as DDP

import oss_plus
from oss_plus import OSS, ShardedDataParallel

pytestmark = [pytest.mark.compile, pytest.mark.timeout(180)]

#: The package's directory: a graph break located in a file under it is oss_plus's.
PACKAGE = str(Path(oss_plus.__file__).resolve().parent)
#: torch's graph-break log line (first and repeated breaks): "... in user code at FILE:LINE".
BREAK_AT = re.compile(r"Graph break\b.*? in user code at (.+?):(\d+)")
STEPS = 4


class _Breaks(logging.Handler):
    """Collects (file, line) of every graph break torch logs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.sites: list[tuple[str, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = BREAK_AT.search(record.getMessage())
        if found:
            self.sites.append((str(Path(found.group(1)).resolve()), int(found.group(2))))


@contextlib.contextmanager
def graph_breaks() -> Iterator[list[tuple[str, int]]]:
    """Record the site of every graph break dynamo logs inside the block (from torch's
    ``graph_breaks`` log artifact, as ``TORCH_LOGS=graph_breaks`` prints it)."""
    torch._dynamo.reset()
    torch._logging.set_logs(graph_breaks=True)
    handler = _Breaks()
    dynamo = logging.getLogger("torch._dynamo")  # set_logs stops it propagating to "torch"
    dynamo.addHandler(handler)
    try:
        yield handler.sites
    finally:
        dynamo.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()


def recording_backend(graphs: list[torch.fx.GraphModule]) -> Any:
    """``aot_eager`` that keeps the graphs it is given."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return backend


def linears(graphs: list[torch.fx.GraphModule]) -> int:
    """How many linear layers the captured graphs run."""
    return sum("linear" in str(n.target) for g in graphs for n in g.graph.nodes)


def _train(ctx: Any, net: Any, opt: Any) -> None:
    for step in range(STEPS):
        opt.zero_grad()
        net(batch(step, ctx.rank)).pow(2).mean().backward()
        opt.step()


def _sanity_break(x: torch.Tensor) -> torch.Tensor:
    x = x + 1
    torch._dynamo.graph_break()
    return x * 2


def whole_model_task(ctx: Any, rule: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01,
              partition_rule=rule)  # fmt: skip
    graphs: list[torch.fx.GraphModule] = []
    with graph_breaks() as probe:  # the log is read: a known break is seen
        torch.compile(_sanity_break, backend="eager")(torch.ones(2))
    with graph_breaks() as sites:
        sdp = ShardedDataParallel(model, opt, ctx.group)
        sdp = torch.compile(sdp, backend=recording_backend(graphs))
        _train(ctx, sdp, opt)
    ddp = torch.compile(DDP(ref, process_group=ctx.group), backend="aot_eager")
    _train(ctx, ddp, torch.optim.Adam(ref.parameters(), lr=0.01))
    torch._dynamo.reset()
    return {
        "probe": [line for path, line in probe if path == str(Path(__file__).resolve())],
        "ours": [(p, line) for p, line in sites if p.startswith(PACKAGE)],
        "linears": linears(graphs),
        "exact": torch.equal(flat(model), flat(ref)),
        "replicas": same_everywhere(ctx, flat(model)),
    }


@pytest.mark.parametrize("rule", ["fairscale", "flat"])
def test_whole_model_compile_breaks_no_graph_in_oss_plus_and_matches_ddp(pool, rule):
    for rank, r in enumerate(pool.run(whole_model_task, rule, world_size=2, timeout=150)):
        assert r["probe"], "torch's graph-break log was not read (the probe's break is missing)"
        assert r["ours"] == [], f"rank {rank}: graph breaks in oss_plus: {r['ours']}"
        assert r["linears"] >= 3, "the wrapped model was not compiled"
        assert r["exact"] and r["replicas"], r


class Blocks(torch.nn.Module):
    """A stack of small blocks, each compiled on its own; ``seen`` records when autograd
    produces the gradient of the first block's output (every later block's backward done,
    the first block's still to run)."""

    def __init__(self, depth: int = 4, width: int = 8) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
            for _ in range(depth)
        )
        self.events: list[str] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 0 and self.events is not None and x.requires_grad:
                x.register_hook(self._reached)
        return x

    def _reached(self, grad: torch.Tensor) -> None:
        assert self.events is not None
        self.events.append("first block reached")


@contextlib.contextmanager
def reductions(events: list[str]) -> Iterator[None]:
    """Record every reduction handed to ``torch.distributed`` (both collectives SDP uses)."""
    real = dist.reduce, dist.reduce_scatter_tensor

    def reduce(*args: Any, **kwargs: Any) -> Any:
        events.append("reduce")
        return real[0](*args, **kwargs)

    def reduce_scatter(*args: Any, **kwargs: Any) -> Any:
        events.append("reduce")
        return real[1](*args, **kwargs)

    dist.reduce, dist.reduce_scatter_tensor = reduce, reduce_scatter
    try:
        yield
    finally:
        dist.reduce, dist.reduce_scatter_tensor = real


def per_block_task(ctx: Any, collective: str) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Blocks()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        for block in m.blocks:
            block.compile(backend="aot_eager")
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=ctx.group, lr=0.01)
    sdp = ShardedDataParallel(model, opt, ctx.group, reduce_buffer_size=0, collective=collective)
    ddp = DDP(ref, process_group=ctx.group)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    before_first = []
    for step in range(STEPS):
        for net, o, inner in ((sdp, opt, model), (ddp, ref_opt, None)):
            o.zero_grad()
            events: list[str] = []
            if inner is not None:
                inner.events = events
            with reductions(events):
                net(batch(step, ctx.rank)).pow(2).mean().backward()
            if inner is not None:
                inner.events = None
                before_first.append(events.index("first block reached"))
            o.step()
    torch._dynamo.reset()
    return {
        "before_first": before_first,
        "exact": torch.equal(flat(model), flat(ref)),
        "replicas": same_everywhere(ctx, flat(model)),
    }


@pytest.mark.parametrize("collective, launches", [("reduce", 6), ("reduce_scatter", 3)])
def test_per_block_compile_reduces_during_backward_and_matches_ddp(pool, collective, launches):
    """One bucket per param: the 3 later blocks' 6 gradients are reduced before autograd
    reaches the first block (each block's compiled backward is one autograd node; its
    params' hooks fire when it ends): 6 reduces, or 3 reduce_scatters of 2 owners' buckets."""
    for r in pool.run(per_block_task, collective, world_size=2, timeout=150):
        assert r["exact"] and r["replicas"], r
        assert all(n >= launches for n in r["before_first"]), r["before_first"]
