from headroom.client.telemetry import GpuSample, detect_cliff, parse_gpu_samples

DCGM = """# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a"} 99
DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-b"} 100
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-a"} 171.5
DCGM_FI_DEV_POWER_USAGE{gpu="1",UUID="GPU-b"} 45
# TYPE DCGM_FI_DEV_MEM_COPY_UTIL gauge
DCGM_FI_DEV_MEM_COPY_UTIL{gpu="0"} 12
"""

HEADROOM = """# TYPE headroom_gpu_utilization_ratio gauge
headroom_gpu_utilization_ratio 0.98
# TYPE headroom_gpu_power_watts gauge
headroom_gpu_power_watts 160
# TYPE headroom_gpu_power_limit_watts gauge
headroom_gpu_power_limit_watts 250
"""


def test_parse_dcgm_per_gpu_ignoring_memory_utilisation():
    samples = parse_gpu_samples(DCGM, at_s=1.0)
    assert [(s.gpu, s.util_percent, s.power_w, s.power_limit_w) for s in samples] == [
        ("0", 99.0, 171.5, None), ("1", 100.0, 45.0, None)
    ]


def test_parse_ratio_gauges_as_percent_and_power_limit():
    (sample,) = parse_gpu_samples(HEADROOM, at_s=0.0)
    assert sample.util_percent == 98.0 and sample.power_w == 160.0 and sample.power_limit_w == 250.0


def test_cpu_server_without_gpu_gauges_is_undecidable():
    assert parse_gpu_samples("# TYPE x gauge\nx 1\n", 0.0) == []
    verdict = detect_cliff([])
    assert not verdict.decidable and not verdict.at_cliff


def series(points, limit=None, gpu="0"):
    return [GpuSample(float(i), gpu, util, power, limit) for i, (util, power) in enumerate(points)]


def test_cliff_is_busy_gpu_on_collapsed_power():
    # Field report 004: healthy 97-99% at 169-175 W; the cliff is 100% at 45 W.
    verdict = detect_cliff(series([(98, 172), (100, 45), (100, 46)]))
    assert verdict.decidable and verdict.at_cliff
    assert "45 W" in verdict.reason or "46 W" in verdict.reason


def test_healthy_full_load_and_idle_gpu_are_not_the_cliff():
    assert not detect_cliff(series([(97, 169), (99, 175), (98, 157)])).at_cliff
    # Idle: low power at low utilisation is rest, not a cliff.
    assert not detect_cliff(series([(0, 30), (2, 31), (98, 170)])).at_cliff


def test_one_dip_is_not_a_cliff_but_the_power_limit_catches_a_run_that_starts_there():
    assert not detect_cliff(series([(100, 170), (100, 45), (99, 168)])).at_cliff
    at_start = detect_cliff(series([(100, 45), (100, 44)], limit=250.0))
    assert at_start.at_cliff and "power limit" in at_start.reason
    assert not detect_cliff(series([(100, 45), (100, 44)])).at_cliff


def test_headroom_engine_gauge_names():
    text = (
        "# TYPE headroom_gpu_utilization_percent gauge\nheadroom_gpu_utilization_percent{gpu=\"0\"} 100\n"
        "# TYPE headroom_gpu_power_watts gauge\nheadroom_gpu_power_watts{gpu=\"0\"} 45\n"
        "# TYPE headroom_gpu_memory_used_bytes gauge\nheadroom_gpu_memory_used_bytes{gpu=\"0\"} 1e9\n"
        "# TYPE headroom_gpu_temperature_celsius gauge\nheadroom_gpu_temperature_celsius{gpu=\"0\"} 48\n"
    )
    (sample,) = parse_gpu_samples(text, 0.0)
    assert (sample.gpu, sample.util_percent, sample.power_w, sample.power_limit_w) == ("0", 100.0, 45.0, None)
