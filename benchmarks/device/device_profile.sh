#!/usr/bin/env bash
# One device call: where a trainer's steps go. Runs benchmarks/bench_trl.py MODE (ODC only by
# default) with the listed steps under torch.profiler, their Chrome traces per rank, and
# benchmarks/trace_phases.py's table of them; on a one-GPU host two ranks share the GPU.
#   ODC_COMMIT=<commit> OUT=$OUT STEPS=7,12 bash benchmarks/device/device_profile.sh grpo
#   (carry [".whl"]; VARIANTS=odc,plain on a host with a GPU per rank; NPROC, default 2;
#   PROFILE_ARGS: more arguments of the example, e.g. "--size 3b --steps 7")
# Back in $OUT: phases.txt, each run's JSON and log and the tables' JSON (profile.tgz), and up
# to 4 traces (traces_<variant>_step<N>_rank<R>.json.gz, each under the tool's 16 MiB a file).
set -uo pipefail
cd "$(dirname "$0")/../.."
mode="${1:?trainer: sft, dpo or grpo}"
OUT="${OUT:-/tmp/odc_profile}"; mkdir -p "$OUT"
work=/tmp/odc_profile_work; rm -rf "$work"; mkdir -p "$work"
export ODC_COMMIT="${ODC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
env OUT=/tmp/odc_prep bash benchmarks/device/device_trl.sh none > "$OUT/prep.log" 2>&1 \
  || { tail -20 "$OUT/prep.log"; exit 1; }
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
rc=0
IFS=, read -r -a variants <<< "${VARIANTS:-odc}"
for v in "${variants[@]}"; do  # one run per variant: each its own traces
  mkdir -p "$work/$v/traces"
  timeout "${BENCH_TIMEOUT:-400}" python3 benchmarks/bench_trl.py "$mode" --nproc "${NPROC:-2}" \
    --variants "$v" --out "$work/$v" -- --profile-steps "${STEPS:-7,12}" \
    --profile-trace "$work/$v/traces" ${PROFILE_ARGS:-} > "$work/$v/bench.log" 2>&1 || rc=1
  grep -v -i warn "$work/$v/bench.log" | tail -20
  # The whole steps, then what runs inside the ranges named by WITHIN (default: the GRPO
  # adapter's microbatches; after:trl::generate_and_score: a GRPO step's update, any variant).
  for t in "$work/$v"/traces/*.json.gz; do cp "$t" "$work/traces_${v}_$(basename "$t")"; done
  { echo "=== $v"
    python3 benchmarks/trace_phases.py "$work/$v"/traces/*.json.gz --json "$work/$v/phases.json"
    python3 benchmarks/trace_phases.py "$work/$v"/traces/*.json.gz --top 40 \
      --within "${WITHIN:-odc::grpo_microbatches}" --json "$work/$v/phases_within.json"
  } >> "$OUT/phases.txt" 2>&1
done
cat "$OUT/phases.txt"
(cd "$work" && find . -type f ! -path '*/traces/*' ! -name 'traces_*' ! -name '*.tgz' -size -12M \
  | tar -czf "$OUT/profile.tgz" -T -)
# The traces themselves, each that fits the tool's 16 MiB a file (at most 4 come back).
find "$work" -maxdepth 1 -name 'traces_*.json.gz' -size -15M | sort | head -4 | xargs -r cp -t "$OUT"
exit $rc
