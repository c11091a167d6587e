"""Compile a warm-up pass's Triton kernels on every CPU core before the pass runs (the cold start).

Why: a cold `headroom serve` compiles its Triton specialisations (51 for the 4B model) one after another, each
inside the warm-up pass that first launches it: most of a 45-67 s start to /ready on the H200 (docs/gpu.md,
sessions 12-13), against 16 s with the compiler caches warm. Triton compiles mostly outside the GIL: two threads
compiled eight attention variants 1.8x faster than one on a 2-core machine with Triton 3.6, 2.0x with 3.9 (sm_90
target; bench/compile_threads.py, bench/results/session14).
A pass cannot use that as it runs, since it meets its kernels one at a time. So the warm-up runs a pass dry
first: every launch that would compile is skipped and its specialisation recorded (Triton's JIT cache hook); all of
them then compile at once on a thread pool (Triton's AsyncCompileMode and JITFunction.preload); the pass then runs
for real and finds every kernel compiled.

A dry pass computes garbage: the kernels it skipped wrote nothing, and whatever ran after them read that; it
also writes the states the real pass then starts from (a continuing chunk's SSM state, a KIVI residual window),
so the real pass computes garbage too, or applies its chunk twice where nothing was left to compile. It therefore
runs only in the warm-up, whose results nothing keeps (the warm-up samples greedily, which NaN logits survive, and
leaves the prefix cache empty), and only where no other thread launches kernels meanwhile (the hook is
process-wide). Every index a kernel or a torch op reads in a pass is built on the host or by torch from host values
(tables, slots, offsets, fla's chunk indices), never by a skipped kernel, so a dry pass reads no memory out of
bounds; the one device value the host reads in a pass (a MoE layer's experts in use) is bounded by the expert
count whatever the router computed (a second review of the forward path, session 14). An autotuner met in a dry
pass would time skipped launches and keep a meaningless choice: its cache is restored after the pass (and its disk
cache not written), so it tunes in the real pass as it always did; the timing of the skipped launches is wasted
(about 0.1 s a config), which the shipped fla configs avoid on the H200.

Off with HEADROOM_COMPILE_AHEAD=0; HEADROOM_COMPILE_THREADS sets the pool (default: the CPUs this process may
use, its cgroup quota included, at most MAX_THREADS).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("headroom.kernels")

# More threads than this only contend for the GIL (a compile holds it for its Python front end: a fifth of its time
# with Triton 3.6, a twelfth with 3.9, bench/compile_threads.py on a 2-core machine).
MAX_THREADS = 16
# Compiles named in the report (and in each round's log line), longest first.
SLOWEST_KEPT = 3


@dataclass
class CompileAheadReport:
    """What compiling ahead did over the warm-up: dry passes run, specialisations compiled ahead, those that failed
    ahead (compiled in their pass instead, where a real error is raised), and the seconds each part took."""

    threads: int
    dry_passes: int = 0
    compiled: int = 0
    failed: int = 0
    dry_seconds: float = 0.0
    compile_seconds: float = 0.0
    # Dry passes that raised (the real pass then runs as it would have, and raises again if the fault is real).
    dry_failures: int = 0
    # The longest single compiles (each with its launcher's build), (seconds, kernel), longest first: a round lasts at
    # least as long as its slowest.
    slowest: list[tuple[float, str]] = field(default_factory=list)

    def summary(self) -> str:
        failed = f", {self.failed} left to their pass" if self.failed else ""
        raised = f", {self.dry_failures} of them raised" if self.dry_failures else ""
        slowest = f"; slowest: {named_times(self.slowest)}" if self.slowest else ""
        return (f"{self.compiled} Triton specialisations compiled ahead on {self.threads} threads in "
                f"{self.compile_seconds:.1f} s{failed} ({self.dry_passes} dry passes{raised}, "
                f"{self.dry_seconds:.1f} s){slowest}")

    def add_compile_times(self, times: list[tuple[float, str]]) -> None:
        self.slowest = sorted([*self.slowest, *times], reverse=True)[:SLOWEST_KEPT]


def named_times(times: list[tuple[float, str]]) -> str:
    """The longest SLOWEST_KEPT of (seconds, kernel), longest first, as the log lines and the report name them."""
    return ", ".join(f"{name} {seconds:.1f} s" for seconds, name in sorted(times, reverse=True)[:SLOWEST_KEPT])


def cgroup_cpus(cpu_max: str) -> float | None:
    """The CPUs a cgroup v2 `cpu.max` line ("quota period", or "max period" when unlimited) allows, or None."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by its cgroup's CPU quota (a pod's limit)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as quota_file:
            quota = cgroup_cpus(quota_file.read())
    except OSError:
        quota = None
    if quota is not None:
        cpus = min(cpus, max(1, int(quota)))
    return max(1, cpus)


