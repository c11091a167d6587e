"""The engine with this repo's fused Triton kernels (norms, rotary, gates, GDN decode step, merges) against the
naive path, on the CPU through the Triton interpreter: same logits and tokens for prefill, mixed and decode
passes, bf16-granular and KIVI pools. On CUDA the kernels run compiled (bench/engine_speed.py checks them)."""

from __future__ import annotations

import os

# triton.jit reads this when a kernel module is first imported (here, inside ops' fused branches).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from headroom.engine.llm import LLM  # noqa: E402
from headroom.kernels import ops  # noqa: E402

from tests.engine.helpers import random_prompt  # noqa: E402


def _generate(model_dir, vocab: int, kv_dtype: str):
    llm = LLM(str(model_dir), max_total_tokens=512, ssm_slots=8, chunked_prefill_size=5, max_running_requests=3,
              kv_dtype=kv_dtype, cuda_graph_max_batch=0)
    prompts = [random_prompt(vocab, n, seed=n) for n in (3, 11, 40)]
    return llm.generate(prompts, max_new_tokens=4, ignore_eos=True)


def _count_calls(monkeypatch) -> dict[str, int]:
    from headroom.kernels import gdn_decode, norm_triton, rotary_triton

    calls = {"rms_norm": 0, "rms_norm_rotary": 0, "qk_norm_rotary_store": 0, "gated_delta_decode": 0,
             "gated_delta_decode rows": 0}
    for module in (norm_triton, rotary_triton, gdn_decode):
        for name in calls:
            if hasattr(module, name):
                def counted(*args, _run=getattr(module, name), _name=name, **kwargs):
                    calls[_name] += 1
                    if _name == "gated_delta_decode" and len(args) > 7 and args[7] is not None:
                        # bounds: short prefill chunks, token by token
                        calls[_name + " rows"] += 1
                    return _run(*args, **kwargs)
                monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("kv_dtype", ["auto", "int2"])
def test_fused_kernels_match_the_naive_path(tiny_model_factory, monkeypatch, kv_dtype):
    model_dir, reference = tiny_model_factory("qwen3_5", 0)
    vocab = reference.config.vocab_size
    naive = _generate(model_dir, vocab, kv_dtype)
    # Fused on the CPU: the Triton kernels in the interpreter.
    monkeypatch.setattr(ops, "_fused", lambda x, op: True)
    calls = _count_calls(monkeypatch)
    fused = _generate(model_dir, vocab, kv_dtype)
    # The fused branches really ran, decode steps and the short chunks' token-by-token delta rule included.
    # A bf16 pool's attention layers norm, rotate and store q/k/v in one kernel; the others norm and rotate alone.
    assert calls["rms_norm"] and calls["rms_norm_rotary" if kv_dtype != "auto" else "qk_norm_rotary_store"] \
        and calls["gated_delta_decode"]
    assert calls["gated_delta_decode rows"]
    for a, b in zip(naive, fused, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.prompt_logits, a.prompt_logits, atol=2e-4, rtol=2e-4)


def test_fused_ops_turn_off_one_at_a_time():
    """set_fused's off names run their references alone (the logit check's ablation); an unknown name is refused
    with the list of ops."""
    from types import SimpleNamespace

    cuda_like = SimpleNamespace(is_cuda=True)
    try:
        ops.set_fused(True, off=("silu_mul",))
        assert not ops._fused(cuda_like, "silu_mul")
        assert all(ops._fused(cuda_like, op) for op in ops.FUSED_OPS if op != "silu_mul")
        ops.set_fused(False)
        assert not any(ops._fused(cuda_like, op) for op in ops.FUSED_OPS)
        with pytest.raises(ValueError, match=r"no fused op named \['silu'\]; the ops are \['rms_norm'"):
            ops.set_fused(True, off=("silu",))
    finally:
        ops.set_fused(True)
    assert ops._fused(cuda_like, "silu_mul") and not ops._fused(SimpleNamespace(is_cuda=False), "silu_mul")


def test_fused_conv_norms_qk_for_the_varlen_rule(tiny_model_factory, monkeypatch):
    """Chunks longer than RECURRENT_ROWS take the one varlen delta rule: there the prefill conv writes q | k | v
    planes with q and k L2-normed in its epilogue, and the rule skips its own norm; same tokens and logits."""
    from headroom.engine.layers import linear_attention
    from headroom.kernels import conv_varlen

    model_dir, reference = tiny_model_factory("qwen3_5", 0)
    vocab = reference.config.vocab_size
    naive = _generate(model_dir, vocab, "auto")
    monkeypatch.setattr(ops, "_fused", lambda x, op: True)
    monkeypatch.setattr(linear_attention, "RECURRENT_ROWS", 3)
    norm_dims: list[int] = []

    def counted(*args, _run=conv_varlen.causal_conv1d_varlen_qkv, **kwargs):
        norm_dims.append(args[7])
        return _run(*args, **kwargs)

    monkeypatch.setattr(conv_varlen, "causal_conv1d_varlen_qkv", counted)
    fused = _generate(model_dir, vocab, "auto")
    # The 4- and 5-row chunks' passes were normed in the conv (per 8-channel head).
    assert reference.config.linear_key_head_dim in norm_dims
    for a, b in zip(naive, fused, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.prompt_logits, a.prompt_logits, atol=2e-4, rtol=2e-4)
