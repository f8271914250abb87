#!/usr/bin/env bash
# One device call: build against the machine's torch, run the GPU tests, the transport benchmark
# on 2 and (when present) 4 GPUs. Logs and results go to $OUT (default: benchmarks/results).
#   bash benchmarks/device_run.sh [tests|bench|sanitize|e2e|all]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
what="${1:-all}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PYTHON:-python3}"
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi -L | tee "$OUT/device.txt"; nvidia-smi topo -m >> "$OUT/device.txt" 2>&1
"$PY" -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || {
  tail -40 "$OUT/build.log"; exit 1; }
"$PY" -c 'import torch_odc; assert torch_odc._C._has_cuda_transport(), "no CUDA transport built"'
rc=0
if [[ $what == tests || $what == all ]]; then
  timeout 420 "$PY" -m pytest tests -q -k "gpu" -p no:cacheprovider --timeout=240 -rs \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -25 || rc=1
fi
if [[ $what == bench || $what == all ]]; then
  for n in 2 4; do
    (( n <= gpus )) || continue
    timeout 240 torchrun --nproc-per-node="$n" benchmarks/bench_transport.py --out "$OUT" \
      2>&1 | tee "$OUT/bench_transport_${n}gpu.log" | tail -22 || rc=1
  done
fi
if [[ $what == e2e ]]; then  # issue 6: 4 GPUs; 4 sequences/rank (3 measured minibatches), then 16 (1)
  for spr in 4 16; do
    mb=3; (( spr > 4 )) && mb=1
    timeout 250 torchrun --nproc-per-node="$gpus" benchmarks/bench_e2e.py --out "$OUT" \
      --seqs-per-rank "$spr" --minibatches "$mb" --tag "e2e_1b_${gpus}gpu_${spr}spr" 2>&1 \
      | tee "$OUT/bench_e2e_${spr}spr.log" | grep -v Warning | tail -14 || rc=1
  done
fi
if [[ $what == sanitize ]]; then
  for tool in memcheck racecheck; do
    timeout 280 compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 9 \
      "$PY" -m pytest tests/test_gpu_odc.py -q -p no:cacheprovider -k "2 and None" \
      2>&1 | tee "$OUT/sanitizer_${tool}.log" | tail -8 || rc=1
  done
fi
exit $rc
