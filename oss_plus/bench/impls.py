"""The implementations the step benchmark compares, behind one small interface.

Every implementation is built on one rank from that rank's copy of the model's params (grads
already set) and returns a :class:`Runner`: a ``step`` to time, the optimizer-state bytes it
holds, the bytes one step puts on the wire, and a gradient-clipping call.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from oss_plus import OSS
from oss_plus.demo import state_bytes
from oss_plus.planning.partition import ParamSpec, Rule, assign_owners
from oss_plus.step.pieces import elementwise
from oss_plus.wire.sync import transport_override


@elementwise  # it touches no element, so the flat rule may cut its params
class NoStep(torch.optim.Optimizer):
    """An optimizer whose ``step`` does nothing (``--optimizer noop``): a row then times only
    what the wrapper adds around the step (checks, hyperparameter copies, the sync)."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


#: Optimizers selectable with ``--optimizer``: class and keyword arguments.
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adam_fused": (torch.optim.Adam, {"lr": 1e-3, "fused": True}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
    "sgd": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "noop": (NoStep, {"lr": 1e-3}),
}


def check_common(config: Any, counts: tuple[str, ...]) -> None:
    """Check what every benchmark config shares: ``optimizer`` and the ``counts`` (>= 1).

    Raises:
        ValueError: an unknown optimizer or a count below 1, named by its flag.
    """
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(
            f"--optimizer must be one of {sorted(OPTIMIZERS)}, got {config.optimizer!r}"
        )
    for name in counts:
        if getattr(config, name) < 1:
            raise ValueError(
                f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}"
            )


def linear_layers(size: float, width: int) -> int:
    """How many ``Linear(width, width)`` layers make ``size`` million params (>= 1)."""
    return max(1, round(size * 1e6 / (width * width + width)))


@dataclass
class Runner:
    """One implementation built on one rank.

    Attributes:
        step: one optimizer step (grads are pre-set; only the optimizer runs).
        state_bytes: bytes of optimizer state this rank holds.
        wire_bytes: bytes one step moves between ranks (0 when nothing is sent).
        clip: clips the grads to a norm (the implementation's own method, or torch's), or None.
        note: what the row means beyond its name (e.g. the transport in use).
        main: the bytes of this rank's main copies (compressed wire) and the elements it
            sends compressed, or None.
    """

    step: Callable[[], Any]
    state_bytes: Callable[[], int]
    wire_bytes: int
    clip: Callable[[float], Any] | None
    note: str = ""
    keep: list[Any] = field(default_factory=list)
    main: Callable[[], tuple[int, int]] | None = None


@dataclass(frozen=True)
class Impl:
    """A row of the benchmark: a name, a builder and the package it needs."""

    key: str
    label: str
    build: Callable[[list[torch.nn.Parameter], str], Runner]
    needs: str | None = None

    def missing(self) -> str | None:
        """Return why this row cannot run here, or None when it can."""
        if self.needs and importlib.util.find_spec(self.needs) is None:
            return f"{self.needs} is not installed (pip install {self.needs})"
        return None


def _torch_clip(params: list[torch.nn.Parameter]) -> Callable[[float], Any]:
    return lambda max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm)


def _oss(
    wire: torch.dtype | None = None,
    transport: str | None = None,
    auto_refresh: bool = True,
    rule: str = "fairscale",
) -> Callable[..., Runner]:
    def build(params: list[torch.nn.Parameter], optimizer: str) -> Runner:
        cls, kwargs = OPTIMIZERS[optimizer]
        with transport_override(transport):
            opt = OSS(
                params,
                optim=cls,
                broadcast_dtype=wire,
                auto_refresh=auto_refresh,
                partition_rule=rule,
                **kwargs,
            )
        clip = getattr(opt, "clip_grad_norm", None)
        via = ",".join(sorted(opt.sync_buckets.transports())) or "none"
        return Runner(
            opt.step,
            lambda: state_bytes(opt.optim),
            opt.sync_buckets.wire_bytes(wire),
            clip,
            note=f"sync: {via}",
            keep=[opt],
            main=lambda: (opt.sync.main_bytes(), opt.sync.compressed_numel(wire)),
        )

    return build


def _fairscale(fp16: bool) -> Callable[..., Runner]:
    def build(params: list[torch.nn.Parameter], optimizer: str) -> Runner:
        from fairscale.optim import OSS as FairscaleOSS

        cls, kwargs = OPTIMIZERS[optimizer]
        opt = FairscaleOSS(params, optim=cls, broadcast_fp16=fp16, **kwargs)
        wire = sum(
            b.buffer.numel() * (2 if fp16 else b.buffer.element_size())
            for per_rank in opt.buckets.values()
            for b in per_rank.values()
        )
        return Runner(
            opt.step, lambda: state_bytes(opt.optim), wire, opt.clip_grad_norm, keep=[opt]
        )

    return build


