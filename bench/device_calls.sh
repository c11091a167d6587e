#!/usr/bin/env bash
# The device calls' plans: `bash bench/device_calls.sh [PLAN]` from the repo root on the GPU machine (sessions 23-24
# ran it as bench/results/session2N/call.sh, which now call this; the exact script of each call is in the commit its
# README lists). Carry .whl and .old. Results go under /tmp/r, tarred into $OUT/r.tgz after every part (starts are scarce and a
# call cut off at its limit still returns what $OUT holds).
source bench/device_env.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); R=/tmp/r
# The outermost plan starts /tmp/r afresh (a warm machine keeps the last call's parts, which the next call's tar would
# carry again); a plan run by another (bash "$0" PLAN) appends to its record instead of overwriting it.
if [[ -z ${DEVICE_CALLS_NESTED:-} ]]; then rm -rf $R; mkdir -p $R; echo "$G" > $R/gpu.txt; fi
export DEVICE_CALLS_NESTED=1
es() { d=$1; o=$R/$2; shift 2; mkdir -p $o; local t0=$SECONDS
    env TRITON_CACHE_DIR=/tmp/tc ENGINE_SPEED_INIT=/nonexistent ENGINE_SPEED_DEADLINE_S=$d timeout $((d+60)) \
        python3 bench/engine_speed.py $o "$@" > $o/log.txt 2>&1
    echo "$o rc $? $((SECONDS-t0)) s: $*" >> $R/gpu.txt; tar czf $OUT/r.tgz -C $R .
    # A part killed at its limit can leave the GPU's memory held for a while (call 1's next LLM found 13.7 GB of 80
    # free and refused to start): wait, up to a minute, for it to come back before the next part.
    for _ in $(seq 60); do (( $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1) < 2000 )) \
        && break; sleep 1; done; }
old() { F=$(cd .old && find . -name '*.py'); for f in $F; do mkdir -p /tmp/new/$(dirname $f); cp $f /tmp/new/$f
    cp .old/$f $f; done; "$@"; for f in $F; do cp /tmp/new/$f $f; done; }
V='{"shipped": {}, "l2_2": {"*": {"l2_prefetch": 2}}, "l2_4": {"*": {"l2_prefetch": 4}},
    "narrow": {"2560x4096": {"block_n": 4, "block_k": 2048, "num_warps": 8, "num_stages": 2, "split": 1},
               "2560x9216": {"block_n": 4, "block_k": 1024, "num_warps": 4, "num_stages": 2, "split": 1}}}'
