"""Where a process's threads spend their wall time, sampled: `python3 bench/stack_sampler.py OUT.json -- ARGS` runs
headroom's CLI (`headroom ARGS`) in this process with a thread that reads every other thread's stack every
INTERVAL seconds (ENGINE_SPEED_STACK_INTERVAL_S, default 0.01) and writes OUT.json every few seconds and at exit.

Why: a cold `headroom serve` spends seconds in steps no log line splits (session 25 on an H100: the first prefill
warm-up pass's dry run took 6-11 s, the decode graphs' warm passes and captures 5 s), and no profiler is installed
on the GPU machine. Python frames only: time inside a C call (a CUDA API, a cuBLAS heuristic, Triton's compiler)
counts against the Python line that made it.

OUT.json: {thread name: {"samples", "leaf": [[frame, samples]], "inclusive": [[frame, samples]],
"timeline": [[second since start, samples, frame path of the bucket's most sampled stack]]}}, a frame being
"file:line function" (leaf) or "file function" (inclusive); the busiest frames first.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

INTERVAL_S = float(os.environ.get("ENGINE_SPEED_STACK_INTERVAL_S", "0.01"))
BUCKET_S = 0.5  # the timeline's resolution
KEPT = 60  # frames kept per list
DEPTH = 12  # innermost frames kept in a timeline's stack
# Threads that only wait (the event loop's select, the compile pool between rounds) say nothing about where time
# goes: a sample whose innermost frame is one of these is not counted, except on the threads whose waits are the
# start-up's critical path (the warm-up joining fla's import, waiting out a round of compiles).
IDLE = ("selectors.py", "threading.py:", "queue.py", "concurrent/futures/thread.py")
WAITS_COUNT_ON = ("headroom-warmup", "headroom-engine")


def _short(filename: str) -> str:
    parts = Path(filename).parts
    return "/".join(parts[-2:])


class Sampler:
    def __init__(self, out: Path):
        self.out = out
        self.started = time.perf_counter()
        self.leaf: dict[str, Counter] = defaultdict(Counter)
        self.inclusive: dict[str, Counter] = defaultdict(Counter)
        self.buckets: dict[str, dict[int, Counter]] = defaultdict(lambda: defaultdict(Counter))
        self.samples: Counter = Counter()
        self.lock = threading.Lock()

    def sample(self) -> None:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        bucket = int((time.perf_counter() - self.started) / BUCKET_S)
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            stack = []
            while frame is not None:
                stack.append(frame)
                frame = frame.f_back
            leaf = f"{_short(stack[0].f_code.co_filename)}:{stack[0].f_lineno} {stack[0].f_code.co_name}"
            name = names.get(ident, str(ident))
            if name not in WAITS_COUNT_ON and any(marker in leaf for marker in IDLE):
                continue
            with self.lock:
                self.samples[name] += 1
                self.leaf[name][leaf] += 1
                for f in {f"{_short(f.f_code.co_filename)} {f.f_code.co_name}" for f in stack}:
                    self.inclusive[name][f] += 1
                path = " < ".join(f"{_short(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}"
                                  for f in stack[:DEPTH])
                self.buckets[name][bucket][path] += 1

    def write(self) -> None:
        with self.lock:
            report = {name: {"samples": count,
                             "leaf": self.leaf[name].most_common(KEPT),
                             "inclusive": self.inclusive[name].most_common(KEPT),
                             "timeline": [[round(b * BUCKET_S, 1), sum(c.values()), c.most_common(1)[0][0]]
                                          for b, c in sorted(self.buckets[name].items())]}
                      for name, count in self.samples.most_common()}
        self.out.write_text(json.dumps({"interval_s": INTERVAL_S, "threads": report}, indent=1))

    def run(self) -> None:
        last_write = time.perf_counter()
        while True:
            time.sleep(INTERVAL_S)
            self.sample()
            if time.perf_counter() - last_write > 5.0:
                self.write()
                last_write = time.perf_counter()


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    sampler = Sampler(Path(sys.argv[1]))
    atexit.register(sampler.write)
    threading.Thread(target=sampler.run, name="stack-sampler", daemon=True).start()
    from headroom.main import main as headroom_main

    sys.argv = ["headroom", *sys.argv[3:]]
    return headroom_main()


if __name__ == "__main__":
    sys.exit(main())