def _torch_zero(bucket_view: bool) -> Callable[..., Runner]:
    def build(params: list[torch.nn.Parameter], optimizer: str) -> Runner:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls, kwargs = OPTIMIZERS[optimizer]
        opt = ZeroRedundancyOptimizer(
            params, optimizer_class=cls, parameters_as_bucket_view=bucket_view, **kwargs
        )
        if bucket_view:
            wire = sum(b.numel() * b.element_size() for dev in opt._buckets for b in dev)
        else:
            wire = sum(p.numel() * p.element_size() for p in opt._all_params)  # type: ignore[attr-defined]
        return Runner(
            opt.step,
            lambda: state_bytes(opt.optim),
            wire,
            _torch_clip(params),
            note="clip: torch.nn.utils (no sharded clip)",
            keep=[opt],
        )

    return build


def _unsharded(params: list[torch.nn.Parameter], optimizer: str) -> Runner:
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(params, **kwargs)
    return Runner(opt.step, lambda: state_bytes(opt), 0, _torch_clip(params), keep=[opt])


def own_partition(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Return the params this rank owns under oss_plus's partition, in its step order.

    oss_plus's inner optimizer steps its params largest first; so does the floor, since
    the order alone moves a CPU Adam step by about 25% (allocator reuse of temporaries).
    """
    specs = [[ParamSpec(p.numel(), p.requires_grad) for p in params]]
    owners = assign_owners(specs, dist.get_world_size(), Rule.FAIRSCALE)[0]
    own = [p for p, owner in zip(params, owners) if owner == dist.get_rank()]
    return sorted(own, key=lambda p: -p.numel())


def _floor(params: list[torch.nn.Parameter], optimizer: str) -> Runner:
    cls, kwargs = OPTIMIZERS[optimizer]
    own = own_partition(params)
    opt = cls(own, **kwargs)
    return Runner(
        opt.step,
        lambda: state_bytes(opt),
        0,
        _torch_clip(own),
        note="own partition only, no communication; clip: local norm only",
        keep=[opt],
    )


def _sync_only(params: list[torch.nn.Parameter], optimizer: str) -> Runner:
    """oss_plus's parameter sync without the step: what the communication alone costs."""
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = OSS(params, optim=cls, **kwargs)
    buckets = opt.sync_buckets
    return Runner(
        buckets.sync,
        lambda: 0,
        buckets.wire_bytes(),
        None,
        note="the fp32 sync alone, no optimizer step",
        keep=[opt],
    )


#: Every row, in table order.
IMPLS: dict[str, Impl] = {
    impl.key: impl
    for impl in (
        Impl("oss_plus", "oss_plus OSS fp32", _oss()),
        Impl("oss_plus_bf16", "oss_plus OSS bf16 wire", _oss(torch.bfloat16)),
        Impl("oss_plus_fp16", "oss_plus OSS fp16 wire", _oss(torch.float16)),
        Impl("oss_plus_all_gather", "oss_plus fp32 all_gather", _oss(transport="all_gather")),
        Impl("oss_plus_manual", "oss_plus fp32 auto_refresh=False", _oss(auto_refresh=False)),
        Impl("oss_plus_flat", "oss_plus fp32 flat partition", _oss(rule="flat")),
        Impl("oss_plus_flat_bf16", "oss_plus flat bf16 wire", _oss(torch.bfloat16, rule="flat")),
        Impl(
            "oss_plus_flat_all_gather",
            "oss_plus flat all_gather",
            _oss(transport="all_gather", rule="flat"),
        ),
        Impl("oss_plus_sync", "oss_plus sync only", _sync_only),
        Impl("oss_plus_again", "oss_plus OSS fp32 (control: a second copy)", _oss()),
        Impl("fairscale", "fairscale OSS", _fairscale(False), needs="fairscale"),
        Impl("fairscale_fp16", "fairscale OSS fp16", _fairscale(True), needs="fairscale"),
        Impl("torch_zero", "torch ZeRO", _torch_zero(False)),
        Impl("torch_zero_bv", "torch ZeRO bucket view", _torch_zero(True)),
        Impl("unsharded", "unsharded optimizer", _unsharded),
        Impl("floor", "shard floor", _floor),
    )
}
#: Rows run only when named: ``oss_plus_again`` is the ``oss_plus`` row a second time, the
#: bench's own spread between two identical rows (issue 28: the bf16 wire at world size 1,
#: where it does the same work as fp32, measured 1.14-1.17x the fused floor on a GPU).
OPT_IN = ("oss_plus_again",)
#: The peers a target is measured against ("the faster of fairscale OSS and torch ZeRO").
PEERS = ("fairscale", "torch_zero", "torch_zero_bv")
