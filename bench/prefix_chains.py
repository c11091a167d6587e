"""Field report 004's chains through `headroom serve` on the GPU: lap 1 / 2 / 3 TTFT and hit rate, bf16 and int2 KV.

3 chains of 16,000 tokens, each visit the chain plus a 16-token question that differs per lap, visited in turn
for 3 laps (the report's workload at the 24 GiB plan of docs/gpu.md; 3 x 16,016 tokens fit that plan's pool).
The model is the Qwen3.5-4B-shaped random bf16 model of bench/gpu_engine.py. Run on the H200 from the repo root:
    source bench/device_env.sh && python3 bench/prefix_chains.py "$OUT"
Writes OUT/prefix_chains.json (per KV dtype: the plan's promise, per-lap TTFT and cached tokens, the prefix-cache
counters of /metrics) and each server's log beside it.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import MODEL_4B, _build_4b  # noqa: E402
from headroom.client.http import OpenAIClient  # noqa: E402
from headroom.client.prompts import from_id_range  # noqa: E402

CHAINS, CHAIN_TOKENS, QUESTION_TOKENS, LAPS = 3, 16000, 16, 3
SERVE = ["--model", str(MODEL_4B), "--device", "cuda", "--gpu-memory", "24GiB", "--context-length", "32768",
         "--max-new-tokens", "512", "--max-running-requests", "16"]
METRICS = ("headroom_prefix_lookup_tokens_total", "headroom_prefix_matched_tokens_total",
           "headroom_prefix_matched_no_state_tokens_total", "headroom_cached_prompt_tokens_total",
           "headroom_ssm_checkpoints_taken_total", "headroom_ssm_checkpoints_evicted_total",
           "headroom_ssm_checkpoint_slots", "headroom_ssm_used_slots", "headroom_ssm_total_slots")


def start_server(kv_dtype: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-c", "import sys; from headroom.main import main; sys.exit(main())", "serve",
               *SERVE, "--kv-cache-dtype", kv_dtype, "--port", str(port)]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd="/tmp")
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"headroom serve exited {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1.0).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"headroom serve not ready in 150 s: {log.read_text()[-2000:]}")


async def run_chains(url: str) -> list[dict]:
    factory = from_id_range(32, 127)
    laps = []
    async with OpenAIClient(url, timeout_s=120.0) as client:
        await client.resolve_model()
        for lap in range(1, LAPS + 1):
            visits = []
            for chain in range(CHAINS):
                prompt = factory.session_prompt(CHAIN_TOKENS, QUESTION_TOKENS, session=f"chain{chain}", visit=lap)
                result = await client.stream_completion(prompt, 8, label=f"lap{lap}", extra={"ignore_eos": True})
                if not result.ok:
                    raise RuntimeError(f"lap {lap} chain {chain}: {result.error}")
                visits.append({"ttft_s": result.ttft_s, "cached_tokens": result.cached_tokens,
                               "prompt_tokens": result.prompt_tokens})
            cached = sum(v["cached_tokens"] or 0 for v in visits)
            laps.append({"lap": lap, "visits": visits, "ttft_s": [v["ttft_s"] for v in visits],
                         "hit_rate": cached / (CHAINS * CHAIN_TOKENS)})
    return laps


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    found = {}
    for name in METRICS:
        match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        if match:
            found[name] = float(match.group(1))
    return found


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    _build_4b()
    results: dict = {"workload": f"{CHAINS} chains x {CHAIN_TOKENS} + {QUESTION_TOKENS}-token question, {LAPS} laps",
                     "serve_args": SERVE, "kv": {}}
    for index, kv in enumerate(("bf16", "int2")):
        port = 18090 + index
        url = f"http://127.0.0.1:{port}"
        server = start_server(kv, port, out / f"serve_{kv}.log")
        try:
            plan = httpx.get(f"{url}/plan", timeout=10.0).json()
            laps = asyncio.run(run_chains(url))
            results["kv"][kv] = {
                "plan": {key: plan[key] for key in ("max_total_tokens", "ssm_slots", "chunked_prefill_size",
                                                    "retained_sessions", "session_tokens", "reuse_interval_tokens")},
                "laps": laps, "metrics": metrics(url),
            }
        finally:
            server.terminate()
            server.wait(timeout=30)
        # Written after each KV dtype, so a run cut short still returns what it measured.
        (out / "prefix_chains.json").write_text(json.dumps(results, indent=2) + "\n")
        for lap in results["kv"][kv]["laps"]:
            print(f"{kv} lap {lap['lap']}: hit {lap['hit_rate']:.1%}, TTFT " + ", ".join(f"{t:.3f}" for t in lap["ttft_s"]))
    results["seconds"] = round(time.perf_counter() - started, 1)
    (out / "prefix_chains.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
