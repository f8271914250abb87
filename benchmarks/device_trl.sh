#!/usr/bin/env bash
# One device call for the trainer integrations on 2 GPUs (issues 32 and 33): the pinned
# transformers / TRL / peft / datasets carried as wheels in .whl/ (the GPU image has no package
# registry; see docs/testing.md), the extension built against the image's torch, then
#   1. the GPU tests of the checkpoint, GRPO and DPO integrations,
#   2. GRPO and DPO, ODC vs plain TRL with FSDP2 over NCCL (benchmarks/bench_trl.py,
#      benchmarks/bench_trl_dpo.py).
# Logs and results go to $OUT (default benchmarks/results/trl_gpu).
#   bash benchmarks/device_trl.sh [tests,grpo,dpo]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/trl_gpu}"; mkdir -p "$OUT"
what="${1:-tests,grpo,dpo}"
has() { [[ ",$what," == *",$1,"* ]]; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/wheels.log" 2>&1 || { tail -20 "$OUT/wheels.log"; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c 'import torch, transformers, trl, peft, accelerate, datasets
print("torch", torch.__version__, "transformers", transformers.__version__, "trl", trl.__version__,
      "peft", peft.__version__, "accelerate", accelerate.__version__, "datasets", datasets.__version__,
      "gpus", torch.cuda.device_count())' 2>&1 | tee "$OUT/versions.txt" || exit 1
"$PY" -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || {
  tail -40 "$OUT/build.log"; exit 1; }
rc=0
commit="${ODC_COMMIT:-unknown}"
if has tests; then
  timeout "${TESTS_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider --timeout=200 -rs \
    tests/test_integrations_hf_checkpoint.py tests/test_integrations_trl_grpo.py \
    tests/test_integrations_trl_dpo.py -k "${TESTS_K:-gpu}" 2>&1 | tee "$OUT/gpu_tests.log" \
    | tail -15 || rc=1
fi
if has grpo; then
  timeout "${GRPO_TIMEOUT:-200}" "$PY" benchmarks/bench_trl.py grpo --out "$OUT" \
    ${GRPO_ARGS:+-- $GRPO_ARGS} 2>&1 | grep -v -i warn | tee "$OUT/bench_trl_grpo.log" | tail -15 || rc=1
fi
if has dpo; then
  timeout "${DPO_TIMEOUT:-200}" "$PY" benchmarks/bench_trl_dpo.py --launch 2 --gpu-defaults \
    ${DPO_ARGS:-} --commit "$commit" --out "$OUT" 2>&1 | grep -v -i warn \
    | tee "$OUT/bench_trl_dpo.log" | tail -15 || rc=1
fi
exit $rc
