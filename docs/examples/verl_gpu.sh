#!/usr/bin/env bash
# verl 0.9.1 on the GPU machines (no package registry there): the wheels the image lacks travel
# with ONE device call (64 MiB with the repository) as one plain tar, .whl-verl/verl-gpu.tar.
#
#   bash docs/examples/verl_gpu.sh fetch     # here (PyPI): .whl-verl/verl-gpu.tar, < 45 MB
#   bash docs/examples/verl_gpu.sh setup     # there: verl's environment and the build only
#                                            # (benchmarks/device/device_trainers.sh uses it)
#   # one device call (nvidia-h100-x4, or -x2 for NPROCS=2):
#   #   carry [".whl-verl/verl-gpu.tar"]  command: bash docs/examples/verl_gpu.sh run
#   # results: $OUT/results.tgz (packed every 15 s) and $OUT/trainers.json. Order: the
#   # benchmark per GPU count (BENCH_TIMEOUT, default 300 s each), the fp32 check
#   # (CHECK_TIMEOUT 150), the CPU-rank tests (TESTS_TIMEOUT 150); a timeout of 0 leaves a
#   # stage out. Install and build take about 80 s of a 600 s call, and the 2-GPU benchmark
#   # did not end within 300 s (2 H200): give it its own call, NPROCS=2 BENCH_TIMEOUT=480
#   # CHECK_TIMEOUT=0 TESTS_TIMEOUT=0 (the check and the tests took 33 s and 60 s there).
#   # BENCH_ARGS adds bench_trl.py arguments, e.g. "--repeats 2" (both orders, steps pooled).
#
# What the GPU image lacks for `import verl` and verl's TrainingWorker (read from an
# environment built like the image: torch 2.11, transformers 5.17.0, accelerate 1.15.0,
# peft 0.21.0): ray (verl/protocol.py imports it), tensordict (+ pyvers), omegaconf (+ antlr4
# runtime, built here from its sdist), codetiming, datasets (+ multiprocess, dill), pydantic
# (+ pydantic-core, annotated-types, typing-inspection: verl/workers/rollout/replica.py imports
# it on the TrainingWorker path, and the image has none), uvicorn, fastapi, starlette and ray's
# small dependencies: 24 wheels. The rest of what they import
# (pandas, pyarrow, pillow, protobuf, msgpack, attrs, requests, urllib3, charset-normalizer,
# six, python-dateutil, xxhash, zipp, cloudpickle, psutil, pyyaml, numpy, ...) is in the image
# (/work/.library/device/KINDS.md, "Python packages already there") and does not travel;
# datasets 5.2.0 runs against the image's pyarrow and pandas.
# (Checked on the CPU: the path's imports succeed with only the image's packages and these
# wheels visible, ray pruned as below.)
#
# ray is pruned: its 79 MB wheel (201 MB unpacked) carries the cluster's executables, which
# only `ray.init()` / `ray start` use. This path (torchrun + verl's TrainingWorker,
# docs/examples/verl_ppo.py, benchmarks/bench_trl.py verl) imports ray (verl/protocol.py does,
# at module level) and never starts a cluster. `fetch` removes from the wheel, and from its
# RECORD:
#   ray/core/src/ray/gcs/gcs_server   the GCS server executable (40 MB)
#   ray/core/src/ray/raylet/raylet    the raylet executable (35 MB)
#   ray/jars/                         ray_dist.jar, for Java workers (35 MB)
#   ray/dashboard/client/build/       the dashboard's web client (JS and source maps, 9 MB)
# and re-zips it at deflate level 9 (22 MB). `import ray` needs ray/_raylet.so (44 MB), which
# stays. Were a path ever to start a cluster, `ray.init()` would fail loudly (the gcs_server /
# raylet executable is missing) rather than run differently.
#
# verl's metadata pins transformers < 5.11, but the image's 5.17.0 runs these paths:
# tests/verl_cases.py passes with it (see docs/integrations/verl.md), so the wheels are installed
# with --no-deps into a --system-site-packages venv. `run` then builds torch_odc, runs the verl
# tests, `benchmarks/bench_trl.py verl` on each GPU count of $NPROCS (default "2 4": verl's
# fsdp2 engine vs odc with LB-Mini, a 1B model, long-tailed rollouts; rows into
# $OUT/trainers.json, labelled with $ODC_DEVICE_KIND, else the kind read from nvidia-smi) and
# an fp32 parameter check on 2 GPUs.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/results}"
WHEELS=(verl==0.9.1 ray==2.60.0 tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.3.1
        codetiming==1.4.0 datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1
        uvicorn==0.54.0 fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2
        importlib-metadata==10.2.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
        referencing==0.37.0 rpds-py==2026.9.1 orjson==3.13.0 pydantic==2.14.4
        pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0)  # pydantic 2.14 needs >= 4.16; the image's may be older
