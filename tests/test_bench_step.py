"""The training-step benchmark (benchmarks/bench_step.py): its GPU-time attribution on a
synthetic profile, and the whole run under torchrun with a tiny model (CPU: shared memory,
FSDP2 over gloo beside it; CUDA: 2 ranks sharing one GPU, or one per GPU)."""

import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_step import CATEGORIES, gpu_breakdown, host_odc_time, innermost, make_result, plot, table

import torch_odc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU, GPU = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
TINY = [
    "--layers",
    "2",
    "--dim",
    "64",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--ffn",
    "176",
    "--vocab",
    "512",
    "--seq",
    "64",
    "--microbatches",
    "2",
    "--warmup",
    "0",
    "--minibatches",
    "2",
    "--copy-iters",
    "2",
]


def ev(name, start, end, device=CPU, id=0, thread=1, annotation=False):
    return SimpleNamespace(
        name=name,
        id=id,
        thread=thread,
        device_type=device,
        is_user_annotation=annotation,
        time_range=SimpleNamespace(start=start, end=end),
    )


def test_innermost_range_of_nested_ranges():
    times, names = innermost(
        [(0, 100, "a"), (10, 20, "b"), (12, 15, "c"), (20, 30, "d"), (200, 210, "e")]
    )

    def at(t):
        import bisect

        i = bisect.bisect_right(times, t) - 1
        return names[i] if i >= 0 else None

    assert [at(t) for t in (-1, 5, 11, 13, 16, 20, 25, 50, 150, 205, 300)] == [
        None,
        "a",
        "b",
        "c",
        "b",
        "d",
        "d",
        "a",
        None,
        "e",
        None,
    ]


def test_gpu_time_by_category_follows_kernel_names_then_launch_ranges():
    """Kernels are attributed by name (ODC's own), else by the innermost FSDP2 / ODC /
    optimizer range that their launch (same correlation id) was issued in, on its thread."""
    events = [
        # host ranges on thread 1 (forward) and thread 2 (autograd's backward thread)
        ev("FSDP::all_gather (layers.0)", 0, 100),
        ev("odc::gather layers.0", 50, 90),
        ev("FSDP::all_gather_copy_out (layers.0)", 100, 120),
        ev("odc::publish_all", 130, 160),
        ev("odc::publish layers.1", 135, 150),
        ev("FSDP::post_backward_reduce (layers.0)", 0, 100, thread=2),
        ev("odc::push layers.0", 40, 60, thread=2),
        ev("Optimizer.step#AdamW.step", 300, 400),
        # launches (CUDA runtime calls) with their correlation ids
        ev("cudaLaunchKernel", 10, 11, id=1),  # copy-in, in FSDP::all_gather only
        ev("cudaLaunchKernel", 60, 61, id=2),  # the wait, in odc::gather
        ev("cudaLaunchKernel", 62, 63, id=3),  # the gather copy
        ev("cudaLaunchKernel", 105, 106, id=4),  # copy-out
        ev("cudaMemcpyAsync", 140, 141, id=5),  # publish's copy into the cache
        ev("cudaLaunchKernel", 142, 143, id=6),  # publish flag
        ev("cudaLaunchKernel", 5, 6, id=7, thread=2),  # reduce copy-in (chunk_cat)
        ev("cudaLaunchKernel", 45, 46, id=8, thread=2),  # the push
        ev("cudaLaunchKernel", 50, 51, id=9, thread=2),  # output.zero_() inside odc::push
        ev("cudaLaunchKernel", 310, 311, id=10),  # AdamW
        ev("cudaLaunchKernel", 500, 501, id=11),  # a GEMM, in no range
        ev("cudaLaunchKernel", 55, 56, id=12, thread=3),  # other thread: its range does not count
        # device activities (us)
        ev("void at::native::CatArrayBatchedCopy<...>", 1000, 1010, GPU, id=1),
        ev("odcWaitAllKernel(torch_odc::cuda_ipc::GatherArgs, ...)", 1010, 1060, GPU, id=2),
        ev("void torch_odc::cuda_ipc::odcGatherKernel(...)", 1060, 1080, GPU, id=3),
        ev("void at::native::split_with_sizes_copy_out", 1080, 1083, GPU, id=4),
        ev("Memcpy DtoD (Device -> Device)", 1100, 1104, GPU, id=5),
        ev("publishKernel(unsigned long*, unsigned long)", 1104, 1105, GPU, id=6),
        ev("chunk_cat_cuda_kernel", 1200, 1207, GPU, id=7),
        ev("void torch_odc::cuda_ipc::odcPushKernel<float>(...)", 1207, 1237, GPU, id=8),
        ev("Memset (Device)", 1237, 1238, GPU, id=9),
        ev("multi_tensor_apply_kernel", 1300, 1340, GPU, id=10),
        ev("sm90_xmma_gemm_bf16", 1400, 1700, GPU, id=11),
        ev("sm90_xmma_gemm_bf16", 1700, 1800, GPU, id=12),
        ev("ncclDevKernel_AllGather_RING_LL", 1800, 1810, GPU, id=99),  # no launch recorded
        # not device work: GPU-side user annotations and synchronizations
        ev("odc::gather layers.0", 1010, 1080, GPU, annotation=True),
        ev("FSDP::all_gather (layers.0)", 1000, 1080, GPU),
        ev("Stream Sync", 1000, 1900, GPU),
    ]
    b = gpu_breakdown(events)
    want = {
        "fsdp2_copy_in": 10,
        "odc_wait": 50,
        "odc_gather": 20,
        "fsdp2_copy_out": 3,
        "odc_other": 4 + 1,
        "odc_publish": 1,
        "fsdp2_reduce": 7,
        "odc_push": 30,
        "optimizer": 40,
        "compute": 400,
        "nccl": 10,
    }
    assert set(b["by_category_us"]) == set(CATEGORIES)
    assert {k: v for k, v in b["by_category_us"].items() if v} == want
    assert b["total_us"] == sum(want.values()) == 576
    assert b["activities"] == 13 and b["unmatched_launches"] == 1
    assert b["odc_kernels_us"] == 101
    assert abs(b["odc_share"] - 101 / 576) < 1e-12
    assert abs(b["odc_with_other_share"] - 106 / 576) < 1e-12
    assert b["odc_other_by_range_us"] == {"odc::publish": 4, "odc::push": 1}

    h = host_odc_time(events)
    assert h["by_kind"]["odc::gather"] == {"us": 40, "calls": 1}
    assert h["by_kind"]["odc::publish_all"] == {"us": 30, "calls": 1}
    assert h["by_kind"]["odc::publish"] == {"us": 15, "calls": 1}
    assert h["total_us"] == 40 + 30 + 20  # nested publish counted once; device copies not
    assert h["waits_us"] == 0 and h["outside_waits_us"] == h["total_us"]


