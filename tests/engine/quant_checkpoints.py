"""Quantized tiny checkpoints and their fp32 references.

INT4 is written by compressed-tensors itself (its min-max qparams and its pack-quantized compressor, module by
module of the saved checkpoint); FP8 blocks by the project's helper from the published definition; GPTQ by a
helper here from GPTQ's published quantizer and packing (AutoGPTQ's QuantLinear.pack), not the engine's. The
reference is transformers on the dequantized weights in fp32, dequantized by the library (INT4) or by the
definition written out here (FP8), never by the engine's own code."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.engine.helpers import perturb_hybrid

# Sizes whose input widths (48, 80, 32) divide the group of 16: compressed-tensors refuses uneven groups.
# A vocabulary past the byte tokenizer's 259 ids: the server's warm-up prompts are bytes.
QWEN3_5 = dict(vocab_size=301, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=3,
               num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4)
QWEN3_NEXT = dict(QWEN3_5, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, mlp_only_layers=[1])
GROUP = 16
IGNORE = ("lm_head", "re:.*in_proj_(a|b|ba)$", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$")


def build_dense(kind: str, out: Path, seed: int = 0) -> Path:
    """A random fp32 Qwen3.5 or Qwen3-Next (every parameter perturbed) saved to out."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    if kind == "qwen3_5":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN3_5, rope_parameters=rope))
    else:
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**QWEN3_NEXT, rope_parameters=rope))
    perturb_hybrid(model, 100 + seed)
    model.float().save_pretrained(out, safe_serialization=True)
    return out


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for path in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(path)).items()}


def _int4_scheme(symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=GROUP)
    return QuantizationScheme(targets=["Linear"], weights=args)


