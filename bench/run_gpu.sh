#!/usr/bin/env bash
# GPU tests (incl. the SM12x compile check) and both benchmarks on the GPU machine.
# Usage (device tool): NVFP4_COMMIT=<hash> STEPS="tests gemm moe ncu" bash bench/run_gpu.sh
# Steps: tests gemm moe profile gprofile probe sortprobe lprobe sweep ncu mncu. Each has its own timeout (T_TESTS, T_GEMM, T_MOE,
# T_PROFILE, T_PROBE, T_NCU seconds; all GPU test modules take ~290 s; TEST_FILES picks modules
# (split at spaces), TEST_K a pytest -k expression, spaces allowed); GEMM_SHAPES, GEMM_MS
# and MOE_TOKENS narrow the benches (MOE_PAD_FC2=1: ours on FC2 weights padded by moe.pad_fc2;
# MOE_SCALE_LAYOUT=linear: ours on linear weight scales, kept
# apart from the committed swizzled rows; bench/merge_results.py merges a partial run into the
# committed JSON); everything lands
# under $OUT (run.log plus each tool's JSON/PNG). Pass the commit: the device copy's .git is the session's base.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nvfp4-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NVFP4_COMMIT=${NVFP4_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
STEPS=${STEPS:-"tests gemm moe"}
T_TESTS=${T_TESTS:-330} T_GEMM=${T_GEMM:-330} T_MOE=${T_MOE:-300} T_PROFILE=${T_PROFILE:-90}
step() { echo "=== $1 ($(date +%T))" | tee -a "$OUT/run.log"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/run.log"
for s in $STEPS; do
  case $s in
    tests)
      step "gpu tests (IEEE fp32 division for bit-exact quantization)"
      XLA_FLAGS="--xla_backend_extra_options=-nvptx-prec-divf32=2" timeout "$T_TESTS" \
        python3 -m pytest -m gpu -q -p no:cacheprovider -rs ${TEST_K:+-k "$TEST_K"} ${TEST_FILES:-tests/moe/test_moe_gpu.py \
        tests/moe/test_moe_mosaic_gpu.py tests/gemm/test_gemm_mosaic_gpu.py tests/gemm/test_gemm_gpu.py \
        tests/codecs/test_quantize_gpu.py} 2>&1 \
        | tail -40 | tee -a "$OUT/run.log" ;;
    gemm)
      step "gemm bench"
      timeout "$T_GEMM" python3 bench/gemm_bench.py --out "$OUT" --budget-s $((T_GEMM - 40)) \
        --shapes "${GEMM_SHAPES:-28672x8192,4096x14336,4096x4096,14336x4096}" --ms "${GEMM_MS:-}" 2>&1 \
        | grep -v Warning | tail -60 | tee -a "$OUT/run.log" ;;
    moe)
      step "moe bench"
      timeout "$T_MOE" python3 bench/moe_bench.py --out "$OUT" --quick --budget-s $((T_MOE - 70)) \
        --tokens "${MOE_TOKENS:-1,8,64,512,4096}" --impls "${MOE_IMPLS:-nvfp4_moe,bf16_ragged_dot,dequant_ragged_dot}" \
        --scale-layout "${MOE_SCALE_LAYOUT:-swizzled_128x4}" ${MOE_PAD_FC2:+--pad-fc2} 2>&1 \
        | grep -v Warning | tail -40 | tee -a "$OUT/run.log" ;;
    profile)
      step "moe profile"
      timeout "$T_PROFILE" python3 bench/moe_profile.py --out "$OUT" --reps 2 ${PROFILE_HLO:+--hlo} \
        --scale-layout "${MOE_SCALE_LAYOUT:-linear}" ${MOE_PAD_FC2:+--pad-fc2} \
        --cases "${PROFILE_CASES:-nemotron:4096,qwen3_30b:4096,qwen3_30b:1}" 2>&1 \
        | grep -v Warning | tail -45 | tee -a "$OUT/run.log" ;;
    gprofile)
      step "gemm profile (per-kernel time of one matmul call)"
      timeout "${T_GPROFILE:-120}" python3 bench/gemm_profile.py --out "$OUT" \
        --cases "${GPROFILE_CASES:-28672x8192x1,28672x8192x16,28672x8192x64,4096x14336x16}" 2>&1 \
        | grep -v Warning | tail -60 | tee -a "$OUT/run.log" ;;
    probe)
      step "moe mosaic probe (Mosaic vs Pallas-Triton layer; config variants with PROBE_SWEEP=1)"
      timeout "${T_PROBE:-200}" python3 bench/moe_mosaic_probe.py --out "$OUT" \
        --shapes "${PROBE_SHAPES:-nemotron,qwen3_30b}" --tokens "${PROBE_TOKENS:-1,8,64}" \
        --budget-s $((${T_PROBE:-200} - 40)) ${PROBE_SWEEP:+--sweep} ${PROBE_CONFIGS:+--configs $PROBE_CONFIGS} \
        ${PROBE_NO_TRITON:+--no-triton} ${PROBE_SWIZZLED:+--swizzled} \
        ${PROBE_ROUTES_METHOD:+--routes-method} \
        ${PROBE_PREFER_ROUTES:+--prefer-routes} ${PROBE_ROUTING_WARPS:+--routing-warps $PROBE_ROUTING_WARPS} \
        --rounds "${PROBE_ROUNDS:-1}" 2>&1 \
        | grep -v Warning | tail -40 | tee -a "$OUT/run.log" ;;
    sortprobe)
      step "the routing's sort: narrow vs int32 keys (${SORT_TOKENS:-512,4096})"
      timeout "${T_SORT:-150}" python3 bench/sort_probe.py --out "$OUT" --tokens "${SORT_TOKENS:-512,4096}" \
        --rounds "${SORT_ROUNDS:-3}" 2>&1 | grep -v Warning | tail -20 | tee -a "$OUT/run.log" ;;
    lprobe)
      step "launch probe: device events next to trivial Mosaic / Pallas-Triton launches"
      timeout "${T_LPROBE:-120}" python3 bench/launch_probe.py --out "$OUT" 2>&1 \
        | grep -v Warning | tail -40 | tee -a "$OUT/run.log" ;;
    sweep)
      step "mosaic GEMM config sweep (${SWEEP_PLAN:-default plan})"
      timeout "${T_SWEEP:-240}" python3 bench/mosaic_sweep.py --out "$OUT" --budget-s $((${T_SWEEP:-240} - 30)) \
        ${SWEEP_PLAN:+--plan "$SWEEP_PLAN"} ${SWEEP_VARIANTS:+--variants "$SWEEP_VARIANTS"} --rounds "${SWEEP_ROUNDS:-1}" 2>&1 \
        | grep -v Warning | grep -v '^{' | tail -60 | tee -a "$OUT/run.log" ;;
    ncu)
      step "Nsight Compute: the Mosaic GEMM (${NCU_SHAPES:-28672x8192x16 28672x8192x64}, 2 launches each)"
      # no preallocation: kernel replay saves and restores all allocated device memory per pass
      # (JAX preallocates 75 % of the GPU by default, which made the first attempt time out)
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${T_NCU:-150}" ncu -k regex:nvfp4 --launch-count 4 --clock-control none \
        --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        python3 bench/mosaic_ncu.py ${NCU_SHAPES:-28672x8192x16 28672x8192x64} > "$OUT/ncu-mosaic.txt" 2>&1
      grep -v "^==PROF==" "$OUT/ncu-mosaic.txt" | tail -60 | tee -a "$OUT/run.log" ;;
    mncu)
      step "Nsight Compute: one MoE layer's six kernels (${MNCU_CASES:-nemotron:8})"
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${T_MNCU:-150}" ncu -k regex:nvfp4_moe \
        --launch-skip "${MNCU_SKIP:-6}" --launch-count "${MNCU_COUNT:-6}" --clock-control none \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis \
        python3 bench/moe_ncu.py ${MNCU_CASES:-nemotron:8} > "$OUT/ncu-moe.txt" 2>&1
      grep -v "^==PROF==" "$OUT/ncu-moe.txt" | grep -E "nvfp4|Duration|Throughput|Registers|Achieved Occ|Theoretical Occ|Block Limit|Warp Cycles|Shared Memory Config|Dynamic Shared|Waves" \
        | head -120 | tee -a "$OUT/run.log" ;;
    *) echo "unknown step $s" | tee -a "$OUT/run.log" ;;
  esac
done
step "done"
