#!/usr/bin/env bash
# One script for the GPU machine: configure, build with every core, run the GPU tests (optionally
# under compute-sanitizer), run the benchmarks, and leave logs and JSON under $OUT.
#
#   scripts/gpu_run.sh [build] [test] [sanitize] [step] [profile] [sass] [bench] [bench-full]   (default: build test bench)
#
# BENCH_FILTER (an extended regex) runs only the benchmarks whose names match, and BENCH_ARGS adds
# options to each (say --launch paced); SANITIZE_FILTER (a gtest filter) narrows the sanitizer runs;
# GTEST_FILTER narrows the GPU tests; SHARDS (default 8) is how many googletest shards of the tests
# and of each sanitizer run at once on the one GPU. LOG_TAG names this invocation's logs
# (logs$LOG_TAG.tgz), so that two in one device call (say one with LATENTKV_MLA_KERNEL=mma, the
# mma.sync kernels) both come back. The whole GPU suite under both sanitizers takes about 10 minutes
# on an H100 (its five largest tests about 5 of them), more than one device call allows: split it
# with SANITIZE_FILTER (docs/benchmarks.md, forty-eighth session, gives four filters that cover it).
# Header-only dependencies travel in .deps/ (see scripts/deps.sh --carry) since that machine reaches no
# package registry.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
# Everything lands in $OUT/logs/, packed into $OUT/logs.tgz at the end (the device tool brings back
# at most 8 files); $OUT/summary.txt stays readable as is.
TAG=${LOG_TAG:-}
L="$OUT/logs$TAG"
mkdir -p "$L"
BUILD=${BUILD:-build-gpu}
JOBS=${JOBS:-$(nproc)}
SHARDS=${SHARDS:-8}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test bench)
status=0

log() { echo "== $(date -u +%H:%M:%S)$TAG $*" | tee -a "$OUT/summary.txt"; }

# sharded NAME WRAPPER -- TEST_BINARY ARGS...: the googletest binary in $SHARDS shards at once on the
# one GPU (the whole suite one after another takes about 7 minutes, most of it the host building
# fixtures and references for the long-request tests, so shards use the 16 cores), each shard's log in
# $L/NAME.<shard>.log and its results in $L/NAME.<shard>.json, WRAPPER (say compute-sanitizer and its
# options, or nothing) before each; the shards' last lines go to the summary. Fails if any shard does.
sharded() {
  local name=$1 wrapper=$2; shift 3
  local i pids=() rc=0
  for ((i = 0; i < SHARDS; i++)); do
    GTEST_TOTAL_SHARDS=$SHARDS GTEST_SHARD_INDEX=$i $wrapper "$@" --gtest_output=json:"$L/$name.$i.json" \
      >"$L/$name.$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || rc=1; done
  for ((i = 0; i < SHARDS; i++)); do
    echo "$name shard $i: $(grep -hE '^\[  (PASSED|FAILED|SKIPPED) ' "$L/$name.$i.log" | tr '\n' ' ')"
  done | tee -a "$OUT/summary.txt"
  return $rc
}

