#!/usr/bin/env bash
# The GPU paths in one prepared run on a bare H200 machine (its own python3 with torch, Triton
# and transformers; no network), in under 8 minutes, reported in ONE JSON: $OUT/gpu_check.json.
# docs/gpu.md says how to run it and what each stage checks.
#
#   bash tools/bench/gpu_check.sh --prepare     # HERE first: gpu_wheels/ (wheels + text data)
#   OUT=/dir bash tools/bench/gpu_check.sh      # THERE, with gpu_wheels/ carried along
#   bash tools/bench/gpu_check.sh --dry-run     # anywhere: syntax, imports, every stage's
#                                               # arguments and the wheel list; no GPU
# --prepare (here: PyPI reachable, the project's .venv) writes gpu_wheels/, ignored by git:
# `pip download` of the wheels of what the GPU image lacks (tools/bench/_gpu_deps.py SHIPPED,
# at the versions installed here, with their dependencies less the image's own) for CPython
# $PY_VERSION on manylinux x86-64; lm_data/, the trainer run's text (the demo's text sources:
# no media, so neither av nor soundfile there); prepared.json (the commit, the sizes).
#
# Stages of a run, each under its own time limit (capped by what is left of BUDGET_S); a
# failing stage does not stop the next, and the exit status says whether all passed:
#   deps         install from gpu_wheels/ what the image lacks into $WORK/site, on PYTHONPATH
#                with the repository (its omniscale/ package: nothing is pip-installed)
#   imports      every module a stage needs imports
#   env          GPU, driver, torch/CUDA/Triton/transformers, commit, the kernel registry's
#                choice per op on CUDA (kernels.describe("cuda"))
#   gpu_tests    pytest -m gpu: the Triton kernels against the torch reference in bf16
#   data         the carried text indexed in $WORK
#   train        omniscale train, lm task, `1b` preset, 1 GPU: FSDP, bf16, selective AC, the
#                default attention backend; $STEPS steps, run dir in $WORK (checkpoints are GBs)
#   train_summary  tokens/s, TFLOP/s, MFU, peak memory (tools/bench/_gpu_train_summary.py)
#   hf_step      the same shapes and token counts through transformers' Qwen3-MoE
#                (tools/bench/_hf_step.py): tokens/s of each and the ratio
#   kernels      tools/bench/kernel_ops.py per op (reference / eager / compiled / Triton)
#   train_syncs  a 3-step run with debug.count_host_syncs: host syncs per micro-batch (by op
#                and line), apart from the timed run (the count hooks every op)
# Then the report: $OUT/gpu_check.json, $OUT/kernels_h200.json, the runs' metrics and config,
# and $OUT/gpu_check.log (everything printed). Only small files go to $OUT.
#
# Environment: OUT (default runs/gpu_check), PYTHON (default python3, the machine's own, never a
# .venv; .venv/bin/python for --prepare), WHEELS (default gpu_wheels), WORK (default
# /tmp/omniscale_gpu_check), BUDGET_S (default 450: the whole run, report included), STEPS
# (default 30), GIT_COMMIT (recorded when the copy of the tree has no .git; else
# gpu_wheels/prepared.json's commit is), PY_VERSION (--prepare: default 3.12, the image's); for
# a CPU rehearsal of the real path: DEVICE (default cuda), PRESET (1b), BATCH_TOKENS (32768),
# MICRO_TOKENS (16384).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
REPO=$PWD
case "${1:-}" in
    --dry-run) MODE=dry ;;
    --prepare) MODE=prepare ;;
    "") MODE=run ;;
    *) echo "usage: bash tools/bench/gpu_check.sh [--prepare | --dry-run]" >&2; exit 2 ;;
esac
DRY=$([ "$MODE" = dry ] && echo 1 || echo 0)
PY=${PYTHON:-$([ "$MODE" = prepare ] && echo .venv/bin/python || echo python3)}
WHEELS=${WHEELS:-gpu_wheels}
PY_VERSION=${PY_VERSION:-3.12}

shipped() {  # what --prepare downloads: NAME==VERSION, the versions installed here
    "$PY" tools/bench/_gpu_deps.py shipped --pinned
}

prepare() {
    local pins
    mapfile -t pins < <(shipped)
    rm -rf "$WHEELS" && mkdir -p "$WHEELS" || return 1
    # --only-binary + the target's tags: wheels for the GPU machine, whatever this one runs
    "$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
        --python-version "$PY_VERSION" --implementation cp --abi "cp${PY_VERSION/./}" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64 -d "$WHEELS" "${pins[@]}" \
        && "$PY" tools/bench/_gpu_deps.py prune "$WHEELS" \
        && "$PY" tools/bench/_gpu_deps.py check "$WHEELS" \
        && "$PY" tools/bench/_gpu_deps.py lm-data "$WHEELS/lm_data" \
        && "$PY" tools/bench/_gpu_deps.py manifest "$WHEELS" "$PY_VERSION"
}