def write_int4(dense: Path, out: Path, symmetric: bool) -> Path:
    """compressed-tensors pack-quantized W4A16 (group 16) of every linear the ignore list leaves."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from compressed_tensors.utils.match import match_name

    scheme = _int4_scheme(symmetric)
    tensors, result = _tensors(dense), {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and tensor.dim() == 2 and "embed_tokens" not in name
        if not linear or any(match_name(module, entry) for entry in IGNORE):
            result[name] = tensor
            continue
        groups = tensor.view(tensor.shape[0], -1, GROUP)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        state = {"weight": tensor, "weight_scale": scale, "weight_zero_point": zero.to(torch.int8)}
        result.update({f"{module}.{k}": v for k, v in PackedQuantizationCompressor.compress(state, scheme).items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in result.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text((dense / "config.json").read_text())
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(IGNORE), format="pack-quantized",
                                quantization_status=QuantizationStatus.COMPRESSED)
    ModelCompressor(quantization_config=config).update_config(str(out))
    return out


def write_fp8(dense: Path, out: Path, block: tuple[int, int]) -> Path:
    from headroom.engine.runtime.quant_checkpoint import fp8_block_config, write_quantized_checkpoint

    return write_quantized_checkpoint(dense, out, fp8_block_config(block, IGNORE))


def _dequantized(model_dir: Path) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    quant = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    tensors, dense = _tensors(model_dir), {}
    gptq = quant.get("quant_method") == "gptq"
    for name, tensor in tensors.items():
        if gptq and name.endswith(".qweight"):
            module = name.removesuffix(".qweight")
            dense[module + ".weight"] = gptq_dequantized(tensors, module, quant["checkpoint_format"])
        elif gptq and name.endswith((".qzeros", ".scales", ".g_idx")):
            continue
        elif name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            state = {k: tensors[f"{module}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape",
                                                            "weight_zero_point") if f"{module}.{k}" in tensors}
            scheme = _int4_scheme(quant["config_groups"]["group_0"]["weights"]["symmetric"])
            dense[module + ".weight"] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()
        elif name.endswith(".weight_scale_inv"):
            module = name.removesuffix(".weight_scale_inv")
            weight, (bn, bk) = tensors[module + ".weight"], quant["weight_block_size"]
            # Published definition: each bn x bk block of the fp8 weight times its scale_inv entry.
            rows = torch.arange(weight.shape[0])[:, None] // bn
            cols = torch.arange(weight.shape[1])[None, :] // bk
            dense[module + ".weight"] = weight.float() * tensor.float()[rows, cols]
        elif not name.endswith((".weight_scale", ".weight_shape", ".weight_zero_point")) and name not in dense:
            dense[name] = tensor.float()
    return dense


def reference_model(model_dir: Path, out: Path):
    """transformers in fp32 on model_dir's dequantized weights (eval)."""
    from transformers import AutoModelForCausalLM

    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(_dequantized(model_dir), str(out / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model


def _gptq_quantize(w: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's quantizer (its min-max grid, zero included in the range) on [N, K] in groups of GROUP along K:
    -> codes [N, K], scales [K/GROUP, N], zeros [K/GROUP, N] (the zero points themselves)."""
    n, k = w.shape
    groups = w.view(n, k // GROUP, GROUP)
    xmin, xmax = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    if symmetric:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    scale = ((xmax - xmin) / 15).clamp(min=1e-8)
    zero = torch.full_like(scale, 8.0) if symmetric else torch.round(-xmin / scale)
    codes = torch.clamp(torch.round(groups / scale[..., None]) + zero[..., None], 0, 15)
    return codes.reshape(n, k).to(torch.int64), scale.t().contiguous(), zero.t().to(torch.int64).contiguous()


def _gptq_pack(values: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's packing of [R, C] 4-bit values along R: word row r holds values 8r..8r+7, value 8r+j in bits
    4j; wrapped into int32 as its numpy uint32 -> int32 view does."""
    rows, cols = values.shape
    words = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for r in range(rows // 8):
        for j in range(8):
            words[r] |= (values[8 * r + j] & 0xF) << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_gptq(dense: Path, out: Path, symmetric: bool, checkpoint_format: str = "gptq") -> Path:
    """A GPTQ checkpoint (4 bits, group 16, no act order) from the published layout: qweight [K/8, N] packed along
    K, qzeros [K/g, N/8] packed along N (zero - 1 for checkpoint_format 'gptq'), scales [K/g, N], g_idx [K];
    the linears of the decoder blocks that IGNORE leaves, named in modules_in_block_to_quantize."""
    from compressed_tensors.utils.match import match_name

    tensors, result, names = _tensors(dense), {}, set()
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and tensor.dim() == 2 and name.startswith("model.layers.")
        if not linear or any(match_name(module, entry) for entry in IGNORE):
            result[name] = tensor
            continue
        names.add(module.split(".", 3)[3])
        codes, scales, zeros = _gptq_quantize(tensor.float(), symmetric)
        stored = zeros - 1 if checkpoint_format == "gptq" else zeros
        result[module + ".qweight"] = _gptq_pack(codes.t())
        result[module + ".qzeros"] = _gptq_pack(stored.t()).t().contiguous()
        result[module + ".scales"] = scales.to(tensor.dtype)
        result[module + ".g_idx"] = (torch.arange(tensor.shape[1]) // GROUP).to(torch.int32)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in result.items()}, str(out / "model.safetensors"))
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": symmetric,
        "checkpoint_format": checkpoint_format, "true_sequential": True, "damp_percent": 0.01, "lm_head": False,
        "modules_in_block_to_quantize": [sorted(names)],
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def gptq_dequantized(tensors: dict[str, torch.Tensor], module: str, checkpoint_format: str) -> torch.Tensor:
    """The published dequantization of one GPTQ linear: scales[g_idx] * (code - zero[g_idx]), [N, K] fp32."""
    qweight, qzeros = tensors[module + ".qweight"].long() & 0xFFFFFFFF, tensors[module + ".qzeros"].long() & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4)
    codes = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])  # [K, N]
    zeros = ((qzeros[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(qzeros.shape[0], -1)  # [K/g, N]
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    g_idx = tensors[module + ".g_idx"].long()
    return (tensors[module + ".scales"].float()[g_idx] * (codes - zeros[g_idx]).float()).t().contiguous()
