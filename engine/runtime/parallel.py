"""Tensor parallelism: one process per device, joined by torch.distributed (NCCL on GPUs, gloo on CPUs).

Rank r of N holds 1/N of every projection: attention heads, KV heads (replicated when there are fewer KV
heads than ranks), Gated DeltaNet key and value heads, MLP and expert widths, and vocabulary rows. Its
model therefore runs a ModelConfig with the head counts and widths divided by N (shard_config), and its KV
and SSM pools come out at the planner's per-GPU size. The residual stream stays replicated: the
row-parallel outputs (o_proj, out_proj, down_proj, a MoE block's sum) are all-reduced in the decoder
layer, the vocabulary-parallel embedding is all-reduced, and the rank's logit columns are all-gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from headroom.engine.models.config import ModelConfig

# Bounds one collective (gloo) and NCCL's watchdog: a pass may be a long prefill, never minutes of it.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the group; group is torch.distributed's default process group."""

    rank: int
    size: int
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place; every rank gets the same bits."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[..., vocab_rows] of each rank -> [..., vocab_size] (padding rows of the last shard dropped)."""
        local = logits.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    """Rank r runs on the r-th GPU after the configured one (cuda -> cuda:r, cuda:2 -> cuda:2+r); a CPU is shared."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def join_group(rank: int, size: int, device: str, store: Any) -> TensorParallel:
    """Enter the process group through `store` (a TCPStore the leader hosts); blocks until all ranks have."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    tp = TensorParallel(rank, size, dist.group.WORLD)
    # NCCL creates its communicator at the first collective: now, never inside a decode-graph capture.
    tp.all_reduce(torch.zeros(1, device=device))
    return tp


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def vocab_rows(vocab_size: int, size: int) -> int:
    """Vocabulary rows each rank holds; the last shard is zero-padded up to this."""
    return -(-vocab_size // size)


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The ModelConfig one rank's model runs: head counts and widths divided by size, its vocabulary rows.

    Raises ValueError naming the first field size does not divide (KV heads may instead be replicated:
    size a multiple of them)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return config
    divided = {
        "num_attention_heads": ("num_heads", config.num_heads),
        "intermediate_size": ("intermediate_size", config.intermediate_size),
        "linear_num_key_heads": ("linear_num_key_heads", config.linear_num_key_heads),
        "linear_num_value_heads": ("linear_num_value_heads", config.linear_num_value_heads),
        "moe_intermediate_size": ("moe_intermediate_size", config.moe_intermediate_size),
        "shared_expert_intermediate_size": ("shared_expert_intermediate_size", config.shared_expert_intermediate_size),
    }
    for hf_name, (_, value) in divided.items():
        if value % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide {hf_name} {value} of {config.architecture}")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(
            f"tensor_parallel_size {size} neither divides num_key_value_heads {kv} nor is a multiple of it"
        )
    fields = {field: value // size for field, value in divided.values()}
    return replace(config, **fields, num_kv_heads=max(1, kv // size), vocab_size=vocab_rows(config.vocab_size, size))


def vocab_parallel_embedding(token_ids: torch.Tensor, shard: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """token_ids [N] -> [N, hidden]: each rank looks up the ids in its rows, zeros elsewhere, then the sum."""
    if tp is None:
        return F.embedding(token_ids, shard)
    rows = shard.shape[0]
    local = token_ids - tp.rank * rows
    inside = (local >= 0) & (local < rows)
    x = F.embedding(local.clamp(0, rows - 1), shard)
    x.masked_fill_(~inside.unsqueeze(-1), 0)
    return tp.all_reduce(x)
