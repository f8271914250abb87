#!/usr/bin/env bash
# benchmarks/device_run.sh as one call of the device tool: its results go to a local folder and
# are packed into $OUT/results.tgz every 15 s while it runs (written aside, then renamed), so a
# call stopped at its time limit still returns everything that finished; the tool returns at
# most 8 files. Environment and arguments as device_run.sh (BUDGET_S: seconds the call may use).
#   OUT=<the tool's output folder> bash benchmarks/device_call.sh tests,bench,step,e2e
set -u
cd "$(dirname "$0")/.."
final="${OUT:?OUT: the device tool's output folder}"
work=/tmp/odc_results
rm -rf "$work"
mkdir -p "$work"
pack() {
  tar -czf "$final/partial.tgz" -C "$work" . 2>/dev/null && mv -f "$final/partial.tgz" "$final/results.tgz"
}
OUT="$work" bash benchmarks/device_run.sh "$@" > "$work/device_run.log" 2>&1 &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
  sleep 15
  pack
done
wait "$pid"
rc=$?
pack
grep -v -i "warn" "$work/device_run.log" | tail -80
exit "$rc"