for step in "${steps[@]}"; do
  case "$step" in
    build)
      log "configure + build ($JOBS jobs)"
      { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1; } \
        >"$L/device.txt" 2>&1
      cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLKV_CUDA=ON -DLKV_CUDA_ARCHS=90a \
        >"$L/configure.log" 2>&1 || { log "configure FAILED"; tail -30 "$L/configure.log"; exit 1; }
      cmake --build "$BUILD" -j"$JOBS" >"$L/build.log" 2>&1 || { log "build FAILED"; grep -m20 -B2 -A6 "error" "$L/build.log"; exit 1; }
      log "build ok"
      ;;
    test)
      log "GPU tests ($SHARDS shards at once)"
      sharded gpu_tests "" -- "$BUILD/tests/latentkv_gpu_tests" \
        || { status=1; log "GPU tests FAILED"; grep -hE "^\[  FAILED|Failure|error|Expected|Which is|worst" "$L"/gpu_tests.*.log | head -60; }
      # The mma.sync kernels that serve sm_89, sm_100 and sm_120 where sm_90 runs wgmma: the MLA and
      # indexer tests again.
      log "MLA and indexer tests on the mma.sync kernels (LATENTKV_MLA_KERNEL=mma LATENTKV_INDEXER_KERNEL=mma)"
      LATENTKV_MLA_KERNEL=mma LATENTKV_INDEXER_KERNEL=mma \
        sharded gpu_tests_mma "" -- "$BUILD/tests/latentkv_gpu_tests" \
        --gtest_filter='*GpuMla*:*GpuSparse*:*GpuPrefill*:*GpuIndexer*:*GpuDsa*' \
        || { status=1; log "GPU tests (mma.sync) FAILED"; grep -hE "^\[  FAILED|Failure|Expected|worst" "$L"/gpu_tests_mma.*.log | head -30; }
      ctest --test-dir "$BUILD" -L cpu -j"$JOBS" --output-on-failure >"$L/cpu_tests.log" 2>&1 || { status=1; log "CPU tests FAILED"; }
      tail -3 "$L/cpu_tests.log" | tee -a "$OUT/summary.txt"
      # The installed package's example (examples/dsa_layer.cpp): one layer's prefill and decode on the
      # GPU here, checked (-V keeps what it prints).
      log "the package test: examples/dsa_layer built against the installed library"
      ctest --test-dir "$BUILD" -L package -V >"$L/package_test.log" 2>&1 || { status=1; log "package test FAILED"; }
      grep -E " at tp [0-9]+ on |prefill|step [0-9]+ \(|check of the last step|^[0-9]+: error|FAILED" "$L/package_test.log" | tee -a "$OUT/summary.txt"
      ;;
    sanitize)
      log "compute-sanitizer memcheck + racecheck on the GPU tests ($SHARDS shards at once)"
      filter=${SANITIZE_FILTER:-*}
      for tool in memcheck racecheck; do
        sharded "$tool" "compute-sanitizer --tool $tool --error-exitcode 9" -- \
          "$BUILD/tests/latentkv_gpu_tests" --gtest_filter="$filter" \
          || { status=1; log "$tool FAILED"; grep -hE "^\[  FAILED|ERROR SUMMARY: [1-9]|HAZARD|Invalid" "$L"/"$tool".*.log | head -20; }
        grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$L"/"$tool".*.log | tee -a "$OUT/summary.txt"
      done
      ;;
    profile)
      # PROFILE_OP (default mla_decode) and PROFILE_KERNELS (an ncu kernel regex, default decode_kernel):
      # one of each matching kernel at glm5 tp 8, B=1 32K and B=64 8K.
      # PROFILE_ARGS replaces the two shapes with bench command lines (each its own --op and shape),
      # separated by ';'.
      # PROFILE_SOURCE=1 also samples every SASS instruction's stalls (logs/source_N.csv per shape).
      op=${PROFILE_OP:-mla_decode}
      log "ncu on $op kernels matching ${PROFILE_KERNELS:-decode_kernel} (${PROFILE_ARGS:-glm5 tp 8, B=1 and B=64})"
      if [ -n "${PROFILE_ARGS:-}" ]; then IFS=';' read -ra shapes <<<"$PROFILE_ARGS"; else
        shapes=("--op $op --batch 1 --context 32768 --pool 600000"
                "--op $op --batch 64 --context 8192 --pool 600000"); fi
      for shape in "${shapes[@]}"; do
        ncu --clock-control none -k "regex:${PROFILE_KERNELS:-decode_kernel}" -c "${PROFILE_COUNT:-1}" \
          --section SpeedOfLight --section Occupancy --section ComputeWorkloadAnalysis \
          --section WarpStateStats --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis \
          "$BUILD/tools/latentkv" bench $shape --backends cuda --iters 1 --warmup 0 \
          --check-requests 0 >>"$L/ncu.log" 2>&1 || { status=1; log "ncu FAILED"; }
      done
      if [ -n "${PROFILE_SOURCE:-}" ]; then  # per-SASS-instruction stall samples, one CSV per shape
        i=0
        for shape in "${shapes[@]}"; do
          i=$((i + 1))
          ncu --clock-control none --set full --import-source yes -k "regex:${PROFILE_KERNELS:-decode_kernel}" -c 1 \
            -o "$L/source_$i" "$BUILD/tools/latentkv" bench $shape --backends cuda --iters 1 --warmup 0 \
            --check-requests 0 >>"$L/ncu_source.log" 2>&1 || { status=1; log "ncu (source) FAILED"; }
          ncu -i "$L/source_$i.ncu-rep" --page source --csv --print-source sass >"$L/source_$i.csv" 2>>"$L/ncu_source.log"
          rm -f "$L/source_$i.ncu-rep"
        done
      fi
      grep -E "^  [a-z_:<>0-9, ]+\(|Duration|Memory Throughput|Achieved Occupancy|Registers|Stall|Warp Cycles Per Issued|Issued Warp|No Eligible|Theoretical Occ|Block Limit|DRAM Throughput|L1/TEX Hit|Compute \(SM\)|Pipe|Executed Ipc|Issue Slots|Shared|stalled|Est. Speedup" "$L/ncu.log" | head -80
      ;;
    sass)
      # SASS of library sources (SASS_SOURCES, default mla/decode_wgmma.cu) under $OUT, with an opcode
      # histogram per file: what the compiler made of a kernel, without a profiler.
      for src in ${SASS_SOURCES:-mla/decode_wgmma.cu}; do
        obj="$BUILD/CMakeFiles/latentkv_objects.dir/src/cuda/$src.o"
        name=$(echo "$src" | tr '/.' '__')
        cuobjdump -sass "$obj" >"$OUT/sass_$name.txt" 2>&1 || { status=1; log "cuobjdump $src FAILED"; continue; }
        log "SASS $src: $(grep -cE '^\s+/\*[0-9a-f]{4}\*/' "$OUT/sass_$name.txt") instructions; most frequent opcodes:"
        grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?[A-Z0-9_.]+' "$OUT/sass_$name.txt" | awk '{print $NF}' \
          | sed 's/\..*//' | sort | uniq -c | sort -rn | head -25 | tr '\n' ' '; echo
      done
      ;;
    bench|bench-full)
      cli="$BUILD/tools/latentkv"
      run_bench() {  # name, args...
        local name=$1; shift
        [[ "$name" =~ ${BENCH_FILTER:-.} ]] || return 0
        log "bench $name: $*"
        "$cli" bench "$@" ${BENCH_ARGS:-} --json "$L/bench_$name.json" >"$L/bench_$name.log" 2>&1 || { status=1; log "bench $name FAILED"; }
        cat "$L/bench_$name.log" >>"$OUT/summary.txt"
        grep -E "^(cuda|cast_full|gather_cast|ceilings|  )" "$L/bench_$name.log"
      }
      run_bench glm5_b1_32k --model glm5 --tp 8 --batch 1 --context 32768 --pool 495000
      run_bench h8_b64_8k --model glm5 --tp 8 --batch 64 --context 8192 --pool 600000 --backends cuda,gather_cast
      run_bench h8_b1_256k --model glm5 --tp 8 --batch 1 --context 262144 --pool 600000 --backends cuda,gather_cast
      run_bench h16_b64_8k --model glm5 --tp 4 --batch 64 --context 8192 --pool 600000 --backends cuda
      run_bench h8_b64_mixed --model glm5 --tp 8 --batch 64 --context 16384 --context-min 1024 --pool 1200000 --backends cuda,gather_cast --check-requests 4
      run_bench h128_b64_8k --model deepseek-v3.2 --tp 1 --batch 64 --context 8192 --pool 600000 --backends cuda --iters 20 --check-requests 1
      run_bench sparse_h8_b64_k2048 --op sparse_mla_decode --model glm5 --tp 8 --batch 64 --context 8192 --topk 2048 --pool 1100000 --backends cuda
      run_bench sparse_h8_b1_k2048 --op sparse_mla_decode --model glm5 --tp 8 --batch 1 --context 32768 --topk 2048 --pool 495000 --backends cuda
      run_bench sparse_h128_b64_k2048 --op sparse_mla_decode --model deepseek-v3.2 --tp 1 --batch 64 --context 8192 --topk 2048 --pool 1100000 --backends cuda --iters 20 --check-requests 1
      run_bench indexer_hi32_b1_128k --op indexer_logits --model glm5 --batch 1 --context 131072 --pool 1100000 --backends cuda
      run_bench indexer_hi32_b16_128k --op indexer_logits --model glm5 --batch 16 --context 131072 --pool 2200000 --backends cuda --check-requests 1
      run_bench topk_b1_128k --op topk --batch 1 --context 131072 --topk 2048 --pool 600000 --backends cuda
      run_bench topk_b1_32k --op topk --batch 1 --context 32768 --topk 2048 --pool 495000 --backends cuda
      run_bench topk_b64_32k --op topk --batch 64 --context 32768 --topk 2048 --pool 2200000 --backends cuda --check-requests 4
      run_bench dsa_glm5_b1_32k --op dsa_decode --model glm5 --tp 8 --batch 1 --context 32768 --topk 2048 --pool 800000
      run_bench dsa_glm5_b64_8k --op dsa_decode --model glm5 --tp 8 --batch 64 --context 8192 --topk 2048 --pool 600000 --check-requests 2
      run_bench sparse_h8_b64_k2048_baselines --op sparse_mla_decode --model glm5 --tp 8 --batch 64 --context 8192 --topk 2048 --pool 1100000
      run_bench sparse_prefill_h128_4k_k2048 --op sparse_mla_prefill --model deepseek-v3.2 --tp 1 --batch 1 --context 32768 --new-tokens 4096 --topk 2048 --pool 100000 --backends cuda,gather_cast --iters 5 --warmup 1
      run_bench sparse_prefill_h8_4k_k2048 --op sparse_mla_prefill --model glm5 --tp 8 --batch 1 --context 32768 --new-tokens 4096 --topk 2048 --pool 100000 --backends cuda,gather_cast,cast_full --iters 10 --warmup 2
      run_bench indexer_prefill_hi32_4k_over_32k --op indexer_prefill --model glm5 --batch 1 --context 36864 --new-tokens 4096 --topk 2048 --pool 100000 --backends cuda --iters 5 --warmup 1
      run_bench dsa_prefill_glm5_4k_over_32k --op dsa_prefill --model glm5 --tp 8 --batch 1 --context 36864 --new-tokens 4096 --topk 2048 --pool 100000 --backends cuda,gather_cast --iters 5 --warmup 1
      run_bench prefill_h64_4k_over_32k --op mla_prefill --model deepseek-v3.2 --tp 2 --batch 1 --context 36864 --new-tokens 4096 --pool 100000 --backends cuda --iters 3 --warmup 1
      run_bench prefill_h8_4k_over_32k --op mla_prefill --model glm5 --tp 8 --batch 1 --context 36864 --new-tokens 4096 --pool 100000 --backends cuda --iters 3 --warmup 1
      run_bench prefill_h8_2k_prompt --op mla_prefill --model glm5 --tp 8 --batch 1 --context 2048 --new-tokens 2048 --pool 100000 --backends cuda --iters 5 --warmup 1
      if [ "$step" = bench-full ]; then
        run_bench glm5_b1_32k_q2 --model glm5 --tp 8 --batch 1 --context 32768 --q-len 2 --pool 495000
        run_bench bf16_h8_b1_32k --model glm5 --tp 8 --batch 1 --context 32768 --kv-dtype bf16 --pool 300000 --backends cuda
      fi
      ;;
    step)
      # latentkv step: the attention side of one decode step of all 78 glm5 layers (docs/step.md).
      cli="$BUILD/tools/latentkv"
      run_step() {  # name, args...
        local name=$1; shift
        log "step $name: $*"
        "$cli" step "$@" --json "$L/step_$name.json" >"$L/step_$name.log" 2>"$L/step_$name.err" \
          || { status=1; log "step $name FAILED"; tail -5 "$L/step_$name.err" | tee -a "$OUT/summary.txt"; }
        cat "$L/step_$name.log" >>"$OUT/summary.txt"
        grep -E "^(fp8|gather_cast|cast_full|dense|sparse|floors) " "$L/step_$name.log"
      }
      run_step glm5_b1_32k --model glm5 --tp 8 --batch 1 --context 32768 --pool 495000
      run_step glm5_b64_8k --model glm5 --tp 8 --batch 64 --context 8192 --pool 600000
      ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
log "done (status $status)"
tar czf "$OUT/logs$TAG.tgz" -C "$OUT" "logs$TAG" && rm -rf "$L"
exit $status
