"""GPU telemetry through pynvml (nvidia-ml-py): memory, utilisation, power, temperature.

On a machine without an NVIDIA driver every function returns nothing and the collector exports no samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GPUSample:
    """One GPU right now. Bytes, percent, watts, degrees Celsius."""

    index: int
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_percent: int
    power_watts: float
    temperature_c: int


def _nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no driver, no library, no GPU: all mean "no telemetry"
        return None


def gpu_samples() -> list[GPUSample]:
    nvml = _nvml()
    if nvml is None:
        return []
    samples = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        samples.append(GPUSample(
            index=index,
            memory_used_bytes=int(memory.used),
            memory_total_bytes=int(memory.total),
            utilization_percent=int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            power_watts=nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            temperature_c=int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        ))
    return samples


class GPUCollector:
    """A prometheus_client custom collector: reads NVML at scrape time; yields nothing without it."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        samples = gpu_samples()
        if not samples:
            return
        families = {
            "memory_used_bytes": GaugeMetricFamily("headroom_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"]),
            "memory_total_bytes": GaugeMetricFamily("headroom_gpu_memory_total_bytes", "GPU memory", labels=["gpu"]),
            "utilization_percent": GaugeMetricFamily("headroom_gpu_utilization_percent", "GPU busy", labels=["gpu"]),
            "power_watts": GaugeMetricFamily("headroom_gpu_power_watts", "GPU power draw", labels=["gpu"]),
            "temperature_c": GaugeMetricFamily("headroom_gpu_temperature_celsius", "GPU temperature", labels=["gpu"]),
        }
        for sample in samples:
            for field, family in families.items():
                family.add_metric([str(sample.index)], float(getattr(sample, field)))
        yield from families.values()
