"""Weight quantization read from config.json's quantization_config (pure: no torch).

Two published formats load:
- "fp8": block-wise FP8 (the model makers' own FP8 releases): `weight` float8_e4m3fn [N, K] and
  `weight_scale_inv` [ceil(N/bn), ceil(K/bk)], w = weight * scale_inv over each bn x bk block.
- "compressed-tensors" with format "pack-quantized": W4A16 group-wise (llm-compressor): `weight_packed`
  int32 [N, ceil(K/8)], `weight_scale` [N, ceil(K/g)], and for asymmetric schemes `weight_zero_point`
  int32 [ceil(N/8), ceil(K/g)]; w = (q - z) * scale.
- "gptq" (AutoGPTQ / GPTQModel, 4 bits, groups, no act order): `qweight` int32 [K/8, N] (codes packed along K),
  `scales` [K/g, N], `qzeros` int32 [K/g, N/8] (packed along N; checkpoint_format "gptq" stores zero - 1,
  "gptq_v2" the zero itself), optional `g_idx` [K] (the identity grouping only). The loader turns it into the
  pack-quantized layout above (engine/runtime/gptq_layout.py), so one set of kernels reads both.
Anything else is refused with the key that made it so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

# Keys that describe the checkpoint but change nothing about how its tensors are read.
_FP8_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert", "ignored_layers"}
_CT_KEYS = {
    "quant_method", "format", "config_groups", "ignore", "quantization_status", "global_compression_ratio",
    "kv_cache_scheme", "sparsity_config", "moe_sparsity_config", "transform_config", "version", "provider",
}
_CT_GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
_CT_WEIGHT_KEYS = {
    "num_bits", "type", "symmetric", "group_size", "strategy", "dynamic", "actorder", "block_structure",
    "observer", "observer_kwargs", "scale_dtype", "zp_dtype",
}
# GPTQ configs (transformers' GPTQConfig, AutoGPTQ's and GPTQModel's quantize_config) carry calibration and
# backend settings beside the layout; these change nothing about how the tensors are read.
_GPTQ_KEYS = {
    "quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format", "format", "pack_dtype", "lm_head",
    "dynamic", "modules_in_block_to_quantize", "block_name_to_quantize", "static_groups", "true_sequential",
    "damp_percent", "damp_auto_increment", "model_name_or_path", "model_file_base_name", "meta", "use_exllama",
    "exllama_config", "use_cuda_fp16", "backend", "tokenizer", "dataset", "batch_size", "cache_block_outputs",
    "max_input_length", "model_seqlen", "pad_token_id", "module_name_preceding_first_block", "mse",
}
# A checkpoint with a vision tower nests the text model; the engine names it 'model.'.
_NESTED_TEXT_PREFIX = "model.language_model."


# From this many rows in a pass, the engine's quantized linears dequantize one weight into a transient dense
# copy and multiply with cuBLAS (kernels/quant_matmul.py's DENSE_MIN_ROWS: a test keeps the two equal).
WEIGHT_DEQUANT_MIN_ROWS = 128


class QuantConfigError(ValueError):
    """A quantization_config the engine cannot load; the message names the key and its value."""


@dataclass(frozen=True)
class WeightQuant:
    """How the checkpoint's linear weights are stored. Sizes are in elements along (out, in)."""

    method: Literal["fp8_block", "int4_group"]
    # fp8_block: (out, in) block of one scale; int4_group: (1, group) - one scale per row and group.
    block: tuple[int, int]
    symmetric: bool = True
    # Module names (or 're:' regexes) left unquantized, as the checkpoint lists them.
    ignore: tuple[str, ...] = ()
    # compressed-tensors targets ('Linear' or 're:' regexes); fp8 targets every linear.
    targets: tuple[str, ...] = ("Linear",)
    # How the checkpoint stores int4 groups: "pack-quantized" (compressed-tensors), or GPTQ's own layout,
    # "gptq" (zero points stored minus one) or "gptq_v2"; the loader converts GPTQ to pack-quantized.
    layout: str = "pack-quantized"

    @property
    def label(self) -> str:
        """Human-readable format, as the plan report prints it."""
        if self.method == "fp8_block":
            return f"fp8 e4m3, {self.block[0]}x{self.block[1]} blocks"
        source = "" if self.layout == "pack-quantized" else f" (GPTQ, {self.layout})"
        return f"int4 W4A16, group {self.block[1]}, {'symmetric' if self.symmetric else 'asymmetric'}{source}"

    def is_quantized(self, module: str) -> bool:
        """Whether the linear module (e.g. 'model.layers.0.mlp.up_proj') is stored quantized."""
        module = _normalise(module)
        targeted = any(t == "Linear" or _matches(t, module) for t in self.targets)
        return targeted and not any(_matches(entry, module) for entry in self.ignore)


