#!/usr/bin/env bash
# Issue 15's contention scenario on the H200 through `headroom serve`, the schedulers in one run:
# fair (the old default), --strict-fcfs, short_first without and with interjection (the default), and an ITL target. The 4B-shaped random bf16 model
# (built by bench/gpu_engine.py's build section), a 24 GiB plan, chunk 8192, 16 running, as in the issue.
# From the repo root on the GPU machine:
#   source bench/device_env.sh && bash bench/gpu_contention.sh "$OUT"
# Writes $OUT/contention_{fair,fcfs,short_first}.json, each server's log, and $OUT/contention.json (all three).
set -u
out=$1; mkdir -p "$out"
repo=$PWD
# Each run gets its own port, and its server is started inline as `( ... exec python3 ...) &`, so that $! is the
# server itself: twice a shell function wrapped it in a second subshell, `kill` stopped only that, and the
# later runs measured the first server again (H200, sessions 2 and 3).
serve_cmd='import sys; from headroom.main import main; sys.exit(main())'
# CONTENTION_BASE replaces the server flags below (bench/cpu_contention.sh runs the same scenario on a CPU).
if [ -z "${CONTENTION_BASE:-}" ]; then
  [ -f /tmp/headroom-q35-4b/config.json ] || python3 bench/gpu_engine.py "$out/build.json" build > "$out/build.log" 2>&1
  base="--model /tmp/headroom-q35-4b --device cuda --gpu-memory 24GiB --context-length 32768 --max-new-tokens 512"
  base="$base --max-running-requests 16 --chunked-prefill-size 8192"
else
  base=$CONTENTION_BASE
fi
port=18080
# CONTENTION_RUNS: label:flags entries separated by '|' (default: the old default, strict FCFS, short_first without
# and with interjection (the default), and the default with a 50 ms ITL target), e.g. a --max-pass-ms sweep.
default_runs="fair:--scheduler-policy fair|fcfs:--strict-fcfs|short_first_plain:--no-interjection|short_first:"
default_runs="$default_runs|short_first_itl50:--itl-target-ms 50"
IFS='|' read -r -a runs <<< "${CONTENTION_RUNS:-$default_runs}"
for run in "${runs[@]}"; do
  label=${run%%:*}; flags=${run#*:}; port=$((port + 1))
  # shellcheck disable=SC2086
  (cd /tmp && exec python3 -c "$serve_cmd" serve $base --port $port $flags) > "$out/serve_$label.log" 2>&1 &
  server=$!
  for _ in $(seq 240); do
    curl -sf localhost:$port/ready >/dev/null && break
    kill -0 $server 2>/dev/null || { echo "serve ($label) exited"; tail -20 "$out/serve_$label.log"; break; }
    sleep 0.5
  done
  (cd /tmp && python3 "$repo/bench/contention_client.py" "http://localhost:$port" "$label" "$out/contention_$label.json") \
    > "$out/client_$label.log" 2>&1 || tail -n 5 "$out/client_$label.log"
  # The server logs its scheduler and fitted cost model: proof of which one answered.
  grep -m1 "scheduler" "$out/serve_$label.log" || echo "no scheduler line in serve_$label.log"
  kill $server; wait $server 2>/dev/null
  # Its GPU memory must be free before the next server plans the same 24 GiB.
  for _ in $(seq 60); do curl -s "localhost:$port/health" >/dev/null || break; sleep 0.5; done
done
python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
runs = {p.stem.split("_", 1)[1]: json.loads(p.read_text()) for p in sorted(out.glob("contention_*.json"))}
import os
env = {k: os.environ[k] for k in ("CONTENTION_BASE", "CONTENTION_RUNS", "CONTENTION_LONG_TOKENS", "CONTENTION_REPEATS")
       if k in os.environ}
(out / "contention.json").write_text(json.dumps({"command": "bash bench/gpu_contention.sh OUT", "env": env, "runs": runs},
                                                indent=2))
for label, r in runs.items():
    c, g = r["contention"], r["decode_gaps"]
    print(label, "short", round(c["short_ttft_s"], 3), c.get("question_ttfts_s"), "idle", round(r["idle"]["short_ttft_s"], 3),
          "long", [round(t, 2) for t in c["long_ttfts_s"]], "agg", round(c["aggregate_prefill_tok_s"]),
          "lone", round(r["lone"]["prefill_tok_s"] or 0), "gaps p50/p95", round(g["itl_p50_s"], 4), round(g["itl_p95_s"], 4),
          "idle itl", round(r["idle"]["itl_p50_s"], 4), "prefill w/ decodes", round(g["prefill_tok_s"]))
    if "repeats" in r:
        print(label, "repeats", r["repeats"]["count"], "aggregate each",
              [round(run["contention"]["aggregate_prefill_tok_s"]) for run in r["repeats"]["runs"]],
              "means", {k: round(v, 4) if v else v for k, v in r["repeats"]["means"].items()})
PY
