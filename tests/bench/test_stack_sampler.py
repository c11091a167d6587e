"""bench/stack_sampler.py: busy threads' frames are counted, leaf and inclusive, with a timeline; threads that only
wait are not, except those whose waits are a start-up's critical path (the warm-up's)."""

import importlib.util
import json
import threading
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "stack_sampler", Path(__file__).resolve().parents[2] / "bench" / "stack_sampler.py")
stack_sampler = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stack_sampler)


def spin_until(stop: list[bool]) -> None:
    # A plain flag: Event.is_set's frame is threading.py's, which the sampler counts as a wait.
    spins = 0
    while not stop:
        spins += 1


def test_busy_and_critical_waiting_threads_counted_idle_ones_not(tmp_path):
    stop = threading.Event()
    spinning: list[bool] = []
    threads = [threading.Thread(target=spin_until, args=(spinning,), name="busy"),
               threading.Thread(target=stop.wait, name="idle-pool-worker"),
               threading.Thread(target=stop.wait, name="headroom-warmup")]
    for thread in threads:
        thread.start()
    sampler = stack_sampler.Sampler(tmp_path / "stacks.json")
    try:
        for _ in range(20):
            sampler.sample()
            time.sleep(0.01)
    finally:
        stop.set()
        spinning.append(True)
        for thread in threads:
            thread.join()
    sampler.write()
    report = json.loads((tmp_path / "stacks.json").read_text())["threads"]
    assert "idle-pool-worker" not in report
    assert report["headroom-warmup"]["samples"] == 20  # its join/wait is the start-up's time
    busy = report["busy"]
    assert busy["samples"] == 20
    assert any("spin_until" in frame for frame, _ in busy["leaf"])
    assert any(frame.endswith("spin_until") for frame, _ in busy["inclusive"])
    assert busy["timeline"] and all(len(bucket) == 3 for bucket in busy["timeline"])