def _normalise(name: str) -> str:
    return "model." + name[len(_NESTED_TEXT_PREFIX):] if name.startswith(_NESTED_TEXT_PREFIX) else name


def _matches(entry: str, module: str) -> bool:
    """A 're:' entry is a regex matched from the name's start (as compressed-tensors does); a plain one a name or a dotted run of its parts."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None or re.match(entry[3:], _denormalise(module)) is not None
    entry = _normalise(entry)
    return module == entry or module.endswith("." + entry) or f".{entry}." in f".{module}."


def _denormalise(module: str) -> str:
    return _NESTED_TEXT_PREFIX + module[len("model."):] if module.startswith("model.") else module


def _refuse_unknown(section: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(section) - known)
    if unknown:
        raise QuantConfigError(f"{where} has keys the engine does not support: {', '.join(unknown)}")


def _names(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise QuantConfigError(f"quantization_config.{key} must be a list of module names, got {value!r}")
    return tuple(value)


def _fp8(cfg: dict[str, Any]) -> WeightQuant:
    _refuse_unknown(cfg, _FP8_KEYS, "quantization_config (quant_method 'fp8')")
    if cfg.get("fmt", "e4m3") != "e4m3":
        raise QuantConfigError(f"quantization_config.fmt is {cfg['fmt']!r}; only 'e4m3' is supported")
    if cfg.get("activation_scheme", "dynamic") != "dynamic":
        raise QuantConfigError(
            f"quantization_config.activation_scheme is {cfg['activation_scheme']!r}; only 'dynamic' is supported "
            "(activations stay in the model dtype)"
        )
    block = cfg.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 and b % 16 == 0 for b in block)):
        raise QuantConfigError(
            f"quantization_config.weight_block_size must be two positive multiples of 16, got {block!r} "
            "(per-tensor FP8 is not supported)"
        )
    ignore = _names(cfg.get("modules_to_not_convert"), "modules_to_not_convert") + _names(
        cfg.get("ignored_layers"), "ignored_layers"
    )
    return WeightQuant("fp8_block", (block[0], block[1]), ignore=ignore)


def _int4_weights(args: Any, where: str) -> tuple[int, bool]:
    """-> (group size, symmetric) of one config group's weights."""
    if not isinstance(args, dict):
        raise QuantConfigError(f"{where} must be an object, got {args!r}")
    _refuse_unknown(args, _CT_WEIGHT_KEYS, where)
    expected = {"num_bits": 4, "type": "int", "strategy": "group", "dynamic": False, "block_structure": None}
    for key, value in expected.items():
        if args.get(key, value) != value:
            raise QuantConfigError(f"{where}.{key} is {args.get(key)!r}; only {value!r} is supported (W4A16 groups)")
    if args.get("actorder") not in (None, "static"):
        raise QuantConfigError(f"{where}.actorder is {args['actorder']!r}; only null or 'static' is supported")
    group = args.get("group_size")
    if not isinstance(group, int) or group <= 0 or group % 8:
        raise QuantConfigError(f"{where}.group_size must be a positive multiple of 8, got {group!r}")
    return group, bool(args.get("symmetric", True))


