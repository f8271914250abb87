#!/usr/bin/env bash
# One device call: where a trainer's steps go. Runs benchmarks/bench_trl.py MODE (ODC only by
# default) with the listed steps under torch.profiler, their Chrome traces per rank, and
# benchmarks/trace_phases.py's table of them; on a one-GPU host two ranks share the GPU.
#   ODC_COMMIT=<commit> OUT=$OUT STEPS=7,12 bash benchmarks/device_profile.sh grpo
#   (carry [".whl"]; VARIANTS=odc,plain on a host with a GPU per rank; NPROC, default 2)
# Back in $OUT: phases.txt, the run's JSON and log and the tables' JSON (profile.tgz), and up
# to 4 traces (each under the tool's 16 MiB a file).
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:?trainer: sft, dpo or grpo}"
OUT="${OUT:-/tmp/odc_profile}"; mkdir -p "$OUT"
work=/tmp/odc_profile_work; rm -rf "$work"; mkdir -p "$work/traces"
export ODC_COMMIT="${ODC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
env OUT=/tmp/odc_prep bash benchmarks/device_trl.sh none > "$OUT/prep.log" 2>&1 \
  || { tail -20 "$OUT/prep.log"; exit 1; }
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
timeout "${BENCH_TIMEOUT:-400}" python3 benchmarks/bench_trl.py "$mode" --nproc "${NPROC:-2}" \
  --variants "${VARIANTS:-odc}" --out "$work" -- --profile-steps "${STEPS:-7,12}" \
  --profile-trace "$work/traces" > "$work/bench.log" 2>&1
rc=$?
grep -v -i warn "$work/bench.log" | tail -30
# The whole steps, then what runs inside the ranges named by WITHIN (default: the GRPO
# adapter's microbatches).
python3 benchmarks/trace_phases.py "$work"/traces/*.json.gz --json "$work/phases.json" \
  > "$OUT/phases.txt" 2>&1
python3 benchmarks/trace_phases.py "$work"/traces/*.json.gz --top 40 \
  --within "${WITHIN:-odc::grpo_microbatches}" --json "$work/phases_within.json" \
  >> "$OUT/phases.txt" 2>&1
cat "$OUT/phases.txt"
(cd "$work" && find . -type f ! -path './traces/*' ! -name '*.tgz' -size -12M \
  | tar -czf "$OUT/profile.tgz" -T -)
# The traces themselves, each that fits the tool's 16 MiB a file (at most 4 come back).
find "$work/traces" -name '*.json.gz' -size -15M | sort | head -4 | xargs -r cp -t "$OUT"
exit $rc
