#!/usr/bin/env bash
# Kernels on a GPU (issue 7), in one prepared run of under 8 minutes on one H200: the GPU-only
# tests (pytest marker `gpu`: Triton vs the torch reference in bf16), then tools/bench/kernels.py
# (Triton vs torch eager vs torch.compile, fraction of the H200's peak), table + JSON in $OUT.
#
#   bash tools/bench/gpu_check.sh            # writes $OUT (default runs/gpu_check)
#
# Each step has its own time limit; a failing step does not stop the next, the exit status
# says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
unset TRITON_INTERPRET OMNISCALE_KERNELS  # compiled kernels, registry defaults
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA'; \
print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt" || exit 1

echo "== GPU tests (pytest -m gpu) =="
timeout 180 $PY -m pytest tests/kernels -m gpu -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests.txt" || status=1

echo "== kernel benchmark =="
timeout 270 $PY tools/bench/kernels.py --device cuda --reps 20 --out "$OUT/kernels_h200.json" \
    2>&1 | tee "$OUT/kernels_h200.txt" || status=1

echo "gpu_check: $([ $status = 0 ] && echo passed || echo FAILED) (results in $OUT)"
exit $status
