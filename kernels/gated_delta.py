"""Gated delta rule (Gated DeltaNet's recurrence), one sequence, token by token.

S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t,
with q, k L2-normalised and q scaled by 1/sqrt(Dk). State in fp32.
"""

from __future__ import annotations

import torch


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def naive_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    qk_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (log decay, <= 0), beta [T, Hv]; state [Hv, Dk, Dv] fp32.

    Each q/k head serves Hv // Hk consecutive value heads. Returns (out [T, Hv, Dv] in v's dtype,
    new state [Hv, Dk, Dv] fp32). qk_normed: q and k are L2-normed already (the prefill conv's fused norm).
    """
    num_v_heads = v.shape[1]
    repeat = num_v_heads // q.shape[1]
    scale = q.shape[-1] ** -0.5
    q, k = q.float().repeat_interleave(repeat, dim=1), k.float().repeat_interleave(repeat, dim=1)
    if not qk_normed:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    v32, g32, beta32 = v.float(), g.float(), beta.float()
    s = state.float().clone()
    out = torch.empty_like(v32)
    for t in range(v.shape[0]):
        s = s * g32[t].exp()[:, None, None]
        predicted = (s * k[t][:, :, None]).sum(dim=1)
        delta = (v32[t] - predicted) * beta32[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = (s * q[t][:, :, None]).sum(dim=1)
    return out.to(v.dtype), s


def naive_gated_delta_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, bounds: torch.Tensor | None = None, qk_normed: bool = False,
) -> torch.Tensor:
    """One token for each of B sequences, states updated in place in the pool; with bounds [B + 1], sequence b's
    rows bounds[b]..bounds[b+1] token by token (the short prefill chunks).

    q, k [N, Hk, Dk]; v [N, Hv, Dv]; g, beta [N, Hv]; states [S, Hv, Dk, Dv] fp32 (the SSM pool's recurrent
    states of one layer); slots [B] rows of states. Returns out [N, Hv, Dv] in v's dtype. qk_normed as
    naive_gated_delta_rule's."""
    out = torch.empty_like(v)
    for b, slot in enumerate(slots.tolist()):
        rows = slice(b, b + 1) if bounds is None else slice(int(bounds[b]), int(bounds[b + 1]))
        out[rows], new_state = naive_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], states[slot],
                                                      qk_normed)
        states[slot].copy_(new_state)
    return out


def naive_gated_delta_tail(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, out: torch.Tensor, pool: torch.Tensor, row_lo: list[int], row_hi: list[int],
    snapshots: list[list[tuple[int, int]]], qk_normed: bool = False,
) -> None:
    """The last rows of B sequences, token by token, with state snapshots on the way (in-pass checkpoints near a
    prompt's end). Sequence b owns rows row_lo[b]..row_hi[b]-1 of q, k [N, Hk, Dk], v [N, Hv, Dv], g, beta
    [N, Hv]; it starts from states[b] ([B, Hv, Dk, Dv] fp32, left holding its final state); its outputs go to
    out [N, Hv, Dv] at its rows; for each (n, slot) of snapshots[b] (ascending, 0 < n < its row count) the state
    after its first n rows is written to pool[slot]. qk_normed as naive_gated_delta_rule's."""
    for b, (lo, hi) in enumerate(zip(row_lo, row_hi, strict=True)):
        state, start = states[b], lo
        for n, slot in [*snapshots[b], (hi - lo, None)]:
            rows = slice(start, lo + n)
            out[rows], state = naive_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], state,
                                                      qk_normed)
            if slot is not None:
                pool[slot] = state.to(pool.dtype)
            start = lo + n
        states[b] = state
