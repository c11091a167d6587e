"""One GPU's memory from GPU feature discovery node labels, for specs that leave spec.gpu.memory out.

NVIDIA's GPU feature discovery labels each GPU node with nvidia.com/gpu.memory (MiB, per GPU),
nvidia.com/gpu.product and nvidia.com/gpu.count. Pure: the caller lists the nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MEMORY_LABEL = "nvidia.com/gpu.memory"
PRODUCT_LABEL = "nvidia.com/gpu.product"
COUNT_LABEL = "nvidia.com/gpu.count"
_MIB = 1024 * 1024


class GpuMemoryUnknown(ValueError):
    """No node tells us the GPU memory; the message says what to set instead."""


@dataclass(frozen=True)
class DiscoveredGpu:
    """The smallest per-GPU memory among matching nodes (bytes), and where it came from."""

    memory_bytes: int
    product: str
    node_names: tuple[str, ...]


def discover_gpu_memory(nodes: list[dict[str, Any]], *, product: str | None, count: int) -> DiscoveredGpu:
    """Pick nodes with at least `count` GPUs (and `product`, when given); plan for the smallest memory.

    The smallest is chosen because the pod may land on any matching node.
    """
    candidates: list[tuple[int, str, str]] = []
    for node in nodes:
        labels = (node.get("metadata") or {}).get("labels") or {}
        name = (node.get("metadata") or {}).get("name", "?")
        if MEMORY_LABEL not in labels:
            continue
        if product and labels.get(PRODUCT_LABEL) != product:
            continue
        if int(labels.get(COUNT_LABEL, "1") or 1) < count:
            continue
        try:
            mib = int(labels[MEMORY_LABEL])
        except ValueError:
            continue
        candidates.append((mib * _MIB, labels.get(PRODUCT_LABEL, "unknown"), name))
    if not candidates:
        wanted = f" with product {product!r}" if product else ""
        raise GpuMemoryUnknown(
            f"spec.gpu.memory is absent and no node{wanted} with >= {count} GPU(s) carries the "
            f"{MEMORY_LABEL} label (GPU feature discovery); set spec.gpu.memory, e.g. '80Gi'"
        )
    smallest = min(c[0] for c in candidates)
    chosen = [c for c in candidates if c[0] == smallest]
    return DiscoveredGpu(
        memory_bytes=smallest,
        product=chosen[0][1],
        node_names=tuple(sorted(c[2] for c in chosen)),
    )
