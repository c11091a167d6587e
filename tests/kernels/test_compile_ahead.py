"""kernels/compile_ahead.py: a dry pass skips and records every launch that would compile; the recorded
specialisations compile on a thread pool into their kernels' caches, so the real pass compiles nothing; a
specialisation that fails ahead is left to its pass, which raises as it always did; an autotuner met in a dry pass
keeps none of the choices it timed on skipped launches; the hook is handed back. Run through Triton's real JIT
(compiled for sm_90, Triton ships ptxas) in a child process without the interpreter and with a driver that
answers for an H200, so no GPU is needed."""

from __future__ import annotations

import pytest
from headroom.kernels.compile_ahead import (
    MAX_THREADS,
    CompileAhead,
    CompileAheadReport,
    cgroup_cpus,
    compile_threads,
)

from tests.kernels.sm90_child import run_on_sm90

_CHILD = r'''
import triton.language as tl
from headroom.kernels.compile_ahead import CompileAhead


@triton.jit
def scale_kernel(x, y, n, factor, BLOCK: tl.constexpr):
    tl.static_assert(BLOCK <= 1024)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y + offs, tl.load(x + offs, mask=mask) * factor, mask=mask)


def time_nothing(fn, quantiles=None, **_):
    fn()
    return [1.0, 1.0, 1.0]


@triton.autotune(configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})], key=["n"],
                 do_bench=time_nothing)
@triton.jit
def tuned_kernel(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)


import threading


class RecordingLauncher:
    """Triton's launcher class, as the pool builds it after each compile: which kernel, on which thread."""
    built = []

    def __init__(self, src, metadata):
        RecordingLauncher.built.append([src.fn.__name__, threading.current_thread().name, metadata.num_warps])


driver.active.launcher_cls = RecordingLauncher
x, y = torch.zeros(4096, dtype=torch.bfloat16), torch.zeros(4096, dtype=torch.bfloat16)
misses = []
own_hook = lambda **kw: misses.append(kw["fn"].name) and False
triton.knobs.runtime.jit_cache_hook = own_hook
ahead = CompileAhead(2)


def dry():
    # 64 twice (one specialisation), 2048 fails its static_assert, the autotuner times its two configs.
    for block in (64, 128, 256, 64, 2048):
        scale_kernel[(1,)](x, y, 4096, 2.0, BLOCK=block)
    tuned_kernel[(1,)](x, y, 4096)


out = {"prepared": ahead.prepare(dry), "report": vars(ahead.report), "preloads_seen_by_hook": len(misses)}
out["slowest"] = [[seconds, name] for seconds, name in ahead.report.slowest]
out["launchers"] = RecordingLauncher.built
out["hook_handed_back"] = triton.knobs.runtime.jit_cache_hook is own_hook
out["tuner_choices_kept"] = len(tuned_kernel.cache)
for block in (64, 128, 256):
    scale_kernel.warmup(x, y, 4096, 2.0, BLOCK=block, grid=(1,))
out["compiles_in_real_pass"] = len(misses) - out["preloads_seen_by_hook"]
try:
    scale_kernel.warmup(x, y, 4096, 2.0, BLOCK=2048, grid=(1,))
    out["failed_one_in_its_pass"] = "compiled"
except Exception as exc:
    out["failed_one_in_its_pass"] = type(exc).__name__
print(json.dumps(out))
'''


def test_a_dry_pass_compiles_its_kernels_ahead_and_the_real_pass_finds_them(tmp_path):
    got = run_on_sm90(_CHILD, tmp_path)
    # Three scale specialisations, the failing one and the autotuner's two configs were met and skipped.
    assert got["prepared"] == 6
    assert got["report"]["compiled"] == 5 and got["report"]["failed"] == 1 and got["report"]["dry_passes"] == 1
    # Each compile timed under its kernel's name (the failed one too: it ran, and its time counts), longest first.
    names = [name for _, name in got["slowest"]]
    assert len(names) == 3 and set(names) <= {"scale_kernel", "tuned_kernel"}
    seconds = [s for s, _ in got["slowest"]]
    assert seconds == sorted(seconds, reverse=True) and all(s > 0 for s in seconds)
    # Each compiled kernel's launcher was built on a compile thread, from the compiled kernel, once per launcher
    # (scale's three specialisations share one, as the tuner's two configs do; the failed one needs none).
    assert sorted(name for name, _, _ in got["launchers"]) == ["scale_kernel", "tuned_kernel"]
    assert all(thread.startswith("headroom-compile") for _, thread, _ in got["launchers"])
    # The preloads went through the hook that was installed before (a CompileWatch counts them there) ...
    assert got["preloads_seen_by_hook"] == 6 and got["hook_handed_back"]
    # ... and the real launches of the same specialisations compile nothing.
    assert got["compiles_in_real_pass"] == 0
    assert got["tuner_choices_kept"] == 0
    assert got["failed_one_in_its_pass"] == "CompileTimeAssertionFailure"


