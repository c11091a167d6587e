"""Gated DeltaNet on the GPU through fla-core (pinned 0.6.0): chunked prefill and recurrent decode, many
sequences in one varlen call, with the same contract as kernels/gated_delta.py's naive_gated_delta_rule.

fla applies the q/k L2 norm (eps 1e-6 inside the square root, as the reference) and the 1/sqrt(Dk) scale in
its kernels, and maps value head i to q/k head i // (Hv / Hk), as repeat_interleave does. Used only on CUDA
when fla imports; everything else runs the reference.
"""

from __future__ import annotations

import contextvars
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from headroom.kernels.gated_delta import naive_gated_delta_rule
from headroom.kernels.host_copy import upload

# fla's kernels autotune on first use: several configs compiled and timed per kernel and key, a large part of
# a cold start (62 s of the first warm-up pass on the H200). This file holds the configs they picked on a GPU
# (bench/engine_speed.py's fla_configs part), per GPU and for the fla and Triton versions that picked them.
# They are put into the autotuners' own caches (Triton's Autotuner.cache, which fla's CachedAutotuner extends)
# right after fla is imported, so a shipped key compiles one config instead of timing all; any other key
# still autotunes.
TUNED_CONFIGS = Path(__file__).with_name("fla_tuned_configs.json")
# fla's l2norm_fwd default, inside the square root as in naive_gated_delta_rule.
QK_NORM_EPS = 1e-6
# Rows per chunk of fla's chunked gated delta rule (chunk_gated_delta_rule's chunk_size default).
FLA_CHUNK = 64
_CONFIG_FIELDS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
# The shipped entries for this GPU, waiting for fla's import (use_tuned_fla_configs sets them).
_pending: dict[str, dict[str, dict]] | None = None
# What gated_delta_rule_varlen imports; import_in_background starts it early.
FLA_MODULE = "fla.ops.gated_delta_rule"
_importing: threading.Thread | None = None
# The context variables the import set on its thread that the threads launching fla's kernels need: Triton's
# allocator (triton/runtime/_allocation.py's ContextVar "_allocator"), which fla sets at import on GPUs with TMA.
# Only those: whatever else an import leaves in its thread's context stays there, as it would have.
CONTEXT_TAKEN = frozenset({"_allocator"})
_import_context: list[tuple[contextvars.ContextVar, Any]] = []
_context_taken = threading.local()

logger = logging.getLogger("headroom.kernels")


def import_in_background(module: str = FLA_MODULE) -> threading.Thread | None:
    """Import fla's ops on a thread of their own, from now until the first Gated DeltaNet call needs them.

    Why: importing fla imports every op it has, and through their torch.compile decorators torch's dynamo and
    inductor and sympy: 7-10 s of a 50 s cold start on an H100 (session 25's sampled stacks,
    bench/stack_sampler.py), inside the first prefill pass of the warm-up. It holds the GIL most of its time: the
    runner starts it once its weights and pools are in place, so that it runs beside cuDNN's plan builds and the
    capture's compiles (started before the weights' load, it slowed that load by about what it took out of the
    pass: session 25, call 4; session 26).
    gated_delta_rule_varlen waits for it before its own import (then a lookup), so two threads never import fla's
    modules at once. An import that fails here is logged; the call's own import raises it where it always did.
    Create Triton's driver first (kernels/compile_ahead.py create_triton_driver): fla's import uses it."""
    global _importing
    if _importing is not None or module in sys.modules:
        return None

    def run() -> None:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - raised again by the import that needs it
            logger.warning("importing %s ahead failed: %s: %s", module, type(exc).__name__, exc)
        # A thread starts with an empty context: whatever it holds now, the import set.
        _import_context[:] = [(var, value) for var, value in contextvars.copy_context().items()
                              if var.name in CONTEXT_TAKEN]

    _importing = threading.Thread(target=run, name="headroom-fla-import", daemon=True)
    _importing.start()
    return _importing


def wait_for_import() -> None:
    """Block until import_in_background's import (if any) has finished (then a None check: every prefill's Gated
    DeltaNet call asks), and give the calling thread the context variables the import set that it has no value of
    its own for: set on the import's thread, fla's Triton allocator (TMA GPUs) would be missing on the threads that
    launch its kernels, which the import on the first caller's thread used to give that thread."""
    global _importing
    if _importing is not None:
        _importing.join()
        _importing = None
    if _import_context and not getattr(_context_taken, "done", False):
        own = contextvars.copy_context()
        for var, value in _import_context:
            if var not in own:
                var.set(value)
        _context_taken.done = True


def use_tuned_fla_configs(device: torch.device) -> str | None:
    """Before fla's first use: take the shipped configs for this GPU, unless the user set FLA_CACHE_MODE (fla's
    own config cache) or the versions differ. Returns what was taken, for the log, or None."""
    global _pending
    if device.type != "cuda" or "FLA_CACHE_MODE" in os.environ or not TUNED_CONFIGS.exists():
        return None
    tuned = json.loads(TUNED_CONFIGS.read_text()).get(gpu_name(device))
    if not tuned or tuned.get("versions") != _versions():
        return None
    # Seeded by gated_delta_rule_varlen once fla's modules are imported.
    _pending = tuned["autotuners"]
    return f"{sum(len(v) for v in _pending.values())} keys of {len(_pending)} kernels"


def gpu_name(device: torch.device | None = None) -> str:
    """The GPU's name with one separator: 'NVIDIA H200' -> 'NVIDIA_H200'."""
    return re.sub(r"[^0-9A-Za-z]+", "_", torch.cuda.get_device_name(device)).strip("_")


