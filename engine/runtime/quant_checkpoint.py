"""Write a quantized copy of a dense checkpoint in a published layout (tests and bench: same random weights,
quantized): block-wise FP8 as the model makers ship it, or INT4 groups in compressed-tensors' pack-quantized
layout. The engine never quantizes at load; this is how checkpoints for it are made without a hub."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from headroom.engine.plan.quant_format import weight_quant_from_config
from headroom.kernels.quant_pack import quantize_fp8_block, quantize_int4_group
from safetensors.torch import load_file, save_file

# Left in the model dtype, as the published Qwen3.5 / Qwen3-Next releases leave them: the output head, the
# GDN gate and decay projections, the MoE router and the shared-expert gate (small, precision-sensitive).
DEFAULT_IGNORE = ("lm_head", "in_proj_a", "in_proj_b", "in_proj_ba", "mlp.gate", "shared_expert_gate")


def fp8_block_config(block: tuple[int, int] = (128, 128), ignore: tuple[str, ...] = DEFAULT_IGNORE) -> dict[str, Any]:
    """quantization_config of a block-wise FP8 release."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block), "modules_to_not_convert": list(ignore)}


def int4_pack_config(group: int = 128, symmetric: bool = True, ignore: tuple[str, ...] = DEFAULT_IGNORE) -> dict[str, Any]:
    """quantization_config of a compressed-tensors W4A16 checkpoint, as llm-compressor writes it."""
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "group_size": group, "strategy": "group",
               "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None}


def quantize_tensors(tensors: dict[str, torch.Tensor], quant_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> the same with every quantized linear's `.weight` replaced by its codes and scales."""
    quant = weight_quant_from_config({"quantization_config": quant_config})
    assert quant is not None
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name[: -len(".weight")]
        is_linear = name.endswith(".weight") and tensor.dim() == 2 and "embed_tokens" not in name
        if not (is_linear and quant.is_quantized(module)):
            out[name] = tensor
        elif quant.method == "fp8_block":
            out[name], out[module + ".weight_scale_inv"] = quantize_fp8_block(tensor, quant.block)
        else:
            packed, scale, zero = quantize_int4_group(tensor, quant.block[1], quant.symmetric)
            out[module + ".weight_packed"], out[module + ".weight_scale"] = packed, scale
            out[module + ".weight_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int64)
            if zero is not None:
                out[module + ".weight_zero_point"] = zero
    return out


def write_quantized_checkpoint(src: Path, dst: Path, quant_config: dict[str, Any], device: str = "cpu") -> Path:
    """Copy model directory src to dst with its linear weights quantized per quant_config (on device); returns dst."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(path, dst / path.name)
    for i, path in enumerate(sorted(src.glob("*.safetensors"))):
        tensors = quantize_tensors(load_file(str(path), device=device), quant_config)
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(dst / f"model-{i:05d}.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
