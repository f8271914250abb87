#!/usr/bin/env bash
# One device call: build against the machine's torch, run the GPU tests, the transport benchmark
# on 2, 4 and 8 GPUs (those present), the training-step benchmark. Logs and results go to $OUT
# (default: benchmarks/results). benchmarks/device/device_call.sh wraps it for the device tool (results
# packed into one archive while it runs, so a call stopped at its limit still returns them).
#   bash benchmarks/device/device_run.sh [MODE[,MODE...]]   modes: tests bench step memory sanitize e2e
#   diag; all = tests,bench,step (ODC_BASELINE: see below)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/results}"
what="${1:-all}"; [[ $what == all ]] && what="tests,bench,step"
has() { [[ ",$what," == *",$1,"* ]]; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PYTHON:-python3}"
# ODC_DEADLINE (epoch seconds, set by device_call.sh from BUDGET_S): long stages shorten their
# timeouts to end before it, and e2e runs that cannot finish are skipped.
left() { if [[ -n ${ODC_DEADLINE:-} ]]; then echo $(( ODC_DEADLINE - $(date +%s) )); else echo 100000; fi; }
capped() { local t=$1 l; l=$(( $(left) - 10 )); (( l < t )) && t=$l; (( t < 1 )) && t=1; echo "$t"; }
# DEVICE_RUN_NO_GPU=1: a dry run of the stages' logic on a machine without GPUs (no nvidia-smi,
# no build, no CUDA check; the extension must already be importable).
dry="${DEVICE_RUN_NO_GPU:-0}"
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [[ $dry != 1 ]]; then
  nvidia-smi -L | tee "$OUT/device.txt"; nvidia-smi topo -m >> "$OUT/device.txt" 2>&1
