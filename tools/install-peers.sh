#!/usr/bin/env bash
# Optional CPU peers that cannot be installed through pyproject extras (their declared
# dependencies would pull CUDA stacks or triton). Tests that need them skip with a reason
# when they are missing. See ../shared/docs/cpu-peers.md.
set -euo pipefail
pip install -q --no-deps b12x==1.5.1
pip install -q nvidia-cutlass-dsl==4.8.0 cuda-python "apache-tvm-ffi>=0.1.11,<0.2,!=0.1.8,!=0.1.8.post0"
pip install -q --no-deps flashinfer-python==0.7.2.post1
pip install -q requests click einops tabulate packaging tqdm ninja nvidia-ml-py
