#!/usr/bin/env bash
# The engine as it is against another commit's, on one GPU machine, alternating (a GPU's speed moves
# between machines and hours, so only runs side by side compare): the bench model's gsp-small and
# no-share runs (`bench.engine_bench --skip-hf`: cache on and off with CUDA graphs, cache on without),
# printed per round as each variant's decode-only step time, time in steps that prefill, and throughput.
#
# Prepare here (the device machine has no git history), then carry `.gpu_ab` with the run:
#   rm -rf .gpu_ab && mkdir -p .gpu_ab/old && git archive REV engine cache bench | tar -x -C .gpu_ab/old
# Run there, from the repository root:  bash bench/gpu_ab.sh [ROUNDS]   (default 2; ~1 minute a round)
# ALT_PYTHONPATH=DIR adds a third variant: this tree with DIR first on the path (another transformers,
# say, installed there with pip --target), to tell a library's cost from the engine's.
# BENCH_ARGS passes more flags to both (`--quick` checks the script on a CPU in a minute or two).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # (runs are started from each tree)
OUT=${OUT:-/tmp/gpu_ab}
ROUNDS=${1:-2}
# USE_HUB_KERNELS=0: commits before 2026-12-04 did not turn the Hub's kernels off, and with transformers
# 5.25 and `kernels` installed their model load fails offline on a GPU
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false USE_HUB_KERNELS=0
[ -d .gpu_ab/old/engine ] || { echo "no .gpu_ab/old: prepare it as this script's header says"; exit 2; }
mkdir -p "$OUT"
root=$(pwd)
run() {  # $1 name, $2 tree, $3 extra PYTHONPATH
  local log="$OUT/$1.$r.log"
  (cd "$2" && PYTHONPATH="${3:+$3:}$2:${PYTHONPATH:-}" timeout 240 $PY -m bench.engine_bench --skip-hf ${BENCH_ARGS:-} --out "$OUT/png_$1" >"$log" 2>&1)
  echo "-- round $r, $1 (rc $?)"
  grep -E '^### |^- engine' "$log" | sed -E 's/; [0-9]+ graphs captured.*//'
  grep '^{' "$log" | tail -1 | $PY -c 'import json,sys; d=json.loads(sys.stdin.read() or "{}"); print("   ", {k: round(v, 3) for k, v in d.items() if isinstance(v, float) and ("throughput" in k or "tok_s" in k)})'
}
for r in $(seq "$ROUNDS"); do
  run new "$root" ""
  run old "$root/.gpu_ab/old" ""
  [ -n "${ALT_PYTHONPATH:-}" ] && run alt "$root" "$ALT_PYTHONPATH"
done
