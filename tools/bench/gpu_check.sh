#!/usr/bin/env bash
# The GPU paths in one prepared run of under 8 minutes on one H200: the GPU-only tests (pytest
# marker `gpu`: Triton vs the torch reference in bf16), tools/bench/kernels.py (Triton vs torch
# eager vs torch.compile, fraction of the H200's peak), then a smoke run of the trainer: the
# `1b` preset on one GPU, bf16 + selective activation checkpointing, flash-attn when installed
# (SDPA / flex otherwise), 30 steps on demo `small` data; tokens/s, MFU and peak memory go to
# $OUT/gpu.json (tools/bench/_gpu_train_summary.py). Tables + JSON in $OUT.
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
timeout 150 $PY -m pytest tests/kernels -m gpu -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests.txt" || status=1

echo "== kernel benchmark =="
timeout 150 $PY tools/bench/kernels.py --device cuda --reps 10 --out "$OUT/kernels_h200.json" \
    2>&1 | tee "$OUT/kernels_h200.txt" || status=1

echo "== trainer smoke run (1b, bf16, selective AC, 30 steps) =="
DEMO=${DEMO:-runs/gpu_demo_small}
timeout 90 $PY -m omniscale data demo "$DEMO" --scale small >"$OUT/demo.txt" 2>&1 \
    && timeout 60 $PY -m omniscale data index "$DEMO/mix.yaml" >>"$OUT/demo.txt" 2>&1 \
    || { status=1; tail -5 "$OUT/demo.txt"; }
rm -rf "$OUT/train"
timeout 150 $PY -m omniscale train configs/demo_omni.yaml --nproc 1 --no-progress \
    --set output_dir="$OUT/train" --set data.spec="$DEMO/mix.yaml" --set data.eval_spec=null \
    --set data.demo=false --set model.preset=1b --set steps=30 --set checkpoint_every=1000 \
    --set data.global_batch_tokens=32768 --set data.micro_batch_tokens=16384 \
    --set data.workers=4 --set parallel.device=cuda --set parallel.mixed_precision=bf16 \
    --set parallel.activation_checkpoint=selective --set eval.enabled=false \
    2>&1 | tail -20 | tee "$OUT/train.txt" || status=1
$PY tools/bench/_gpu_train_summary.py "$OUT/train" --out "$OUT/gpu.json" || status=1

echo "gpu_check: $([ $status = 0 ] && echo passed || echo FAILED) (results in $OUT)"
exit $status
