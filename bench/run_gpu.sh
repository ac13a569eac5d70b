#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, both benchmarks and the SM12x compile check.
# Usage (device tool): bash bench/run_gpu.sh   (writes under $OUT, default /tmp/nvfp4-out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nvfp4-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/run.log"
python3 -c "import jax, jaxlib, triton, torch; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'triton', triton.__version__, 'torch', torch.__version__, jax.devices())" 2>&1 | tee -a "$OUT/run.log"
step() { echo "=== $1 ($(date +%T))" | tee -a "$OUT/run.log"; }
step "gpu tests"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -40 | tee -a "$OUT/run.log"
step "sm12x compile"
[ -f bench/sm12x_compile.py ] && timeout 120 python3 bench/sm12x_compile.py --out "$OUT" 2>&1 | tail -20 | tee -a "$OUT/run.log"
step "gemm bench"
[ -f bench/gemm_bench.py ] && timeout 260 python3 bench/gemm_bench.py --out "$OUT" 2>&1 | tail -60 | tee -a "$OUT/run.log"
step "moe bench"
[ -f bench/moe_bench.py ] && timeout 200 python3 bench/moe_bench.py --out "$OUT" 2>&1 | tail -60 | tee -a "$OUT/run.log"
step "done"
