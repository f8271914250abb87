"""The end-to-end benchmark's model: a packed microbatch (documents back to back, positions
restarting per document, document-causal attention) has exactly the loss of its documents run
one by one. On CUDA this checks the varlen flash-attention path against per-sequence SDPA."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_e2e import MODELS, Llama, config_base, config_env


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_packed_microbatch_equals_its_documents(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Llama(*MODELS["tiny"]).to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    seqs = [
        torch.randint(0, MODELS["tiny"][5], (n,), generator=gen).to(device) for n in (17, 5, 33, 2)
    ]
    packed = model(seqs)
    one_by_one = sum(model([s]) for s in seqs)
    # Different documents must not attend to each other: a packed run of a reversed order
    # gives the same total too.
    reordered = model(seqs[::-1])
    tol = 1e-4 if device == "cpu" else 2e-2
    assert torch.allclose(packed, one_by_one, rtol=tol, atol=tol), (packed, one_by_one)
    assert torch.allclose(reordered, one_by_one, rtol=tol, atol=tol), (reordered, one_by_one)
    packed.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_cost_fit_recovers_rates_and_floor():
    """The planner's cost model: seconds = floor + dense flops / dense rate + attention flops /
    attention rate, fitted from timed sequences of new lengths."""
    from bench_e2e import CostModel, calibration_lengths, fit_cost, time_cost

    n_params, layers, dim = 1.06e9, 18, 2048
    want = CostModel(4.0e14, 2.5e14, 0.15)
    truth = time_cost(want, n_params, layers, dim)
    lengths = calibration_lengths()
    assert len(set(lengths)) == len(lengths)  # every timed length is new to the process
    rng = torch.Generator().manual_seed(0)
    noise = 1 + 0.01 * (torch.rand(len(lengths), generator=rng) - 0.5)
    samples = [(n, truth(n) * float(e)) for n, e in zip(lengths, noise)]
    got = fit_cost(samples, n_params, layers, dim)
    assert abs(got.dense_rate / want.dense_rate - 1) < 0.05, got
    assert abs(got.attn_rate / want.attn_rate - 1) < 0.05, got
    assert abs(got.floor - want.floor) < 0.01, got
    assert all(abs(a / b - 1) < 1e-9 for a, b in zip(CostModel.parse(str(got)), got))
    assert CostModel.parse("3e14,0.1") == CostModel(3e14, 3e14, 0.1)
    # Packed, a document pays its token share of its microbatch's floor.
    packed = time_cost(want, n_params, layers, dim, pack_tokens=16384)
    assert abs((packed(8192) - truth(8192)) + 0.075) < 1e-9


def test_uncovered_time():
    """Time blocked in communication: communication spans not covered by compute spans."""
    from bench_e2e import uncovered

    assert uncovered([[0, 10]], [[2, 3], [5, 7]]) == 7
    assert uncovered([[0, 10], [20, 30]], [[-5, 1], [9, 21], [25, 26]]) == 16
    assert uncovered([[0, 10]], []) == 10
    assert uncovered([[3, 4]], [[0, 10]]) == 0


def test_kernel_breakdown_splits_busy_blocked_and_host_gap():
    """A profiled rank: compute, communication alone, an empty gap, then the barrier's kernels
    after the end marker (not the rank's work)."""
    from types import SimpleNamespace

    from bench_e2e import kernel_breakdown

    def k(name, s, e):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=s, end=e))

    kernels = [
        k("ncclDevKernel_Barrier", -500, -100),  # before the start marker: not counted
        k("spin_kernel", 0, 10),
        k("odcGatherKernel", 10, 110),  # comm alone: blocked 100
        k("ampere_bf16_gemm", 110, 1110),  # compute 1000
        k("odcPushKernel", 1000, 1300),  # overlaps compute by 110: alone 190
        k("flash_fwd_kernel", 1500, 2000),  # compute 500; 1300..1500 is a host gap of 200
        k("spin_kernel", 2000, 2005),
        k("elementwise_kernel", 2100, 2300),  # the barrier's finalize: after the window
    ]
    b = kernel_breakdown(kernels)
    assert abs(b["busy_s"] - 1500e-6) < 1e-12
    assert abs(b["comm_only_s"] - 290e-6) < 1e-12
    assert abs(b["work_span_s"] - 2000e-6) < 1e-12
    assert abs(b["host_gap_s"] - 210e-6) < 1e-12  # 200 idle + the start marker's 10


