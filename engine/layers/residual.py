"""The residual stream between two projections: a layer's last linear, the residual add, the next RMSNorm and the
next linear. At decode (FUSED_ROWS: one row, where it was measured to win) the add rides on the first GEMV and the
norm on the second (kernels/gemv.py RESIDUAL and NORM; Gated DeltaNet's output norm on its out-projection, GATED)
where the GEMV table has both shapes, so no norm kernel runs between them: 88 launches a step fewer on the 4B
model, whose 65 norms and 24 gated norms took 0.177 of a 2.78 ms step on the H200 (session 16's
profile_decode_batches). Everywhere else (prefill, cuBLAS shapes, quantized weights, a bias, tensor parallel, the
CPU) the same objects run the unfused ops, so callers need not know which path ran.

Mixers and the MLP hand back their last linear as a Projection, not its output; the decoder layer adds it to the
residual (add_and_norm) and hands the next module NormedRows, which its first linear norms as it loads them (or,
with PRESCALED_NORM at several rows, reads with the norm's weight already applied and scales by 1 / rms after)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from headroom.engine.layers.linear import LinearWeight, linear
from headroom.engine.layers.normed_rows import NormedRows
from headroom.kernels import ops

# Off with HEADROOM_FUSED_RESIDUAL=0 (the add and the norm then run as add_rms_norm between the GEMVs).
FUSED_RESIDUAL = os.environ.get("HEADROOM_FUSED_RESIDUAL", "1") == "1"
# The most rows a pass fuses at (the GEMV runs up to ops.GEMV_ROWS). Measured on an H100 (session 18, graphed decode
# of the 4B model with a GEMV table swept for it, bench/results/session18/): batch 1 1.5% faster a step fused
# (3.503 against 3.557 ms), batch 8 6.7% and batch 16 22% slower: the fused tensor-core and CUDA-core tiles of
# several rows lose more in their loops than the norm launches cost.
FUSED_ROWS = 1
# Passes of FUSED_ROWS + 1 to ops.GEMV_ROWS rows: the add in the projection's GEMV, which also stores the sum
# times the next RMSNorm's weight, and the next linear's GEMV multiplies those rows with its plain loop and scales
# its output rows by their 1 / rms (kernels/gemv.py residual_prescaled_gemv, RowNorm.prescaled): no norm kernel
# between the GEMVs and no norm in the second's loop (the NORM loop lost at several rows, above). Not bit for bit
# the unfused path: r * (1 + g) is rounded where rms_norm rounds r * rstd * (1 + g). Gated DeltaNet's output norm
# runs as its own kernel first. HEADROOM_PRESCALED_NORM=1 turns it on. Off: it loses. On an H100 (session 33,
# bench/engine_speed.py fused_prescaled_norm, graph replay on against off in one process) batch 8 took 3.780 ms
# a step against 3.749 (1.008x) and batch 16 4.196 against 4.172 (1.006x), 64 norm launches fewer; batch 1 never
# takes it. Unmeasured on the H200.
# (The prescaled rows are stored whether or not the next module's GEMV reads them: a MoE block, a quantized or
# biased linear, a shape outside the table norm the sum itself, so they cost one unread [rows, hidden] store there.)
# (Session 31's first try, the next norm by the residual GEMV's last program, bit for bit but 1.11x the step at
# batch 8 and 16 on an H100, session 32: one program norming every row after every block's arrival.)
PRESCALED_NORM = os.environ.get("HEADROOM_PRESCALED_NORM", "0") == "1"


@dataclass(frozen=True)
class Projection:
    """weight @ a (+ bias) not yet computed: a mixer's or MLP's out-projection. up: SwiGLU's down projection, whose
    input is silu(a) * up (a the gate half). gate_norm (z [N, K], weight [head], eps): Gated DeltaNet's
    out-projection, whose input is gated_rms_norm(a, z) over heads of `head` channels."""

    a: torch.Tensor
    weight: LinearWeight
    bias: torch.Tensor | None = None
    up: torch.Tensor | None = None
    gate_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def gated_input(self) -> torch.Tensor:
        """gate_norm's input to the projection, gated_rms_norm(a, z) over heads [N, K] (gate_norm set)."""
        assert self.gate_norm is not None
        z, weight, eps = self.gate_norm
        rows, head = self.a.shape[0], weight.shape[0]
        return ops.gated_rms_norm(self.a.view(rows, -1, head), z.view(rows, -1, head), weight, eps).reshape(rows, -1)

    def run(self) -> torch.Tensor:
        """The projection's output [N, out] on its own (the unfused path)."""
        if self.gate_norm is not None:
            return linear(self.gated_input(), self.weight, self.bias)
        if self.up is None:
            return linear(self.a, self.weight, self.bias)
        if isinstance(self.weight, torch.Tensor) and self.bias is None:
            # Decode on CUDA where the GEMV table has the fused shape: the activation is made inside the down
            # projection's GEMV (no silu_mul launch, no [N, I] activation written and read back).
            out = ops.silu_mul_dense_linear(self.a, self.up, self.weight)
            if out is not None:
                return out
        return linear(ops.silu_mul(self.a, self.up), self.weight, self.bias)