def _compressed_tensors(cfg: dict[str, Any]) -> WeightQuant:
    _refuse_unknown(cfg, _CT_KEYS, "quantization_config (quant_method 'compressed-tensors')")
    if cfg.get("format") != "pack-quantized":
        raise QuantConfigError(f"quantization_config.format is {cfg.get('format')!r}; only 'pack-quantized' is supported")
    if cfg.get("quantization_status", "compressed") != "compressed":
        raise QuantConfigError(f"quantization_config.quantization_status is {cfg['quantization_status']!r}; "
                               "only 'compressed' checkpoints load")
    for key in ("kv_cache_scheme", "sparsity_config", "moe_sparsity_config", "transform_config"):
        if cfg.get(key):
            raise QuantConfigError(f"quantization_config.{key} is set ({cfg[key]!r}); it is not supported")
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantConfigError(f"quantization_config.config_groups must be a non-empty object, got {groups!r}")
    schemes: set[tuple[int, bool]] = set()
    targets: list[str] = []
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise QuantConfigError(f"{where} must be an object, got {group!r}")
        _refuse_unknown(group, _CT_GROUP_KEYS, where)
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise QuantConfigError(f"{where}.{key} is set; only weight-only (W4A16) schemes are supported")
        if group.get("format") not in (None, "pack-quantized"):
            raise QuantConfigError(f"{where}.format is {group['format']!r}; only 'pack-quantized' is supported")
        schemes.add(_int4_weights(group.get("weights"), where + ".weights"))
        targets.extend(_names(group.get("targets"), f"config_groups.{name}.targets"))
    if len(schemes) != 1:
        raise QuantConfigError(f"quantization_config.config_groups mix weight schemes {sorted(schemes)}; only one is supported")
    bad = [t for t in targets if t != "Linear" and not t.startswith("re:")]
    if bad or not targets:
        raise QuantConfigError(f"quantization_config targets {bad or targets} are not supported (only 'Linear' or 're:' names)")
    (group, symmetric), = schemes
    return WeightQuant("int4_group", (1, group), symmetric, _names(cfg.get("ignore"), "ignore"), tuple(targets))


def _gptq(cfg: dict[str, Any]) -> WeightQuant:
    where = "quantization_config (quant_method 'gptq')"
    _refuse_unknown(cfg, _GPTQ_KEYS, where)
    if cfg.get("bits") != 4:
        raise QuantConfigError(f"quantization_config.bits is {cfg.get('bits')!r}; only 4-bit GPTQ is supported")
    group = cfg.get("group_size")
    if not isinstance(group, int) or group <= 0 or group % 8:
        raise QuantConfigError(f"quantization_config.group_size must be a positive multiple of 8, got {group!r} "
                               "(-1, one group per row, is not supported)")
    if cfg.get("desc_act", False):
        raise QuantConfigError("quantization_config.desc_act is true; act order (a g_idx permutation of the "
                               "inputs) is not supported")
    layout = cfg.get("checkpoint_format", cfg.get("format", "gptq"))
    if layout not in ("gptq", "gptq_v2"):
        raise QuantConfigError(f"quantization_config.checkpoint_format is {layout!r}; only 'gptq' and 'gptq_v2' "
                               "(GPTQ's own packing) are supported")
    if cfg.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise QuantConfigError(f"quantization_config.pack_dtype is {cfg['pack_dtype']!r}; only int32 is supported")
    if cfg.get("dynamic"):
        raise QuantConfigError(f"quantization_config.dynamic is set ({cfg['dynamic']!r}); per-module overrides "
                               "are not supported")
    # GPTQ quantizes the linears inside the decoder blocks (those named, if the config names them), and
    # lm_head only when it says so.
    blocks = cfg.get("modules_in_block_to_quantize")
    if blocks is None:
        targets = [r"re:model\.layers\.\d+\."]
    else:
        if not isinstance(blocks, list) or not all(isinstance(b, list) and all(isinstance(n, str) for n in b)
                                                   for b in blocks):
            raise QuantConfigError("quantization_config.modules_in_block_to_quantize must be a list of lists of "
                                   f"module names, got {blocks!r}")
        names = "|".join(re.escape(n) for block in blocks for n in block)
        targets = [rf"re:model\.layers\.\d+\.({names})$"]
    if cfg.get("lm_head", False):
        targets.append("lm_head")
    return WeightQuant("int4_group", (1, group), bool(cfg.get("sym", True)), targets=tuple(targets), layout=layout)


def weight_quant_from_config(cfg: dict[str, Any]) -> WeightQuant | None:
    """Parse config.json's quantization_config (top level or a wrapper's text_config); None if absent."""
    quant = cfg.get("quantization_config")
    if quant is None and isinstance(cfg.get("text_config"), dict):
        quant = cfg["text_config"].get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise QuantConfigError(f"config.json quantization_config must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method == "fp8":
        return _fp8(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "gptq":
        return _gptq(quant)
    raise QuantConfigError(
        f"config.json quantization_config.quant_method {method!r} is not supported; "
        "supported: 'fp8' (block-wise e4m3), 'compressed-tensors' (pack-quantized int4) and 'gptq' (int4)"
    )