fi
# The tests stage's Hugging Face / TRL tests need the pinned transformers, trl, peft, datasets
# (and tokenizers, dill, multiprocess, xxhash), absent from the GPU image, which has no package
# registry: the call carries them as wheels (run's carry: [".whl"]; fill .whl/ with
# `pip download --no-deps` of those pins). Installed into /tmp/site once per machine (a stamp
# of the wheels' names and sizes), in the background while the extension builds (~15 s).
wheels_pid=""; site=""
if has tests && compgen -G ".whl/*.whl" > /dev/null; then
  wstamp=$(ls -l .whl/*.whl | awk '{print $5, $NF}' | sha256sum | cut -c1-16)
  if [[ $(cat /tmp/site/.odc_wheels 2>/dev/null) != "$wstamp" ]]; then
    ( rm -rf /tmp/site && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site .whl/*.whl > "$OUT/wheels.log" 2>&1 && echo "$wstamp" > /tmp/site/.odc_wheels ) &
    wheels_pid=$!
  fi
  site=/tmp/site  # on PYTHONPATH once installed (below), not while pip builds the extension
fi
# ODC_BASELINE=<tar of an earlier tree> (e.g. `git archive <commit> csrc setup.py pyproject.toml
# torch_odc CMakeLists.txt`): built beside this one, and the benchmarks run with it too, in the
# same call (results under $OUT/baseline): a kernel change measured side by side with the code
# before it. ODC_BASELINE_FOR=bench,step (default) names the benchmarks run with it.
base=""
if [[ -n ${ODC_BASELINE:-} ]]; then
  base=/tmp/odc_baseline; rm -rf "$base"; mkdir -p "$base" "$OUT/baseline"
  tar -xf "$ODC_BASELINE" -C "$base"
  (cd "$base" && "$PY" setup.py build_ext --inplace > "$OUT/baseline/build.log" 2>&1) &
  base_pid=$!
fi
# The extension, built in place (torch_odc/_C*.so) against this machine's torch (~80 s). A warm
# machine keeps it between calls: build/odc_build.stamp holds a hash of what the build reads
# (csrc/, setup.py, CMakeLists.txt, pyproject.toml, python, torch, CUDA, the build knobs) and of
# the .so it produced; when both still match, the build is skipped. The tree's root goes first
# on PYTHONPATH, so the in-place .so is imported whether or not pip's editable hook is there.
stamp=build/odc_build.stamp
so=$("$PY" -c 'import sysconfig; print("torch_odc/_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
build_key() {
  { "$PY" -c 'import sys, torch; print(sys.version, torch.__version__, torch.version.cuda,
                                       torch.__file__)'
    echo "${ODC_FORCE_CPU:-} ${TORCH_CUDA_ARCH_LIST:-} ${CC:-} ${CXX:-}"
    find csrc setup.py CMakeLists.txt pyproject.toml -type f -print0 | sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-32
}
so_key() { sha256sum "$so" 2>/dev/null | cut -c1-32; }
build() {
  local t0=$SECONDS
  "$PY" -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || {
    tail -40 "$OUT/build.log"; exit 1; }
  mkdir -p build && echo "$(build_key) $(so_key)" > "$stamp"
  echo "extension built in $(( SECONDS - t0 )) s"
}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
built=0
if [[ $dry == 1 ]]; then
  :
elif [[ -f $so && -f $stamp && $(cat "$stamp") == "$(build_key) $(so_key)" ]]; then
  echo "extension unchanged since its build on this machine ($stamp): not rebuilt"
else
  build; built=1
fi
if [[ -n $base ]]; then
  wait "$base_pid" || { tail -20 "$OUT/baseline/build.log"; base=""; }
fi
# with_base CMD...: runs CMD with the baseline tree's torch_odc first on the path.
with_base() { PYTHONPATH="$base${PYTHONPATH:+:$PYTHONPATH}" "$@"; }
cuda_ok() { "$PY" -c 'import torch_odc; assert torch_odc._C._has_cuda_transport(), "no CUDA transport built"'; }
if [[ $dry != 1 ]] && ! cuda_ok; then
  (( built )) && exit 1
  echo "the kept extension does not load with a CUDA transport: rebuilding"; build; cuda_ok || exit 1
fi
if [[ -n $wheels_pid ]] && ! wait "$wheels_pid"; then
  echo "installing .whl/ into /tmp/site failed:"; tail -20 "$OUT/wheels.log"; rc_wheels=1
fi
if [[ -n $site ]]; then
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
fi
rc=0
(( ${rc_wheels:-0} )) && rc=1
if has tests; then
  # The whole GPU suite (TESTS: files or folders, default tests; TESTS_K: the -k expression,
  # default "gpu or cuda"), in two phases:
  #   1. the `serial` tests (they time themselves against a timeout or check /dev/shm: see
  #      tests/conftest.py) one at a time on a quiet machine; ~130 s on 2 H100;
  #   2. the rest on TESTS_WORKERS (default 8) pytest-xdist workers, grouped and ordered by
  #      tests/conftest.py (tests of different workers share the GPUs); ~250 s on 2 H100.
  # Expected ~6.5 min with the extension kept (+~80 s to build it). Each phase is stopped with
  # SIGINT at its limit (TESTS_SERIAL_TIMEOUT 180 s, TESTS_TIMEOUT 330 s, both shortened to end
  # before ODC_DEADLINE), so pytest still writes its report. gpu_tests.log holds both phases;
  # then one summary line (GPU SUITE GREEN / NOT GREEN: counts, wall seconds), the phases, skip
  # reasons (! marks a skip this machine should not need: not green), failures and the slowest
  # tests (also in gpu_tests_summary.txt).
  sel=(${TESTS:-tests}); k="${TESTS_K:-gpu or cuda}"
  common=(-q -p no:cacheprovider -rfEs --durations=15 -k "$k")
  workers="${TESTS_WORKERS:-8}"
  if (( workers > 1 )) && "$PY" -c 'import xdist' 2>/dev/null; then
    spread=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
  else
    echo "pytest-xdist missing (or TESTS_WORKERS=$workers): the tests run one at a time"
    spread=(-p no:xdist); workers=1
  fi
  df -h /dev/shm | tail -1 | sed 's/^/\/dev\/shm: /'
  : > "$OUT/gpu_tests.log"
  t_start=$SECONDS; phases=()
  for phase in serial parallel; do
    if [[ $phase == serial ]]; then
      args=(-m serial -p no:xdist --timeout=240); limit="${TESTS_SERIAL_TIMEOUT:-180}"
    else
      args=(-m "not serial" "${spread[@]}" --timeout=300); limit="${TESTS_TIMEOUT:-330}"
    fi
    echo "=== GPU tests, $phase phase (at $(date +%T))" | tee -a "$OUT/gpu_tests.log"
    t0=$SECONDS; rm -f "$OUT/gpu_tests_$phase.xml"
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" timeout -s INT -k 30 "$(capped "$limit")" \
      "$PY" -m pytest "${sel[@]}" "${common[@]}" "${args[@]}" \
      --junitxml="$OUT/gpu_tests_$phase.xml" > "$OUT/gpu_tests_$phase.log" 2>&1
    prc=$?
    cat "$OUT/gpu_tests_$phase.log" >> "$OUT/gpu_tests.log"
    grep -E "^(FAILED|ERROR) " "$OUT/gpu_tests_$phase.log" | cut -c1-300 | head -20
    tail -1 "$OUT/gpu_tests_$phase.log"
    label=$phase; [[ $phase == parallel ]] && label="parallel on $workers workers"
    phases+=(--phase "$label=$OUT/gpu_tests_$phase.xml:$prc:$(( SECONDS - t0 ))")
    (( prc == 0 || prc == 5 )) || rc=1
  done
  "$PY" benchmarks/device/suite_summary.py --wall $(( SECONDS - t_start )) --gpus "$gpus" "${phases[@]}" \
    | tee "$OUT/gpu_tests_summary.txt" || rc=1
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
  # odc-mini-lazy: shards published at first all-gather, not up front; a suffix
  # @ODC_NAME=VALUE[,...] runs a config with those settings, e.g. odc-mini@ODC_CUDA_CTAS=32).
  # E2E_EXTRA: further WORKLOAD:CONFIG runs after those (e.g. "rl:odc-micro": ODC on the
  # LB-Micro plan, the same microbatches per rank as FSDP2, to compare host gaps on one plan;
  # a pair given again runs again, reported as CONFIG#2, ...),
  # merged into the same table; skipped like the others when the deadline is near.
  # E2E_MB: measured minibatches per run (default 4 at 4 sequences per rank, 1 above);
  # E2E_RL_PACK: the token cap of the rl-packed workload (RL sequences packed into varlen
  # microbatches, reported beside "rl"). With ODC_DEADLINE, a run is skipped when less than
  # E2E_RUN_S seconds (default 60) are left.
  # E2E_MODEL=7b (issue 31): Llama-2-7B's shape on the meta device, shards initialized after
  # fully_shard, SGD (AdamW's states do not fit beside long-context activations on 2 x 80 GB:
  # docs/benchmarks.md, "7B-class on 2 GPUs"); defaults then: workloads "long-context rl",
  # configs "nccl-micro odc-mini", E2E_SPR=4, E2E_MB=1, E2E_RUN_S=100, the allocator's
  # expandable segments (E2E_ALLOC_CONF; empty: torch's default); E2E_OPT=adamw|sgd overrides
  # the optimizer (7B with AdamW: RL only, ~70 GiB). Results e2e_7b_*. On 2 H100:
  # ~45 s calibration, ~85 / 75 s long-context (nccl-micro / odc-mini), ~50 / 50 s rl, each
  # with ~20 s of process start (E2E_MB=2: +20 s per long-context run, +6 s per rl run).
  model="${E2E_MODEL:-1b}"; mtag=""; e2e_run_s="${E2E_RUN_S:-60}"; spr_default="4 16"
  if [[ $model == 7b ]]; then
    export PYTORCH_CUDA_ALLOC_CONF="${E2E_ALLOC_CONF-expandable_segments:True}"
    : "${E2E_WORKLOADS:=long-context rl}" "${E2E_CONFIGS:=nccl-micro odc-mini}" "${E2E_MB:=1}"
    e2e_run_s="${E2E_RUN_S:-100}"; spr_default=4; mtag="_7b"
  fi
  pack="${E2E_PACK:-1}"; ptag=""; (( pack > 1 )) && ptag="_pack${pack}"
  # E2E_MESH="R S" (issue 44): HSDP over a (replicas x shards) mesh, ODC inside each shard
  # group against FSDP2-HSDP over NCCL; the JSON's "replicate" reports the bytes each rank
  # all-reduces across replicas and the all-reduce kernels' time. Results e2e_*_hsdpRxS.
  mesh="${E2E_MESH:-}"; [[ -n $mesh ]] && ptag="${ptag}_hsdp${mesh// /x}"
  cal="${E2E_CAL:-}"
  if [[ -z $cal ]]; then
    cal=$(timeout "$(capped "${E2E_CAL_TIMEOUT:-150}")" torchrun --nproc-per-node="$gpus" benchmarks/bench_e2e.py --calibrate-only \
          --model "$model" --pack-tokens "$pack" 2>&1 | tee "$OUT/calibration${mtag}.log" \
          | grep -o 'CALIBRATION=.*' | cut -d= -f2)
    [[ -n $cal ]] || { echo "cost-model calibration failed"; tail -20 "$OUT/calibration${mtag}.log"; exit 1; }
  fi
  echo "cost model: $cal"
  for spr in ${E2E_SPR:-$spr_default}; do
    mb=4; (( spr > 4 )) && mb=1; mb="${E2E_MB:-$mb}"
    parts=()
    runs=()
    for w in ${E2E_WORKLOADS:-long-context rl rl-packed equal}; do
      for c in ${E2E_CONFIGS:-nccl-micro odc-mini odc-micro}; do runs+=("$w:$c"); done
    done
    declare -A seen=()
    for wc in "${runs[@]}" ${E2E_EXTRA:-}; do
      w=${wc%%:*}; c=${wc#*:}
      tag="p${spr}${mtag}${ptag}_${w}_${c//[@=,]/_}"
      # a repeated WORKLOAD:CONFIG (run-to-run variation) gets its own file: _r2, _r3, ...
      seen[$tag]=$(( ${seen[$tag]:-0} + 1 )); (( seen[$tag] > 1 )) && tag="${tag}_r${seen[$tag]}"
      if (( $(left) < e2e_run_s )); then
        echo "skipped $tag: $(left) s left before the deadline" | tee -a "$OUT/bench_e2e${mtag}_${spr}spr.log"
        rc=1; continue
      fi
      timeout "$(capped 240)" torchrun --nproc-per-node="$gpus" benchmarks/bench_e2e.py --out "$OUT/e2e_parts" \
        --model "$model" ${E2E_OPT:+--optimizer "$E2E_OPT"} --seqs-per-rank "$spr" --minibatches "$mb" --workloads "$w" --configs "$c" \
        --pack-tokens "$pack" --rl-pack-tokens "${E2E_RL_PACK:-16384}" --calibration "$cal" \
        ${mesh:+--mesh $mesh} \
        --tag "$tag" 2>&1 | grep -v -i warn >> "$OUT/bench_e2e${mtag}_${spr}spr.log"
      if [[ -f $OUT/e2e_parts/$tag.json ]]; then parts+=("$OUT/e2e_parts/$tag.json"); else rc=1; fi
    done
    (( ${#parts[@]} )) && "$PY" benchmarks/bench_e2e.py --merge "${parts[@]}" --out "$OUT" \
      --tag "e2e_${model}_${gpus}gpu_${spr}spr${ptag}" 2>&1 | grep -v -i warn | tee -a "$OUT/bench_e2e${mtag}_${spr}spr.log"
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
  # SANITIZE_TOOLS (default "memcheck racecheck") and SANITIZE_FLOWS (default "primitive fsdp")
  # pick a subset, e.g. SANITIZE_TOOLS=racecheck SANITIZE_FLOWS=fsdp for the longest one alone.
  flows="${SANITIZE_FLOWS:-primitive fsdp}"
  sanitize() {  # tool, visible devices, torchrun port
    local left; left=$(capped $(( ${SANITIZE_DEADLINE:-570} - SECONDS )))
    if [[ " $flows " == *" primitive "* ]]; then
      local share=$left; [[ " $flows " == *" fsdp "* ]] && share=$(( left * 2 / 5 ))
      CUDA_VISIBLE_DEVICES=$2 timeout "$share" compute-sanitizer --tool "$1" \
        --target-processes all --error-exitcode 9 torchrun --master-port "$3" --nproc-per-node=2 \
        tests/sanitizer_flow.py > "$OUT/sanitizer_$1.log" 2>&1 || echo "$1 primitive flow: rc=$?"
    fi
    left=$(capped $(( ${SANITIZE_DEADLINE:-570} - SECONDS )))
    if [[ " $flows " == *" fsdp "* ]]; then
      CUDA_VISIBLE_DEVICES=$2 timeout "$left" compute-sanitizer --tool "$1" \
        --target-processes all --error-exitcode 9 "$PY" tests/sanitizer_fsdp_flow.py \
        > "$OUT/sanitizer_fsdp_$1.log" 2>&1 || echo "$1 FSDP flow: rc=$?"
    fi
  }
  tools=(${SANITIZE_TOOLS:-memcheck racecheck}); rm -f /tmp/sanitize_*.rc
  if (( gpus >= 4 && ${#tools[@]} == 2 )); then
    sanitize "${tools[0]}" 0,1 29511 > "/tmp/sanitize_${tools[0]}.rc" &
    sanitize "${tools[1]}" 2,3 29512 > "/tmp/sanitize_${tools[1]}.rc" &
    wait
  else
    port=29511
    for tool in "${tools[@]}"; do
      sanitize "$tool" 0,1 "$port" > "/tmp/sanitize_$tool.rc"; port=$(( port + 1 ))
    done
  fi
  echo "sanitize finished after ${SECONDS}s"
  for f in /tmp/sanitize_*.rc; do [[ -s $f ]] && { cat "$f"; rc=1; }; done
  grep -E "SUMMARY|ok|max|done" "$OUT"/sanitizer_*.log
fi
exit $rc