def compile_threads(environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """Threads to compile ahead on: HEADROOM_COMPILE_THREADS, else usable_cpus() up to MAX_THREADS; 0 when off
    (HEADROOM_COMPILE_AHEAD=0, or one thread, which would only add the dry passes)."""
    if environ.get("HEADROOM_COMPILE_AHEAD", "1") == "0":
        return 0
    raw = environ.get("HEADROOM_COMPILE_THREADS")
    if raw is None:
        threads = min(usable_cpus(), MAX_THREADS)
    else:
        try:
            threads = int(raw)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"HEADROOM_COMPILE_THREADS={raw!r} must be a whole number of threads, at least 1")
    return threads if threads > 1 else 0


def create_triton_driver() -> None:
    """Create Triton's driver on this thread, now. Triton creates it on its first use, without a lock, so a thread
    importing a module that uses it (fla's import ahead, kernels/gdn_fla.py import_in_background) and this one
    could each create one."""
    from triton.runtime import driver

    driver.active.get_current_target()


def triton_compiles_ahead() -> bool:
    """Whether this Triton has what compiling ahead uses: the JIT cache hook, AsyncCompileMode and preload."""
    try:
        from triton import knobs
        from triton.runtime import _async_compile
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return (hasattr(knobs.runtime, "jit_cache_hook") and hasattr(_async_compile, "AsyncCompileMode")
            and hasattr(JITFunction, "preload"))


class CompileAhead:
    """prepare(dry_pass) before each warm-up pass; `report` sums what it did."""

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"compile ahead: {threads} threads")
        self.report = CompileAheadReport(threads)

    def prepare(self, *dry_passes: Callable[[], object]) -> int:
        """Run each dry pass with every launch that would compile skipped, then compile what they skipped on the
        thread pool, all in one round (passes whose real runs come one after another, such as the decode graphs'
        sizes, wait for one round of compiles instead of one each: a round lasts about as long as its slowest
        compile). Returns how many specialisations they met. A dry pass that raises is logged, not raised: it
        computes on garbage, and the real pass after it shows whether the fault is real; the passes after it
        still run dry."""
        pending: dict[tuple[int, str], tuple[Any, str]] = {}
        dry_before = self.report.dry_seconds
        for dry_pass in dry_passes:
            for key, met in self._record(dry_pass).items():
                pending.setdefault(key, met)
        dry_seconds = self.report.dry_seconds - dry_before
        if pending:
            seconds, times = self._compile(list(pending.values()))
            # One line a round: where a cold start's seconds went (which round, which kernel held it up).
            logger.info("compile ahead: %d dry pass%s in %.2f s, then %d specialisations in %.1f s (slowest, with its "
                        "launcher: %s)",
                        len(dry_passes), "" if len(dry_passes) == 1 else "es", dry_seconds, len(pending), seconds,
                        named_times(times))
        return len(pending)

    def _record(self, dry_pass: Callable[[], object]) -> dict[tuple[int, str], tuple[Any, str]]:
        from triton import knobs
        from triton.runtime.autotuner import Autotuner

        met: dict[tuple[int, str], tuple[Any, str]] = {}

        def skip(**kwargs: Any) -> bool:
            # A miss: remember the specialisation, and tell Triton to neither compile nor launch it.
            fn = kwargs["fn"].jit_function
            met.setdefault((id(fn), str(kwargs["key"])), (fn, kwargs["compile"]["specialization_data"]))
            return True

        tuners: dict[int, tuple[Any, dict, bool]] = {}
        autotuner_run = Autotuner.run

        def run_keeping_cache(tuner: Any, *args: Any, **kwargs: Any) -> Any:
            if id(tuner) not in tuners:
                tuners[id(tuner)] = (tuner, dict(tuner.cache), getattr(tuner, "cache_results", False))
            if hasattr(tuner, "cache_results"):
                tuner.cache_results = False
            return autotuner_run(tuner, *args, **kwargs)

        hook = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = skip
        Autotuner.run = run_keeping_cache  # type: ignore[method-assign]
        started = time.perf_counter()
        try:
            dry_pass()
        except Exception as exc:  # noqa: BLE001 - a dry pass reads garbage; only the real pass's errors count
            self.report.dry_failures += 1
            logger.warning("compile ahead: a dry pass raised %s: %s (what it met before compiles ahead; the rest "
                           "compiles in the pass)", type(exc).__name__, exc)
        finally:
            knobs.runtime.jit_cache_hook = hook
            Autotuner.run = autotuner_run  # type: ignore[method-assign]
            for tuner, cache, cache_results in tuners.values():
                tuner.cache.clear()
                tuner.cache.update(cache)
                if hasattr(tuner, "cache_results"):
                    tuner.cache_results = cache_results
            self.report.dry_passes += 1
            self.report.dry_seconds += time.perf_counter() - started
        return met

    def _compile(self, pending: list[tuple[Any, str]]) -> tuple[float, list[tuple[float, str]]]:
        """Compile these on the pool; returns the round's seconds and each compile's (seconds, kernel name)."""
        from triton.runtime._async_compile import AsyncCompileMode

        started = time.perf_counter()
        futures = []
        failed = 0
        with ThreadPoolExecutor(self.report.threads, thread_name_prefix="headroom-compile") as pool:
            timed = TimedPool(pool)
            # Leaving the mode waits for every compile and puts each kernel in its function's cache; a compile that
            # fails is left out (ignore_errors), and its pass compiles it again and raises where it always did.
            with AsyncCompileMode(timed, ignore_errors=True):  # type: ignore[arg-type] - it only calls submit
                for fn, data in pending:
                    timed.name = getattr(fn, "__name__", str(fn))
                    try:
                        futures.append(fn.preload(data))
                    except Exception as exc:  # noqa: BLE001 - a specialisation preload cannot rebuild: its pass compiles it
                        failed += 1
                        logger.debug("compile ahead: %s not preloaded: %s", fn, exc)
        failed += sum(1 for future in futures if getattr(future, "kernel", None) is None)
        seconds = time.perf_counter() - started
        self.report.compiled += len(pending) - failed
        self.report.failed += failed
        self.report.compile_seconds += seconds
        self.report.add_compile_times(timed.times)
        return seconds, timed.times