def _versions() -> dict[str, str]:
    return {name: importlib.metadata.version(dist) for name, dist in (("fla", "fla-core"), ("triton", "triton"))}


def _autotuners() -> dict[str, Any]:
    """Every Triton autotuner fla has defined so far, by 'module:attribute' (heuristics wrappers unwrapped).
    Recognised by class name, as this module must not import Triton (the CPU path never does)."""

    def is_autotuner(obj: Any) -> bool:
        return any(c.__name__ == "Autotuner" for c in type(obj).__mro__)

    found: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for attribute, obj in list(vars(module).items()):
            for _ in range(4):
                if obj is None or is_autotuner(obj):
                    break
                obj = getattr(obj, "fn", None)
            if obj is not None and is_autotuner(obj):
                found[f"{name}:{attribute}"] = obj
    return found


def _describe(config: Any) -> dict:
    return {"kwargs": dict(config.kwargs), **{field: getattr(config, field, None) for field in _CONFIG_FIELDS}}


def harvest_fla_configs() -> dict:
    """The configs fla's autotuners picked in this process, as TUNED_CONFIGS stores them for this GPU (run after
    the shapes serving uses have run)."""
    autotuners = {name: {json.dumps(list(key), default=str): _describe(config) for key, config in tuner.cache.items()}
                  for name, tuner in _autotuners().items() if tuner.cache}
    return {gpu_name(): {"versions": _versions(), "autotuners": autotuners}}


def _seed_autotuners() -> int:
    """Put the pending shipped configs into fla's autotuner caches; returns the keys seeded. A config that is no
    longer among the kernel's candidates is skipped (that key autotunes as usual)."""
    global _pending
    if not _pending:
        return 0
    seeded = 0
    for name, tuner in _autotuners().items():
        for key, wanted in _pending.get(name, {}).items():
            match = next((c for c in tuner.configs if _describe(c) == wanted), None)
            if match is not None:
                tuner.cache.setdefault(tuple(json.loads(key)), match)
                seeded += 1
    _pending = None
    return seeded


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
    cu_seqlens_cpu: torch.Tensor | None = None, qk_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """B sequences flattened: q, k [N, Hk, Dk]; v [N, Hv, Dv]; g (log decay), beta [N, Hv]; states [B, Hv, Dk, Dv]
    (initial, any float dtype); cu_seqlens [B+1] int64, sequence b owning rows cu_seqlens[b]..cu_seqlens[b+1]-1.

    Returns (out [N, Hv, Dv] in v's dtype, final states [B, Hv, Dk, Dv] fp32). is_decode (every sequence one
    token) picks fla's fused recurrent kernel; otherwise the chunked one. None: read from cu_seqlens.
    cu_seqlens_cpu: the same bounds on the host, from which the chunked path's chunk index is built here and
    uploaded without a stream sync (chunk_index). qk_normed: q and k already L2-normed (QK_NORM_EPS), so the chunked path skips fla's
    own norm (the recurrent one norms inside its kernel, free).
    """
    _check(q, k, v, g, beta, states, cu_seqlens)
    wait_for_import()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    if _pending:
        _seed_autotuners()
    if is_decode is None:
        is_decode = q.shape[0] == cu_seqlens.shape[0] - 1
    args = {"g": g[None].float(), "beta": beta[None].to(q.dtype), "initial_state": states.float(),
            "output_final_state": True, "cu_seqlens": cu_seqlens.long()}
    if is_decode:
        out, final = fused_recurrent_gated_delta_rule(q[None], k[None], v[None], use_qk_l2norm_in_kernel=True, **args)
    else:
        if cu_seqlens_cpu is not None:
            # fla builds it from cu_seqlens_cpu with a blocking copy to the device (a stream sync in every GDN layer
            # and round of a prefill, which kept the host from running ahead of the GPU): hand it over instead.
            args["chunk_indices"] = upload(chunk_index(cu_seqlens_cpu.tolist()), q.device)
        out, final = chunk_gated_delta_rule(q[None], k[None], v[None], use_qk_l2norm_in_kernel=not qk_normed, **args)
    return out[0].to(v.dtype), final.float()


def chunk_index(bounds: list[int], chunk_size: int = FLA_CHUNK) -> torch.Tensor:
    """fla's chunk index of a varlen call (its prepare_chunk_indices): int64 [num_chunks, 2], one row per chunk of
    chunk_size rows, (sequence, chunk within the sequence), sequences in order. bounds: cu_seqlens on the host."""
    rows = [(b, j) for b in range(len(bounds) - 1) for j in range(-(-(bounds[b + 1] - bounds[b]) // chunk_size))]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 2)


def fla_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for naive_gated_delta_rule (one sequence): state [Hv, Dk, Dv] -> (out [T, Hv, Dv], state fp32)."""
    cu_seqlens = torch.tensor([0, q.shape[0]], dtype=torch.long, device=q.device)
    out, final = gated_delta_rule_varlen(q, k, v, g, beta, state[None], cu_seqlens)
    return out, final[0]


def naive_gated_delta_rule_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, cu_seqlens: torch.Tensor, is_decode: bool | None = None, qk_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for gated_delta_rule_varlen: naive_gated_delta_rule per sequence."""
    _check(q, k, v, g, beta, states, cu_seqlens)
    out = torch.empty_like(v)
    finals = torch.empty(states.shape, dtype=torch.float32, device=states.device)
    bounds = cu_seqlens.tolist()
    for b in range(len(bounds) - 1):
        rows = slice(bounds[b], bounds[b + 1])
        out[rows], finals[b] = naive_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], states[b],
                                                          qk_normed)
    return out, finals
