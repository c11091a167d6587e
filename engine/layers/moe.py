"""Qwen3-Next sparse MoE MLP: softmax router, top-k experts (optionally renormalised), plus a shared
SwiGLU expert scaled by a sigmoid gate. Experts stay the checkpoint's per-expert tensors."""

from __future__ import annotations

import torch
from headroom.engine.layers.linear import LinearWeight, linear, linear_weight
from headroom.engine.layers.mlp import SwiGLU
from headroom.engine.models.config import ModelConfig


class SparseMoE:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str):
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.router = linear_weight(config, weights, prefix + "gate")
        self.experts = [SwiGLU(config, weights, f"{prefix}experts.{e}.") for e in range(config.num_experts)]
        # (shared SwiGLU expert, its gate weight [1, hidden]); None when shared_expert_intermediate_size is 0.
        self.shared: tuple[SwiGLU, LinearWeight] | None = None
        if config.shared_expert_intermediate_size:
            self.shared = (SwiGLU(config, weights, prefix + "shared_expert."),
                           linear_weight(config, weights, prefix + "shared_expert_gate"))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (expert ids [N, k] int64, weights [N, k] in x's dtype)."""
        logits = linear(x, self.router)
        # Probabilities in fp32 whatever the model dtype, so that half precision cannot flip the top-k.
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_probs, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        return top_ids, top_probs.to(logits.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        top_ids, top_weights = self.route(x)
        out = torch.zeros_like(x)
        # Reference path: one gathered SwiGLU per expert that some token picked (a fused MoE kernel goes here).
        for expert_id in torch.unique(top_ids).tolist():
            rows, rank = torch.where(top_ids == expert_id)
            expert_out = self.experts[expert_id](x[rows]) * top_weights[rows, rank, None]
            out.index_add_(0, rows, expert_out)
        if self.shared is not None:
            shared_expert, shared_gate = self.shared
            out = out + torch.sigmoid(linear(x, shared_gate)) * shared_expert(x)
        return out
