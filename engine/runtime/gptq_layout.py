"""GPTQ checkpoints (AutoGPTQ / GPTQModel, 4 bits, groups) read into the pack-quantized layout that
kernels/quant_weight.py and every int4 kernel take, at load, one linear at a time.

GPTQ stores a linear [N, K] as qweight int32 [K/8, N] (eight codes of one column along K, code k in bits
4 (k mod 8)), scales [K/g, N], qzeros int32 [K/g, N/8] (eight columns' zero points along N) and g_idx [K]
(each input's group). w = (code - zero) * scale over each group; checkpoint_format "gptq" stores zero - 1,
"gptq_v2" the zero itself. The pack-quantized layout is the transpose: weight_packed [N, K/8] with the same
bit order, weight_scale [N, K/g], weight_zero_point [N/8, K/g] packed along N (asymmetric only; symmetric
groups have the implicit zero 8). Nothing is requantized: the codes, scales and zero points are the
checkpoint's. The loader hands over every GPTQ tensor of the checkpoint at once (its shards may split a linear)."""

from __future__ import annotations

import torch
from headroom.engine.plan.quant_format import WeightQuant
from headroom.engine.runtime.loader import GPTQ_SUFFIXES
from headroom.kernels.quant_pack import pack_int4
from headroom.kernels.quant_weight import INT4_SYMMETRIC_ZERO, unpack_int4


class GPTQLayoutError(ValueError):
    """A GPTQ tensor set that does not describe one int4 linear; the message names the tensor and the numbers."""


def gptq_to_pack_quantized(tensors: dict[str, torch.Tensor], quant: WeightQuant) -> dict[str, torch.Tensor]:
    """tensors with every GPTQ linear's qweight / qzeros / scales / g_idx replaced by weight_packed,
    weight_scale, weight_shape and (asymmetric) weight_zero_point; other tensors as they are."""
    out = {name: t for name, t in tensors.items() if not name.endswith(GPTQ_SUFFIXES)}
    modules = sorted({name.rsplit(".", 1)[0] for name in tensors if name.endswith(GPTQ_SUFFIXES)})
    for module in modules:
        out.update(_convert(module, tensors, quant))
    return out


def _convert(module: str, tensors: dict[str, torch.Tensor], quant: WeightQuant) -> dict[str, torch.Tensor]:
    missing = [module + s for s in (".qweight", ".qzeros", ".scales") if module + s not in tensors]
    if missing:
        raise GPTQLayoutError(f"GPTQ linear {module} lacks {', '.join(missing)}")
    qweight, qzeros, scales = (tensors[module + s] for s in (".qweight", ".qzeros", ".scales"))
    group = quant.block[1]
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise GPTQLayoutError(f"{module}.qweight must be int32 [K/8, N], got {qweight.dtype} {list(qweight.shape)}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = -(-k // group)
    if tuple(scales.shape) != (groups, n):
        raise GPTQLayoutError(f"{module}.scales is {list(scales.shape)}; qweight {list(qweight.shape)} with group "
                              f"{group} needs [{groups}, {n}]")
    if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, -(-n // 8)):
        raise GPTQLayoutError(f"{module}.qzeros is {qzeros.dtype} {list(qzeros.shape)}; needs int32 "
                              f"[{groups}, {-(-n // 8)}]")
    g_idx = tensors.get(module + ".g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k, device=g_idx.device) // group):
        raise GPTQLayoutError(f"{module}.g_idx is not the inputs' groups in order (act order): not supported")
    zeros = unpack_int4(qzeros, n, dim=1)
    if quant.layout == "gptq":
        zeros = zeros + 1
        if int(zeros.max()) > 15:
            raise GPTQLayoutError(f"{module}.qzeros stores a zero point of 16 (15 + 1, checkpoint_format 'gptq'): "
                                  "outside int4")
    out = {module + ".weight_packed": qweight.t().contiguous(), module + ".weight_scale": scales.t().contiguous(),
           module + ".weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if quant.symmetric:
        if not bool((zeros == INT4_SYMMETRIC_ZERO).all()):
            raise GPTQLayoutError(f"{module}.qzeros holds zero points other than {INT4_SYMMETRIC_ZERO} "
                                  f"(from {int(zeros.min())} to {int(zeros.max())}) although sym is true")
    else:
        out[module + ".weight_zero_point"] = pack_int4(zeros.t(), dim=0)
    return out
