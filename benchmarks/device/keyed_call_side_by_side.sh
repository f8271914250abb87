#!/usr/bin/env bash
# Made for one device call: git archive BEFORE -o .devbuild/before.tar; git archive HEAD -o
# .devbuild/after.tar; git rev-parse --short BEFORE > .devbuild/before.commit; git rev-parse
# --short HEAD > .devbuild/after.commit; then run this with .devbuild carried (results in $OUT).
# Side by side in one call: the keyed push's host cost (keyed_call_micro, host CPU, 2 ranks)
# of the tree before a change and after it, runs alternating; then the GPU tests of the changed
# C++ paths on the after build.
set -uo pipefail
after=$(cat .devbuild/after.commit)
before=$(cat .devbuild/before.commit 2>/dev/null || echo 1625248)
micro_path() {  # keyed_call_micro.py moved to benchmarks/probes/ with the results reorganization
  if [ -f /tmp/$1/benchmarks/probes/keyed_call_micro.py ]; then echo benchmarks/probes/keyed_call_micro.py
  else echo benchmarks/keyed_call_micro.py; fi
}
for t in before after; do mkdir -p /tmp/$t && tar -xf .devbuild/$t.tar -C /tmp/$t; done
export MAX_JOBS=8
( cd /tmp/before && python3 setup.py -q build_ext --inplace > $OUT/build_before.log 2>&1; echo "before rc=$?" ) &
( cd /tmp/after && python3 setup.py -q build_ext --inplace > $OUT/build_after.log 2>&1; echo "after rc=$?" ) &
wait; echo "built at $SECONDS s"
micro() {  # tree, micro path
  (cd /tmp/$1 && PYTHONPATH=/tmp/$1 CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 60 \
    python3 -m torch.distributed.run --standalone --nproc-per-node=2 $2 --calls 20000 2>&1 | grep -v -i warn | tail -8)
}
# ROUNDS (default 2) rounds; odd rounds run before first, even ones after first.
for r in $(seq 1 "${ROUNDS:-2}"); do
  order="before after"; [ $((r % 2)) -eq 0 ] && order="after before"
  for t in $order; do
    echo "== round $r $t ($(eval echo \$$t))"; micro $t "$(micro_path $t)"
  done
done 2>&1 | tee $OUT/keyed_call_micro.txt
echo "micro done at $SECONDS s"
[ "${GPU_TESTS:-1}" = 1 ] || exit 0
cd /tmp/after && PYTHONPATH=/tmp/after timeout 300 python3 -m pytest -q -p no:cacheprovider -x --timeout=100 \
  tests/test_shard_cache.py tests/test_grad_memory.py tests/test_release_memory.py tests/test_odc_cpu.py \
  tests/test_conformance.py tests/test_gpu_odc.py -k "gpu or cuda" 2>&1 | tail -6 | tee $OUT/gpu_tests.txt
echo "all done at $SECONDS s"
