#!/usr/bin/env bash
# Made for one device call: the one-rank decomposition rows (a), from .devbuild/tree.tar (git archive
# HEAD) and .devbuild/tree.commit, with the pinned wheels in .whl/ (carry .whl .devbuild):
#   TRAINER_TIMEOUT=290 bash benchmarks/device/decomposition_a.sh grpo dpo
set -uo pipefail
T=/tmp/tree; R=/tmp/res; mkdir -p $R
commit=$(cat .devbuild/tree.commit)
if [ ! -f $T/.built ]; then
  rm -rf $T /tmp/site; mkdir -p $T; tar -xf .devbuild/tree.tar -C $T
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $OUT/wheels.log 2>&1 || { tail $OUT/wheels.log; exit 1; }
  start=$SECONDS
  (cd $T && python3 -m pip install -q --no-build-isolation --no-deps -e . > $R/build.log 2>&1) || { tail -30 $R/build.log; exit 1; }
  echo "build $((SECONDS-start)) s"; touch $T/.built
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRL_EXPERIMENTAL_SILENCE=1
export ODC_COMMIT=$commit
cd $T
for trainer in "$@"; do
  start=$SECONDS
  timeout ${TRAINER_TIMEOUT:-560} python3 benchmarks/bench_trl.py $trainer --nproc 1 --same-data-as 2 \
    --variants odc,plain,plain-tuned --out $R --summary $R/trainers.json --kind nvidia-h200 \
    --commit-note "tree $commit (git archive); nvidia-h200, 1 GPU; (a) of the $trainer decomposition on the 2-GPU row's data" \
    --device-command "bench_trl.py $trainer --nproc 1 --same-data-as 2 --variants odc,plain,plain-tuned -- --steps 8, carry .whl .devbuild" \
    -- --steps 8 2>&1 | grep -v -i warn | tail -25
  echo "$trainer: $((SECONDS-start)) s"
done
ls -la $R
cp $R/*.json $R/*.png $OUT/ 2>/dev/null; ls $OUT
