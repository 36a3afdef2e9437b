#!/usr/bin/env bash
# One command for a GPU machine, in bounded time (GPU_CHECK_SECONDS, default 570):
#   1. set-up: the wheels brought along in .whl/ installed into /tmp/site (no network), the
#      Cython extension built for this Python (scripts/gpu_wheels.txt: which wheels, how to fetch
#      them); the machine and the versions;
#   2. ZINC-12k built in data/ (RDKit, all cores);
#   3. only when the code differs from the ranking recorded for this GPU
#      (RESULTS_DIR/ranking_<gpu>.json): the tests that need a GPU, then the speed ranking of the
#      training step at the paper's shape (scripts/bench_train.py, URPE and RPE), recorded there;
#   4. the paper's ZINC ablation trained further (graphormer-urpe-ablation --time-budget) until
#      ~60 s before the end, its progress table written into README.md;
#   5. the runs' states (RUNS_DIR/zinc-paper), the README, RESULTS_DIR and the logs packed into
#      OUT_DIR/state.tgz.part-* (files of at most 15 MiB; unpack with
#      `cat OUT_DIR/state.tgz.part-* | tar xzf -` in the checkout).
# Run again on the same machine, it only trains (and packs).
#
#   scripts/gpu_check.sh OUT_DIR
#
# Each part writes OUT_DIR/<part>.txt; a part that fails or runs out of time is recorded there and
# the next part runs. The last lines printed are each part's summary. PYTHON picks the
# interpreter (default python3); RUNS_DIR, RESULTS_DIR and README move the outputs (defaults
# results/runs, docs/results, README.md).
#
# Before anything runs or is written it stops with one line: exit status 2 for an OUT_DIR that is
# a link or a file, or a folder holding files it did not write (OUT_DIR/.gpu_check marks its
# own; name an empty or new folder); exit status 1 when PYTHON's torch sees no CUDA GPU (a run
# without one would pack untrained state for the next machine). Its CPU test sets PYTHON to a
# stand-in that answers the GPU probe (`... get_device_name ...`) with `cuda device: <name>`.
set -u
OUT_DIR=${1:-gpu_check}
BUDGET=${GPU_CHECK_SECONDS:-570}
PY=${PYTHON:-python3}
RUNS_DIR=${RUNS_DIR:-results/runs}
RESULTS_DIR=${RESULTS_DIR:-docs/results}
README=${README:-README.md}
#: seconds kept after training for the tests of finished runs and the packing
RESERVE=60
START=$(date +%s)
if [ -L "$OUT_DIR" ] || { [ -e "$OUT_DIR" ] && [ ! -d "$OUT_DIR" ]; }; then
  echo "gpu_check.sh: $OUT_DIR is a link or not a directory; name a directory to write the results into" >&2
  exit 2
fi
#: marks OUT_DIR as this script's own, which a later run may write into again
MARK=.gpu_check
if [ -d "$OUT_DIR" ] && [ ! -f "$OUT_DIR/$MARK" ] && [ -n "$(ls -A "$OUT_DIR")" ]; then
  echo "gpu_check.sh: $OUT_DIR holds files that gpu_check.sh did not write ($(ls -A "$OUT_DIR" | head -n 3 \
| paste -sd ' ' -)...), which it would overwrite; name an empty or new directory" >&2
  exit 2
fi
# The GPU the parts are for, as torch sees it (CUDA_VISIBLE_DEVICES included).
PROBE=$("$PY" -c "import torch; print('cuda device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() \
else ''); print('torch', torch.__version__, 'built for CUDA', torch.version.cuda)" 2>&1)
GPU=$(echo "$PROBE" | sed -n 's/^cuda device: //p' | head -n 1)
if [ -z "$GPU" ]; then
  if echo "$PROBE" | grep -q '^cuda device:'; then
    why="$(echo "$PROBE" | grep '^torch ' | head -n 1) sees no CUDA device"
  else
    why="$(echo "$PROBE" | tail -n 1 | cut -c1-200)"
  fi
  echo "gpu_check.sh: no CUDA GPU visible to $PY ($why); nothing run, nothing written" >&2
  exit 1
fi
mkdir -p "$OUT_DIR" || exit 2
echo "written by scripts/gpu_check.sh, which may write here again" > "$OUT_DIR/$MARK"

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