_CHILD_SEVERAL = r'''
import triton.language as tl
from headroom.kernels.compile_ahead import CompileAhead


@triton.jit
def scale_kernel(x, y, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y + offs, tl.load(x + offs, mask=mask) * factor, mask=mask)


x, y = torch.zeros(4096, dtype=torch.bfloat16), torch.zeros(4096, dtype=torch.bfloat16)
misses = []
triton.knobs.runtime.jit_cache_hook = lambda **kw: misses.append(kw["fn"].name) and False
ahead = CompileAhead(2)
compiled_per_round = []
compile = ahead._compile
ahead._compile = lambda pending: (compiled_per_round.append(len(pending)), compile(pending))[1]


def launches(*blocks):
    def dry():
        for block in blocks:
            scale_kernel[(1,)](x, y, 4096, 2.0, BLOCK=block)
    return dry


def raises():
    scale_kernel[(1,)](x, y, 4096, 2.0, BLOCK=512)
    raise RuntimeError("garbage index")


# The decode graphs' sizes: passes that share some specialisations, one raising after it met one of its own.
out = {"prepared": ahead.prepare(launches(64, 128), raises, launches(128, 256, 64)), "report": vars(ahead.report),
       "rounds": compiled_per_round}
seen = len(misses)
for block in (64, 128, 256, 512):
    scale_kernel.warmup(x, y, 4096, 2.0, BLOCK=block, grid=(1,))
out["compiles_in_real_passes"] = len(misses) - seen
print(json.dumps(out))
'''


def test_several_dry_passes_compile_what_they_met_in_one_round(tmp_path):
    got = run_on_sm90(_CHILD_SEVERAL, tmp_path)
    # 64, 128, 256 and the raising pass's 512: each once, in a single round, whatever pass met it first.
    assert got["prepared"] == 4 and got["rounds"] == [4]
    assert got["report"]["dry_passes"] == 3 and got["report"]["dry_failures"] == 1
    assert got["report"]["compiled"] == 4 and got["report"]["failed"] == 0
    assert got["compiles_in_real_passes"] == 0


def test_cgroup_quota_lines():
    assert cgroup_cpus("200000 100000\n") == 2.0
    assert cgroup_cpus("150000 100000") == 1.5
    assert cgroup_cpus("max 100000") is None
    assert cgroup_cpus("") is None and cgroup_cpus("x y") is None and cgroup_cpus("0 100000") is None


def test_threads_from_the_environment():
    assert compile_threads({"HEADROOM_COMPILE_AHEAD": "0", "HEADROOM_COMPILE_THREADS": "8"}) == 0
    assert compile_threads({"HEADROOM_COMPILE_THREADS": "6"}) == 6
    # One thread would only add the dry passes.
    assert compile_threads({"HEADROOM_COMPILE_THREADS": "1"}) == 0
    assert 0 <= compile_threads({}) <= MAX_THREADS
    for bad in ("0", "-2", "four", ""):
        with pytest.raises(ValueError, match=f"HEADROOM_COMPILE_THREADS={bad!r} must be a whole number"):
            compile_threads({"HEADROOM_COMPILE_THREADS": bad})
    with pytest.raises(ValueError, match="0 threads"):
        CompileAhead(0)


