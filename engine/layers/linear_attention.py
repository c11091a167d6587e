"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): in-projections, short causal conv, gated delta rule,
gated RMSNorm, out-projection. Per-sequence conv and recurrent state live in the SSM pool."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from headroom.engine.layers.gdn_projection import gdn_projection
from headroom.engine.layers.linear import linear_weight
from headroom.engine.layers.normed_rows import NormedRows
from headroom.engine.layers.residual import Projection, deferred
from headroom.engine.models.config import ModelConfig
from headroom.engine.runtime.forward_batch import GDN_BOUNDS, GDN_SEGMENTS, GDN_SLOTS, ForwardBatch
from headroom.engine.runtime.ssm_pool import SSMPool
from headroom.kernels import ops
from headroom.kernels.host_copy import to_device

# Passes whose every chunk is at most this many rows run the delta rule token by token in one launch per layer
# (kernels/gdn_decode.py) instead of fla's chunked kernels, whose ~8 launches a layer cost over 1 ms of host time
# each layer whatever the length. H200, 4B model, a lone prompt's pass (bench/engine_speed.py short_passes, session
# 7): 8 tokens 22.7 ms against 48.9 through fla, 30 tokens 31.7 against 50.5, 64: 27.6 / 62.2, 256: 35.9 / 51.7,
# four 30-token prompts 34.2 / 54.5. The recurrence is sequential in the rows (~2.7 us a row and layer), so long
# chunks stay with fla.
RECURRENT_ROWS = 256
# A decode step's conv runs in the epilogue of the in-projection's GEMV (kernels/gemv.py CONV) where that GEMV runs,
# for passes of at most FUSED_CONV_ROWS rows: a launch a layer fewer, 24 a step on the 4B model, whose conv launches
# took 0.047 / 0.054 / 0.064 ms of a 2.78 / 3.29 / 3.67 ms graphed step at batch 1 / 8 / 16 on the H200 (session 16's
# profile_decode_batches). Measured on the H200 (session 19, bench/engine_speed.py fused_conv, graphed decode of the 4B
# model, fused against not in one process, the same tokens): batch 1 0.9% faster a step (2.776 against 2.800 ms),
# batch 8 1.6% and batch 16 0.6% slower (the epilogue on the tensor-core tiles costs more than the launch it saves).
# Off with HEADROOM_FUSED_CONV=0.
FUSED_CONV = os.environ.get("HEADROOM_FUSED_CONV", "1") == "1"
# Still one row only with the step-tuned tables: on an H100 (session 33, fused_conv_rows, FUSED_CONV_ROWS 16
# against 1, graph replay) batch 8 1.050x and batch 16 1.005x the step, the same tokens.
FUSED_CONV_ROWS = 1
# A decode step of at least DECODE_STEP_FUSED_ROWS sequences may run the layer's gated output norm (DECODE_GATE_NORM)
# and its short conv (DECODE_CONV_IN_STEP) inside the delta rule's kernel (kernels/gdn_decode.py gate_norm: a
# head's value blocks meet at the last to arrive; conv: the step convolves the in-projection's raw columns, the last
# reader of a key head's carried inputs rolling them) instead of a gated_rms_norm launch before the out-projection
# and a conv launch before the step: 24 launches a step fewer each on the 4B model, whose gated norms and convs
# took 0.047 and 0.063 ms of a 4.19 ms batch-8 step on an H100 (session 28's profile_decode_batches, PDL off). One
# row has both in its GEMVs already (residual.py; FUSED_CONV above). Both lose, so both stay off: on an H100
# (session 29, bench/engine_speed.py fused_gate_norm / fused_conv_in_step, graph replay fused against not in one
# process, two calls) the norm 1.004-1.005x the step at batch 8 and 1.019-1.021x at 16, the conv 1.029-1.032x and
# 1.044-1.045x (every one of a key head's readers convolves its q and k, and each program ends on an atomic).
# HEADROOM_DECODE_GATE_NORM=1, HEADROOM_DECODE_CONV_IN_STEP=1 turn them on.
DECODE_GATE_NORM = os.environ.get("HEADROOM_DECODE_GATE_NORM", "0") == "1"
DECODE_CONV_IN_STEP = os.environ.get("HEADROOM_DECODE_CONV_IN_STEP", "0") == "1"
DECODE_STEP_FUSED_ROWS = 2


