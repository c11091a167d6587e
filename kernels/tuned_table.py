"""Tables of kernel configurations measured on a GPU and shipped beside the kernels (gemv_tuned_configs.json,
quant_gemv_tuned_configs.json): {gpu name: {"triton": version, "source": how it was measured, "configs": [...]}}.
A table's entries hold only for the GPU and the Triton version they were timed with (another compiler version
generates other code, so its timings say nothing); everything else falls back to the kernel's defaults."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import triton


def entries_for(path: Path, device: torch.device) -> list[dict]:
    """The configs the table at `path` ships for this device's GPU and this Triton version ([] for none)."""
    from headroom.kernels.gdn_fla import gpu_name

    if device.type != "cuda" or not path.exists():
        return []
    entry = json.loads(path.read_text()).get(gpu_name(device), {})
    if entry.get("triton") != triton.__version__:
        return []
    return list(entry.get("configs", []))


def table_text(device: torch.device, configs: list[dict], source: str, shipped: Path | None = None) -> str:
    """The table with this GPU's entry replaced by `configs` (other GPUs' entries in `shipped` kept)."""
    from headroom.kernels.gdn_fla import gpu_name

    table = json.loads(shipped.read_text()) if shipped is not None and shipped.exists() else {}
    table[gpu_name(device)] = {"triton": triton.__version__, "source": source, "configs": configs}
    return json.dumps(table, indent=1) + "\n"
