#!/usr/bin/env bash
# Made for one device call: git archive BEFORE -o .devbuild/before.tar; git archive HEAD -o
# .devbuild/after.tar; git rev-parse --short HEAD > .devbuild/after.commit; then run this with
# .devbuild carried (results in $OUT). Paths of keyed_call_micro.py: before and after its move.
# Side by side in one call: the keyed push's host cost (keyed_call_micro, host CPU, 2 ranks)
# of the tree before the backend split (1625248) and after it (HEAD), builds alternating; then
# the GPU tests of the changed C++ paths on the after build.
set -uo pipefail
after=$(cat .devbuild/after.commit)
for t in before after; do mkdir -p /tmp/$t && tar -xf .devbuild/$t.tar -C /tmp/$t; done
export MAX_JOBS=8
( cd /tmp/before && python3 setup.py -q build_ext --inplace > $OUT/build_before.log 2>&1; echo "before rc=$?" ) &
( cd /tmp/after && python3 setup.py -q build_ext --inplace > $OUT/build_after.log 2>&1; echo "after rc=$?" ) &
wait; echo "built at $SECONDS s"
micro() {  # tree, micro path
  (cd /tmp/$1 && PYTHONPATH=/tmp/$1 CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 60 \
    python3 -m torch.distributed.run --standalone --nproc-per-node=2 $2 --calls 20000 2>&1 | grep -v -i warn | tail -8)
}
for r in 1 2; do
  echo "== round $r before (1625248)"; micro before benchmarks/keyed_call_micro.py
  echo "== round $r after ($after)"; micro after benchmarks/probes/keyed_call_micro.py
done 2>&1 | tee $OUT/keyed_call_micro.txt
echo "micro done at $SECONDS s"
cd /tmp/after && PYTHONPATH=/tmp/after timeout 120 python3 -m pytest -q -p no:cacheprovider -x --timeout=100 \
  tests/test_shard_cache.py tests/test_grad_memory.py tests/test_release_memory.py tests/test_odc_cpu.py -k "gpu or cuda" 2>&1 | tail -6 | tee $OUT/gpu_tests.txt
echo "all done at $SECONDS s"