class GatedDeltaNet:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, pool_layer: int):
        self.config = config
        self.pool_layer = pool_layer
        # Qwen3.5's separate or Qwen3-Next's fused, head-grouped in-projections.
        self.project = gdn_projection(config, weights, prefix)
        self.conv_weight = weights[prefix + "conv1d.weight"][:, 0, :]
        self.dt_bias = weights[prefix + "dt_bias"]
        # Decay rate per value head, fp32 so that exp() cannot overflow in half precision.
        self.neg_a = -weights[prefix + "A_log"].float().exp()
        self.norm = weights[prefix + "norm.weight"]
        self.out_proj = linear_weight(config, weights, prefix + "out_proj")
        self.key_dim = config.linear_num_key_heads * config.linear_key_head_dim

    def __call__(self, x: torch.Tensor | NormedRows, batch: ForwardBatch, ssm_pool: SSMPool) -> torch.Tensor | Projection:
        """x [N, hidden] -> [N, hidden], or at decode the gated norm and out_proj still to run (residual.deferred:
        the decoder layer adds them to the residual in one GEMV); advances every item's SSM slot by its tokens."""
        cfg = self.config
        n = x.shape[0]
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        slots = batch.cached(GDN_SLOTS, lambda: _slot_index(batch, x.device))
        conv_states = ssm_pool.conv[self.pool_layer]
        # A decode step's conv in the in-projection's GEMV where it runs (FUSED_CONV), else its own kernel below.
        convolved = self.project.convolved(x, self.conv_weight, conv_states, slots) \
            if batch.is_decode_only and FUSED_CONV and n <= FUSED_CONV_ROWS else None
        mixed, z, b, a = convolved if convolved is not None else self.project(x)
        # A fused decode step makes its gates from the raw a and b itself (one launch a layer fewer).
        raw_gates = batch.is_decode_only and ops.decodes_with_raw_gates(x)
        beta, g = (b, a) if raw_gates else ops.gdn_gates(b, a, self.neg_a, self.dt_bias)
        qk_normed = False
        # Where the decode step's kernel runs them (DECODE_GATE_NORM, DECODE_CONV_IN_STEP), its gated norm and conv.
        step_fuses = batch.is_decode_only and n >= DECODE_STEP_FUSED_ROWS and ops.decodes_with_raw_gates(x)
        norm_in_step = step_fuses and DECODE_GATE_NORM and ops.decodes_with_gate_norm(x)
        conv_in_step = step_fuses and DECODE_CONV_IN_STEP and convolved is None and mixed.stride(-1) == 1
        if batch.is_decode_only:
            # One token per sequence: one batched conv step over the pool's states, in place (in the GEMV or the
            # delta rule's kernel where those run it).
            conv_out = mixed if convolved is not None or conv_in_step else ops.causal_conv1d_update(
                mixed, self.conv_weight, conv_states, slots)
            q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, hv * dv], dim=-1)
        else:
            if batch.has_captures:
                _capture_conv_states(mixed, conv_states, batch)
            # The q/k L2 norm in the fused conv's epilogue, once a row and head, for every path below: fla's
            # chunked rule then skips its own norm and input copies, and the token-by-token kernels (short
            # chunks, the checkpoint tail) two reductions a row in each of the Dv / block_v programs that share a
            # q/k head. qk_normed False where the conv did not norm (the reference, a head size not a power of 2).
            lengths = [span.length for span in batch.spans]
            q, k, v, qk_normed = ops.causal_conv1d_varlen(mixed, self.conv_weight, conv_states, slots,
                                                          _bounds(batch, x.device), lengths, self.key_dim, dk)
        q, k, v = q.reshape(n, -1, dk), k.reshape(n, -1, dk), v.reshape(n, hv, dv)
        recurrent = ssm_pool.recurrent[self.pool_layer]
        # Decode on the GPU: one fused step, states updated in place in the pool (None elsewhere); short chunks
        # token by token in the same launch.
        core = None
        if batch.is_decode_only:
            core = ops.gated_delta_decode(
                q, k, v, g, beta, recurrent, slots, raw_gates=(self.neg_a, self.dt_bias) if raw_gates else None,
                gate_norm=(z.reshape(n, hv, dv), self.norm, cfg.rms_norm_eps) if norm_in_step else None,
                conv=(mixed, self.conv_weight, conv_states) if conv_in_step else None)
            # (step_fuses holds only where the fused step runs)
            assert core is not None or not step_fuses
        elif not batch.has_captures and max(span.length for span in batch.spans) <= RECURRENT_ROWS:
            core = ops.gated_delta_decode(q, k, v, g, beta, recurrent, slots, _bounds(batch, x.device), qk_normed)
        if core is None:
            core = self._varlen(q, k, v, g, beta, recurrent, slots, batch, qk_normed)
        # Else the gated norm goes with the out-projection: at one-row decode both run in its GEMV, with the
        # residual add.
        return deferred(Projection(core.reshape(n, hv * dv), self.out_proj,
                                   gate_norm=None if norm_in_step else (z.reshape(n, hv * dv), self.norm,
                                                                        cfg.rms_norm_eps)))

    def _varlen(self, q, k, v, g, beta, recurrent, slots, batch: ForwardBatch, qk_normed: bool) -> torch.Tensor:
        """Prefill chunks (or decode off the fused path): the varlen call, or the reference per sequence.
        qk_normed: q and k come L2-normed from the conv."""
        n, hv, dv = v.shape
        if batch.has_captures:
            return _segmented(q, k, v, g, beta, recurrent, slots, batch, qk_normed)
        if q.is_cuda or batch.is_static:
            # One varlen call for every sequence of the pass (fla-core's kernels on the GPU).
            core, final = ops.gated_delta_rule_varlen(q, k, v, g, beta, recurrent[slots], _bounds(batch, q.device),
                                                      _bounds(batch, torch.device("cpu")), qk_normed=qk_normed)
            recurrent[slots] = final.to(recurrent.dtype)
        else:
            core = torch.empty((n, hv, dv), dtype=v.dtype, device=q.device)
            for span in batch.spans:
                slot = span.seq.ssm_slot
                rows = slice(span.offset, span.offset + span.length)
                out, new_state = ops.gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], recurrent[slot],
                                                      qk_normed=qk_normed)
                recurrent[slot].copy_(new_state)
                core[rows] = out
        return core


