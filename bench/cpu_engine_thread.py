"""Why the CPU engine thread runs torch with one intra-op thread (EngineConfig.cpu_threads): the median forward of
16 decodes of the embedded model through the LLM API, run from the main thread and from a new thread, with
torch's default intra-op threads and with one. Each case runs in its own process (OpenMP state is per process).

    python3 bench/cpu_engine_thread.py OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

CASE = textwrap.dedent("""
    import json, random, statistics, sys, threading, time, torch
    from headroom.engine.default_model import ensure_default_model
    from headroom.engine.llm import LLM
    where, threads = sys.argv[1], int(sys.argv[2])
    rng = random.Random(3)
    llm = LLM(str(ensure_default_model()), device="cpu", max_total_tokens=16384, ssm_slots=24,
              chunked_prefill_size=512, max_running_requests=16)
    inner, times = llm.runner.forward, []
    def forward(items, *args, **kwargs):
        started = time.perf_counter()
        out = inner(items, *args, **kwargs)
        if len(items) == 16 and all(len(i.token_ids) == 1 for i in items):
            times.append(time.perf_counter() - started)
        return out
    llm.runner.forward = forward
    def run():
        if threads:
            torch.set_num_threads(threads)
        llm.generate([[rng.randrange(32, 128) for _ in range(32)] for _ in range(16)], max_new_tokens=80,
                     ignore_eos=True)
    if where == "main":
        run()
    else:
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    print(json.dumps({"where": where, "threads": threads or torch.get_num_threads(),
                      "forward_ms_median": statistics.median(times) * 1000, "forwards": len(times)}))
""")


def main() -> None:
    cases = []
    for where, threads in (("main", 0), ("thread", 0), ("thread", 1), ("main", 1)):
        out = subprocess.run([sys.executable, "-c", CASE, where, str(threads)], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
        cases.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(cases[-1], flush=True)
    Path(sys.argv[1]).write_text(json.dumps({"command": "python3 bench/cpu_engine_thread.py " + sys.argv[1],
                                             "cores": os.cpu_count(), "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
