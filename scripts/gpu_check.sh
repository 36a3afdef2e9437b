#!/usr/bin/env bash
# Check a GPU install and measure it, in one command of bounded time:
#   1. the machine and the versions;
#   2. ZINC-12k built in data/ (from the ZINC source files: RDKit, all cores), before any timing;
#   3. the six runs of the paper's ablation as one stacked, compiled model, all members at once,
#      in turn, and in turn on the fused attention kernels (which way the ablation trains fastest);
#   4. the tests that need a GPU (pytest -m gpu; they build their own ZINC copy once), then the
#      fused attention kernels' tests and the ensemble's and the engine's on those kernels;
#   5. the training step of one run at the same shape (Graphormer-slim, batch 256, 20 hops): the
#      training engine with and without a compiled backbone and the fused attention core, URPE
#      and RPE, with the kernels that take each step's time.
# (The attention core alone: scripts/bench_attention.py.)
#
#   scripts/gpu_check.sh [OUT_DIR]     (default gpu_check; ZINC is built in data/ if missing)
#
# Each part writes OUT_DIR/<part>.txt and has its share of GPU_CHECK_SECONDS (default 540, which
# the shares fill); a part that fails or runs out of time is recorded there and the next part
# runs, and a smaller budget cuts the last parts first. The last lines printed are each part's
# summary. PYTHON picks the interpreter (default python3).
set -u
OUT_DIR=${1:-gpu_check}
BUDGET=${GPU_CHECK_SECONDS:-540}
PY=${PYTHON:-python3}
START=$(date +%s)
if [ -L "$OUT_DIR" ] || { [ -e "$OUT_DIR" ] && [ ! -d "$OUT_DIR" ]; }; then
  echo "gpu_check.sh: $OUT_DIR is a link or not a directory; name a directory to write the results into" >&2
  exit 2
fi
mkdir -p "$OUT_DIR" || exit 2

seconds_left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# part NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (less if the budget is short)
part() {
  local name=$1 want=$2 left
  shift 2
  left=$(( $(seconds_left) - 5 ))
  (( want > left )) && want=$left
  if (( want < 10 )); then
    echo "skipped: the budget ran out" > "$OUT_DIR/$name.txt"
    return
  fi
  echo "== $(( $(date +%s) - START )) s: $name (at most $want s)"
  timeout "$want" "$@" > "$OUT_DIR/$name.txt" 2>&1
  local status=$?
  (( status == 124 )) && echo "stopped after $want s (GPU_CHECK_SECONDS)" >> "$OUT_DIR/$name.txt"
  echo "exit status $status" >> "$OUT_DIR/$name.txt"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, triton, lightning, torch_geometric, numpy, rdkit; print('torch', torch.__version__, \
'| triton', triton.__version__, '| lightning', lightning.__version__, '| torch_geometric', \
torch_geometric.__version__, '| numpy', numpy.__version__, '| rdkit', rdkit.__version__)"
  git log --oneline -1 2>/dev/null
  echo "$(nproc) CPU cores, $(date -u +%F)"
} > "$OUT_DIR/machine.txt" 2>&1

ZINC="--zinc-root data --build-workers $(nproc)"
part data 60 "$PY" -c "from graphormer_urpe.data.zinc import load_zinc
for split in ('train', 'val', 'test'): print(split, len(load_zinc('data/ZINC', split=split)), 'graphs')"
# the six stacked runs as the ablation trains them (the recipe's bf16-mixed, compiled): all at
# once (vmap), in turn, in turn on the fused attention kernels
for name in bench_ensemble bench_ensemble_in_turn bench_ensemble_in_turn_triton; do
  case $name in
    bench_ensemble) how= ;;
    bench_ensemble_in_turn) how=--ensemble-in-turn ;;
    *) how="--ensemble-in-turn --ensemble-attention-impl triton" ;;
  esac
  part $name 70 "$PY" scripts/bench_train.py --presets zinc --attention urpe \
    --paths engine --zinc-batch 256 --skip-data-only $ZINC --warmup 10 --steps 40 --count-ops 3 --ensemble 6 \
    $how --ensemble-args "--model.compile true"
done
part tests 100 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests
part tests_fused 40 "$PY" -m pytest -q -p no:cacheprovider tests/nn/test_fused_attention.py \
  tests/training/test_ensemble.py tests/training/test_engine.py -k "kernel or fused_attention"

part bench_train 95 "$PY" scripts/bench_train.py --presets zinc --attention urpe,rpe \
  --paths engine,engine-compiled,engine-compiled-static,engine-triton,engine-compiled-triton --zinc-batch 256 \
  --skip-data-only $ZINC --count-ops 3 --top-ops 30 --warmup 10 --steps 100

echo "== $(( $(date +%s) - START )) s: done; full output in $OUT_DIR/"
cat "$OUT_DIR/machine.txt"
for name in data bench_ensemble bench_ensemble_in_turn bench_ensemble_in_turn_triton tests tests_fused bench_train; do
  echo "---- $name"
  tr '\r' '\n' < "$OUT_DIR/$name.txt" | grep -E "graphs|ms/step|ms  |member|passed|failed|error|Error|stopped|skipped|exit status" \
    | grep -v "it/s\]" | tail -n 24
done