def _capture_conv_states(mixed: torch.Tensor, conv_states: torch.Tensor, batch: ForwardBatch) -> None:
    """Each capture's conv state - the K-1 inputs before it, some from the sequence's carried state when the
    capture is that close to the chunk's start - into its slot; before the conv overwrites the carried one."""
    width = conv_states.shape[-1]
    for span in batch.spans:
        old = conv_states[span.seq.ssm_slot] if span.captures else None
        for at, slot in span.captures:
            rows = mixed[span.offset + max(0, at - width) : span.offset + at].transpose(0, 1)
            window = rows if at >= width else torch.cat((old[:, at:], rows), dim=1)  # type: ignore[index]
            conv_states[slot].copy_(window)


# A span's captures within this many rows of its end run in one token-by-token launch (ops.gated_delta_tail)
# rather than a varlen round each: a round is a fla call per layer at a fixed host cost (H200, 4B model: a lone
# 256-token prompt's pass with its 3 stops took 140 ms as rounds, 47 ms without the stops). A span this short
# altogether runs all in the tail, as it would token by token without captures (RECURRENT_ROWS): its first
# round, up to its first capture, was a fla call per layer too (session 12: the 256-token prompt 58.4 ms with its
# stops against 20.0 without).
TAIL_ROWS = 256


@dataclass(frozen=True)
class _Round:
    """One varlen call of a pass with captures: the rows of every active span's piece (a slice where they are
    contiguous), those spans' indices into the pass's states, the pieces' bounds (on the device and on the host,
    as fla takes them), and (piece, capture slot) for each piece that ends at a capture."""

    rows: slice | torch.Tensor
    which: torch.Tensor
    bounds: torch.Tensor
    host_bounds: torch.Tensor
    saves: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _Segments:
    """How a pass with captures runs its delta rule, the same in every layer (built once, ForwardBatch-cached, so
    that a layer uploads no index of its own): varlen rounds, then the spans' tails in one token-by-token launch
    (tail_which: those spans' indices into the pass's states; tail: the launch's rows and snapshots)."""

    rounds: list[_Round]
    tail_which: torch.Tensor | None
    tail: ops.TailIndex | None