# 1. Set-up (the runbook's): offline wheels, the extension for this interpreter; the checkout
# first on the path.
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
{
  status=0
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || status=$?
  fi
  "$PY" setup.py -q build_ext --inplace || status=$?
  echo "exit status $status"
} > "$OUT_DIR/setup.txt" 2>&1
export PYTHONUNBUFFERED=1
export GRAPHORMER_URPE_ZINC_SOURCE=${GRAPHORMER_URPE_ZINC_SOURCE:-$PWD/shared/data/zinc}
{
  echo "$GPU"
  "$PY" -c "import torch, lightning, torch_geometric, numpy, rdkit, optuna; print('torch', torch.__version__, \
'| lightning', lightning.__version__, '| torch_geometric', torch_geometric.__version__, '| numpy', \
numpy.__version__, '| rdkit', rdkit.__version__, '| optuna', optuna.__version__)"
  echo "$(nproc) CPU cores, $(date -u +%F)"
} > "$OUT_DIR/machine.txt" 2>&1

# 2. ZINC
part data 60 "$PY" -c "from graphormer_urpe.data.zinc import load_zinc
for split in ('train', 'val', 'test'): print(split, len(load_zinc('data/ZINC', split=split)), 'graphs')"

# 3. The GPU tests and the speed ranking, once per state of the code (names and contents) and
# of the wheels, per GPU; recorded only when the tests passed.
SLUG=$(echo "$GPU" | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '-' | sed 's/-$//')
CODE=$( { find graphormer_urpe cython_ext configs tests scripts/bench_train.py setup.py pyproject.toml -type f \
            \( -name '*.py' -o -name '*.pyx' -o -name '*.yaml' -o -name '*.toml' \) -print0 \
          | LC_ALL=C sort -z | xargs -0 sha256sum; ls .whl 2>/dev/null; } | sha256sum | cut -c1-16)
RANKING="$RESULTS_DIR/ranking_$SLUG.json"
if [ -f "$RANKING" ] && grep -q "\"code\": \"$CODE\"" "$RANKING"; then
  echo "ranking of this code on this GPU: $RANKING" > "$OUT_DIR/ranking.txt"
else
  part tests 100 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests
  part ranking 120 "$PY" scripts/bench_train.py --presets zinc --attention urpe,rpe \
    --paths engine@bf16-mixed,engine-compiled@bf16-mixed,engine-triton@bf16-mixed,engine-compiled-triton@bf16-mixed \
    --zinc-batch 256 --skip-data-only --zinc-root data --count-ops 3 --top-ops 20 --warmup 10 --steps 60 \
    --code "$CODE" --record "$OUT_DIR/ranking.json"
  if grep -q "^exit status 0$" "$OUT_DIR/tests.txt" && [ -f "$OUT_DIR/ranking.json" ]; then
    mkdir -p "$RESULTS_DIR" && cp "$OUT_DIR/ranking.json" "$RANKING"
  fi
fi

# 4. The ablation, on the fastest path measured: the engine's recorded, compiled step on
# device-resident batches of one shape.
TRAIN=$(( $(seconds_left) - RESERVE ))
if (( TRAIN >= 20 )); then
  part ablation $(( TRAIN + 30 )) "$PY" -m graphormer_urpe.cli.ablation --config configs/zinc.yaml --name zinc-paper \
    --runs-dir "$RUNS_DIR" --results "$RESULTS_DIR/zinc_gpu.json" --readme "$README" --time-budget "${TRAIN}s" \
    --data.init_args.device_resident true --data.init_args.static_shapes true --model.compile true
else
  echo "skipped: the budget ran out" > "$OUT_DIR/ablation.txt"
fi

# 5. Everything the next machine resumes from.
rm -f "$OUT_DIR"/state.tgz.part-*
tar czf - --ignore-failed-read "$RUNS_DIR/zinc-paper" "$README" "$RESULTS_DIR" "$OUT_DIR"/*.txt 2> "$OUT_DIR/pack.txt" \
  | split -b 15m - "$OUT_DIR/state.tgz.part-"

echo "== $(( $(date +%s) - START )) s: done; full output in $OUT_DIR/"
cat "$OUT_DIR/machine.txt"
for name in setup data tests ranking ablation; do
  [ -f "$OUT_DIR/$name.txt" ] || continue
  echo "---- $name"
  tr '\r' '\n' < "$OUT_DIR/$name.txt" | grep -E "graphs|ms/step|fastest|passed|failed|error|Error|stopped|skipped|fit|val |took|exit status" \
    | grep -v "it/s\]" | tail -n 16
done
ls -l "$OUT_DIR"/state.tgz.part-*
