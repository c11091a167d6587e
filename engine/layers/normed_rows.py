"""A layer's input rows with their RMSNorm still to apply (engine/layers/residual.py makes them at decode)."""

from __future__ import annotations

import torch
from headroom.kernels import ops


class NormedRows:
    """rms_norm(x) [N, D] not yet computed: x the residual stream as the GEMV that added the last projection left
    it, sumsq its rows' partial sums of squares [N, parts] from the same launch. Stands in for the normed tensor
    where a module's first linear reads it (layers/linear.py's linear norms it in its GEMV, ops.normed_dense_linear):
    same shape, dtype and device; tensor() norms it for any other use (once). scaled: x times the norm's weight
    from that launch too (residual.PRESCALED_NORM), which that GEMV reads instead of x, scaling its output rows by
    their 1 / rms (the norm factored out of the projection)."""

    def __init__(self, x: torch.Tensor, sumsq: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool,
                 scaled: torch.Tensor | None = None):
        self.x, self.sumsq, self.weight, self.eps, self.unit_offset = x, sumsq, weight, eps, unit_offset
        self.scaled = scaled
        self._normed: torch.Tensor | None = None

    shape = property(lambda self: self.x.shape)
    dtype = property(lambda self: self.x.dtype)
    device = property(lambda self: self.x.device)
    is_cuda = property(lambda self: self.x.is_cuda)

    def tensor(self) -> torch.Tensor:
        if self._normed is None:
            self._normed = ops.rms_norm(self.x, self.weight, self.eps, self.unit_offset)
        return self._normed

    def gemv_operands(self) -> tuple[torch.Tensor, ops.RowNormArgs]:
        """(the rows a GEMV reads, the norm it applies to them: ops.RowNormArgs) for the fused linears."""
        rows = self.scaled if self.scaled is not None else self.x
        return rows, (self.sumsq, self.weight, self.eps, self.unit_offset, self.scaled is not None)

    def take(self, index: torch.Tensor) -> NormedRows:
        """These rows at index (each row's sums of squares and prescaled row go with it)."""
        return NormedRows(self.x[index], self.sumsq[index], self.weight, self.eps, self.unit_offset,
                          self.scaled[index] if self.scaled is not None else None)
