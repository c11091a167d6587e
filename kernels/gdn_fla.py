"""Gated DeltaNet on the GPU through fla-core (pinned 0.6.0): chunked prefill and recurrent decode, many
sequences in one varlen call, with the same contract as kernels/gated_delta.py's naive_gated_delta_rule.

fla applies the q/k L2 norm (eps 1e-6 inside the square root, as the reference) and the 1/sqrt(Dk) scale in
its kernels, and maps value head i to q/k head i // (Hv / Hk), as repeat_interleave does. Used only on CUDA
when fla imports; everything else runs the reference.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch
from headroom.kernels.gated_delta import naive_gated_delta_rule

# fla's kernels autotune on first use: several configs compiled and timed per kernel and shape class, a large
# part of a cold start. This file holds the configs they picked on a GPU (bench/engine_speed.py's fla_configs
# part), per GPU and for the fla and Triton versions that picked them; fla reads them through its own config
# cache (FLA_CACHE_MODE=fuzzy), and any kernel or key it does not find still autotunes.
TUNED_CONFIGS = Path(__file__).with_name("fla_tuned_configs.json")


def use_tuned_fla_configs(device: torch.device) -> str | None:
    """Before fla's first import: point fla at the shipped configs for this GPU, unless the user set
    FLA_CACHE_MODE or the versions differ. Returns the directory used, or None."""
    if device.type != "cuda" or "FLA_CACHE_MODE" in os.environ or "fla.ops.utils.cache" in sys.modules:
        return None
    if not TUNED_CONFIGS.exists():
        return None
    tuned = json.loads(TUNED_CONFIGS.read_text()).get(_gpu_name(device))
    if not tuned or tuned.get("versions") != _versions():
        return None
    folder = Path(tempfile.mkdtemp(prefix="headroom-fla-configs-"))
    for kernel, content in tuned["kernels"].items():
        (folder / f"{kernel}.json").write_text(json.dumps(content))
    os.environ["FLA_CACHE_MODE"] = "fuzzy"
    os.environ["FLA_CONFIG_DIR"] = str(folder)
    return str(folder)


def _gpu_name(device: torch.device | None = None) -> str:
    """The GPU's name as fla names its config folders (its sanitize_gpu_name): 'NVIDIA H200' -> 'NVIDIA_H200'."""
    return re.sub(r"[^0-9A-Za-z]+", "_", torch.cuda.get_device_name(device)).strip("_")


def _versions() -> dict[str, str]:
    return {name: importlib.metadata.version(dist) for name, dist in (("fla", "fla-core"), ("triton", "triton"))}


def harvest_fla_configs() -> dict:
    """The configs fla's autotuners hold in this process, as TUNED_CONFIGS stores them for this GPU (run after
    the shapes serving uses have run)."""
    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner

    kernels: dict = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for tuner in vars(module).values():
            if not isinstance(tuner, CachedAutotuner) or not tuner.cache:
                continue
            entries = {AutotuneKey.key_hash(key): {"autotune_key": AutotuneKey.normalize_autotune_key(key), "config": {
                "kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                "num_ctas": cfg.num_ctas, "maxnreg": cfg.maxnreg}} for key, cfg in tuner.cache.items()}
            kernels.setdefault(tuner.kernel_name, {"kernel_name": tuner.kernel_name, "autotune_entries": {}})
            kernels[tuner.kernel_name]["autotune_entries"].update(entries)
    return {_gpu_name(): {"versions": _versions(), "kernels": kernels}}


def fla_available() -> bool:
    """True when fla-core is installed (the import itself is deferred to the first call)."""
    return importlib.util.find_spec("fla") is not None


def _check(q, k, v, g, beta, states, cu_seqlens) -> None:
    num_tokens, num_k_heads, key_dim = q.shape
    num_v_heads, value_dim = v.shape[1:]
    num_seqs = cu_seqlens.shape[0] - 1
    if k.shape != q.shape or v.shape[0] != num_tokens or num_v_heads % num_k_heads:
        raise ValueError(f"gated delta: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "(q, k [N, Hk, Dk]; v [N, Hv, Dv], Hv a multiple of Hk)")
    if g.shape != (num_tokens, num_v_heads) or beta.shape != (num_tokens, num_v_heads):
        raise ValueError(f"gated delta: g {tuple(g.shape)}, beta {tuple(beta.shape)} must be [{num_tokens}, {num_v_heads}]")
    if states.shape != (num_seqs, num_v_heads, key_dim, value_dim):
        raise ValueError(f"gated delta: states {tuple(states.shape)} must be [{num_seqs}, {num_v_heads}, {key_dim}, {value_dim}]")


def gated_delta_rule_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, cu_seqlens: torch.Tensor, is_decode: bool | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """B sequences flattened: q, k [N, Hk, Dk]; v [N, Hv, Dv]; g (log decay), beta [N, Hv]; states [B, Hv, Dk, Dv]
    (initial, any float dtype); cu_seqlens [B+1] int64, sequence b owning rows cu_seqlens[b]..cu_seqlens[b+1]-1.

    Returns (out [N, Hv, Dv] in v's dtype, final states [B, Hv, Dk, Dv] fp32). is_decode (every sequence one
    token) picks fla's fused recurrent kernel; otherwise the chunked one. None: read from cu_seqlens.
    cu_seqlens_cpu: the same bounds on the host, so that fla's chunked path builds its chunk index without a
    device-to-host sync.
    """
    _check(q, k, v, g, beta, states, cu_seqlens)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    if is_decode is None:
        is_decode = q.shape[0] == cu_seqlens.shape[0] - 1
    args = {"g": g[None].float(), "beta": beta[None].to(q.dtype), "initial_state": states.float(),
            "output_final_state": True, "use_qk_l2norm_in_kernel": True, "cu_seqlens": cu_seqlens.long()}
    if is_decode:
        out, final = fused_recurrent_gated_delta_rule(q[None], k[None], v[None], **args)
    else:
        if cu_seqlens_cpu is not None:
            args["cu_seqlens_cpu"] = cu_seqlens_cpu.long()
        out, final = chunk_gated_delta_rule(q[None], k[None], v[None], **args)
    return out[0].to(v.dtype), final.float()


def fla_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for naive_gated_delta_rule (one sequence): state [Hv, Dk, Dv] -> (out [T, Hv, Dv], state fp32)."""
    cu_seqlens = torch.tensor([0, q.shape[0]], dtype=torch.long, device=q.device)
    out, final = gated_delta_rule_varlen(q, k, v, g, beta, state[None], cu_seqlens)
    return out, final[0]


def naive_gated_delta_rule_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, cu_seqlens: torch.Tensor, is_decode: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for gated_delta_rule_varlen: naive_gated_delta_rule per sequence."""
    _check(q, k, v, g, beta, states, cu_seqlens)
    out = torch.empty_like(v)
    finals = torch.empty(states.shape, dtype=torch.float32, device=states.device)
    bounds = cu_seqlens.tolist()
    for b in range(len(bounds) - 1):
        rows = slice(bounds[b], bounds[b + 1])
        out[rows], finals[b] = naive_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], states[b])
    return out, finals
