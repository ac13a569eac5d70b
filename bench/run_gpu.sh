#!/usr/bin/env bash
# GPU tests and both benchmarks on a GPU machine, each step under its own timeout; everything
# lands under $OUT (run.log plus each tool's JSON/PNG/text).
# Usage: NVFP4_COMMIT=<hash> STEPS="tests gemm moe" bash bench/run_gpu.sh
# Steps: tests tests_ieee selftest gemm moe proxy qdiv e2e candidates mcand tiles sm12x profile
# eprof ncu mncu (default "tests gemm moe").
#   tests:   every test marked gpu (TEST_FILES: module names or paths,
#            split at spaces; TEST_K: a pytest -k expression), without XLA flags as a user runs
#            them; tests_ieee: the same with XLA's IEEE fp32 division flag; T_TESTS seconds.
#   selftest: nvfp4 selftest without XLA flags (SELFTEST_ARGS, e.g. "--jobs 4" or "--full";
#            OUT/selftest$SELFTEST_TAG.json and OUT/selftest-failures/); T_SELFTEST seconds (330).
#   gemm:    bench/gemm_bench.py (GEMM_SHAPES, GEMM_MS narrow it); T_GEMM.
#   moe:     bench/moe_bench.py (MOE_TOKENS, MOE_IMPLS; MOE_PAD_FC2=1: ours on FC2 weights padded
#            by moe.pad_fc2; MOE_SCALE_LAYOUT=linear: ours on linear weight scales); T_MOE.
#   proxy:   the SM12x path measured on this GPU as its proxy, as a user runs it (no XLA flags):
#            gemm_bench --proxy (Pallas-Triton W4A16/W4A4 vs bf16 jnp.dot and the Hopper path,
#            M = 1..4096; PROXY_SHAPES, PROXY_MS narrow it) then moe_bench --proxy (the Triton MoE
#            vs the Hopper path and bf16 ragged_dot, T = PROXY_TOKENS; PROXY_MOE_SHAPES), then
#            the README table (bench/tables.py proxy); T_PROXY_GEMM + T_PROXY_MOE seconds
#            (180 + 140 by default). PROXY_RESUME=bench/results: skip the rows the committed
#            proxy JSONs already hold (merge the new ones with bench/merge_results.py).
#   e2e:     bench/e2e_bench.py without XLA flags (E2E_ARGS, e.g. "--models llama-3-8b
#            --precisions nvfp4 --batches 1"); OUT/e2e-<gpu>.json; T_E2E seconds (420).
#   candidates: bench/gemm_bench.py --candidates, the decode/tile candidates against bf16
#            (CAND_SHAPES, CAND_MS narrow it); T_CAND seconds (300).
#   mcand:   bench/moe_bench.py --candidates, the Pallas-Triton MoE's tile/decode candidates
#            against the Mosaic MoE (MCAND_SHAPES, MCAND_TOKENS narrow it; default qwen3_30b,
#            nemotron at T = 1,8,64; MCAND_LABELS: only these candidates); T_MCAND seconds (420).
#   tiles:   bench/mosaic_mma_bench.py --sm90-tiles, the wgmma tiles of shapes the sm_90 table
#            lacks (TILES_SHAPES, default the Qwen3/Llama linears; TILES_MS, default 1); T_TILES (400).
#   sm12x:   bench/mosaic_sm12x.py, the GEMM cases and (--moe) the MoE layers lowered as SM 12.0
#            and checked against the oracle; their PTX in OUT/ptx-sm12x.tgz, for
#            `--ptxas` here (sm_120a/121a counts); T_SM12X seconds per part (240).
#   qdiv:    nvfp4_jax.quantize with its exact division vs XLA's plain one (gemm_bench.py
#            --quantize-division; QDIV_SIZES: M x K list); T_QDIV seconds (120).
#   profile: bench/moe_profile.py, per-kernel device time of one MoE layer (PROFILE_CASES).
#   eprof:   bench/e2e_profile.py, a decoder's batch-1 step by kernel, stacked against unrolled
#            layers (EPROF_ARGS, e.g. "--layers 4"; OUT/e2e-profile.json); T_EPROF seconds (240).
#   ncu:     Nsight Compute on the Mosaic GEMM (bench/mosaic_ncu.py, NCU_SHAPES).
#   mncu:    Nsight Compute on one MoE layer's kernels (bench/moe_ncu.py, MNCU_CASES).
# bench/merge_results.py merges a partial run into the committed JSON. Pass NVFP4_COMMIT when
# the tree's .git does not describe the tree (a copied working tree).
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
    tests|tests_ieee)
      # tests: as a user runs them, no XLA flags (the library's divisions are exact without
      # them); tests_ieee: the same with XLA's IEEE fp32 division flag
      flags=""; [ "$s" = tests_ieee ] && flags="--xla_backend_extra_options=-nvptx-prec-divf32=2"
      step "gpu tests (XLA_FLAGS='$flags')"
      files=""
      for f in ${TEST_FILES:-tests}; do  # a module name is found wherever it lives
        if [ -e "$f" ]; then files="$files $f"; else files="$files $(find tests -name "$f" | head -1)"; fi
      done
      # SIGINT at the limit: pytest stops and still prints the failures it has collected
      env -u XLA_FLAGS ${flags:+XLA_FLAGS="$flags"} timeout -s INT -k 30 "$T_TESTS" \
        python3 -m pytest -m gpu -v -p no:cacheprovider -rs ${TEST_K:+-k "$TEST_K"} $files 2>&1 \
        | tee "$OUT/$s.log" | tail -40 | tee -a "$OUT/run.log" ;;
    selftest)
      step "nvfp4 selftest (no XLA flags; SELFTEST_ARGS='${SELFTEST_ARGS:-}')"
      env -u XLA_FLAGS timeout "${T_SELFTEST:-330}" python3 -m nvfp4_jax.cli selftest \
        --json "$OUT/selftest${SELFTEST_TAG:-}.json" --out-dir "$OUT/selftest-failures" \
        ${SELFTEST_ARGS:-} 2>&1 | grep -v Warning | tail -80 | tee -a "$OUT/run.log" ;;
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
    proxy)
      step "SM12x proxy: GEMM (pallas vs bf16 and the Hopper path; XLA_FLAGS='${XLA_FLAGS:-}')"
      timeout "${T_PROXY_GEMM:-180}" python3 bench/gemm_bench.py --proxy --out "$OUT" \
        --budget-s $((${T_PROXY_GEMM:-180} - 35)) --shapes "${PROXY_SHAPES:-}" \
        --ms "${PROXY_MS:-}" ${PROXY_RESUME:+--resume "$PROXY_RESUME"} 2>&1 \
        | grep -v Warning | tail -70 | tee -a "$OUT/run.log"
      step "SM12x proxy: MoE (the Triton MoE vs the Hopper path and bf16 ragged_dot)"
      timeout "${T_PROXY_MOE:-140}" python3 bench/moe_bench.py --proxy --quick --out "$OUT" \
        --budget-s $((${T_PROXY_MOE:-140} - 60)) --tokens "${PROXY_TOKENS:-1,8,64,512,4096}" \
        --shapes "${PROXY_MOE_SHAPES:-nemotron,qwen3_30b}" ${PROXY_RESUME:+--resume "$PROXY_RESUME"} 2>&1 \
        | grep -v Warning | tail -40 | tee -a "$OUT/run.log"
      python3 bench/tables.py proxy --results "$OUT" 2>&1 | tee -a "$OUT/run.log" ;;
    e2e)
      step "end-to-end decoders (no XLA flags; E2E_ARGS='${E2E_ARGS:-}')"
      env -u XLA_FLAGS timeout "${T_E2E:-420}" python3 bench/e2e_bench.py --out "$OUT" \
        --budget-s $((${T_E2E:-420} - 60)) ${E2E_ARGS:-} 2>&1 | grep -v Warning | tail -40 \
        | tee -a "$OUT/run.log" ;;
    candidates)
      step "GEMM decode/tile candidates vs bf16 (no XLA flags)"
      env -u XLA_FLAGS timeout "${T_CAND:-300}" python3 bench/gemm_bench.py --candidates \
        --out "$OUT" --budget-s $((${T_CAND:-300} - 60)) --shapes "${CAND_SHAPES:-}" \
        --ms "${CAND_MS:-}" 2>&1 | grep -v Warning | tail -60 | tee -a "$OUT/run.log" ;;
    mcand)
      step "MoE tile/decode candidates vs the Mosaic MoE (no XLA flags)"
      env -u XLA_FLAGS timeout "${T_MCAND:-420}" python3 bench/moe_bench.py --candidates \
        --out "$OUT" --budget-s $((${T_MCAND:-420} - 60)) --shapes "${MCAND_SHAPES:-qwen3_30b,nemotron}" \
        --tokens "${MCAND_TOKENS:-1,8,64}" --labels "${MCAND_LABELS:-}" 2>&1 | grep -v Warning | tail -70 | tee -a "$OUT/run.log" ;;
    tiles)
      step "Mosaic wgmma tiles of the shapes the sm_90 table lacks (no XLA flags)"
      env -u XLA_FLAGS timeout "${T_TILES:-400}" python3 bench/mosaic_mma_bench.py --sm90-tiles \
        --out "$OUT" --budget-s $((${T_TILES:-400} - 80)) \
        --shapes "${TILES_SHAPES:-2048x4096,5120x2048,6144x4096,28672x4096}" --ms "${TILES_MS:-1}" \
        2>&1 | grep -v Warning | tail -70 | tee -a "$OUT/run.log" ;;
    sm12x)
      step "the Mosaic kernels lowered as SM 12.0: GEMM cases, then the MoE through auto"
      for part in "" --moe; do
        env -u XLA_FLAGS timeout "${T_SM12X:-240}" python3 bench/mosaic_sm12x.py --out "$OUT" \
          $part 2>&1 | grep -v "Warning\|nvdisasm\|Source Location\|dump.cc\|^$" | tail -20 \
          | tee -a "$OUT/run.log"
      done
      cp "$OUT/mosaic-sync-lowered-12.0.json" "$OUT/ptx-12.0/" 2>/dev/null
      cp "$OUT/mosaic-sync-moe-lowered-12.0.json" "$OUT/ptx-moe-12.0/" 2>/dev/null
      tar czf "$OUT/ptx-sm12x.tgz" -C "$OUT" ptx-12.0 ptx-moe-12.0 && rm -rf "$OUT/ptx-12.0" "$OUT/ptx-moe-12.0" ;;
    qdiv)
      step "quantize: exact division vs XLA's plain division (XLA_FLAGS='${XLA_FLAGS:-}')"
      timeout "${T_QDIV:-120}" python3 bench/gemm_bench.py --quantize-division --out "$OUT" \
        --shapes "${QDIV_SIZES:-}" 2>&1 | grep -v Warning | tail -30 | tee -a "$OUT/run.log" ;;
    eprof)
      step "decoder step profile (no XLA flags; EPROF_ARGS='${EPROF_ARGS:-}')"
      env -u XLA_FLAGS timeout "${T_EPROF:-240}" python3 bench/e2e_profile.py --out "$OUT" \
        ${EPROF_ARGS:-} 2>&1 | grep -v Warning | tail -70 | tee -a "$OUT/run.log" ;;
    profile)
      step "moe profile"
      timeout "$T_PROFILE" python3 bench/moe_profile.py --out "$OUT" --reps 2 ${PROFILE_HLO:+--hlo} \
        --scale-layout "${MOE_SCALE_LAYOUT:-linear}" ${MOE_PAD_FC2:+--pad-fc2} \
        --cases "${PROFILE_CASES:-nemotron:4096,qwen3_30b:4096,qwen3_30b:1}" 2>&1 \
        | grep -v Warning | tail -45 | tee -a "$OUT/run.log" ;;
    ncu)
      step "Nsight Compute: the Mosaic GEMM (${NCU_SHAPES:-28672x8192x16 28672x8192x64}, 2 launches each)"
      # no preallocation: kernel replay saves and restores all allocated device memory per pass
      # (JAX preallocates 75 % of the GPU by default, and replaying all of it takes minutes)
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
