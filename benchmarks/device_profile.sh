#!/usr/bin/env bash
# One device call: where a trainer's steps go. Runs benchmarks/bench_trl.py MODE (ODC only by
# default) with the listed steps under torch.profiler, their Chrome traces per rank, and
# benchmarks/trace_phases.py's table of them; on a one-GPU host two ranks share the GPU.
#   ODC_COMMIT=<commit> OUT=$OUT STEPS=7,12 bash benchmarks/device_profile.sh grpo
#   (carry [".whl"]; VARIANTS=odc,plain on a host with a GPU per rank; NPROC, default 2)
# Back in $OUT: phases.{txt,json}, the run's JSON and log (profile.tgz), the traces
# (traces.tgz, when under the tool's 16 MiB a file).
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
python3 benchmarks/trace_phases.py "$work"/traces/*.json.gz --json "$OUT/phases.json" \
  > "$OUT/phases.txt" 2>&1
cat "$OUT/phases.txt"
(cd "$work" && find . -type f ! -path './traces/*' ! -name '*.tgz' -size -12M \
  | tar -czf "$OUT/profile.tgz" -T -)
tar -czf "$OUT/traces.tgz" -C "$work" traces
[[ $(stat -c %s "$OUT/traces.tgz") -lt 16000000 ]] || rm -f "$OUT/traces.tgz"
exit $rc
