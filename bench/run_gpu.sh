#!/usr/bin/env bash
# One call on the GPU machine: GPU tests (incl. the SM12x compile check), then both benchmarks.
# Usage (device tool): NVFP4_COMMIT=<hash> bash bench/run_gpu.sh   (writes under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nvfp4-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NVFP4_COMMIT=${NVFP4_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
T_TESTS=${T_TESTS:-110} T_GEMM=${T_GEMM:-150} T_MOE=${T_MOE:-110}
step() { echo "=== $1 ($(date +%T))" | tee -a "$OUT/run.log"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/run.log"
step "gpu tests (IEEE fp32 division for bit-exact quantization)"
XLA_FLAGS="--xla_backend_extra_options=-nvptx-prec-divf32=2" timeout "$T_TESTS" \
  python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_quantize_gpu.py tests/test_gemm_gpu.py tests/test_moe_gpu.py 2>&1 | tail -30 | tee -a "$OUT/run.log"
step "gemm bench"
timeout "$T_GEMM" python3 bench/gemm_bench.py --out "$OUT" --budget-s $((T_GEMM - 25)) 2>&1 | tail -45 | tee -a "$OUT/run.log"
step "moe bench"
timeout "$T_MOE" python3 bench/moe_bench.py --out "$OUT" --quick 2>&1 | tail -45 | tee -a "$OUT/run.log"
step "done"