if [ "$MODE" = prepare ]; then
    prepare
    exit
fi

OUT=${OUT:-runs/gpu_check}
BUDGET_S=${BUDGET_S:-450}
STEPS=${STEPS:-30}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-1b}
BATCH_TOKENS=${BATCH_TOKENS:-32768}
MICRO_TOKENS=${MICRO_TOKENS:-16384}
PRECISION=$([ "$DEVICE" = cuda ] && echo bf16 || echo auto)
REPORT_S=20  # kept back for the report at the end
if (( DRY )); then
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
    OUT=$WORK/out
else
    WORK=${WORK:-/tmp/omniscale_gpu_check}
    rm -rf "$WORK"
fi
mkdir -p "$WORK/kernels" "$OUT"
unset TRITON_INTERPRET OMNISCALE_KERNELS  # compiled kernels, the registry's own choice
export PY WHEELS WORK DEVICE PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"

# The trainer runs: configs/demo_lm.yaml (lm task, no encoders) on the carried text, 1b preset.
SETS=(data.spec="$WORK/lm_data/lm.yaml" data.eval_spec=null data.demo=false
      model.preset="$PRESET" checkpoint_every=100000 deterministic=false eval.enabled=false
      data.global_batch_tokens="$BATCH_TOKENS" data.micro_batch_tokens="$MICRO_TOKENS"
      data.workers=2 parallel.device="$DEVICE" parallel.mixed_precision="$PRECISION"
      parallel.activation_checkpoint=selective watchdog.step_timeout_s=300)
train_args() {  # RUN STEPS EXTRA_SET...: ARGS = `omniscale train`'s arguments for that run
    local run=$1 steps=$2 s
    shift 2
    ARGS=(configs/demo_lm.yaml --nproc 1 --no-progress)
    for s in "${SETS[@]}" output_dir="$WORK/$run" steps="$steps" "$@"; do ARGS+=(--set "$s"); done
}

status=0
stage() {  # NAME LIMIT_S COMMAND...: one stage, its exit status and seconds in stages.tsv
    local name=$1 limit=$2 rc t0=$SECONDS
    shift 2
    local left=$((BUDGET_S - REPORT_S - SECONDS))
    (( limit > left )) && limit=$left
    if (( ! DRY && limit < 15 )); then
        echo "== $name: skipped ($left s of the $BUDGET_S s budget left)"
        printf '%s\tskipped\t0\t0\n' "$name" >>"$WORK/stages.tsv"
        status=1
        return 1
    fi
    echo "== $name (limit $limit s; $SECONDS s elapsed) =="
    if (( DRY )); then "$@"; else timeout -k 10 "$limit" "$@"; fi
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - t0)) "$limit" >>"$WORK/stages.tsv"
    (( rc == 0 )) || { status=1; echo "== $name: FAILED (exit $rc)"; }
    return $rc
}

kernel_ops() {  # the ops tools/bench/kernel_ops.py times on CUDA (its own default list)
    "$PY" -c "import torch; from omniscale.tools.bench.kernel_ops import cases; \
print(' '.join(cases('cpu', torch.float32)))"
}

# -- the stages that are more than one command --------------------------------------------------
data() {
    rm -rf "$WORK/lm_data" && cp -r "$WHEELS/lm_data" "$WORK/" \
        && "$PY" -m omniscale data index "$WORK/lm_data/lm.yaml"
}

kernels() {
    local op rc=0
    # one process per op: a slow compile costs that op alone; --foreground keeps each in the
    # stage's process group, so the stage's own limit ends it too
    for op in $(kernel_ops); do
        timeout --foreground -k 5 60 "$PY" tools/bench/kernel_ops.py --device "$DEVICE" \
            --ops "$op" --reps 10 --warmup 2 --out "$WORK/kernels/$op.json" \
            || { rc=1; echo "kernels: $op failed"; }
    done
    return $rc
}

export -f data kernels kernel_ops

# -- dry-run checks: the same wiring, nothing that needs a GPU ----------------------------------
dry_deps() {
    local pins
    pins=$(shipped) || return 1
    [ -n "$pins" ] || { echo "--prepare would download nothing"; return 1; }
    if grep -qv '==' <<<"$pins"; then
        echo "a shipped distribution is not installed here (no version to pin): $pins"
        return 1
    fi
    echo "--prepare downloads: $(tr '\n' ' ' <<<"$pins")"
    echo "missing in this interpreter (would be installed): $("$PY" tools/bench/_gpu_deps.py \
missing | tr '\n' ' ')"
    if [ -d "$WHEELS" ]; then
        "$PY" tools/bench/_gpu_deps.py check "$WHEELS" || return 1
        [ -f "$WHEELS/lm_data/lm.yaml" ] || { echo "$WHEELS/lm_data/lm.yaml missing"; return 1; }
    else
        echo "no $WHEELS/ here: its files are not checked (bash tools/bench/gpu_check.sh" \
            "--prepare writes it)"
    fi
}

