#!/usr/bin/env bash
# verl 0.9.1 on the GPU machines (no package registry there): its wheels travel with the
# device calls, 64 MiB per call, so they go in parts over several calls of one warm machine.
#
#   bash docs/examples/verl_gpu.sh fetch     # here (PyPI): .whl-verl/part*.tar, each < 58 MiB
#   # device calls on one warm machine (nvidia-h100-x2), carrying one part each:
#   #   carry [".whl-verl/part1.tar"]  command: bash docs/examples/verl_gpu.sh stage
#   #   ... part2, part3, then the last part with:
#   #   carry [".whl-verl/part4.tar"]  command: bash docs/examples/verl_gpu.sh stage run
#
# What the GPU image lacks for `import verl` and verl's TrainingWorker (read from an
# environment built like the image: torch 2.11, transformers 5.17.0, accelerate 1.15.0,
# peft 0.21.0): ray (verl/protocol.py imports it), tensordict, omegaconf, codetiming, datasets
# (with pyarrow, pandas, multiprocess, dill, xxhash), pillow, uvicorn, fastapi, starlette and
# their small dependencies: 35 wheels, 157 MB (ray 79 MB, pyarrow 55 MB). verl's metadata pins
# transformers < 5.11, but the image's 5.17.0 runs these paths: tests/verl_cases.py passed with
# it (see docs/integrations.md), so the wheels are installed with --no-deps next to the image's
# packages. `run` then builds torch_odc, runs the verl tests, `benchmarks/bench_trl.py verl` on
# each GPU count of $NPROCS (default "2 4": verl's fsdp2 engine vs odc with LB-Mini, a 1B model,
# long-tailed rollouts; rows into $OUT/trainers.json) and an fp32 parameter check on 2 GPUs.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/results}"
WHEELS=(verl==0.9.1 ray==2.60.0 tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.3.1
        codetiming==1.4.0 datasets==5.2.0 pyarrow==26.0.1 pandas==3.1.1 python-dateutil==4.0.0
        six==1.17.0 tzdata==2026.6 multiprocess==0.70.19 dill==0.4.1 xxhash==4.1.0
        pillow==13.0.0 uvicorn==0.54.0 fastapi==0.165.0 starlette==1.10.0
        opentelemetry-api==1.45.2 importlib-metadata==10.2.0 zipp==4.1.2 msgpack==1.2.4
        protobuf==7.36.2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
        referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 requests==2.34.2
        urllib3==2.8.0 charset-normalizer==3.5.3 orjson==3.13.0 cloudpickle==3.1.3)
STAGE=.devbuild/verl-wheels
VENV=.devbuild/verl-venv

fetch() {  # on a machine with PyPI; wheels for the GPU image's CPython 3.12
  local dl=.whl-verl/download
  rm -rf .whl-verl && mkdir -p "$dl"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$dl" "${WHEELS[@]}"
  python3 -m pip wheel -q --no-deps -w "$dl" antlr4-python3-runtime==4.9.3  # sdist only
  (cd "$dl" && for w in ray-*.whl; do split -b 40m "$w" "$w.split-" && rm "$w"; done)
  # Parts of at most ~58 MB (a device call carries 64 MiB with the repository).
  local part=1 size=0 limit=$((58 * 1000 * 1000)) files=()
  flush() {
    if [ ${#files[@]} -gt 0 ]; then
      tar -cf ".whl-verl/part$part.tar" -C "$dl" "${files[@]}"
      part=$((part + 1)); size=0; files=()
    fi
  }
  for f in $(cd "$dl" && ls -S); do
    s=$(stat -c %s "$dl/$f")
    if (( size + s > limit )); then flush; fi
    files+=("$f"); size=$((size + s))
  done
  flush
  rm -rf "$dl"
  ls -l .whl-verl
}

stage() {  # on the device: keep what this call carried (ignored paths survive while warm)
  mkdir -p "$STAGE"
  for t in .whl-verl/part*.tar; do [ -e "$t" ] && tar -xf "$t" -C "$STAGE"; done
  ls "$STAGE" | wc -l
}

run() {
  export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=4
  mkdir -p "$OUT"
  (cd "$STAGE" && for f in ray-*.whl.split-aa; do w=${f%.split-aa}; cat "$w".split-* > "$w"; done)
  python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -m pip install -q --no-index --no-deps "$STAGE"/*.whl
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/verl_build.log" 2>&1 || {
    tail -30 "$OUT/verl_build.log"; exit 1; }
  local py="$PWD/$VENV/bin/python" rc=0
  export PYTHONPATH="$PWD"
  # The CPU-rank tests, under this environment (the image's transformers 5.17.0).
  ODC_VERL_PYTHON="$py" timeout 600 python3 -m pytest tests/test_integrations_verl.py -q \
    -p no:cacheprovider -s 2>&1 | tee "$OUT/verl_tests_gpu_image.log" | tail -5 || rc=1
  # verl's actor update, ODC (LB-Mini) vs verl's fsdp2 engine (NCCL, equal counts), one rank
  # per GPU on each count of $NPROCS: benchmarks/bench_trl.py verl (a 1B Qwen2 shape,
  # long-tailed responses up to 4096 tokens, 8192 tokens per microbatch, bf16, 14 steps after
  # 3 warm-up), a row each into trainers.json.
  export ODC_COMMIT="${ODC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  local gpus n
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  for n in ${NPROCS:-2 4}; do
    (( n <= gpus )) || continue
    ODC_VERL_PYTHON="$py" timeout "${BENCH_TIMEOUT:-600}" python3 benchmarks/bench_trl.py verl \
      --nproc "$n" --out "$OUT" --summary "$OUT/trainers.json" 2>&1 | grep -v -i warn \
      | tee "$OUT/bench_verl_${n}.log" | tail -8 || rc=1
  done
  # fp32 for the parameter check over NCCL (bf16 differs by rounding).
  timeout 600 "$py" -m torch.distributed.run --nproc-per-node 2 docs/examples/verl_ppo.py \
    --size small --dtype fp32 --steps 3 --lr 1e-4 --out "$OUT/verl_fp32" 2>&1 \
    | grep -v -i warn | tee "$OUT/verl_ppo_small_fp32_2gpu.log" | tail -8 || rc=1
  return $rc
}

[ $# -gt 0 ] || { echo "usage: $0 fetch | stage [run] | run" >&2; exit 2; }
for step in "$@"; do
  case $step in fetch|stage|run) "$step" ;; *) echo "unknown step $step" >&2; exit 2;; esac
done
