#!/usr/bin/env bash
# benchmarks/device/device_run.sh as one call of the device tool. Each argument is one device_run.sh
# invocation (its modes), run in order; ODC_BASELINE applies to the first only (one baseline
# build). Results go to a local folder and are packed into $OUT/results.tgz every 15 s while
# they run (written aside, then renamed), so a call stopped at its time limit still returns what
# finished (the tool returns at most 8 files). BUDGET_S: seconds from now that the runs may use
# (device_run.sh shortens its stages and skips e2e runs to end before it).
#   OUT=<the tool's output folder> BUDGET_S=540 bash benchmarks/device/device_call.sh bench,step tests
set -u
cd "$(dirname "$0")/../.."
final="${OUT:?set OUT to the output folder of the device tool}"
work=/tmp/odc_results
rm -rf "$work"
mkdir -p "$work"
[[ -n ${BUDGET_S:-} ]] && export ODC_DEADLINE=$(( $(date +%s) + BUDGET_S ))
pack() {
  tar -czf "$final/partial.tgz" -C "$work" . 2>/dev/null && mv -f "$final/partial.tgz" "$final/results.tgz"
}
(
  rc=0
  for phase in "$@"; do
    echo "=== device_run.sh $phase (at $(date +%T))"
    OUT="$work" bash benchmarks/device/device_run.sh "$phase" || rc=1
    unset ODC_BASELINE
  done
  exit $rc
) > "$work/device_run.log" 2>&1 &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
  sleep 15
  pack
done
wait "$pid"
rc=$?
pack
grep -v -i "warn" "$work/device_run.log" | tail -100
exit "$rc"