TAR=.whl-verl/verl-gpu.tar
STAGE=.devbuild/verl-wheels
VENV=.devbuild/verl-venv

# ray's wheel without the cluster-only files (the header says which and why).
prune_ray() {
  python3 - "$1" "$2" <<'PY'
import sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
PRUNE = ("ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet", "ray/jars/",
         "ray/dashboard/client/build/")
drop = lambda name: name.startswith(PRUNE)
gone = 0
with zipfile.ZipFile(src) as zi, \
        zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
    for info in zi.infolist():
        if drop(info.filename):
            gone += info.file_size
            continue
        data = zi.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = "".join(l for l in data.decode().splitlines(True)
                           if not drop(l.split(",")[0])).encode()
        zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    assert "ray/_raylet.so" in zo.namelist()
print(f"ray: pruned {gone / 1e6:.0f} MB unpacked")
PY
}

fetch() {  # on a machine with PyPI; wheels for the GPU image's CPython 3.12
  local dl=.whl-verl/download
  rm -rf .whl-verl && mkdir -p "$dl"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$dl" "${WHEELS[@]}"
  python3 -m pip wheel -q --no-deps -w "$dl" antlr4-python3-runtime==4.9.3  # sdist only
  local w
  for w in "$dl"/ray-*.whl; do prune_ray "$w" "$w.pruned" && mv -f "$w.pruned" "$w"; done
  # Plain tar: the wheels are compressed already (xz over it saved ~2%).
  tar -cf "$TAR" -C "$dl" $(cd "$dl" && ls)
  rm -rf "$dl"
  tar -tvf "$TAR"
  ls -l "$TAR"
  local size; size=$(stat -c %s "$TAR")
  echo "$TAR: $((size / 1000000)) MB ($size bytes)"
  (( size < 45 * 1000 * 1000 )) || { echo "$TAR is over 45 MB" >&2; exit 1; }
}

setup() {  # verl's environment ($VENV/bin/python) and the extension, from the carried tar
  local log="${1:-/tmp/verl_build.log}"
  # The wheels this call carried (fetch); the venv sees the image's packages and its pip.
  rm -rf "$STAGE" && mkdir -p "$STAGE"
  tar -xf "$TAR" -C "$STAGE"
  # Installed beside the image's environment, not in a venv over it: the image's python3 is
  # itself a venv's (/opt/torch/.venv), whose packages (numpy, torch, ...) a nested
  # --system-site-packages venv does not see (it sees the base interpreter's only). The
  # "interpreter" is the image's python3 with the wheels first on PYTHONPATH.
  rm -rf "$VENV" && mkdir -p "$VENV/bin"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$VENV/site" "$STAGE"/*.whl
  printf '#!/usr/bin/env bash\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec %s "$@"\n' \
    "$PWD/$VENV/site" "$(command -v python3)" > "$VENV/bin/python"
  chmod +x "$VENV/bin/python"
  "$VENV/bin/python" -c 'import verl.workers.engine_workers, datasets, ray
print("verl env ok: ray", ray.__version__, "datasets", datasets.__version__)'
  # The build, unless this machine has one (benchmarks/device/device_trl.sh's, or a warm machine's).
  python3 -c 'import torch_odc._C' 2>/dev/null \
    || python3 -m pip install -q --no-build-isolation --no-deps -e . > "$log" 2>&1 || {
      tail -30 "$log"; exit 1; }
}