quiet() {  # COMMAND...: its output only when it fails
    local said
    if said=$("$@" 2>&1); then echo ok; else echo "$said"; return 1; fi
}

dry_kernels() {
    local ops
    ops=$(kernel_ops) && [ -n "$ops" ] && echo "ops: $ops" \
        && quiet "$PY" tools/bench/kernel_ops.py --help
}

dry_gpu_tests() {
    local listed
    listed=$("$PY" -m pytest tests/kernels -m gpu --collect-only -q -p no:cacheprovider) \
        || { echo "$listed"; return 1; }
    grep -E '^[0-9]+/[0-9]+ tests collected' <<<"$listed"
    grep -qE '^[1-9][0-9]*/[0-9]+ tests collected' <<<"$listed"
}

main() {
    echo "gpu_check: python $PY, wheels $WHEELS, work $WORK, out $OUT, budget $BUDGET_S s$( \
        (( DRY )) && echo ', DRY RUN')"
    local final=(checkpoint.final=false)  # no model-sized checkpoint at the end
    if (( DRY )); then
        stage syntax 10 bash -n tools/bench/gpu_check.sh
        stage deps 60 dry_deps
        stage imports 60 "$PY" tools/bench/_gpu_deps.py verify
    else
        stage deps 60 "$PY" tools/bench/_gpu_deps.py install "$WHEELS" "$WORK/site"
        stage imports 60 "$PY" tools/bench/_gpu_deps.py verify --json "$WORK/imports.json"
    fi
    if (( DRY )); then
        stage env 60 quiet "$PY" tools/bench/_gpu_report.py env --json "$WORK/env.json" \
            --wheels "$WHEELS"
        stage gpu_tests 120 dry_gpu_tests
        stage data 60 quiet "$PY" -m omniscale data index --help
        train_args train "$STEPS" "${final[@]}"
        stage train 180 "$PY" tools/bench/_gpu_report.py check-train "${ARGS[@]}"
        stage train_summary 30 quiet "$PY" tools/bench/_gpu_train_summary.py --help
        stage hf_step 90 quiet "$PY" tools/bench/_hf_step.py --help
        stage kernels 120 dry_kernels
        train_args train_syncs 3 debug.count_host_syncs=true "${final[@]}"
        stage train_syncs 90 "$PY" tools/bench/_gpu_report.py check-train "${ARGS[@]}"
    else
        stage env 60 "$PY" tools/bench/_gpu_report.py env --json "$WORK/env.json" \
            --wheels "$WHEELS"
        stage gpu_tests 120 "$PY" -m pytest tests/kernels -m gpu -q -p no:cacheprovider \
            --junitxml="$WORK/gpu_tests.xml"
        stage data 60 bash -c data
        train_args train "$STEPS" "${final[@]}"
        stage train 180 "$PY" -m omniscale train "${ARGS[@]}"
        cp "$WORK/train/metrics.jsonl" "$OUT/train_metrics.jsonl" 2>/dev/null
        cp "$WORK/train/config.yaml" "$OUT/train_config.yaml" 2>/dev/null
        rm -rf "$WORK/train/checkpoints"  # GBs: the disk is small
        stage train_summary 30 "$PY" tools/bench/_gpu_train_summary.py "$WORK/train" \
            --out "$WORK/train_summary.json"
        stage hf_step 90 "$PY" tools/bench/_hf_step.py --device "$DEVICE" \
            --from-summary "$WORK/train_summary.json" --out "$WORK/hf_step.json"
        stage kernels 120 bash -c kernels
        train_args train_syncs 3 debug.count_host_syncs=true "${final[@]}"
        stage train_syncs 90 "$PY" -m omniscale train "${ARGS[@]}"
        cp "$WORK/train_syncs/metrics.jsonl" "$OUT/train_syncs_metrics.jsonl" 2>/dev/null
        rm -rf "$WORK/train_syncs/checkpoints"
    fi
    echo "== report =="
    timeout -k 5 "$REPORT_S" "$PY" tools/bench/_gpu_report.py assemble --work "$WORK" \
        --out "$OUT" --budget-s "$BUDGET_S" || status=1
    echo "gpu_check: $( ((status == 0)) && echo passed || echo FAILED) in $SECONDS s" \
        "(results in $OUT/gpu_check.json)"
    return $status
}

if (( DRY )); then
    main
else
    main 2>&1 | tee "$OUT/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi
