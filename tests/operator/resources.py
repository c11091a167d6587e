"""InferenceServer manifests shared by the operator tests (a small Qwen3.5-style hybrid model)."""

from __future__ import annotations

import copy
from typing import Any

NAMESPACE = "llm"

# A Qwen3.5-4B-shaped config.json (hybrid: 3 Gated DeltaNet layers per full-attention layer).
CONFIG_JSON: dict[str, Any] = {
    "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
    "hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 256, "intermediate_size": 9216, "vocab_size": 248320, "full_attention_interval": 4,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}

SPEC: dict[str, Any] = {
    "model": {"pvc": {"claimName": "models"}, "path": "qwen3.5-4b", "config": CONFIG_JSON},
    "gpu": {"count": 1, "memory": "24Gi"},
    "engine": {"kind": "builtin"},
    "kvCache": {"dtype": "bf16"},
    "targets": {"contextLength": 32768, "maxRunningRequests": 4, "maxNewTokens": 512},
    "smokeTest": {"enabled": True, "timeoutSeconds": 60},
    "rollout": {"autoRollback": True, "readyTimeoutSeconds": 600},
}


def inference_server(name: str = "qwen", **spec_changes: Any) -> dict[str, Any]:
    """A valid InferenceServer; spec_changes replace top-level spec keys (None removes one)."""
    spec = copy.deepcopy(SPEC)
    for key, value in spec_changes.items():
        if value is None:
            spec.pop(key, None)
        else:
            spec[key] = value
    return {
        "apiVersion": "headroom.dev/v1alpha1",
        "kind": "InferenceServer",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }
