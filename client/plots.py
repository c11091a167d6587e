"""PNG plots of TTFT and ITL distributions per workload, one colour per configuration (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from headroom.client.report import workload_names


def _ecdf(values: list[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    return ordered, [(index + 1) / len(ordered) for index in range(len(ordered))]


def _samples(workload: dict[str, Any], metric: str) -> list[float]:
    """TTFT or ITL samples of a workload's successful requests, in milliseconds."""
    values: list[float] = []
    for request in workload["requests"]:
        if request["error"] is not None:
            continue
        if metric == "ttft" and request["ttft_s"] is not None:
            values.append(request["ttft_s"] * 1000.0)
        elif metric == "itl":
            values += [gap * 1000.0 for gap in request["itl_s"]]
    return values


def plot_distributions(results: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """One PNG per workload: TTFT and ITL empirical CDFs, one colour per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colours = plt.get_cmap("tab10")
    written = []
    for name in workload_names(results):
        figure, axes = plt.subplots(1, 2, figsize=(11, 4))
        for index, result in enumerate(results):
            workload = result["workloads"].get(name)
            if workload is None:
                continue
            for axis, metric in zip(axes, ("ttft", "itl"), strict=True):
                values = _samples(workload, metric)
                if values:
                    xs, ys = _ecdf(values)
                    axis.step(xs, ys, where="post", color=colours(index % 10), label=f"{result['config']} (n={len(values)})")
        for axis, title in zip(axes, ("TTFT", "inter-token latency"), strict=True):
            axis.set_title(f"{name}: {title}")
            axis.set_xlabel("ms")
            axis.set_ylabel("fraction of samples")
            axis.grid(alpha=0.3)
            if axis.get_legend_handles_labels()[0]:
                axis.legend(fontsize=8)
        figure.tight_layout()
        path = out / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written