def test_host_time_outside_the_barriers_waits():
    """The barrier's waits (for the own GPU, for the peers) are host time ODC only waits:
    ODC's own host work is the union of its ranges less theirs."""
    events = [
        ev("odc::minibatch_barrier", 0, 100),
        ev("odc::publish_shards", 2, 7),
        ev("odc::barrier_arrive", 10, 90),
        ev("odc::wait_device", 11, 30),
        ev("odc::wait_peers", 31, 85),
        ev("odc::gather layers.0", 200, 210),
        ev("odc::push layers.0", 300, 320, thread=2),
        ev("odc::reduce_scatter_call", 295, 322, thread=2),
    ]
    h = host_odc_time(events)
    assert h["total_us"] == 100 + 10 + 27
    assert h["waits_us"] == 19 + 54
    assert h["outside_waits_us"] == 100 + 10 + 27 - 73
    assert h["by_kind"]["odc::wait_peers"] == {"us": 54, "calls": 1}


def test_breakdowns_read_real_profiler_events():
    """The same functions on torch.profiler's own events (CPU here: no device work)."""
    x = torch.ones(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with (
            torch.profiler.record_function("odc::push layers.0"),
            torch.profiler.record_function("odc::gather layers.0"),
        ):
            x = x @ x
        x = x + 1
    events = prof.events()
    b = gpu_breakdown(events)
    assert b["total_us"] == 0 and b["activities"] == 0 and b["odc_share"] is None
    h = host_odc_time(events)
    assert h["by_kind"]["odc::push"]["calls"] == h["by_kind"]["odc::gather"]["calls"] == 1
    assert 0 < h["by_kind"]["odc::gather"]["us"] <= h["by_kind"]["odc::push"]["us"]
    assert h["total_us"] == h["by_kind"]["odc::push"]["us"]


def test_report_of_gpu_profiles(tmp_path):
    """Summary, table and plot from GPU profiles (synthetic: the CUDA-only branches, checked
    here on any machine): ODC's share, the slowest rank per minibatch, NCCL's share."""

    def rank(walls, gather_us, compute_us):
        def prof(odc):
            comm = [
                ev("cudaLaunchKernel", 1, 2, id=1),
                ev(
                    "odcGatherKernel" if odc else "ncclDevKernel_AllGather",
                    10,
                    10 + gather_us,
                    GPU,
                    id=1,
                ),
            ]
            return comm + [
                ev("odc::gather l0" if odc else "FSDP::all_gather (l0)", 0, 3000),
                ev("gemm", 100, 100 + compute_us, GPU, id=2),
            ]

        rows = [
            {"wall_s": w, "micro_s": w * 0.8, "barrier_s": w * 0.1, "step_s": w * 0.1}
            for w in walls
        ]
        moved = {
            "bytes_fetched": 3 * 2**20,
            "keyed_gathers": 4,
            "bytes_pushed": 2**20,
            "keyed_reduce_scatters": 2,
        }
        ref = {
            w: {
                "bytes": moved[b],
                "calls": moved[c],
                "piece_bytes": 1,
                "one_copy_s": 1e-3,
                "per_call_s": 2e-3,
            }
            for w, b, c in (
                ("gathered", "bytes_fetched", "keyed_gathers"),
                ("pushed", "bytes_pushed", "keyed_reduce_scatters"),
            )
        }
        return {
            cfg: {
                "rows": rows,
                "n_params": 7,
                "moved": moved,
                "allocator_peak_bytes": 1,
                "profiled": {
                    "row": rows[0],
                    "gpu": gpu_breakdown(prof(cfg == "odc")),
                    "host_odc": host_odc_time(prof(cfg == "odc")),
                },
            }
            for cfg in ("odc", "nccl")
        } | {"reference": ref}

    per_rank = [rank([0.3, 0.5, 0.4], 100, 900), rank([0.35, 0.2, 0.45], 300, 700)]
    r = make_result(per_rank, ["odc", "nccl"], "synthetic", "cuda", False, {})
    odc, nccl = r["configs"]["odc"], r["configs"]["nccl"]
    assert odc["minibatch_s"] == [0.35, 0.5, 0.45] and odc["minibatch_s_median"] == 0.45
    assert odc["gpu_ms_per_rank"][1]["odc_gather"] == 0.3 and odc["gpu_ms_mean"]["total"] == 1.0
    assert odc["odc_share_per_rank"] == [0.1, 0.3] and odc["odc_share_max"] == 0.3
    assert nccl["nccl_share_max"] == 0.3 and nccl["odc_share_max"] == 0.0
    assert odc["host_odc_ms_per_rank"] == [3.0, 3.0] and nccl["host_odc_ms_per_rank"] == [0, 0]
    text = table(r)
    assert "30.0%" in text and "odc_gather kernels 0.10 ms vs plain copy 1.00 ms" in text, text
    assert "comm. kernels share" in text, text
    plot(r, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000


def torchrun(args, out, limit_s=300):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        os.path.join(ROOT, "benchmarks", "bench_step.py"),
        "--out",
        str(out),
        *args,
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(torch_odc.__file__)))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"bench_step timed out:\n{log[-6000:]}")
    assert proc.returncode == 0, f"bench_step exited {proc.returncode}:\n{log[-6000:]}"
    return log


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bench_step_runs_and_reports(device, tmp_path):
    """The whole benchmark at tiny sizes: every number is there and consistent with the model
    (bytes pushed per minibatch = microbatches x the fp32 shard of every parameter x the
    peers), the reference moved the bytes ODC reported, table and plot written."""
    if device == "cuda" and not (torch.cuda.is_available() and torch_odc._C._has_cuda_transport()):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    args = TINY + ["--device", device] + (["--baseline", "on"] if device == "cpu" else [])
    log = torchrun(args, tmp_path)
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    tag = f"{min(gpus, 2)}gpu_2ranks" if device == "cuda" else "2cpu"
    with open(tmp_path / f"step_{tag}.json") as f:
        r = json.load(f)
    assert (tmp_path / f"step_{tag}.png").stat().st_size > 10_000
    assert "minibatch s (median" in log and "host ms in ODC calls" in log, log[-3000:]
    env = r["environment"]
    assert env["torch"] == torch.__version__ and "bench_step.py" in env["command"]
    assert len(env["git_commit"]) == 40 or env["git_commit"] == "unavailable"
    baseline = {"cpu": "gloo", "cuda": "nccl"}[device]
    assert next(iter(r["configs"])) == "odc"
    assert (baseline in r["configs"]) == (device == "cpu" or gpus >= 2)
    odc = r["configs"]["odc"]
    n = odc["n_params"]
    # per layer: wq, wkv (2 x 2 kv heads x 16 wide), wo: 64 x 64 each; w13 + w2; 2 norms.
    # Then embedding, norm, head.
    assert n == 2 * (3 * 64 * 64 + 3 * 64 * 176 + 2 * 64) + 64 + 2 * 512 * 64
    for moved, ref, host in zip(
        r["moved_per_rank"],
        r["reference_per_rank"],
        odc["host_odc_by_kind_ms_per_rank"],
        strict=True,
    ):
        # 2 microbatches, fp32 shard (n / 2 elements, dims are even: no padding), 1 peer
        assert moved["bytes_pushed"] == 2 * (n // 2) * 4, moved
        assert moved["keyed_reduce_scatters"] == 2 * 3, moved  # 2 layers + root per microbatch
        # the peer's shard of every unit (n / 2 elements; its cache holds the fp32 parameters,
        # 4 bytes, rounded to bf16 as they are read), once per microbatch in the forward and at
        # most once more in the backward: 4 n .. 8 n bytes
        assert 4 * n <= moved["bytes_fetched"] <= 8 * n, moved
        assert ref["gathered"]["bytes"] == moved["bytes_fetched"]
        assert ref["pushed"]["bytes"] == moved["bytes_pushed"]
        assert ref["gathered"]["calls"] == moved["keyed_gathers"] >= 6
        for what in ("gathered", "pushed"):
            assert 0 < ref[what]["one_copy_s"] < 5 and 0 < ref[what]["per_call_s"] < 5, ref
        for kind in ("odc::gather", "odc::push", "odc::minibatch_barrier"):
            assert host[kind]["calls"] >= 1 and host[kind]["ms"] > 0, host
        assert host["odc::push"]["calls"] == moved["keyed_reduce_scatters"], host
    # ODC's own host time measured without the profiler (torch_odc.stats()["host_s"] less the
    # barrier's waits): positive and below the minibatch.
    own = odc["host_odc_unprofiled_ms_per_rank"]
    assert all(0 < ms < 1e3 * odc["minibatch_s_median"] for ms in own), odc
    assert all(w >= 0 for w in odc["host_odc_unprofiled_waits_ms_per_rank"]), odc
    assert 0 < odc["host_odc_unprofiled_share_max"] < 1
    # ... by entry point (medians per kind), and the C++ part of each keyed call kind inside its
    # entry point's clock, which wraps it in every minibatch (so in the medians too)
    for kinds in odc["host_odc_unprofiled_by_kind_ms_per_rank"]:
        assert kinds["gather"] > 0 and kinds["push"] > 0 and kinds["barrier"] >= 0, kinds
    for cpp, kinds in zip(
        odc["host_odc_cpp_ms_per_rank"], odc["host_odc_unprofiled_by_kind_ms_per_rank"]
    ):
        for kind, outer in (("gather", "gather"), ("push", "push")):
            assert 0 < cpp[kind] <= kinds[outer] * 1.001, (cpp, kinds)
    for cfg, s in r["configs"].items():
        assert len(s["minibatch_s"]) == 2 and 0 < s["minibatch_s_median"] < 60, (cfg, s)
        assert 0 < s["micro_s_median"] < s["minibatch_s_median"] * 1.01, (cfg, s)
    assert all(
        0 < h <= odc["profiled_minibatch_wall_s"] * 1e3 for h in odc["host_odc_ms_per_rank"]
    ), odc
    if device == "cpu":
        assert "gpu_ms_mean" not in odc
        return
    for rank, g in enumerate(odc["gpu_ms_per_rank"]):
        for cat in (
            "odc_gather",
            "odc_wait",
            "odc_push",
            "odc_publish",
            "compute",
            "fsdp2_copy_in",
            "optimizer",
        ):
            assert g[cat] > 0, (rank, cat, g)
        assert g["nccl"] == 0, g
        assert abs(sum(g[c] for c in CATEGORIES) - g["total"]) < 1e-6 * g["total"]
    assert 0 < odc["odc_share_max"] < 1
    # Device work is matched to its launch (else it is attributed by name only): most of it
    # (launches through an API the profiler does not record may stay unmatched).
    for unmatched, count in zip(odc["unmatched_launches_per_rank"], odc["activities_per_rank"]):
        assert unmatched <= 0.5 * count, odc
    if baseline in r["configs"]:
        nccl = r["configs"][baseline]
        assert all(g["nccl"] > 0 and g["odc_gather"] == 0 for g in nccl["gpu_ms_per_rank"])
