"""Naive kernel references against independent formulations (transformers' own where it has one).

Grid: odd sizes, fp32 and bf16. These references are the CPU path and the oracle for Triton (issue 8).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from headroom.kernels import ops

DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype: torch.dtype) -> dict[str, float]:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim"), [(1, 2, 1, 8), (7, 6, 2, 12), (33, 3, 3, 40)])
def test_prefix_attention_matches_sdpa(dtype, tokens, heads, kv_heads, dim):
    prefix = 5
    q = torch.randn(tokens, heads, dim, dtype=dtype)
    k = torch.randn(prefix + tokens, kv_heads, dim, dtype=dtype)
    v = torch.randn(prefix + tokens, kv_heads, dim, dtype=dtype)
    positions = torch.arange(prefix, prefix + tokens)
    got = ops.prefix_attention(q, k, v, positions, dim**-0.5)
    mask = torch.arange(prefix + tokens)[None, :] <= positions[:, None]
    group = heads // kv_heads
    want = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().repeat_interleave(group, 1).transpose(0, 1),
        v.float().repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask,
    ).transpose(0, 1)
    torch.testing.assert_close(got.float(), want, **tol(dtype))


@pytest.mark.parametrize(("tokens", "channels", "kernel"), [(1, 5, 4), (9, 17, 3), (30, 8, 4)])
def test_causal_conv1d_with_carried_state_equals_one_pass(tokens, channels, kernel):
    x = torch.randn(tokens, channels)
    weight = torch.randn(channels, kernel)
    state = torch.zeros(channels, kernel - 1)
    whole, _ = ops.causal_conv1d(x, weight, state)
    want = F.silu(F.conv1d(x.T[None], weight[:, None], padding=kernel - 1, groups=channels)[0, :, :tokens]).T
    torch.testing.assert_close(whole, want)
    pieces, carried = [], state
    for start in range(0, tokens, 4):
        out, carried = ops.causal_conv1d(x[start : start + 4], weight, carried)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces), whole)


@pytest.mark.parametrize(("tokens", "k_heads", "v_heads", "dk", "dv"), [(1, 1, 1, 4, 4), (13, 2, 4, 8, 6), (70, 1, 3, 6, 10)])
def test_gated_delta_rule_matches_transformers_chunked(tokens, k_heads, v_heads, dk, dv):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k = torch.randn(tokens, k_heads, dk), torch.randn(tokens, k_heads, dk)
    v = torch.randn(tokens, v_heads, dv)
    g, beta = -torch.rand(tokens, v_heads), torch.rand(tokens, v_heads)
    state = torch.randn(v_heads, dk, dv) * 0.1
    got, got_state = ops.gated_delta_rule(q, k, v, g, beta, state)
    want, want_state = torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(got, want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_state, want_state[0], atol=1e-4, rtol=1e-4)


def test_gated_delta_rule_takes_normed_qk():
    """qk_normed (q, k L2-normed by the prefill conv's epilogue) gives what the rule's own norm gives."""
    from headroom.kernels.gated_delta import naive_gated_delta_rule
    from headroom.kernels.norm import naive_l2_norm

    q, k, v = torch.randn(9, 2, 8), torch.randn(9, 2, 8), torch.randn(9, 4, 6)
    g, beta, state = -torch.rand(9, 4), torch.rand(9, 4), torch.randn(4, 8, 6) * 0.1
    want, want_state = naive_gated_delta_rule(q, k, v, g, beta, state)
    got, got_state = naive_gated_delta_rule(naive_l2_norm(q, 1e-6), naive_l2_norm(k, 1e-6), v, g, beta, state,
                                            qk_normed=True)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_state, want_state)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [4, 16])
def test_rotary_matches_transformers(dtype, rotary_dim):
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    x = torch.randn(11, 3, 16, dtype=dtype)
    positions = torch.arange(3, 14)
    inv_freq = ops.rotary_inv_freq(rotary_dim, 10000.0)
    freqs = positions[:, None].float() * inv_freq[None]
    emb = torch.cat((freqs, freqs), -1)
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], emb.cos()[None].to(dtype), emb.sin()[None].to(dtype))
    torch.testing.assert_close(ops.apply_rotary(x, positions, inv_freq), want[0].transpose(0, 1), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_match_transformers(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    x, gate = torch.randn(5, 3, 24, dtype=dtype), torch.randn(5, 3, 24, dtype=dtype)
    for cls, offset in ((Qwen3RMSNorm, False), (Qwen3_5RMSNorm, True)):
        norm = cls(24, eps=1e-6).to(dtype)
        torch.nn.init.normal_(norm.weight)
        with torch.no_grad():
            torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-6, offset), norm(x))
    gated = Qwen3_5RMSNormGated(24, eps=1e-6).to(dtype)
    torch.nn.init.normal_(gated.weight)
    with torch.no_grad():
        torch.testing.assert_close(ops.gated_rms_norm(x, gate, gated.weight, 1e-6), gated(x, gate))
