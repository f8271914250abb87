#!/usr/bin/env bash
# One device call for trainer rows on a 4-GPU host (nvidia-h200-x4 / nvidia-h100-x4): the 2-GPU
# rows run two at a time, on GPUs 0,1 and 2,3 (on a 2-GPU host one after the other) (each row's two variants still run one after the
# other on the same pair, so a row compares like with like), then the 4-GPU rows one by one.
# Two 2-GPU rows share the host's CPUs (64 cores) and nothing else.
#
#   ODC_COMMIT=<commit> ODC_DEVICE_KIND=nvidia-h200-x4 OUT=$OUT \
#     bash benchmarks/device/device_trainers.sh "grpo,verl" "grpo,verl"     # 2-GPU rows, 4-GPU rows
#   (a device call ends at 600 s: with ~90 s of preparation, a GRPO row takes ~170 s and a verl
#   row ~240-300 s, so split the rows over calls, e.g. "" grpo, then "" verl)
#   carry [".whl"] (sft, dpo, grpo) and ".whl-verl/verl-gpu.tar" (verl)
#
# Trainers: sft, dpo, grpo (benchmarks/device/device_trl.sh) and verl (docs/examples/verl_gpu.sh setup,
# then benchmarks/bench_trl.py verl in its environment). Every run's files are packed into
# $OUT/<trainer>_<gpus>.tgz as it ends; the rows are merged into $OUT/trainers.json and the
# timeline into $OUT/call.log (with 4 rows, 6 files come back). BENCH_TIMEOUT: seconds per
# row (default 280). BENCH_ARGS: more arguments of bench_trl.py for every row, e.g.
# BENCH_ARGS="--repeats 2" (odc,plain then plain,odc, steps pooled: the 4-GPU verl row, whose
# host-bound runs move ~10 % apart, takes ~340 s so, BENCH_TIMEOUT=420, alone in a call).
# DRY=1 prints the plan (commands) without running anything (DRY_GPUS: the host's GPU count
# it assumes, default 4).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/odc_trainers}"; mkdir -p "$OUT"
two="${1:-}"; four="${2:-}"
limit="${BENCH_TIMEOUT:-280}"
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/call.log"; }
exec 3>&1  # DRY=1 prints the commands here, past the rows' redirections
do_() { if [[ ${DRY:-0} == 1 ]]; then echo "+ $*" >&3; else "$@"; fi; }
export ODC_DEVICE_KIND="${ODC_DEVICE_KIND:-}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [[ -z ${ODC_COMMIT:-} ]]; then
  ODC_COMMIT=$(git rev-parse --short HEAD 2>/dev/null)
  git diff --quiet HEAD -- . 2>/dev/null || ODC_COMMIT="${ODC_COMMIT}+uncommitted-or-newer"
fi
export ODC_COMMIT

# Once, before any row: the TRL wheels and the build (device_trl.sh with no stage), verl's
# environment (it rebuilds in the same tree, so not beside a running row).
do_ env OUT=/tmp/odc_prep bash benchmarks/device/device_trl.sh none > /tmp/odc_prep.log 2>&1 \
  || { tail -20 /tmp/odc_prep.log; exit 1; }
if [[ ",$two,$four," == *,verl,* ]]; then
  do_ bash docs/examples/verl_gpu.sh setup > /tmp/odc_verl_setup.log 2>&1 \
    || { tail -20 /tmp/odc_verl_setup.log; exit 1; }
fi
log "prepared (commit $ODC_COMMIT)"
rm -rf /tmp/odc_row_*  # a warm machine's earlier rows are not this call's

row() {  # trainer gpus devices: one row, its files packed into $OUT/<trainer>_<gpus>.tgz
  local t=$1 n=$2 devices=$3 work=/tmp/odc_row_$1_$2
  rm -rf "$work" && mkdir -p "$work"
  if [[ $t == verl ]]; then
    do_ env CUDA_VISIBLE_DEVICES="$devices" OMP_NUM_THREADS=4 PYTHONPATH="$PWD" \
      ODC_VERL_PYTHON="$PWD/.devbuild/verl-venv/bin/python" timeout "$limit" \
      python3 benchmarks/bench_trl.py verl --nproc "$n" --out "$work" \
      --summary "$work/trainers.json" ${BENCH_ARGS:-} > "$work/bench_verl_$n.log" 2>&1
  else
    do_ env CUDA_VISIBLE_DEVICES="$devices" ODC_TRL_WORK="$work" OUT="$work/out" NPROCS="$n" \
      BENCH_TIMEOUT="$limit" bash benchmarks/device/device_trl.sh "$t" > "$work/device_trl_$n.log" 2>&1
  fi
  local rc=$?
  [[ ${DRY:-0} == 1 ]] || (cd "$work" && find . -type f -size -12M ! -name '*.tgz' \
    | tar -czf "$OUT/${t}_$n.tgz" -T -)
  log "$t on $n GPUs ($devices): rc=$rc"
}

merge() {  # every row's trainers.json into $OUT/trainers.json
  [[ ${DRY:-0} == 1 ]] && return
  python3 - "$OUT/trainers.json" /tmp/odc_row_*/trainers.json <<'PY'
import json, sys
sys.path.insert(0, "benchmarks")
from bench_trl import update_summary
for path in sys.argv[2:]:
    for r in json.load(open(path)).get("rows", []):
        update_summary(sys.argv[1], r)
PY
}

IFS=, read -r -a pairs <<< "$two"
host_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[[ ${DRY:-0} == 1 ]] && host_gpus=${DRY_GPUS:-4}
if (( host_gpus < 4 )); then  # a 2-GPU host: the 2-GPU rows one after the other
  for t in "${pairs[@]}"; do row "$t" 2 0,1; done
  pairs=()
fi
for ((i = 0; i < ${#pairs[@]}; i += 2)); do
  row "${pairs[i]}" 2 0,1 &
  a=$!
  if (( i + 1 < ${#pairs[@]} )); then row "${pairs[i+1]}" 2 2,3 & b=$!; wait "$b"; fi
  wait "$a"
done
IFS=, read -r -a fours <<< "$four"
for t in "${fours[@]}"; do row "$t" 4 0,1,2,3; done
merge
log "done"
