#!/usr/bin/env bash
# One device call: build against the machine's torch, run the GPU tests, the transport benchmark
# on 2, 4 and 8 GPUs (those present), the training-step benchmark. Logs and results go to $OUT
# (default: benchmarks/results). benchmarks/device_call.sh wraps it for the device tool (results
# packed into one archive while it runs, so a call stopped at its limit still returns them).
#   bash benchmarks/device_run.sh [MODE[,MODE...]]   modes: tests bench step memory sanitize e2e
#   diag; all = tests,bench,step (ODC_BASELINE: see below)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
what="${1:-all}"; [[ $what == all ]] && what="tests,bench,step"
has() { [[ ",$what," == *",$1,"* ]]; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PYTHON:-python3}"
# ODC_DEADLINE (epoch seconds, set by device_call.sh from BUDGET_S): long stages shorten their
# timeouts to end before it, and e2e runs that cannot finish are skipped.
left() { if [[ -n ${ODC_DEADLINE:-} ]]; then echo $(( ODC_DEADLINE - $(date +%s) )); else echo 100000; fi; }
capped() { local t=$1 l; l=$(( $(left) - 10 )); (( l < t )) && t=$l; (( t < 1 )) && t=1; echo "$t"; }
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi -L | tee "$OUT/device.txt"; nvidia-smi topo -m >> "$OUT/device.txt" 2>&1
# ODC_BASELINE=<tar of an earlier tree> (e.g. `git archive <commit> csrc setup.py pyproject.toml
# torch_odc CMakeLists.txt`): built beside this one, and the benchmarks run with it too, in the
# same call (results under $OUT/baseline): a kernel change measured side by side with the code
# before it. ODC_BASELINE_FOR=bench,step (default) names the benchmarks run with it.
base=""
if [[ -n ${ODC_BASELINE:-} ]]; then
  base=/tmp/odc_baseline; rm -rf "$base"; mkdir -p "$base" "$OUT/baseline"
  tar -xf "$ODC_BASELINE" -C "$base"
  (cd "$base" && "$PY" setup.py build_ext --inplace > "$OUT/baseline/build.log" 2>&1) &
fi
"$PY" -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || {
  tail -40 "$OUT/build.log"; exit 1; }
if [[ -n $base ]]; then
  wait || { tail -20 "$OUT/baseline/build.log"; base=""; }
fi
# with_base CMD...: runs CMD with the baseline tree's torch_odc first on the path.
with_base() { PYTHONPATH="$base${PYTHONPATH:+:$PYTHONPATH}" "$@"; }
"$PY" -c 'import torch_odc; assert torch_odc._C._has_cuda_transport(), "no CUDA transport built"'
rc=0
if has tests; then
  # TESTS: the test files or folders (default tests); TESTS_K: the -k expression.
  timeout "$(capped "${TESTS_TIMEOUT:-420}")" "$PY" -m pytest ${TESTS:-tests} -q -k "${TESTS_K:-gpu or cuda}" -p no:cacheprovider --timeout=240 -rs \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -25 || rc=1
fi
if has bench; then
  for n in 2 4 8; do
    # With one GPU, 2 ranks share it (odc ops only: NCCL refuses two ranks on one GPU).
    (( n <= gpus || (n == 2 && gpus == 1) )) || continue
    timeout "$(capped 240)" torchrun --nproc-per-node="$n" benchmarks/bench_transport.py --out "$OUT" ${TRANSPORT_ARGS:-} \
      2>&1 | tee "$OUT/bench_transport_${n}gpu.log" | tail -30 || rc=1
    if [[ -n $base && ${ODC_BASELINE_FOR:-bench,step} == *bench* ]]; then
      with_base timeout 240 torchrun --nproc-per-node="$n" benchmarks/bench_transport.py \
        --out "$OUT/baseline" ${TRANSPORT_ARGS:-} 2>&1 | tee "$OUT/baseline/bench_transport_${n}gpu.log" | tail -30 || rc=1
    fi
  done
