#!/usr/bin/env bash
# `headroom bench` workloads of the seeds against `headroom serve` on the GPU (the 4B-shaped random model
# that bench/gpu_engine.py builds). Run on the H200 from the repo root after `source bench/device_env.sh`:
#   bash bench/gpu_serve_bench.sh OUTDIR
set -u
out=$1; mkdir -p "$out"
headroom() { (cd /tmp && python3 -c 'import sys; from headroom.main import main; sys.exit(main())' "$@"); }
serve_args=${SERVE_ARGS:---model /tmp/headroom-q35-4b --device cuda --context-length 32768 --max-new-tokens 512 --max-running-requests 16}
# shellcheck disable=SC2086
headroom serve $serve_args --port 18080 > "$out/serve.log" 2>&1 &
server=$!
for _ in $(seq 240); do
  curl -sf localhost:18080/ready >/dev/null && break
  kill -0 $server 2>/dev/null || { echo "headroom serve exited; see $out/serve.log"; tail -20 "$out/serve.log"; exit 1; }
  sleep 0.5
done
curl -s localhost:18080/plan > "$out/plan.json"
ids="--token-id-range 32 127"
headroom bench --url http://localhost:18080 --workload hom_c8_2k_each --workload mix_short6_long2_c8 \
  --workload prefill_heavy_c4_4k_each --workload decode_heavy_c8_short --label gpu-002 --out "$out/seed002" \
  --no-progress $ids --timeout-s 120 > "$out/bench002.txt" 2>&1
headroom bench --url http://localhost:18080 --workload long1_short_mid --workload long4_short_mid \
  --workload chains_k3_revisit --max-prompt-tokens ${LONG_TOKENS:-24000} --label gpu-000-004 --out "$out/seed000_004" \
  --no-progress $ids --timeout-s 180 > "$out/bench000_004.txt" 2>&1
curl -s localhost:18080/metrics | grep -E '^headroom_' > "$out/metrics.txt"
kill $server; wait $server 2>/dev/null
tar czf "$out.tgz" -C "$out" .
