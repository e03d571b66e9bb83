"""What the step benchmark runs (:mod:`oss_plus.bench.step_bench`): :class:`BenchConfig`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oss_plus.bench.impls import IMPLS, OPT_IN, check_common, linear_layers

__all__ = ["ALL_IMPLS", "FULL_SWEEP_SIZES", "MAIN_IMPLS", "SWEEP_IMPLS", "BenchConfig"]

#: Rows of the size / world-size sweeps (when available).
SWEEP_IMPLS = ("oss_plus", "fairscale", "torch_zero_bv", "floor")
#: Rows of the default run: oss_plus (fp32 and bf16 wire), its peers and the two references.
MAIN_IMPLS = (
    "oss_plus",
    "oss_plus_bf16",
    "fairscale",
    "torch_zero",
    "torch_zero_bv",
    "unsharded",
    "floor",
)
#: Every row but the opt-in ones (``--full``).
ALL_IMPLS = tuple(k for k in IMPLS if k not in OPT_IN)
#: Model sizes (M params) of ``--full``'s size sweep.
FULL_SWEEP_SIZES = (5.0, 20.0, 50.0)


@dataclass(frozen=True)
class BenchConfig:
    """What to run. Sizes are in millions of parameters.

    Raises:
        ValueError: a value out of range or an unknown optimizer / implementation.
    """

    size: float = 20.0
    width: int = 1024
    world_size: int = 2
    optimizer: str = "adam"
    steps: int = 6
    warmup: int = 2
    rounds: int = 3
    memory_steps: int = 3
    impls: tuple[str, ...] = MAIN_IMPLS
    sweep_sizes: tuple[float, ...] = ()
    sweep_worlds: tuple[int, ...] = ()
    sweep_impls: tuple[str, ...] = SWEEP_IMPLS
    memory: bool = True
    interleave: bool = True
    memory_impls: tuple[str, ...] | None = None
    profile: tuple[str, ...] = ()
    backend: str = "auto"
    threads: int = 0
    seed: int = 0
    tensors: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        check_common(self, ("width", "world_size", "steps", "rounds"))
        if self.tensors < 0:
            raise ValueError(f"--tensors must be >= 0 (0: Linear layers), got {self.tensors}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda needs a CUDA device; use --device cpu")
        named = (*self.impls, *self.sweep_impls, *self.profile, *(self.memory_impls or ()))
        unknown = [k for k in named if k not in IMPLS]
        if unknown:
            raise ValueError(f"unknown implementation(s) {unknown}: choose from {list(IMPLS)}")
        if (
            self.size <= 0
            or any(s <= 0 for s in self.sweep_sizes)
            or any(w < 1 for w in self.sweep_worlds)
        ):
            raise ValueError("sizes must be > 0 (millions of params) and world sizes >= 1")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"--backend must be auto, gloo or nccl, got {self.backend!r}")

    def layers(self, size: float | None = None) -> int:
        """Return how many Linear(width, width) layers make ``size`` million params (>= 1)."""
        return linear_layers(self.size if size is None else size, self.width)

    def tensor_numel(self, size: float) -> int:
        """Elements of each of the ``tensors`` equal tensors that make ``size`` M params."""
        return max(1, round(size * 1e6 / max(1, self.tensors)))

    def numel(self, size: float) -> int:
        """Elements of the model of ``size`` M params as built (layers or equal tensors)."""
        if self.tensors:
            return self.tensors * self.tensor_numel(size)
        return self.layers(size) * (self.width * self.width + self.width)