def test_a_launcher_that_fails_to_build_ahead_loses_no_kernel(caplog):
    """The pool hands back the compiled kernel whatever its launcher's build does (its first launch builds it again
    and raises there), and times the compile; a compile that raises raises through the future, timed too."""
    import logging
    from concurrent.futures import ThreadPoolExecutor

    from headroom.kernels.compile_ahead import TimedPool

    def broken_launcher(kernel):
        raise OSError(f"gcc: not found ({kernel})")

    caplog.set_level(logging.DEBUG, logger="headroom.kernels")
    with ThreadPoolExecutor(2) as pool:
        timed = TimedPool(pool, build_launcher=broken_launcher)
        timed.name = "scale_kernel"
        assert timed.submit(lambda: "compiled").result() == "compiled"
        timed.name = "bad_kernel"
        failing = timed.submit(lambda: (_ for _ in ()).throw(RuntimeError("static_assert")))
        with pytest.raises(RuntimeError, match="static_assert"):
            failing.result()
    assert sorted(name for _, name in timed.times) == ["bad_kernel", "scale_kernel"]
    assert "scale_kernel's launcher not built ahead: gcc: not found (compiled)" in caplog.text


def test_triton_s_driver_is_created_on_the_calling_thread(monkeypatch):
    """Before fla's import ahead starts on its thread: the driver Triton would otherwise create, unlocked, on
    whichever thread used it first."""
    import threading

    from headroom.kernels.compile_ahead import create_triton_driver
    from triton.runtime import driver

    asked: list[str] = []

    class Driver:
        def get_current_target(self):
            asked.append(threading.current_thread().name)

    monkeypatch.setattr(driver, "_active", Driver())
    create_triton_driver()
    assert asked == [threading.current_thread().name]


def test_one_launcher_build_per_launcher_key_a_round():
    """Kernels whose launchers share a source (same argument types and tensor descriptors) build it once; one with
    other types builds its own; one the key cannot be read from builds every time it is asked."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from headroom.kernels.compile_ahead import TimedPool, launcher_key

    def kernel(signature, name):
        return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=SimpleNamespace(), name=name)

    ints = {"x": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    kernels = [kernel(ints, "block64"), kernel(dict(ints), "block128"), kernel({**ints, "n": "i64"}, "wide"),
               SimpleNamespace(name="opaque"), SimpleNamespace(name="opaque")]
    assert launcher_key(kernels[0]) == launcher_key(kernels[1]) != launcher_key(kernels[2])
    built: list[str] = []
    with ThreadPoolExecutor(4) as pool:
        timed = TimedPool(pool, build_launcher=lambda k: built.append(k.name))
        for k in kernels:
            timed.submit(lambda k=k: k).result()
    assert sorted(built) == ["block64", "opaque", "opaque", "wide"]


def test_report_summary():
    report = CompileAheadReport(8, dry_passes=12, compiled=49, failed=2, dry_seconds=3.25, compile_seconds=9.04)
    assert report.summary() == ("49 Triton specialisations compiled ahead on 8 threads in 9.0 s, 2 left to their "
                                "pass (12 dry passes, 3.2 s)")
    report.dry_failures = 1
    assert "(12 dry passes, 1 of them raised, 3.2 s)" in report.summary()
    # The longest compiles over every round, three kept, longest first.
    report.add_compile_times([(2.5, "chunk_o"), (0.4, "norm")])
    report.add_compile_times([(0.1, "gemv"), (7.25, "solve_tril")])
    assert report.slowest == [(7.25, "solve_tril"), (2.5, "chunk_o"), (0.4, "norm")]
    assert report.summary().endswith("3.2 s); slowest: solve_tril 7.2 s, chunk_o 2.5 s, norm 0.4 s")


def test_a_dry_pass_that_raises_is_logged_and_everything_is_handed_back(caplog):
    from triton import knobs
    from triton.runtime.autotuner import Autotuner

    hook, run = knobs.runtime.jit_cache_hook, Autotuner.run
    ahead = CompileAhead(2)

    def dry():
        assert knobs.runtime.jit_cache_hook is not hook and Autotuner.run is not run
        raise RuntimeError("garbage index")

    assert ahead.prepare(dry) == 0
    assert knobs.runtime.jit_cache_hook is hook and Autotuner.run is run
    assert ahead.report.dry_failures == 1 and ahead.report.dry_passes == 1
    assert "a dry pass raised RuntimeError: garbage index" in caplog.text