def deferred(p: Projection) -> torch.Tensor | Projection:
    """p itself where the decoder layer may add it inside its GEMV (a pass of at most FUSED_ROWS rows), else its
    output now: a longer pass then frees p's input, and the tensors it views (a Gated DeltaNet layer's whole
    in-projection output, through z), as its module returns, as before the fusion (8,192 rows of the 4B model
    hold about 0.5 GiB of them)."""
    rows = p.a.shape[0]
    if FUSED_RESIDUAL and (rows <= min(FUSED_ROWS, ops.GEMV_ROWS) or (PRESCALED_NORM and rows <= ops.GEMV_ROWS)):
        return p
    return p.run()


def add_and_norm(
    x: torch.Tensor, delta: torch.Tensor | Projection | None, weight: torch.Tensor, eps: float, unit_offset: bool,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor | NormedRows, torch.Tensor]:
    """The decoder's residual step: (rms_norm(x + delta), x + delta); delta None: (rms_norm(x), x). A Projection
    delta is added in its own GEMV where one runs it (decode-sized, dense, no bias, the table's shape) and the norm
    is then left to the next linear (NormedRows). reduce (tensor parallel's all-reduce of a row-parallel output)
    runs on the projection's output first, so it takes the unfused path."""
    if isinstance(delta, Projection):
        if delta.a.shape[0] <= FUSED_ROWS:
            fused = _add_projection(delta, x) if reduce is None else None
            if fused is not None:
                summed, sumsq = fused
                return NormedRows(summed, sumsq, weight, eps, unit_offset), summed
        elif reduce is None:
            prescaled = _add_projection_prescaled(delta, x, weight, unit_offset)
            if isinstance(prescaled, tuple):
                summed, sumsq, scaled = prescaled
                return NormedRows(summed, sumsq, weight, eps, unit_offset, scaled), summed
            if prescaled is not None:
                delta = prescaled
        if isinstance(delta, Projection):
            delta = delta.run()
    if delta is None:
        return ops.rms_norm(x, weight, eps, unit_offset), x
    return ops.add_rms_norm(reduce(delta) if reduce is not None else delta, x, weight, eps, unit_offset)


def as_tensor(rows: torch.Tensor | NormedRows) -> torch.Tensor:
    """The normed rows as a tensor, for modules that read them other than through their first linear (MoE)."""
    return rows.tensor() if isinstance(rows, NormedRows) else rows


def take_rows(rows: torch.Tensor | NormedRows, index: torch.Tensor) -> torch.Tensor | NormedRows:
    """rows[index], normed or still to norm (each row's sums of squares go with it)."""
    if isinstance(rows, NormedRows):
        return rows.take(index)
    return rows[index]


def _fusable(p: Projection) -> bool:
    """Whether p's GEMV may add the residual: the fusion on, a dense weight, no bias."""
    return FUSED_RESIDUAL and p.bias is None and isinstance(p.weight, torch.Tensor)


def _add_projection_prescaled(p: Projection, residual: torch.Tensor, weight: torch.Tensor, unit_offset: bool,
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | torch.Tensor | None:
    """(residual + p's output, its rows' sums of squares, the sum times the next norm's weight) in p's GEMV
    (PRESCALED_NORM). Where that GEMV does not run: a gated projection's output (its norm, already run, not run
    twice), else None (the caller runs p). A gated projection's norm runs first as its own kernel (GATED's loop
    norms each tile in registers)."""
    if not PRESCALED_NORM or not _fusable(p):
        return None
    a = p.gated_input() if p.gate_norm is not None else p.a
    fused = ops.residual_prescaled_dense_linear(a, p.weight, residual, weight, unit_offset, p.up)
    if fused is None and p.gate_norm is not None:
        return linear(a, p.weight)
    return fused


def _add_projection(p: Projection, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(residual + p's output, its rows' partial sums of squares) in p's GEMV, or None where that does not run."""
    if not _fusable(p):
        return None
    return ops.residual_dense_linear(p.a, p.weight, residual, p.up, p.gate_norm)