fi
if has step; then
  # Issue 23: a training step (16 layers x 2048, bf16, 2 x 4096 tokens per rank) under FSDP2 +
  # ODC: minibatch time, GPU time by category (ODC's kernels' share), host time in ODC calls
  # (and outside the barrier's waits, issue 30), the plain-copy reference. 2 ranks sharing GPU 0
  # (STEP_SHARED=0 skips it), then with 2+ GPUs one rank per GPU with FSDP2 over NCCL beside
  # it; the baseline tree (ODC_BASELINE) runs each beside the new one.
  if [[ ${STEP_SHARED:-1} != 0 ]]; then
    CUDA_VISIBLE_DEVICES=0 timeout 240 torchrun --nproc-per-node=2 benchmarks/bench_step.py \
      --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/bench_step_1gpu.log" | tail -30 || rc=1
    if [[ -n $base && ${ODC_BASELINE_FOR:-bench,step} == *step* ]]; then
      CUDA_VISIBLE_DEVICES=0 with_base timeout 240 torchrun --nproc-per-node=2 \
        benchmarks/bench_step.py --out "$OUT/baseline" 2>&1 | grep -v -i warn \
        | tee "$OUT/baseline/bench_step_1gpu.log" | tail -30 || rc=1
    fi
  fi
  if (( gpus >= 2 )); then
    timeout "$(capped 300)" torchrun --nproc-per-node="$gpus" benchmarks/bench_step.py --out "$OUT" \
      ${STEP_ARGS:-} 2>&1 | grep -v -i warn | tee "$OUT/bench_step_${gpus}gpu.log" | tail -30 || rc=1
    if [[ -n $base && ${ODC_BASELINE_FOR:-bench,step} == *step* ]]; then
      with_base timeout "$(capped 300)" torchrun --nproc-per-node="$gpus" benchmarks/bench_step.py \
        --out "$OUT/baseline" ${STEP_ARGS:-} 2>&1 | grep -v -i warn \
        | tee "$OUT/baseline/bench_step_${gpus}gpu.log" | tail -30 || rc=1
    fi
  fi
fi
if has memory; then
  # Issue 17: allocator peak + ODC region vs FSDP2 on the e2e model (2 ranks; on one GPU they
  # share it and FSDP2's figure is accounted, see benchmarks/bench_memory.py).
  n=$(( gpus >= 2 ? gpus : 2 ))
  timeout 200 torchrun --nproc-per-node="$n" benchmarks/bench_memory.py --out "$OUT" \
    2>&1 | grep -v -i warn | tee "$OUT/bench_memory.log" | tail -8 || rc=1
