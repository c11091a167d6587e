#!/usr/bin/env bash
# One H200 call for the benches of issues 14, 15 and 19 (device time is scarce: one start, one command).
# From the repo root on the GPU machine, with the wheels in .whl/ (bench/device_env.sh):
#   bash bench/gpu_batch.sh "$OUT"
# Each bench has its own time limit and writes as it goes, so a bench cut short still returns what it
# measured; everything is packed into $OUT/results.tgz (the device returns at most 8 files) and the
# summary JSONs are copied beside it.
set -u
out=$1; res=/tmp/gpu_batch; rm -rf "$res"; mkdir -p "$res"
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$res/gpu.csv" 2>&1
start=$SECONDS
timeout 240 python3 bench/prefix_chains.py "$res/chains" > "$res/chains.log" 2>&1; echo "chains rc=$? at $((SECONDS - start)) s"
timeout 170 bash bench/gpu_contention.sh "$res/contention" > "$res/contention.log" 2>&1; echo "contention rc=$? at $((SECONDS - start)) s"
left=$((575 - (SECONDS - start)))
timeout "$left" python3 bench/quant_weights.py "$res/quant_weights.json" > "$res/quant.log" 2>&1; echo "quant rc=$? at $((SECONDS - start)) s"
tail -8 "$res/chains.log" "$res/contention.log" "$res/quant.log"
cp "$res/chains/prefix_chains.json" "$res/contention/contention.json" "$res/quant_weights.json" "$out/" 2>/dev/null
tar czf "$out/results.tgz" -C "$res" .