PLAN=${1:-auto}
# auto: an H200 runs the step tuning and the HTTP rows with its table (the machine); an H100 the batch-1 step
# tuning with the tuner as changed after session 23's calls (the fused down projection's silu_mul entry) and nearest.
if [[ $PLAN == auto ]]; then [[ $G == *H200* ]] && PLAN=step_serve || PLAN=h100; fi
echo "plan $PLAN" >> $R/gpu.txt
export GEMV_FUZZ_CASES=8
case $PLAN in
  table)  # the issue's table (session 24's `rows` on an H100 needed 270 s for these four parts; 250 cut hf_prefill)
    es 360 h serve llm_bf16 llm_int2 hf_prefill
    es 100 p profile_decode_int2 ;;
  variants)
    export ENGINE_SPEED_GEMV_VARIANTS="$V"
    es 40 qn quantizers page_close gated_merge gemv_fuzz
    es 200 n llm_bf16_gemv profile_decode_batches
    export ENGINE_SPEED_GEMV_VARIANTS='{"shipped": {}}'; old es 80 o quantizers page_close llm_bf16_gemv ;;
  step)  # the GEMV table tuned in the graphed step at STEP_TUNE_ROWS, then the decode rows shipped against tuned
    if [[ -n ${FUSED_ROWS:-} ]]; then export ENGINE_SPEED_FUSED_ROWS=$FUSED_ROWS; fi  # else the shipped setting
    if [[ -n ${FUSED_CONV_ROWS:-} ]]; then export ENGINE_SPEED_FUSED_CONV_ROWS=$FUSED_CONV_ROWS; fi
    ENGINE_SPEED_STEP_TUNE_ROWS=${STEP_TUNE_ROWS:-1} ENGINE_SPEED_STEP_CANDIDATES=${STEP_CANDIDATES:-5} ENGINE_SPEED_STEP_TUNE_S=${STEP_TUNE_S:-220} es ${STEP_DEADLINE:-330} gs gemv_step ;;
  step_serve)  # the step tuning, then the HTTP rows with the table it wrote (kernels/ here only: commit it by hand)
    ENGINE_SPEED_STEP_TUNE_ROWS=${STEP_TUNE_ROWS:-1,8,16} ENGINE_SPEED_STEP_CANDIDATES=${STEP_CANDIDATES:-5} \
        ENGINE_SPEED_STEP_TUNE_S=${STEP_TUNE_S:-300} es ${STEP_DEADLINE:-400} gs gemv_step
    if [[ -f $R/gs/gemv_tuned_configs.json ]]; then cp $R/gs/gemv_tuned_configs.json kernels/; es 100 sn serve; fi ;;
  h100)
    ENGINE_SPEED_STEP_TUNE_ROWS=1 ENGINE_SPEED_STEP_CANDIDATES=5 ENGINE_SPEED_STEP_TUNE_S=180 \
        es 270 gs gemv_step
    es 150 nr llm_bf16_nearest ;;
  nearest_serve)  # the HTTP rows with NEAREST_ROWS on (its compile count after /ready), then nearest on/off/on
    HEADROOM_GEMV_NEAREST_ROWS=1 es 120 sn serve
    es 200 nr llm_bf16_nearest ;;
  step_rows24)  # entries of their own for 2 and 4 rows (NEAREST_ROWS gives 2-7 the 8-row ones), then nearest with them
    ENGINE_SPEED_STEP_TUNE_ROWS=2,4 ENGINE_SPEED_STEP_CANDIDATES=5 ENGINE_SPEED_STEP_TUNE_S=230 es 380 gs gemv_step
    if [[ -f $R/gs/gemv_tuned_configs.json ]]; then cp $R/gs/gemv_tuned_configs.json kernels/; es 130 nr llm_bf16_nearest; fi ;;
  rows)  # the HTTP and LLM rows with transformers beside them, the shipped table (session 24 ran it at 250 s,
    es 360 h serve llm_bf16 llm_int2 hf_prefill ;;  # which stopped hf_prefill)
  cold_fla)  # fla's configs autotuned on this GPU (llm_bf16's shapes) and shipped for it, then cold starts with them /
    # with only the configs shipped before (none for an H100: its fla kernels autotune in the warm-up) / with them
    cp kernels/fla_tuned_configs.json /tmp/fla_shipped.json
    es 200 fc llm_bf16 fla_configs; cp kernels/fla_tuned_configs.json /tmp/fla_this_gpu.json
    es 100 c1 serve_cold_tuned
    cp /tmp/fla_shipped.json kernels/fla_tuned_configs.json; es 100 c2 serve_cold_tuned
    cp /tmp/fla_this_gpu.json kernels/fla_tuned_configs.json; es 100 c3 serve_cold_tuned ;;
  stacks)  # a cold start (this GPU's fla configs shipped) with its threads' Python stacks sampled (bench/stack_sampler.py, stacks_*.json)
    ENGINE_SPEED_STACKS=1 es 100 st serve_cold_tuned
    es 220 si serve_int2 ;;  # and the INT2 plan over HTTP: nothing may compile after /ready with the GEMV cover
  startab)  # cold starts: this tree / .old's start-up (session 25: before launchers built on the compile threads, fla
    # imported on a thread of its own and cuDNN's plans before the capture) / this tree with the HTTP rows
    es 100 a serve_cold_tuned
    old es 100 b serve_cold_tuned
    es 120 c serve ;;  # this tree again, a cold start and the HTTP rows (nothing may compile after /ready)
  startab2)  # cold starts: this tree / .old's / this tree with its threads' stacks sampled (for session 26: .old
    # holding engine/runtime/model_runner.py with fla's import started after the weights' load, or not at all)
    es 80 a serve_cold_tuned
    old es 80 b serve_cold_tuned
    ENGINE_SPEED_STACKS=1 es 80 c serve_cold_tuned ;;
  s26a)  # session 26's first call. On an H200 (none since session 20): the GEMV table tuned in the graphed step at 1, 8
    # and 16 rows and the HTTP rows with it (step_serve), then the split merges' timings. On an H100: where a
    # prefill's wall time outside the GPU's span goes, the 32K decode step's kernels with PDL off (bf16 / int2), and
    # the split merge in programs of 32 channels against .old's (kernels/attention_merge_triton.py: a program a row)
    # alone and in the decode rows (int2 and bf16, LLM API)
    if [[ $G == *H200* ]]; then
      ENGINE_SPEED_STEP_TUNE_ROWS=1,8,16 ENGINE_SPEED_STEP_CANDIDATES=5 ENGINE_SPEED_STEP_TUNE_S=280 es 370 gs gemv_step
      if [[ -f $R/gs/gemv_tuned_configs.json ]]; then cp $R/gs/gemv_tuned_configs.json kernels/; es 90 sn serve; fi
      es 20 m split_merges; old es 20 mo split_merges
    else
      es 110 g prefill_host profile_decode_long_nopdl
      es 30 m split_merges; old es 30 mo split_merges
      es 110 d llm_int2_decode llm_bf16_decode; old es 110 do llm_int2_decode llm_bf16_decode
    fi ;;
  s26b)  # fla's import ahead started after the pools (this tree) / from the runner's start (.old, session 25's): this
    # tree's HTTP rows with their cold start (the split merge in them; nothing may compile after /ready), then cold
    # starts .old / this tree (the first start on a machine runs slow whatever it runs)
    # (on an H200, none since session 20: the HTTP rows and cold start first, then a b)
    if [[ $G == *H200* ]]; then es 120 c serve; es 60 a serve_cold_tuned; old es 60 b serve_cold_tuned
    else es 110 c serve; old es 60 b serve_cold_tuned; es 60 a serve_cold_tuned; fi ;;  # (the time left: c b a)
  s26c)  # this tree's HTTP rows with their cold start alone (the split merge in serving: nothing may compile after /ready)
    es 100 c serve ;;
  s26d)  # cold starts .old (fla's import from the runner's start) / this tree (after the pools), on s26c's warm machine
    old es 50 b serve_cold_tuned; es 50 a serve_cold_tuned ;;
  s27b)  # the issue's table with transformers' decode column too (none since session 20 on an H200): the HTTP and LLM
    # rows, transformers' prefill and decode rows, one engine_speed.json; then the whole engine's bf16 logits against
    # transformers' own distance from fp32 (none since session 21; the split merge changed twice since)
    es 430 h serve llm_bf16 llm_int2 hf_prefill hf_decode
    es 110 l logits ;;
  s28b)  # session 28's last start: an H200 the issue's table alone (s27b's first part); an H100 the int2 / bf16 decode
    # rows twice with the wide split merge shipped (the batch-1 32K parity, orders swapped)
    if [[ $G == *H200* ]]; then es ${S28B_H200_S:-260} h serve llm_bf16 llm_int2 hf_prefill hf_decode
    else es 110 d1 llm_int2_decode llm_bf16_decode; es 110 d2 llm_bf16_decode llm_int2_decode; fi ;;
  s31b)  # session 31's last start: an H200 the issue's table and logits (s27b; none since session 20); an H100 a cold
    # start with the table's several-row L2 prefetch (nothing may compile after /ready), then the step tuning at 8 and
    # 16 rows with candidates that keep the entry's l2_prefetch (decode_parts.step_candidates; the sweep's ask for none)
    if [[ $G == *H200* ]]; then bash "$0" s27b
    else es 100 c serve; ENGINE_SPEED_STEP_TUNE_ROWS=8,16 ENGINE_SPEED_STEP_CANDIDATES=4 ENGINE_SPEED_STEP_TUNE_S=150 \
        es 230 gs gemv_step; fi ;;
  s32)  # session 32's first start: an H200 the issue's table and logits (s27b); an H100 the norm tail (s31d)
    if [[ $G == *H200* ]]; then bash "$0" s27b; else bash "$0" s31d; fi ;;
  s33)  # session 33's first start: an H200 the issue's table and logits (s27b); an H100 the prescaled norm (s32b), then
    # the conv in the in-projection's GEMV at 2-16 sequences (FUSED_CONV_ROWS 16 against 1; lost 1.6% / 0.6% at 8 / 16
    # on the H200 in session 19, before the step-tuned tables), alone and with the prescaled norm
    if [[ $G == *H200* ]]; then bash "$0" s27b
    else bash "$0" s32b; es 150 cr fused_conv_rows; es 150 pc fused_prescaled_conv_rows; fi ;;
  s34)  # session 34's first start. An H200: the issue's table and logits (s27b), then the 4B-shaped model's logits.
    # An H100: the prescaled norm with its loads under the loop, then the residual GEMVs' residual rows loaded
    # before their loop (EARLY_RESIDUAL; graphed step on against off, PDL on, each), then the 4B-shaped model's
    # logits with the bf16 bound both ways (fla, as transformers runs by default, and transformers' torch
    # functions; the fp32 truth on the torch functions; and the naive run without fla), then the prescaled norm's
    # PDL-off kernel profile on and off
    if [[ $G == *H200* ]]; then bash "$0" s27b; LOGIT_HF_TORCH=1 LOGIT_ABLATION=0 es 300 l4 logits_4b
    else es 110 pn fused_prescaled_norm; es 110 er fused_early_residual
      LOGIT_HF_TORCH=1 LOGIT_ABLATION=0 es 300 l4 logits_4b
      HEADROOM_PRESCALED_NORM=1 es 90 pp profile_decode_batches; es 90 p0 profile_decode_batches; fi ;;
  s33d)  # the prescaled norm with its loads moved under the loop (the reader's sums, the writer's norm weight): the
    # graphed step on against off (PDL on, as served)
    es 110 pn fused_prescaled_norm ;;
  s33c)  # s33b's logits of the 4B-shaped model alone (its int2 run asked for a pool of 6,256 tokens, not whole pages)
    LOGIT_HF_TORCH=1 LOGIT_ABLATION=0 es 240 l4 logits_4b ;;
  s33b)  # session 33's second start: an H200 the issue's table and logits (s27b); an H100 first the logits of the
    # 4B-shaped model (the tiny model's shapes are not in the GEMV table, so `logits` never ran the GEMVs; transformers'
    # references on its torch functions, fla's fp32 compile being minutes), then where the prescaled norm's step goes
    # (it lost 0.8% / 0.6% of the graphed step at 8 / 16 in call 1): the PDL-off kernel profile with it on, then off,
    # then the graphed step on against off with PDL off (is the norm launch it saves hidden by PDL?)
    if [[ $G == *H200* ]]; then bash "$0" s27b; else
      LOGIT_HF_TORCH=1 LOGIT_ABLATION=0 es 300 l4 logits_4b
      HEADROOM_PRESCALED_NORM=1 es 90 pp profile_decode_batches; es 90 p0 profile_decode_batches
      HEADROOM_PDL=0 es 150 pnx fused_prescaled_norm; fi ;;
  s32e)  # s32b's step and logits alone (little device time left): the prescaled norm on against off, then the logits
    es 150 pn fused_prescaled_norm; export LOGIT_ABLATION=0; es 150 l logits ;;
  s32d)  # the HTTP and LLM rows with PRESCALED_NORM on (after s32b's step gain): the decode rows the table takes
    export HEADROOM_PRESCALED_NORM=1; es 330 h serve llm_bf16 llm_int2 ;;
  s32c)  # session 32's second start: an H200 the issue's table and logits (s27b); an H100 the prescaled norm (s32b)
    if [[ $G == *H200* ]]; then bash "$0" s27b; else bash "$0" s32b; fi ;;
  s31d)  # (ran as session 32's call 1 on 16ba0e1: the norm tail, since removed; that commit has its script)
    echo "s31d: the norm tail is gone (session 32); run it from 16ba0e1" >> $R/gpu.txt ;;
  s32b)  # the next norm factored out of the next projection at 2-16 sequences (engine/layers/residual.py PRESCALED_NORM,
    # off): graphed decode on against off in one process with the greedy tokens, then the kernels' GPU checks
    # (residual_prescaled_gemv at every several-row residual entry against residual_gemv and fp32, normed_gemv /
    # swiglu_gemv of prescaled rows at every several-row hidden-wide entry against fp32 and the unfused path), then
    # the logits with 4 sequences decoding in one pass, off and on, against transformers fp32 (no per-op runs)
    es 150 pn fused_prescaled_norm; export LOGIT_ABLATION=0; es 150 l logits; es 120 k kernels; es 60 f gemv_fuzz ;;
  s31c)  # the several-row L2 prefetch on this GPU's own table (session 31 shipped it on the H100's: batch 8 -3.2%, 16
    # -2.7% a step): the decode rows with the shipped table, l2_prefetch 1 and 2 at every 8- and 16-row entry, shipped again
    export ENGINE_SPEED_GEMV_VARIANTS='{"shipped": {}, "l2_1_rows": {"*@8": {"l2_prefetch": 1}, "*@16": {"l2_prefetch": 1}},
      "l2_2_rows": {"*@8": {"l2_prefetch": 2}, "*@16": {"l2_prefetch": 2}}, "shipped_again": {}}'
    es 250 v llm_bf16_gemv ;;
  s30c)  # session 30's last start: an H200 the issue's table and logits (s27b, now with SwiGLU's epilogue on); an
    # H100 the several-row L2 prefetch (s30b)
    if [[ $G == *H200* ]]; then bash "$0" s27b; else bash "$0" s30b; fi ;;
  s30b)  # several-row GEMVs asking L2 for the next 2 / 4 / 8 weight tiles before their PDL wait (GemvConfig.l2_prefetch;
    # batch 1 lost with it in session 22, several rows never ran it): the 2,560-wide outputs run 6 (K 4,096) or 12
    # (K 9,216) K tiles a program at 8-16 rows, so the tiles before the wait are much of a program's weights. The
    # decode rows with the shipped table, l2_prefetch 2, 4 and 8 at every 8- and 16-row entry, the 2,560-wide
    # entries' 64 x 256 swapped tiles with the deepest cp.async pipeline that fits shared memory (8 rows launch the
    # 16-row tile too, gemv._rows_tile; sm_90 compiles here: 4 stages 197 KB, 5 need 246 KB of the H100's 227), the
    # shipped table again (the spread)
    export ENGINE_SPEED_GEMV_VARIANTS='{"shipped": {}, "l2_2_rows": {"*@8": {"l2_prefetch": 2}, "*@16": {"l2_prefetch": 2}},
      "l2_4_rows": {"*@8": {"l2_prefetch": 4}, "*@16": {"l2_prefetch": 4}},
      "l2_8_rows": {"*@8": {"l2_prefetch": 8}, "*@16": {"l2_prefetch": 8}},
      "deep_narrow": {"2560x4096@8": {"num_stages": 4}, "2560x9216@8": {"num_stages": 4},
                      "2560x4096@16": {"num_stages": 4}, "2560x9216@16": {"num_stages": 4}}, "shipped_again": {}}'
    es 330 v llm_bf16_gemv ;;
  s30)  # session 30's first start: the issue's table and logits with SwiGLU's gate|up epilogue on (session 29: the
    # decode step 0.4-1.0% faster with it, prefill and serving not measured), then the kernels' GPU checks
    export HEADROOM_FUSED_SWIGLU=1
    es 430 h serve llm_bf16 llm_int2 hf_prefill hf_decode; es 110 l logits; es 120 k kernels ;;
  s29)  # session 29's first start: an H200 the issue's table and logits (s27b); an H100 the decode step's fusions (s29b)
    if [[ $G == *H200* ]]; then bash "$0" s27b; else bash "$0" s29b; fi ;;
  s29b)  # session 29's follow-up on a warm machine: Gated DeltaNet's output norm and conv in the delta rule's decode
    # kernel at 2+ sequences against their own launches (graphed decode at 1, 8, 16, one engine after the other):
    # both; SwiGLU's activation in the gate|up GEMV's epilogue against silu_mul's launch; the delta rule's launch
    # configurations (Triton 3.6 spills the shipped decode entries, 64 x 4 warps and 16 x 1: 45 and 41 local stores
    # in sm_90 SASS, none at 8 warps); then the kernels' GPU checks (the fused steps against the naive rule, the
    # epilogue against gemv + silu_mul, at 4B sizes); then each step fusion alone
    es 180 fs fused_step; es 130 fw fused_swiglu
    mkdir -p $R/gs; GDN_SWEEP_BUDGET_S=100 timeout 160 python3 bench/gdn_decode_sweep.py $R/gs/gdn_decode_sweep.json \
      > $R/gs/log.txt 2>&1; echo "$R/gs rc $?: gdn_decode_sweep" >> $R/gpu.txt; tar czf $OUT/r.tgz -C $R .
    es 120 k kernels; es 100 fg fused_gate_norm; es 100 fc fused_conv_in_step ;;
  s28)  # one start for whichever card comes: an H200 the table (s27b); an H100 the split merge A/B (s27c), then
    # a graphed decode step's GPU time by kernel at batch 1, 8 and 16 (none since session 23's step tuning)
    if [[ $G == *H200* ]]; then bash "$0" s27b; else bash "$0" s27c; es 100 pb profile_decode_batches; fi ;;
  s27c)  # the split merge's chunks (session 28's calls 1 and 3 ran this plan as 381b21b has it, WIDE_SPLIT_CHUNK then
    # off; it ships at 128 since): the shipped merge (`mo`, `do`) against rows of more than 32 splits read 32 at a
    # time as well (WIDE_SPLIT_CHUNK = SPLIT_CHUNK: `mn`, `dn`) and every row 128 at a time (SPLIT_CHUNK 128: `m`),
    # each edited in for its parts only: the merge alone (all three), the int2 / bf16 decode rows (narrow and shipped)
    cp kernels/attention_merge_triton.py /tmp/merge_shipped.py
    es 30 mo split_merges
    sed -i 's/^WIDE_SPLIT_CHUNK = 128$/WIDE_SPLIT_CHUNK = SPLIT_CHUNK/' kernels/attention_merge_triton.py
    grep -q '^WIDE_SPLIT_CHUNK = SPLIT_CHUNK$' kernels/attention_merge_triton.py && { es 30 mn split_merges
      es 110 dn llm_int2_decode llm_bf16_decode; }
    cp /tmp/merge_shipped.py kernels/attention_merge_triton.py
    sed -i 's/^SPLIT_CHUNK = 32$/SPLIT_CHUNK = 128/' kernels/attention_merge_triton.py
    grep -q '^SPLIT_CHUNK = 128$' kernels/attention_merge_triton.py && es 30 m split_merges
    cp /tmp/merge_shipped.py kernels/attention_merge_triton.py
    es 110 do llm_int2_decode llm_bf16_decode ;;
  cold)  # cold starts to /ready, NEAREST_ROWS on / off / on, one process (each with an empty Triton cache)
    es 330 cn serve_cold_tuned serve_cold_exact_rows serve_cold_tuned_again ;;
  nearest)  # decode at batches without a GEMV entry of their own, gemv.NEAREST_ROWS off and on
    es 150 nr llm_bf16_nearest ;;
  serveab)  # the HTTP rows with this session's GEMV table, the table before it (.old/kernels/), this one again
    cp kernels/gemv_tuned_configs.json /tmp/table_new.json
    es 120 sn serve
    cp .old/kernels/gemv_tuned_configs.json kernels/; es 120 so serve; cp /tmp/table_new.json kernels/gemv_tuned_configs.json
    es 120 sn2 serve ;;
  variants2)  # call 1's variants row met a GPU still held by the killed fuzz; the fuzz given its own time
    export ENGINE_SPEED_GEMV_VARIANTS="$V"; es 160 n2 llm_bf16_gemv
    export ENGINE_SPEED_GEMV_VARIANTS='{"shipped": {}}'; old es 60 o2 llm_bf16_gemv
    es 200 fz gemv_fuzz ;;
esac