run() {
  export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=4
  # Results go to a local folder packed into $OUT/results.tgz every 15 s (a device call
  # returns at most 8 files, and what is under $OUT when it is stopped at its limit).
  local final="$OUT"
  OUT=/tmp/odc_verl_results
  rm -rf "$OUT" && mkdir -p "$OUT" "$final"
  # Files over 12 MB stay behind (the tool returns none over 16 MiB, and drops the whole tar).
  pack() { (cd "$OUT" && find . -type f -size -12M) | tar -czf "$final/partial.tgz" -C "$OUT" -T - \
      2>/dev/null && mv -f "$final/partial.tgz" "$final/results.tgz"; }
  ( while sleep 15; do pack; done ) &
  local packer=$!
  setup "$OUT/verl_build.log"
  local py="$PWD/$VENV/bin/python" rc=0
  export PYTHONPATH="$PWD"
  # verl's actor update, ODC (LB-Mini) vs verl's fsdp2 engine (NCCL, equal counts), one rank
  # per GPU on each count of $NPROCS: benchmarks/bench_trl.py verl (a 1B Qwen2 shape,
  # long-tailed responses up to 2048 tokens, 8192 tokens per microbatch, bf16, 13 steps with
  # 3 warm-up), a row each into trainers.json. verl_ppo.py runs without remove-padding
  # (use_remove_padding=False, sdpa), so the response width sets the work per row.
  # The device copy's git HEAD can be older than the tree that travelled: say so in the commit
  # (as benchmarks/device/device_trl.sh does).
  if [[ -z ${ODC_COMMIT:-} ]]; then
    ODC_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || true)
    git diff --quiet HEAD -- . 2>/dev/null || ODC_COMMIT="${ODC_COMMIT}+uncommitted-or-newer"
  fi
  export ODC_COMMIT
  local gpus n
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  # The kind bench_trl.py records in each row (--kind, default $ODC_DEVICE_KIND): the lent
  # kinds' names, nvidia-h100-x<N> / nvidia-h200-x<N> (one H200: nvidia-h200).
  if [[ -z ${ODC_DEVICE_KIND:-} ]]; then
    local card=h100
    [[ $(nvidia-smi -L 2>/dev/null) == *H200* ]] && card=h200
    ODC_DEVICE_KIND="nvidia-$card-x$gpus"
    [[ $ODC_DEVICE_KIND == nvidia-h200-x1 ]] && ODC_DEVICE_KIND=nvidia-h200
  fi
  export ODC_DEVICE_KIND
  echo "commit $ODC_COMMIT, kind $ODC_DEVICE_KIND, $gpus GPUs"
  for n in ${NPROCS:-2 4}; do
    (( n <= gpus )) || continue
    ODC_VERL_PYTHON="$py" timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_trl.py verl \
      --nproc "$n" --out "$OUT" --summary "$OUT/trainers.json" ${BENCH_ARGS:-} 2>&1 | grep -v -i warn \
      | tee "$OUT/bench_verl_${n}.log" | tail -8 || rc=1
  done
  # fp32 for the parameter check over NCCL (bf16 differs by rounding). CHECK_TIMEOUT=0 or
  # TESTS_TIMEOUT=0 leaves the check or the tests out (a call for the benchmark alone).
  (( ${CHECK_TIMEOUT:-150} > 0 )) && { timeout "${CHECK_TIMEOUT:-150}" "$py" -m torch.distributed.run --nproc-per-node 2 docs/examples/verl_ppo.py \
    --size small --dtype fp32 --steps 3 --lr 1e-4 --out "$OUT/verl_fp32" 2>&1 \
    | grep -v -i warn | tee "$OUT/verl_ppo_small_fp32_2gpu.log" | tail -8 || rc=1; }
  # Last, the CPU-rank tests, under this environment (the image's transformers 5.17.0).
  (( ${TESTS_TIMEOUT:-150} > 0 )) && { ODC_VERL_PYTHON="$py" timeout "${TESTS_TIMEOUT:-150}" \
    python3 -m pytest tests/test_integrations_verl.py -q -p no:cacheprovider -s 2>&1 \
    | tee "$OUT/verl_tests_gpu_image.log" | tail -5 || rc=1; }
  kill "$packer" 2>/dev/null
  pack; cp -f "$OUT/trainers.json" "$final/" 2>/dev/null
  return $rc
}

[ $# -gt 0 ] || { echo "usage: $0 fetch | setup | run" >&2; exit 2; }
for step in "$@"; do
  case $step in fetch|setup|run) "$step" ;; *) echo "unknown step $step" >&2; exit 2;; esac
done