def test_kernel_breakdown_with_launch_times_tells_communication_waits_from_host_waits():
    """Communication running with no compute is blocked only from the moment the next compute
    kernel was issued (before that the GPU waited for the host); with no launch time, all of
    it is blocked (the communication-only rule)."""
    from types import SimpleNamespace

    from bench_e2e import kernel_breakdown

    def k(name, s, e, i):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=s, end=e), id=i)

    kernels = [
        k("spin_kernel", 0, 10, 1),
        k("gemm", 10, 110, 2),
        k("odcPushKernel", 110, 300, 3),  # alone from 110 to 300
        k("gemm", 300, 400, 4),  # issued at 250: 110..250 host, 250..300 blocked
        k("odcGatherKernel", 400, 500, 5),
        k("gemm", 600, 700, 6),  # issued at 100: 400..500 blocked, 500..600 host
        k("ncclKernel", 700, 750, 7),
        k("flash_fwd", 800, 900, 8),  # no launch time: 700..750 blocked, 750..800 host
        k("spin_kernel", 1000, 1001, 9),  # 900..1000 after the last compute: host gap
    ]
    launched = {2: 5.0, 4: 250.0, 6: 100.0}
    b = kernel_breakdown(kernels, launched)
    assert abs(b["busy_s"] - 400e-6) < 1e-12 and abs(b["work_span_s"] - 1000e-6) < 1e-12
    assert abs(b["blocked_in_work_s"] - 200e-6) < 1e-12, b  # 50 + 100 + 50
    assert abs(b["host_gap_s"] - 400e-6) < 1e-12, b  # 10 + 140 + 100 + 50 + 100
    assert abs(b["comm_only_s"] - 340e-6) < 1e-12, b  # 190 + 100 + 50
    assert b["gaps_with_launch_time"] == 3 and b["gaps"] == 5, b
    b = kernel_breakdown(kernels)  # no launch times: the communication-only rule
    assert abs(b["blocked_in_work_s"] - 340e-6) < 1e-12, b


def test_kernel_breakdown_without_markers_uses_the_compute_window():
    from types import SimpleNamespace

    from bench_e2e import kernel_breakdown

    def k(name, s, e):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=s, end=e))

    b = kernel_breakdown([k("gemm", 100, 200), k("ncclKernel", 200, 250), k("gemm", 300, 400)])
    assert abs(b["work_span_s"] - 300e-6) < 1e-12 and abs(b["busy_s"] - 200e-6) < 1e-12
    assert abs(b["comm_only_s"] - 50e-6) < 1e-12 and abs(b["host_gap_s"] - 50e-6) < 1e-12
    assert kernel_breakdown([]) == {}


