#!/usr/bin/env bash
# Is the cost of cudaIpcOpenMemHandle of a peer's memory its size not being a whole number of
# 2 MiB pages? One device call, on one GPU:
#  1) benchmarks/probes/probe_vmm_map.cu (static and shared cudart), the ipc mode at 1.92 GiB rounded
#     to 2 MiB and at 2055368704 bytes (IPC_BYTES), the size benchmarks/probes/probe_ipc_open.py used;
#  2) benchmarks/probes/probe_ipc_context.py (two spawned Python processes) at both sizes;
#  3) free/restore_gradient_memory() timed by benchmarks/bench_memory.py --cycles (2 ranks sharing
#     the GPU), with this tree and with ODC_BASELINE (a tar of an earlier tree: csrc setup.py
#     pyproject.toml torch_odc CMakeLists.txt), built side by side.
#   OUT=<folder> ODC_BASELINE=/tmp/base.tar bash benchmarks/probes/probe_ipc_size.sh
set -u
cd "$(dirname "$0")/../.."
out="${OUT:?set OUT}"
export PYTHONUNBUFFERED=1
log="$out/ipc_size.log"
{
  echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader), torch" \
       "$(python3 -c 'import torch; print(torch.__version__)'), tree ${ODC_COMMIT:-?}, $(date -u +%F)"
  nvcc -O2 -o /tmp/probe_static benchmarks/probes/probe_vmm_map.cu -lcuda
  nvcc -O2 -cudart shared -o /tmp/probe_shared benchmarks/probes/probe_vmm_map.cu -lcuda
  for bin in /tmp/probe_static /tmp/probe_shared; do
    for k in 2057306112 2055368704; do
      echo "# IPC_BYTES=$k $bin 2057306112 (ipc rows)"
      IPC_BYTES=$k "$bin" 2057306112 | grep "importer ipc"
    done
  done
  for k in 2057306112 2055368704; do
    echo "# python3 benchmarks/probes/probe_ipc_context.py $k"
    timeout 150 python3 benchmarks/probes/probe_ipc_context.py "$k"
  done
} > "$log" 2>&1
# The builds after the probes, which time host calls (no compiler beside them).
base=/tmp/odc_baseline
if [[ -n ${ODC_BASELINE:-} ]]; then
  rm -rf "$base" && mkdir -p "$base" && tar -xf "$ODC_BASELINE" -C "$base"
  (cd "$base" && python3 setup.py build_ext --inplace > "$out/build_baseline.log" 2>&1) &
fi
(python3 setup.py build_ext --inplace > "$out/build.log" 2>&1) &
wait
for tree in baseline new; do
  dir=$PWD; [[ $tree == baseline ]] && dir=$base
  [[ $tree == baseline && -z ${ODC_BASELINE:-} ]] && continue
  echo "# $tree: torchrun --nproc-per-node 2 benchmarks/bench_memory.py --cycles 8" >> "$log"
  PYTHONPATH="$dir" timeout 240 torchrun --nproc-per-node 2 benchmarks/bench_memory.py \
    --cycles 8 --out "$out/$tree" 2>&1 | grep -v -i warn | grep -i "free/restore\|error" >> "$log"
done
cat "$log"