class TimedPool:
    """The executor AsyncCompileMode submits to: each compile, and then its launcher's build, on a pool thread,
    timed under the name of the kernel being preloaded when it was submitted (preload submits at most one compile,
    from the caller's thread). A launcher is built once a round per launcher_key, by the first compile that needs
    it (the specialisations of one kernel share it: Triton 3.6's launcher source follows the argument types only)."""

    def __init__(self, pool: ThreadPoolExecutor, build_launcher: Callable[[Any], None] | None = None):
        self.pool = pool
        self.name = ""
        self.times: list[tuple[float, str]] = []
        self.build_launcher = build_launcher if build_launcher is not None else build_triton_launcher
        self._launchers: set[tuple[str, str]] = set()
        self._launchers_lock = threading.Lock()

    def submit(self, compile_fn: Callable[[], Any]) -> Any:
        name = self.name

        def timed() -> Any:
            started = time.perf_counter()
            try:
                kernel = compile_fn()
                self._build_launcher_once(kernel, name)
                return kernel
            finally:
                # list.append is atomic under the GIL: the pool's threads share the list without a lock.
                self.times.append((time.perf_counter() - started, name))

        return self.pool.submit(timed)

    def _build_launcher_once(self, kernel: Any, name: str) -> None:
        try:
            key = launcher_key(kernel)
        except Exception:  # noqa: BLE001 - no key: build it, as often as asked
            key = None
        if key is not None:
            with self._launchers_lock:
                if key in self._launchers:
                    return
                self._launchers.add(key)
        try:
            self.build_launcher(kernel)
        except Exception as exc:  # noqa: BLE001 - the kernel's first launch builds it again, and raises there
            logger.debug("compile ahead: %s's launcher not built ahead: %s", name, exc)


def launcher_key(kernel: Any) -> tuple[str, str]:
    """What a compiled kernel's launcher is built from in Triton 3.6 (make_launcher): its arguments' types and its
    tensor descriptors. Constexpr values are not in it, so a kernel's specialisations share one launcher. Were a
    Triton to put more into it, two kernels with one key would still each get a launcher: the second at its first
    launch, as before compiling ahead built any."""
    return repr(tuple(kernel.src.signature.items())), repr(getattr(kernel.metadata, "tensordesc_meta", None))


def build_triton_launcher(kernel: Any) -> None:
    """Build a compiled kernel's launcher into the Triton cache, so that its first launch only loads it.

    Why: Triton (3.6) gives each kernel signature a launcher of its own, a C extension it compiles with the host's C
    compiler on the kernel's first launch (cached by source in the Triton cache, which a cold start has empty). That
    ran on the warm-up's thread, one gcc after another: 7 s of a 50 s cold start on an H100 (session 25's sampled
    stacks, bench/stack_sampler.py), 3.5 s of it in the decode graphs' capture. Built here, on a compile thread,
    they run side by side; the first launch finds the built module in the cache (compile_module_from_src's key is
    the launcher's source) and only loads it. The object built here is dropped: the kernel makes its own there."""
    from triton.runtime import driver

    driver.active.launcher_cls(kernel.src, kernel.metadata)
