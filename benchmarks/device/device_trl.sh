#!/usr/bin/env bash
# One device call for the trainer integrations: the pinned transformers / TRL / peft / datasets
# carried as wheels in .whl/ (the GPU image has no package registry; docs/testing.md), the
# extension built against the image's torch, then the stages asked for, in order:
#   tests        the Hugging Face / TRL GPU tests (every GPU of the host visible: a host with
#                more GPUs than the tests' 2 ranks is what users with a bigger node have)
#   sft,dpo,grpo ODC vs the unmodified trainer (benchmarks/bench_trl.py) on each rank count of
#                $NPROCS (default "2 4"), every row into trainers.json
# Results go to a local folder packed into $OUT/results.tgz every 15 s (a call stopped at its
# limit still returns what finished); trainers.json and the last log lines also land in $OUT.
#   OUT=... ODC_DEVICE_KIND=nvidia-h100-x4 NPROCS="2 4" bash benchmarks/device/device_trl.sh tests,sft
set -uo pipefail
cd "$(dirname "$0")/../.."
final="${OUT:-benchmarks/results/trainers}"; mkdir -p "$final"
work="${ODC_TRL_WORK:-/tmp/odc_trl_results}"; mkdir -p "$work"  # one per concurrent call
what="${1:-tests,sft,dpo,grpo}"
has() { [[ ",$what," == *",$1,"* ]]; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TRL_EXPERIMENTAL_SILENCE=1
PY="${PYTHON:-python3}"
pack() { tar -czf "$final/partial.tgz" -C "$work" . 2>/dev/null && mv -f "$final/partial.tgz" "$final/results.tgz"; }
(
  if compgen -G ".whl/*.whl" > /dev/null && [[ ! -f /tmp/site/.odc_trl ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl > "$work/wheels.log" 2>&1 || { tail -20 "$work/wheels.log"; exit 1; }
    touch /tmp/site/.odc_trl
  fi
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c 'import torch, transformers, trl, peft, accelerate, datasets
print("torch", torch.__version__, "transformers", transformers.__version__, "trl", trl.__version__,
      "peft", peft.__version__, "accelerate", accelerate.__version__, "datasets", datasets.__version__,
      "gpus", torch.cuda.device_count())' 2>&1 | tee "$work/versions.txt" || exit 1
  nvidia-smi -L >> "$work/versions.txt" 2>&1
  "$PY" -c 'import torch_odc._C' 2>/dev/null || "$PY" -m pip install -q --no-build-isolation \
    --no-deps -e . > "$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
  rc=0
  if has tests; then
    echo "=== HF/TRL GPU tests (at $(date +%T))"
    timeout "${TESTS_TIMEOUT:-330}" "$PY" -m pytest -q -p no:cacheprovider --timeout=300 -rs \
      -n "${TESTS_WORKERS:-4}" --dist loadgroup \
      tests/test_integrations_hf.py tests/test_integrations_hf_checkpoint.py \
      tests/test_integrations_trl_grpo.py tests/test_integrations_trl_dpo.py \
      tests/test_integrations_hf_lora.py -k "${TESTS_K:-gpu}" 2>&1 | grep -v -i warn \
      | tee "$work/hf_gpu_tests.log" | tail -25 || rc=1
  fi
  # The device copy's git HEAD can be older than the tree that travelled: say so in the commit.
  if [[ -z ${ODC_COMMIT:-} ]]; then
    ODC_COMMIT=$(git rev-parse --short HEAD 2>/dev/null)
    git diff --quiet HEAD -- . 2>/dev/null || ODC_COMMIT="${ODC_COMMIT}+uncommitted-or-newer"
  fi
  export ODC_COMMIT
  for trainer in sft dpo grpo; do
    has "$trainer" || continue
    for n in ${NPROCS:-2 4}; do
      echo "=== $trainer on $n GPUs (at $(date +%T))"
      timeout "${BENCH_TIMEOUT:-300}" "$PY" benchmarks/bench_trl.py "$trainer" --nproc "$n" \
        --out "$work" --summary "$work/trainers.json" ${BENCH_ARGS:-} 2>&1 | grep -v -i warn \
        | tee "$work/bench_${trainer}_${n}.log" | tail -8 || rc=1
    done
  done
  exit $rc
) > "$work/device_trl.log" 2>&1 &
pid=$!
while kill -0 "$pid" 2>/dev/null; do sleep 15; pack; done
wait "$pid"; rc=$?
pack
cp -f "$work/trainers.json" "$final/" 2>/dev/null
grep -v -i "warn" "$work/device_trl.log" | tail -80
exit "$rc"
