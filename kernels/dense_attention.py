"""Attention of a long prefill span over dense keys through torch's cuDNN fused attention, with its log-sum-exp.

Why: on the H200 cuDNN's fused attention ran an 8,192-query causal chunk at 631 TFLOP/s against 325 for this
engine's paged Triton kernel (bench/results/session11, the attention_backends part); at 32K it is a third of an
8K chunk's pass. It reads dense K/V only, so a span's keys come from the layer's own K/V (its diagonal block)
and from its prefix gathered out of the pool in fixed blocks (engine/layers/paged_attention.py); each piece
returns its log-sum-exp, and the pieces are merged (merge) as the paged kernel's passes chain.

cuDNN builds an execution plan per shape, the first time it meets one (tens of milliseconds): queries are padded
to a multiple of QUERY_BUCKET and prefix blocks are PREFIX_BLOCK keys, so serving meets a small fixed set of
shapes, all built by warm_up() before a server is ready.
"""

from __future__ import annotations

import torch
from headroom.kernels.attention_merge import merge_two, naive_attention_with_lse

# Query rows are padded up to a multiple of this (extra rows are computed and dropped; a causal block's real rows
# never see the padded keys after them).
QUERY_BUCKET = 512
# Prefix keys are gathered and attended in blocks of this many; the prefix's last partial block goes to the paged
# kernel instead, so every dense block has this one key count.
PREFIX_BLOCK = 8192

# None: not probed yet; then whether this torch and GPU run cuDNN's attention at our shapes (GQA, head dim).
_available: dict[tuple, bool] = {}


def padded_rows(rows: int) -> int:
    return -(-rows // QUERY_BUCKET) * QUERY_BUCKET


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [L, Hq, D], k/v [S, Hkv, D] -> (out [L, Hq, D], lse [L, Hq] fp32, natural log)."""
    got = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True, 0.0, causal, False,
        scale=scale)
    return to_rows(got[0], got[1])


def to_rows(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's [1, H, L, D] output and [1, H, L] (or [1, H, L, 1]) log-sum-exp as rows: out [L, H, D] a view (its last
    dim contiguous, as every consumer needs), lse [L, H] fp32 contiguous, as the paged kernel's continuation
    (prev) takes it."""
    heads, rows = out.shape[1], out.shape[2]
    return out[0].transpose(0, 1), lse.reshape(heads, rows).transpose(0, 1).float().contiguous()


def available(q: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether cuDNN attention runs here at q's head count and dim with num_kv_heads (probed once per shape
    class on a tiny input, so that a torch or driver without it falls back to the paged kernel, never fails)."""
    if not q.is_cuda:
        return False
    key = (q.device, q.dtype, q.shape[1], num_kv_heads, q.shape[2])
    if key not in _available:
        try:
            probe = torch.randn(QUERY_BUCKET, q.shape[1], q.shape[2], device=q.device, dtype=q.dtype)
            keys = probe[:, :num_kv_heads].contiguous()
            out, lse = _cudnn(probe, keys, keys, True, q.shape[2] ** -0.5)
            want, want_lse = naive_attention_with_lse(probe[:64], keys[:64], keys[:64],
                                                      torch.arange(64, device=q.device), q.shape[2] ** -0.5)
            _available[key] = bool((out[:64].float() - want.float()).abs().max() < 0.05
                                   and (lse[:64] - want_lse).abs().max() < 0.05)
        except (RuntimeError, NotImplementedError):
            _available[key] = False
    return _available[key]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [L, Hq, D]; k, v [S, Hkv, D]. causal: S == L and query i sees keys 0..i; else every query sees every key.
    Returns (out [L, Hq, D] in q's dtype, lse [L, Hq] fp32). cuDNN on CUDA (queries padded to QUERY_BUCKET),
    naive_dense_attention elsewhere."""
    if causal and k.shape[0] != q.shape[0]:
        raise ValueError(f"dense attention: a causal block needs as many keys as queries ({k.shape[0]} != {q.shape[0]})")
    if not q.is_cuda:
        return naive_dense_attention(q, k, v, causal, scale)
    rows = q.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        pad = (0, 0, 0, 0, 0, padded - rows)
        q = torch.nn.functional.pad(q, pad)
        if causal:
            k, v = torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
    out, lse = _cudnn(q, k, v, causal, scale)
    return out[:rows], lse[:rows]


def naive_dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for dense_attention (fp32 softmax, naive_attention_with_lse)."""
    rows = torch.arange(q.shape[0], device=q.device)
    seen = rows if causal else torch.full_like(rows, k.shape[0] - 1)
    return naive_attention_with_lse(q, k, v, seen, scale)


def merge(a: torch.Tensor, a_lse: torch.Tensor, b: torch.Tensor, b_lse: torch.Tensor, out: torch.Tensor,
          out_lse: torch.Tensor) -> None:
    """Attention over two disjoint key ranges (a, b [N, H, D], any float dtype; lses [N, H] fp32) merged into out
    (its own dtype) and out_lse; out / out_lse may be a / a_lse. One Triton launch on CUDA (a long span's pieces:
    about fifteen torch kernels a merge otherwise, 22 ms of a 32K prompt's passes on the H200, session 12),
    merge_two's arithmetic elsewhere."""
    if a.is_cuda:
        from headroom.kernels.attention_merge_triton import merge_pair_into

        merge_pair_into(a, a_lse, b, b_lse, out, out_lse)
        return
    merged, lse = merge_two(a.float(), a_lse, b, b_lse)
    out.copy_(merged)
    out_lse.copy_(lse)


def warm_up(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
            max_rows: int) -> int:
    """Build cuDNN's plan for every shape serving can meet (the causal block and the prefix block of each query
    bucket up to max_rows, the chunk); returns how many, 0 where cuDNN attention is not available here."""
    if not available(torch.empty(1, num_heads, head_dim, device=device, dtype=dtype), num_kv_heads):
        return 0
    # Separate key and value tensors, as serving passes them (not one tensor twice).
    keys, values = (torch.zeros(max(PREFIX_BLOCK, padded_rows(max_rows)), num_kv_heads, head_dim, device=device,
                                dtype=dtype) for _ in range(2))
    built = 0
    for rows in range(QUERY_BUCKET, padded_rows(max_rows) + 1, QUERY_BUCKET):
        q = torch.zeros(rows, num_heads, head_dim, device=device, dtype=dtype)
        diagonal, lse = dense_attention(q, keys[:rows], values[:rows], True, head_dim**-0.5)
        part, part_lse = dense_attention(q, keys[:PREFIX_BLOCK], values[:PREFIX_BLOCK], False, head_dim**-0.5)
        built += 2
    if not built:
        return 0
    # Every merge a span's pieces take (engine/layers/paged_attention.py): the diagonal into an fp32 accumulator or
    # straight into the output, the accumulator in place or into the output; each dtype pair is a kernel variant.
    acc = torch.empty(diagonal.shape, device=device, dtype=torch.float32)
    merge(diagonal, lse, part, part_lse, acc, lse.clone())
    merge(acc, lse.clone(), part, part_lse, acc, lse.clone())
    merge(acc, lse.clone(), part, part_lse, torch.empty_like(q), lse.clone())
    merge(diagonal, lse, part, part_lse, torch.empty_like(q), lse.clone())
    return built
