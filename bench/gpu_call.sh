#!/usr/bin/env bash
# One H200 call running the named benches in order, each under its own time limit (device time is scarce: one
# start, one command). From the repo root on the GPU machine, with the wheels in .whl/ (bench/device_env.sh):
#   bash bench/gpu_call.sh "$OUT" quant_kernels:100 contention:190 engine_speed:240 ...
# Benches: quant_kernels, quant_weights, gpu_plans (GPU_PLANS_KV), contention, engine_speed (parts from ENGINE_SPEED_PARTS), tp_speed.
# Each writes as it goes, so one cut short still returns what it measured; everything is packed into
# $OUT/results.tgz (the device returns at most 8 files) and the summary JSONs are copied beside it.
set -u
out=$1; shift
res=/tmp/gpu_call; rm -rf "$res"; mkdir -p "$res"
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$res/gpu.csv" 2>&1
start=$SECONDS
for job in "$@"; do
  name=${job%%:*}; limit=${job#*:}
  case $name in
    quant_kernels) cmd=(python3 bench/quant_kernels.py "$res/quant_kernels.json") ;;
    quant_weights) cmd=(python3 bench/quant_weights.py "$res/quant_weights.json") ;;
    gpu_plans) cmd=(python3 bench/gpu_plans.py "$res/gpu_plans.json") ;;
    contention) cmd=(bash bench/gpu_contention.sh "$res/contention") ;;
    # shellcheck disable=SC2086
    engine_speed) cmd=(env ENGINE_SPEED_DEADLINE_S=$((limit - 60)) python3 bench/engine_speed.py "$res/engine_speed" ${ENGINE_SPEED_PARTS:-}) ;;
    tp_speed) cmd=(env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
                   python3 bench/tp_speed.py "$res/tp_speed.json") ;;
    *) echo "unknown bench $name"; continue ;;
  esac
  timeout --signal=TERM --kill-after=15 "$limit" "${cmd[@]}" > "$res/$name.log" 2>&1
  echo "$name rc=$? at $((SECONDS - start)) s"
  tail -6 "$res/$name.log"
done
cp "$res"/*.json "$res/contention/contention.json" "$res/engine_speed/engine_speed.json" "$out/" 2>/dev/null
cp "$res/engine_speed/engine_speed_detail.json" "$res/engine_speed/fla_tuned_configs.json" "$res/engine_speed/gemv_tuned_configs.json" "$out/" 2>/dev/null
tar czf "$out/results.tgz" -C "$res" .