def _segments(batch: ForwardBatch, device: torch.device) -> _Segments:
    """Each span cut at its captures: round r runs every span's r-th piece; a span's pieces from the first cut
    within TAIL_ROWS of its end (its start, for a span that short) run in the tail launch instead, its captures
    there taken as snapshots."""
    spans = batch.spans
    cuts = [[0] + [at for at, _ in span.captures] + [span.length] for span in spans]
    # Where each span's tail starts: an index into its cuts, None for no tail.
    tails = [next((j for j in range(len(c) - 1) if c[-1] - c[j] <= TAIL_ROWS), None) for c in cuts]
    round_cuts = [c if j is None else c[: j + 1] for c, j in zip(cuts, tails, strict=True)]
    rounds = []
    for r in range(max(len(c) for c in round_cuts) - 1):
        active = [b for b, c in enumerate(round_cuts) if r < len(c) - 1]
        pieces = [(spans[b].offset + round_cuts[b][r], spans[b].offset + round_cuts[b][r + 1]) for b in active]
        contiguous = all(pieces[i][1] == pieces[i + 1][0] for i in range(len(pieces) - 1))
        rows: slice | torch.Tensor = slice(pieces[0][0], pieces[-1][1]) if contiguous else to_device(
            [row for lo, hi in pieces for row in range(lo, hi)], torch.long, device)
        bounds = [0]
        for lo, hi in pieces:
            bounds.append(bounds[-1] + hi - lo)
        # A piece before the tail ends at capture r.
        saves = tuple((i, spans[b].captures[r][1]) for i, b in enumerate(active) if r < len(spans[b].captures))
        rounds.append(_Round(rows, to_device(active, torch.long, device), to_device(bounds, torch.long, device),
                             torch.tensor(bounds), saves))
    with_tail = [b for b, j in enumerate(tails) if j is not None]
    if not with_tail:
        return _Segments(rounds, None, None)
    starts = [cuts[b][tails[b]] for b in with_tail]  # type: ignore[index]
    tail = ops.TailIndex([spans[b].offset + start for b, start in zip(with_tail, starts, strict=True)],
                         [spans[b].offset + spans[b].length for b in with_tail],
                         [[(at - start, slot) for at, slot in spans[b].captures if at > start]
                          for b, start in zip(with_tail, starts, strict=True)])
    return _Segments(rounds, to_device(with_tail, torch.long, device), tail)


def _segmented(q, k, v, g, beta, recurrent, slots, batch: ForwardBatch, qk_normed: bool) -> torch.Tensor:
    """The delta rule with in-pass checkpoints (_segments): round r runs every span's r-th piece in one varlen
    call from the state round r-1 left, a piece that ends at a capture leaving its state in the capture's slot;
    then the tails (the stops near a span's end every prompt takes: tail and exact repeat) in one launch that
    snapshots the captures in them. A prefill chunk so runs as one pass instead of one pass per stop (three to
    four extra passes of 30-50 ms each a prompt on the H200). qk_normed: q and k come L2-normed from the conv, for
    the rounds and the tail alike."""
    plan = batch.cached(GDN_SEGMENTS, lambda: _segments(batch, q.device))
    state = recurrent[slots].float()
    core = torch.empty_like(v)
    for round_ in plan.rounds:
        rows = round_.rows
        out, final = ops.gated_delta_rule_varlen(q[rows], k[rows], v[rows], g[rows], beta[rows], state[round_.which],
                                                 round_.bounds, round_.host_bounds, qk_normed=qk_normed)
        core[rows] = out
        state[round_.which] = final
        for i, slot in round_.saves:
            recurrent[slot] = final[i].to(recurrent.dtype)
    if plan.tail is not None:
        tail_states = state[plan.tail_which]
        ops.gated_delta_tail(q, k, v, g, beta, tail_states, core, recurrent, plan.tail, qk_normed)
        state[plan.tail_which] = tail_states
    recurrent[slots] = state.to(recurrent.dtype)
    return core


def _bounds(batch: ForwardBatch, device: torch.device) -> torch.Tensor:
    """Row bounds of the spans, int64 [num_spans + 1], once per pass and device (the CPU copy spares fla a
    device-to-host sync in every layer)."""
    # Decode graphs fill GDN_BOUNDS with their static tensor; the host copy has a key of its own.
    key = GDN_BOUNDS if device.type != "cpu" else GDN_BOUNDS + ".host"
    return batch.cached(key, lambda: to_device([0] + [s.offset + s.length for s in batch.spans], torch.long, device))


def _slot_index(batch: ForwardBatch, device: torch.device) -> torch.Tensor:
    """SSM slot of every span, int64 [num_spans]; a hybrid model needs one per running request."""
    missing = [span.seq.request_id for span in batch.spans if span.seq.ssm_slot is None]
    if missing:
        raise ValueError(f"requests {missing} have no SSM slot but the model is hybrid")
    return to_device([span.seq.ssm_slot for span in batch.spans], torch.long, device)