def _train_meta_built(rank, world):
    """One microbatch of rank-specific tokens through the benchmark's meta-device build (each
    rank initializes its own shards after fully_shard), under FSDP2 over gloo and under ODC."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from bench_e2e import build

    import torch_odc

    build.nccl_group = dist.new_group(backend="gloo")
    args = SimpleNamespace(model="tiny", mesh=None, meta_init=True)
    tokens = torch.randint(
        0, MODELS["tiny"][5], (41,), generator=torch.Generator().manual_seed(7 + rank)
    )
    out = {"tokens": tokens}
    for kind in ("nccl", "odc"):
        model, handle, _ = build(args, torch.device("cpu"), kind)
        weights = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        loss = model([tokens])
        loss.backward()
        if handle is not None:
            torch_odc.minibatch_barrier()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        if handle is not None:
            handle.detach()
        out[kind] = (loss.item(), weights, grads)
    return out


def test_meta_device_build_trains_the_initialized_shards():
    """--meta-init (always for --model 7b): the weights FSDP2 and ODC gather are the ones
    init_shards wrote (a plain model loaded with them gives the same loss), initialized as the
    modules' defaults, and both configurations start from the same values and train alike."""
    sys.path.insert(0, os.path.dirname(__file__))
    from multiproc import run_ranks

    results = run_ranks(2, _train_meta_built, timeout=240)
    weights = results[0]["nccl"][1]
    assert torch.equal(weights["norm.weight"], torch.ones_like(weights["norm.weight"]))
    assert 0.9 < weights["embed.weight"].std().item() < 1.1
    bound = MODELS["tiny"][0] ** -0.5
    wq = weights["layers.0.wq.weight"]
    assert wq.abs().max().item() <= bound and wq.std().item() > 0.5 * bound / 3**0.5
    ref = Llama(*MODELS["tiny"])
    ref.load_state_dict(weights)
    ref = ref.to(torch.bfloat16)
    for r in results:
        for name, t in r["odc"][1].items():
            assert torch.equal(t, weights[name]), name
        expect = ref([r["tokens"]]).item()
        assert r["nccl"][0] == expect and r["odc"][0] == expect, (r["nccl"][0], r["odc"][0], expect)
        for name, g in r["nccl"][2].items():
            assert torch.isfinite(g).all() and g.abs().sum() > 0, name
            assert torch.allclose(r["odc"][2][name], g, rtol=1e-5, atol=1e-6), name


def test_7b_shape_and_memory_arithmetic():
    """--model 7b is Llama-2-7B's shape; the arithmetic docs/benchmarks.md quotes: ODC needs its
    published cache (2 B per sharded parameter) beside FSDP2 holding its .grad, fits 78 GiB with
    SGD at long-context's longest sequence (63165 tokens), and not with AdamW."""
    from bench_e2e import memory_estimate

    sgd = memory_estimate("7b", 2, "sgd", 63165)
    assert sgd["params"] == 6_738_415_616 and sgd["sharded_params"] == 3_369_207_808
    cache = 2 * sgd["sharded_params"] / 2**30
    assert abs(sgd["odc_total"] - sgd["fsdp2_total_grad_held"] - cache) < 1e-9
    assert sgd["odc_total"] < 70
    assert memory_estimate("7b", 2, "adamw", 63165)["odc_total"] > 78


def test_memory_vs_reference_per_sharded_parameter():
    from bench_e2e import memory_vs_reference

    n, gib = 1_000_000, 2**30
    ref = [
        {
            "peak_bytes": 10 * gib,
            "held_after_microbatches_bytes": 3 * gib + 4 * n,
            "sharded_numel": n,
        }
    ] * 2
    odc = [
        {
            "peak_bytes": 10 * gib,
            "held_after_microbatches_bytes": 3 * gib,
            "sharded_numel": n,
            "region_bytes": 6 * n + 100,
        }
    ] * 2
    got = memory_vs_reference(
        {
            "configs": {
                "nccl-micro": {"allocator_per_rank": ref},
                "odc-mini": {"allocator_per_rank": odc},
            }
        }
    )["odc-mini"]
    assert got["peak_b_per_param"] == (6 * n + 100) / n
    assert got["held_b_per_param"] == (2 * n + 100) / n
    assert got["region_minus_fp32_grad_b_per_param"] == (2 * n + 100) / n


def test_config_labels_with_settings():
    assert config_base("odc-mini@ODC_CUDA_CTAS=32#2") == "odc-mini"
    assert config_base("nccl-micro") == "nccl-micro"
    assert config_env("odc-mini@ODC_CUDA_CTAS=32,ODC_CUDA_FUSED=0#2") == {
        "ODC_CUDA_CTAS": "32",
        "ODC_CUDA_FUSED": "0",
    }
    assert config_env("odc-mini") == {}
    for bad in ("odc-mini@CTAS=32", "odc-mini@ODC_CUDA_CTAS"):
        with pytest.raises(SystemExit, match="ODC_NAME=VALUE"):
            config_env(bad)
