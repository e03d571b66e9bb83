"""The compute of a Muon step per parameter (PURE): Newton-Schulz on each 2-D matrix.

``torch.optim.Muon`` orthogonalizes each matrix's update by ``ns_steps`` (default 5)
Newton-Schulz iterations on ``X``, the ``s x l`` orientation of the ``m x n`` update
(``s = min(m, n)``, ``l = max(m, n)``). Each iteration is three matrix products:
``A = X @ X.T`` (``s * s * l`` multiply-adds), ``B = b * A + c * A @ A`` (``s**3``) and
``X = a * X + B @ X`` (``s * s * l``): ``s**2 * (2 * l + s)`` multiply-adds. Over 5 steps
that is the ``5 * s**2 * (2 * l + s)`` of issue 49, counted in multiply-adds; in FLOPs (a
multiply and an add each, as ``torch.utils.flop_counter`` counts them) it is twice that. The
momentum update and the scaling are a few elementwise passes, negligible next to it.

Example:
    >>> ns_flops((2, 3))  # s = 2, l = 3: 5 steps x 2 FLOPs x 2**2 x (2 * 3 + 2)
    320
    >>> ns_flops((4096, 11008)) == ns_flops((11008, 4096))
    True
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NS_STEPS", "ns_flops"]

#: ``torch.optim.Muon``'s default number of Newton-Schulz iterations.
NS_STEPS = 5


def ns_flops(shape: Sequence[int], steps: int = NS_STEPS) -> int:
    """FLOPs of ``steps`` Newton-Schulz iterations on a matrix of ``shape`` (2 per
    multiply-add); 0 for a shape that is not 2-D (Muon steps only matrices).

    Raises:
        ValueError: ``steps`` < 0.
    """
    if steps < 0:
        raise ValueError(f"ns_flops: steps must be >= 0, got {steps}")
    if len(shape) != 2:
        return 0
    short, long = sorted(shape)
    return 2 * steps * short * short * (2 * long + short)
