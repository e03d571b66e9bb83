"""Bytes of optimizer state per parameter tensor, per optimizer (PURE: a table, no import of
the optimizers' packages).

Low-bit optimizers keep their state in blocks: codes of a few bits per element, an fp32
scale per block, sometimes a lookup table per tensor, and fp32 state for tensors too small
(or of a size not made of whole blocks) to quantize. So a rank's state depends on the
tensors it owns, not only on their elements: :meth:`OptimizerState.rank_bytes` sums the
tensors' own costs (``oss-plus plan --optimizer``; :func:`oss_plus.planning.scale.scale_rows`).

The numbers are read from the optimizers' sources (torchao 0.18, bitsandbytes 0.50; fp32
params) and checked against the state the real optimizers hold after a step by
``tests/test_state_memory.py`` (skipped where a package is missing).

Example:
    >>> OPTIMIZER_STATES["adamw"].tensor_bytes(1000)  # two fp32 moments and the step
    8004
    >>> OPTIMIZER_STATES["adamw8bit"].tensor_bytes(4096)  # 2 x (codes, 16 scales, qmap), step
    10372
    >>> OPTIMIZER_STATES["adamw8bit"].tensor_bytes(4000)  # under 4096 elements: fp32
    32004
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["OPTIMIZER_STATES", "UNKNOWN_OPTIMIZER", "OptimizerState", "optimizer_state"]

#: Raised for an optimizer name the table does not hold.
UNKNOWN_OPTIMIZER = "unknown optimizer {name!r}: choose one of {known}"


@dataclass(frozen=True)
class OptimizerState:
    """How one optimizer lays out the state of a parameter tensor of ``n`` fp32 elements.

    A tensor is quantized when ``n >= min_numel`` (and, with ``whole_blocks``, ``n`` is a
    multiple of ``block``); its state is then ``states`` code arrays of ``bits`` per element,
    one fp32 scale per ``block`` elements and code array (the last block partial unless
    ``whole_blocks``), and ``qmap_bytes`` of lookup tables. Otherwise it is ``states`` fp32
    arrays. Every tensor also holds ``step_bytes`` (a float32 step tensor; 0 for a Python int).

    Attributes:
        name: the name ``oss-plus plan --optimizer`` takes.
        source: the class it describes.
        states: state arrays per tensor (Adam: 2 moments; SGD with momentum: 1).
        bits: bits per element of a quantized array (32: never quantized).
        block: elements per fp32 scale (0: no scales).
        min_numel: tensors with fewer elements keep fp32 state.
        whole_blocks: tensors whose size is not a multiple of ``block`` keep fp32 state
            (torchao); otherwise the last block is partial (bitsandbytes).
        qmap_bytes: lookup tables held by every quantized tensor (torchao: one per array).
        shared_bytes: lookup tables held once by the optimizer, when it quantizes any
            tensor (bitsandbytes).
        step_bytes: the step counter of every tensor.
    """

    name: str
    source: str
    states: int
    bits: int = 32
    block: int = 0
    min_numel: int = 0
    whole_blocks: bool = False
    qmap_bytes: int = 0
    shared_bytes: int = 0
    step_bytes: int = 4

    def __post_init__(self) -> None:
        if self.bits not in (4, 8, 32) or self.states < 0:
            raise ValueError(
                f"OptimizerState {self.name!r}: bits must be 4, 8 or 32 and states >= 0, "
                f"got bits={self.bits}, states={self.states}"
            )
        if self.bits < 32 and self.block < 1:
            raise ValueError(f"OptimizerState {self.name!r}: a quantized state needs a block")

    def quantized(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` elements gets low-bit state."""
        if self.bits == 32 or numel < self.min_numel:
            return False
        return not (self.whole_blocks and numel % self.block)

    def tensor_bytes(self, numel: int) -> int:
        """Bytes of state for one tensor of ``numel`` elements (its step included)."""
        if not self.quantized(numel):
            return self.states * 4 * numel + self.step_bytes
        blocks = -(-numel // self.block)
        codes = numel * self.bits // 8
        return self.states * (codes + 4 * blocks) + self.qmap_bytes + self.step_bytes

    def rank_bytes(self, numels: Iterable[int]) -> int:
        """Bytes of state for the tensors of ``numels`` in one optimizer (one rank)."""
        numels = list(numels)
        shared = self.shared_bytes if any(self.quantized(n) for n in numels) else 0
        return sum(self.tensor_bytes(n) for n in numels) + shared

    def describe(self) -> str:
        """One line: the class and its per-element and per-tensor costs."""
        if self.bits == 32:
            return f"{self.source}: {4 * self.states} B per element, {self.step_bytes} B per tensor"
        per = self.states * self.bits / 8 + self.states * 4 / self.block
        return (
            f"{self.source}: {per:.4g} B per element ({self.states} x {self.bits}-bit codes, "
            f"an fp32 scale per {self.block}), fp32 ({4 * self.states} B) for tensors under "
            f"{self.min_numel:,} elements"
            + (f" or not a multiple of {self.block}" if self.whole_blocks else "")
        )


def _torchao(name: str, source: str, bits: int, block: int, qmap_entries: int) -> OptimizerState:
    """A torchao Adam: fp32 state under 4096 elements or for a size not made of whole blocks;
    a float32 lookup table of ``qmap_entries`` per code array (none for fp8)."""
    qmaps = 2 * 4 * qmap_entries
    return OptimizerState(name, source, 2, bits, block, 4096, True, qmap_bytes=qmaps)


def _bnb(name: str, source: str) -> OptimizerState:
    """A bitsandbytes 8-bit Adam: blocks of 256 (the last partial), fp32 state under 4096
    elements (``min_8bit_size``), two 256-entry tables shared by every tensor, a Python int
    step."""
    return OptimizerState(name, source, 2, 8, 256, 4096, shared_bytes=2 * 256 * 4, step_bytes=0)


#: The optimizers ``oss-plus plan --optimizer`` knows, by name (fp32 params).
OPTIMIZER_STATES: dict[str, OptimizerState] = {
    s.name: s
    for s in (
        OptimizerState("adam", "torch.optim.Adam", 2),
        OptimizerState("adamw", "torch.optim.AdamW", 2),
        OptimizerState("sgd", "torch.optim.SGD (momentum > 0)", 1, step_bytes=0),
        _torchao("adamw8bit", "torchao.optim.AdamW8bit", 8, 256, 256),
        _torchao("adamw4bit", "torchao.optim.AdamW4bit", 4, 128, 16),
        _torchao("adamwfp8", "torchao.optim.AdamWFp8", 8, 256, 0),
        _bnb("bnb-adam8bit", "bitsandbytes.optim.Adam8bit"),
        _bnb("bnb-adamw8bit", "bitsandbytes.optim.AdamW8bit"),
    )
}


def optimizer_state(name: str) -> OptimizerState:
    """Return the table's entry for ``name``.

    Raises:
        ValueError: a name not in :data:`OPTIMIZER_STATES`.
    """
    if name not in OPTIMIZER_STATES:
        raise ValueError(UNKNOWN_OPTIMIZER.format(name=name, known=", ".join(OPTIMIZER_STATES)))
    return OPTIMIZER_STATES[name]
