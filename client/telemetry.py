"""GPU telemetry from a server's /metrics, and the VRAM cliff of field report 004.

The cliff does not show as an allocation error: utilisation stays near 100% while power collapses
(healthy 169-175 W at 97-99%, cliff 45 W at 100%). A sample is at the cliff when utilisation is at
least util_threshold_percent and power is below power_ratio of the reference power: the GPU's power
limit when /metrics exposes it, else the highest power seen in the run. Metric names differ per
exporter (headroom's pynvml gauges, DCGM's DCGM_FI_DEV_*), so they are matched by name.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

from headroom.client.http import OpenAIClient
from prometheus_client.parser import text_string_to_metric_families

GPU_LABELS = ("gpu", "device", "index", "minor_number", "UUID")


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one time: utilisation in percent (0-100), power and its limit in watts."""

    at_s: float
    gpu: str
    util_percent: float | None
    power_w: float | None
    power_limit_w: float | None


def _kind(name: str) -> str | None:
    lowered = name.lower()
    if "power" in lowered and "limit" in lowered:
        return "power_limit"
    if "power" in lowered and "energy" not in lowered:
        return "power"
    if "util" in lowered and "gpu" in lowered and "mem" not in lowered:
        return "util"
    return None


def parse_gpu_samples(metrics_text: str, at_s: float) -> list[GpuSample]:
    """GPU samples from Prometheus text; an empty list when the exporter has no GPU gauges (e.g. CPU)."""
    by_gpu: dict[str, dict[str, float]] = {}
    try:
        families = list(text_string_to_metric_families(metrics_text))
    except ValueError:
        return []
    for family in families:
        for sample in family.samples:
            kind = _kind(sample.name)
            if kind is None or sample.name.endswith(("_created", "_total", "_count", "_sum", "_bucket")):
                continue
            gpu = next((sample.labels[key] for key in GPU_LABELS if key in sample.labels), "0")
            value = float(sample.value)
            if kind == "util" and ("ratio" in sample.name or "fraction" in sample.name):
                value *= 100.0
            if kind.startswith("power") and "milliwatt" in sample.name.lower():
                value /= 1000.0
            by_gpu.setdefault(gpu, {})[kind] = value
    return [
        GpuSample(at_s, gpu, kinds.get("util"), kinds.get("power"), kinds.get("power_limit"))
        for gpu, kinds in sorted(by_gpu.items())
        if "util" in kinds and "power" in kinds
    ]


@dataclass(frozen=True)
class CliffVerdict:
    """decidable is False when there is nothing to judge (no GPU gauges, or no reference power)."""

    decidable: bool
    at_cliff: bool
    reason: str
    peak_power_w: float | None = None
    lowest_busy_power_w: float | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def detect_cliff(
    samples: list[GpuSample], *, util_threshold_percent: float = 95.0, power_ratio: float = 0.4, min_consecutive: int = 2
) -> CliffVerdict:
    """At the cliff when min_consecutive samples of one GPU are busy (util >= threshold) on collapsed power."""
    if not samples:
        return CliffVerdict(False, False, "/metrics exposes no GPU utilisation and power")
    for gpu in sorted({s.gpu for s in samples}):
        series = [s for s in samples if s.gpu == gpu and s.util_percent is not None and s.power_w is not None]
        limit = next((s.power_limit_w for s in series if s.power_limit_w), None)
        reference = limit or max((s.power_w or 0.0) for s in series)
        busy = [s for s in series if (s.util_percent or 0.0) >= util_threshold_percent]
        lowest_busy = min((s.power_w for s in busy if s.power_w is not None), default=None)
        run = 0
        for s in series:
            collapsed = (s.util_percent or 0.0) >= util_threshold_percent and (s.power_w or 0.0) < power_ratio * reference
            run = run + 1 if collapsed else 0
            if run >= min_consecutive:
                source = "power limit" if limit else "peak power seen"
                return CliffVerdict(
                    True, True,
                    f"GPU {gpu}: {run} samples at >= {util_threshold_percent:.0f}% utilisation drawing "
                    f"{s.power_w:.0f} W < {power_ratio:.2f} x {reference:.0f} W ({source})",
                    reference, lowest_busy,
                )
    peak = max((s.power_w or 0.0) for s in samples)
    lowest = min((s.power_w for s in samples if (s.util_percent or 0.0) >= util_threshold_percent and s.power_w is not None), default=None)
    return CliffVerdict(True, False, f"{len(samples)} samples, none busy on collapsed power", peak, lowest)


class MetricsSampler:
    """Polls /metrics every interval_s while a measurement runs: `async with MetricsSampler(client):`."""

    def __init__(self, client: OpenAIClient, interval_s: float = 1.0):
        self.client = client
        self.interval_s = interval_s
        self.samples: list[GpuSample] = []
        self.last_text: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._origin = time.perf_counter()

    async def sample_once(self) -> None:
        response = await self.client.get("/metrics")
        if response is None or response.status_code != 200:
            return
        self.last_text = response.text
        self.samples += parse_gpu_samples(response.text, time.perf_counter() - self._origin)

    async def _loop(self) -> None:
        while True:
            await self.sample_once()
            await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> MetricsSampler:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.sample_once()