fi
if has e2e; then
  # Issue 6: one process per (workload, config) -- a process that already ran the same sequence
  # lengths runs them faster (shape caches), which would favour whichever config runs later --
  # all planning with one cost model fitted first (or given as E2E_CAL=DENSE,ATTN,FLOOR).
  # E2E_SPR: sequences per rank to run (default "4 16": 4 measured minibatches at 4, 1 at 16;
  # ~6 and ~8 min on 4 H200, so split them over two calls). E2E_PACK=N packs sequences into
  # microbatches of up to N tokens (document-causal varlen attention); default 1 = one each.
  # E2E_WORKLOADS / E2E_CONFIGS pick a subset (configs: nccl-micro odc-mini odc-micro, and
  # odc-mini-lazy: shards published at first all-gather, not up front).
  # E2E_EXTRA: further WORKLOAD:CONFIG runs after those (e.g. "rl:odc-micro": ODC on the
  # LB-Micro plan, the same microbatches per rank as FSDP2, to compare host gaps on one plan),
  # merged into the same table; skipped like the others when the deadline is near.
  # E2E_MB: measured minibatches per run (default 4 at 4 sequences per rank, 1 above);
  # E2E_RL_PACK: the token cap of the rl-packed workload (RL sequences packed into varlen
  # microbatches, reported beside "rl"). With ODC_DEADLINE, a run is skipped when less than
  # E2E_RUN_S seconds (default 60) are left.
  pack="${E2E_PACK:-1}"; ptag=""; (( pack > 1 )) && ptag="_pack${pack}"
  cal="${E2E_CAL:-}"
  if [[ -z $cal ]]; then
    cal=$(timeout "$(capped "${E2E_CAL_TIMEOUT:-150}")" torchrun --nproc-per-node="$gpus" benchmarks/bench_e2e.py --calibrate-only \
          --pack-tokens "$pack" 2>&1 | tee "$OUT/calibration.log" | grep -o 'CALIBRATION=.*' \
          | cut -d= -f2)
    [[ -n $cal ]] || { echo "cost-model calibration failed"; tail -20 "$OUT/calibration.log"; exit 1; }
  fi
  echo "cost model: $cal"
  for spr in ${E2E_SPR:-4 16}; do
    mb=4; (( spr > 4 )) && mb=1; mb="${E2E_MB:-$mb}"
    parts=()
    runs=()
    for w in ${E2E_WORKLOADS:-long-context rl rl-packed equal}; do
      for c in ${E2E_CONFIGS:-nccl-micro odc-mini odc-micro}; do runs+=("$w:$c"); done
    done
    for wc in "${runs[@]}" ${E2E_EXTRA:-}; do
      w=${wc%%:*}; c=${wc#*:}
      tag="p${spr}_${w}_${c}"
      if (( $(left) < ${E2E_RUN_S:-60} )); then
        echo "skipped $tag: $(left) s left before the deadline" | tee -a "$OUT/bench_e2e_${spr}spr.log"
        rc=1; continue
      fi
      timeout "$(capped 240)" torchrun --nproc-per-node="$gpus" benchmarks/bench_e2e.py --out "$OUT/e2e_parts" \
        --seqs-per-rank "$spr" --minibatches "$mb" --workloads "$w" --configs "$c" \
        --pack-tokens "$pack" --rl-pack-tokens "${E2E_RL_PACK:-16384}" --calibration "$cal" \
        --tag "$tag" 2>&1 | grep -v -i warn >> "$OUT/bench_e2e_${spr}spr.log"
      if [[ -f $OUT/e2e_parts/$tag.json ]]; then parts+=("$OUT/e2e_parts/$tag.json"); else rc=1; fi
    done
    (( ${#parts[@]} )) && "$PY" benchmarks/bench_e2e.py --merge "${parts[@]}" --out "$OUT" \
      --tag "e2e_1b_${gpus}gpu_${spr}spr${ptag}" 2>&1 | grep -v -i warn | tee -a "$OUT/bench_e2e_${spr}spr.log"
  done
fi
if has diag; then
  # What makes short microbatches host-bound: every host-GPU synchronization in one measured
  # RL minibatch, with its Python stack, under plain FSDP2 and under ODC.
  for c in nccl-micro odc-mini; do
    timeout 200 torchrun --nproc-per-node="$gpus" benchmarks/bench_e2e.py --out /tmp/diag \
      --workloads rl --configs "$c" --minibatches 1 --cost flops --sync-debug 2>&1 \
      | grep -v -i "warn" | tee -a "$OUT/sync_debug.log" | tail -30 || rc=1
  done
fi
if has sanitize; then
  # The ODC primitive flow (torchrun, no FSDP) and FSDP2 + attach (spawned ranks), 2 GPUs, no
  # NCCL in the processes. With 4 GPUs memcheck and racecheck run at once on separate pairs,
  # within what is left of SANITIZE_DEADLINE seconds since this script started (default 570).
  sanitize() {  # tool, visible devices, torchrun port
    local left=$(( ${SANITIZE_DEADLINE:-570} - SECONDS ))
    CUDA_VISIBLE_DEVICES=$2 timeout $(( left * 2 / 5 )) compute-sanitizer --tool "$1" \
      --target-processes all --error-exitcode 9 torchrun --master-port "$3" --nproc-per-node=2 \
      tests/sanitizer_flow.py > "$OUT/sanitizer_$1.log" 2>&1 || echo "$1 primitive flow: rc=$?"
    left=$(( ${SANITIZE_DEADLINE:-570} - SECONDS ))
    CUDA_VISIBLE_DEVICES=$2 timeout "$left" compute-sanitizer --tool "$1" \
      --target-processes all --error-exitcode 9 "$PY" tests/sanitizer_fsdp_flow.py \
      > "$OUT/sanitizer_fsdp_$1.log" 2>&1 || echo "$1 FSDP flow: rc=$?"
  }
  if (( gpus >= 4 )); then
    sanitize memcheck 0,1 29511 > /tmp/sanitize_memcheck.rc &
    sanitize racecheck 2,3 29512 > /tmp/sanitize_racecheck.rc &
    wait
  else
    sanitize memcheck 0,1 29511 > /tmp/sanitize_memcheck.rc
    sanitize racecheck 0,1 29512 > /tmp/sanitize_racecheck.rc
  fi
  echo "sanitize finished after ${SECONDS}s"
  cat /tmp/sanitize_*.rc; [[ -s /tmp/sanitize_memcheck.rc || -s /tmp/sanitize_racecheck.rc ]] && rc=1
  grep -E "SUMMARY|ok|max|done" "$OUT"/sanitizer_*.log
fi
exit $rc
