"""On-demand mode on CPU ranks (shared-memory transport): FSDP2 + torch_odc.attach trains
exactly like a single process on the union of all ranks' samples, with per-rank microbatch
counts that differ (zero included); ranks do not wait for each other between barriers; misuse
gives clear errors, never a hang or a silently wrong gradient."""

import os

import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from odc_training import (
    join_shards,
    make_model,
    profiled_minibatch,
    reference,
    sharded_model,
    slow_peer_first_microbatch,
    train_odc,
)

LR = 0.1
BF16, FP32 = torch.bfloat16, torch.float32
PLANS = {
    2: [[2, 1], [0, 3], [1, 1]],
    4: [[1, 2, 0, 3], [3, 0, 1, 1], [0, 0, 2, 1]],
}


def _odc_shm_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("odc-")}


@pytest.mark.parametrize(
    "world,mp,reshard_after_forward,root_without_params,atol",
    [
        (2, None, True, False, 1e-5),
        (4, None, False, True, 1e-5),
        (4, None, True, False, 1e-5),
        (2, (BF16, FP32), True, True, 1e-3),
        (4, (BF16, BF16), False, False, 1e-3),
    ],
    ids=[
        "w2-fp32",
        "w4-fp32-noreshard-emptyroot",
        "w4-fp32",
        "w2-bf16p-fp32r-emptyroot",
        "w4-bf16p-bf16r-noreshard",
    ],
)
def test_odc_training_matches_single_process_reference(
    world, mp, reshard_after_forward, root_without_params, atol
):
    plan = PLANS[world]
    shm_before = _odc_shm_names()
    results = run_ranks(world, train_odc, plan, root_without_params, mp, reshard_after_forward, LR)
    assert _odc_shm_names() <= shm_before, "shared-memory regions left in /dev/shm"
    want = reference(plan, root_without_params, LR)
    init = make_model(root_without_params).state_dict()
    for rank, (params, stats, _) in enumerate(results):
        moved, err2, upd2 = 0.0, 0.0, 0.0
        for name, ref in want.items():
            torch.testing.assert_close(
                params[name],
                ref,
                rtol=0,
                atol=atol,
                msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
            )
            moved = max(moved, (ref - init[name]).abs().max().item())
            err2 += ((params[name] - ref) ** 2).sum().item()
            upd2 += ((ref - init[name]) ** 2).sum().item()
        assert moved > 10 * atol, "training barely moved the parameters: the check is too weak"
        # The error relative to the whole update (bf16 measured at ~0.6%, fp32 at ~1e-7).
        assert (err2 / upd2) ** 0.5 < (1e-4 if mp is None else 0.03)
        total = stats["total"]
        assert total["minibatches"] == len(plan)
        assert total["keyed_reduce_scatters"] > 0 or all(p[rank] == 0 for p in plan)
        assert total["bytes_fetched"] > 0
        # The region holds at least this rank's shard of every parameter twice (the published
        # cache in the gather dtype and the accumulator in the reduce dtype, >= 2 bytes each).
        n_shard = sum(v.numel() for v in want.values()) / world
        assert stats["region_bytes"] >= 4 * n_shard * 0.9, stats["region_bytes"]


def test_parameters_replaced_between_minibatches_train_exactly_through_the_cpp_push():
    """load_state_dict(assign=True) after a step replaces every parameter object (FSDP2 resets
    its sharded parameters): the next minibatch drops the C++ common push's stale parameters
    and turns it on again with the new ones, and training equals the reference. Every key with
    a trainable parameter ends on the C++ push (its .grad swap and gradient notes in C++)."""
    plan = PLANS[2]
    # (sleep_in, device, attach, local_shards, reassign_after)
    results = run_ranks(2, train_odc, plan, False, None, True, LR, None, "cpu", True, False, 1)
    want = reference(plan, False, LR)
    for rank, (params, stats, _) in enumerate(results):
        for name, ref in want.items():
            torch.testing.assert_close(
                params[name],
                ref,
                rtol=0,
                atol=1e-5,
                msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
            )
        assert stats["fast_push"] and all(stats["fast_push"]), stats["fast_push"]
        assert stats["fast_params_current"]


def _second_run_after_destroying_the_group(rank, world, plan, init_file):
    """A model attached and trained for one minibatch but never detached; then the process
    group is destroyed and a new one made (a second run in the same process, a restart in
    place), and a new model trains over it. Returns the second run's training, the registry's
    size before the second attach, whether the first model was freed, and what using the first
    model raises."""
    import gc
    import weakref

    from odc_training import loss_of, samples

    import torch_odc

    first = sharded_model(world)
    torch_odc.attach(first)
    opt = torch.optim.SGD(first.parameters(), lr=LR)
    loss_of(first, samples(0, world)[rank]).backward()
    torch_odc.minibatch_barrier()
    opt.step()
    dist.destroy_process_group()
    dist.init_process_group("odc", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        first(samples(1, 1)[0][:, :-1])
        used = None
    except Exception as err:  # noqa: BLE001 -- the test reports whatever was raised
        used = f"{type(err).__name__}: {err}"
    registry = len(torch_odc.stats())  # drops the model of the destroyed group
    alive = weakref.ref(first)
    del first, opt
    gc.collect()
    second = train_odc(rank, world, plan, False, None, True, LR)
    return second, registry, alive() is not None, used


def test_a_model_of_a_destroyed_process_group_is_dropped_and_a_new_run_trains_exactly(tmp_path):
    """destroy_process_group() ends what was attached through it: the barrier and the other
    registry calls no longer reach that model (nor keep it alive), using it raises, and a new
    model over a new process group in the same process trains as FSDP2 would."""
    plan = PLANS[2]
    results = run_ranks(2, _second_run_after_destroying_the_group, plan, str(tmp_path / "init"))
    want = reference(plan, False, LR)
    for rank, ((params, stats, _), registry, alive, used) in enumerate(results):
        assert registry == 0, f"rank {rank}: {registry} models still attached"
        assert not alive, f"rank {rank}: the registry keeps the first model alive"
        assert used is not None and "destroy_process_group" in used, f"rank {rank}: {used}"
        assert stats["total"]["minibatches"] == len(plan)
        for name, ref in want.items():
            torch.testing.assert_close(
                params[name],
                ref,
                rtol=0,
                atol=1e-5,
                msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
            )


def test_local_shards_join_to_the_reference():
    """What the compute-sanitizer flow relies on: each rank's dim-0 shards, joined in rank
    order, are the full parameters (no all-gather needed to check a run)."""
    plan = PLANS[4]
    got = join_shards(run_ranks(4, train_odc, plan, False, None, True, LR, None, "cpu", True, True))
    want = reference(plan, False, LR)
    assert got.keys() == want.keys()
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=0, atol=1e-5, msg=name)


def test_fast_rank_does_not_wait_for_a_slow_rank_before_the_barrier():
    plan = [[3, 3]]
    # Rank 1 sleeps 3 s inside its second microbatch.
    results = run_ranks(2, train_odc, plan, False, None, True, LR, (0, 1, 1))
    (_, fast_stats, fast_timeline), (_, _, slow_timeline) = results
    fast_enter = {(e, mb): t for e, mb, t in fast_timeline}[("barrier_enter", 0)]
    slow_enter = {(e, mb): t for e, mb, t in slow_timeline}[("barrier_enter", 0)]
    assert slow_enter - fast_enter > 2.0, (fast_enter, slow_enter)
    assert fast_stats["last"]["publish_wait_s"] < 1.0, fast_stats
    assert fast_stats["last"]["barrier_s"] > 2.0, fast_stats  # it waited there, and only there
    want = reference(plan, False, LR)
    for name, ref in want.items():
        torch.testing.assert_close(results[0][0][name], ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "lazy"])
def test_first_forward_does_not_wait_for_a_peer_reaching_each_module(eager):
    """With eager publishing (the default) a rank publishes every shard before its first
    forward of the minibatch, so a peer's first forward waits for nobody; published lazily,
    it waits at the last layer until the slow rank gets there (what eager publish removes)."""
    results = run_ranks(2, slow_peer_first_microbatch, eager)
    (elapsed0, wait0, params0), (_, _, params1) = results
    if eager:
        assert wait0 < 1.0 and elapsed0 < 1.5, (wait0, elapsed0)  # rank 1 sleeps 2 s
    else:
        assert wait0 > 1.5 and elapsed0 > 1.8, (wait0, elapsed0)
    # Same training either way: both ranks hold the parameters of the single-process reference.
    want = reference([[1, 1], [1, 1]], False, LR)
    for name, ref in want.items():
        torch.testing.assert_close(params0[name], ref, rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(params1[name], ref, rtol=0, atol=1e-5, msg=name)


def _step_misuse(rank, world):
    """optimizer.step() without the barrier, then a forward between barrier and step: both
    are refused before the step changes anything."""
    from odc_training import loss_of, samples

    import torch_odc

    model = sharded_model(world)
    handle = torch_odc.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=LR)  # not this model's
    seq = samples(0, 1)[0]
    loss_of(model, seq).backward()
    errors = []
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    try:
        opt.step()  # forgot the barrier
    except RuntimeError as err:
        errors.append(str(err))
    other.step()  # an optimizer over other parameters is not concerned
    torch_odc.minibatch_barrier()
    with torch.no_grad():
        model(seq[:, :-1])  # a forward before the step publishes the pre-step parameters
    try:
        opt.step()
    except RuntimeError as err:
        errors.append(str(err))
    unchanged = all(torch.equal(before[k], v.to_local()) for k, v in model.state_dict().items())
    # No zero_grad() here: after that forward it could not drop the gradient kept from the
    # last minibatch (the barrier would refuse it); the step below applies it, as FSDP2's would.
    torch_odc.minibatch_barrier()
    opt.step()  # the right order works
    handle.detach()
    dist.barrier()
    return errors, unchanged


def _compiled_autograd_backward(rank, world):
    """A backward under compiled autograd with the model attached: refused, naming it."""
    from odc_training import loss_of, samples
    from torch._dynamo import compiled_autograd

    import torch_odc

    model = sharded_model(world)
    handle = torch_odc.attach(model)
    seq = samples(0, 1)[0]
    try:
        with compiled_autograd._enable(torch.compile(backend="eager")):
            loss_of(model, seq).backward()
        error = None
    except Exception as err:  # noqa: BLE001 -- the test reports whatever was raised
        error = f"{type(err).__name__}: {err}"
    handle.detach()
    dist.barrier()
    return error


def test_compiled_autograd_is_refused_with_a_clear_error():
    for error in run_ranks(2, _compiled_autograd_backward):
        assert error is not None and "compiled autograd is not supported" in error, error


def test_optimizer_step_out_of_order_is_refused_with_a_clear_error():
    for rank, (errors, unchanged) in enumerate(run_ranks(2, _step_misuse)):
        assert len(errors) == 2, errors
        for err in errors:
            assert f"rank {rank}" in err and "minibatch_barrier()" in err, err
        assert "minibatch 1" in errors[0] and "minibatch 2" in errors[1], errors
        assert unchanged, "a refused step changed parameters"


def _skip_barrier(rank, world):
    import time

    from odc_training import loss_of, samples

    import torch_odc

    model = sharded_model(world)
    torch_odc.attach(model)
    seq = samples(0, 1)[0]
    loss_of(model, seq).backward()
    if rank == 1:
        time.sleep(8)  # never calls the barrier
        return "skipped"
    try:
        torch_odc.minibatch_barrier()
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_a_rank_that_skips_the_barrier_is_named_after_the_timeout():
    msg, _ = run_ranks(2, _skip_barrier, pg_timeout=2.0)
    assert "peer rank 1" in msg and "minibatch 1" in msg and "minibatch_barrier" in msg, msg


def _gather_from_absent_peer(rank, world):
    import time

    from odc_training import loss_of, samples

    import torch_odc

    model = sharded_model(world)
    torch_odc.attach(model)
    if rank == 1:
        time.sleep(8)  # never runs a forward: never publishes
        return "slept"
    t0 = time.time()
    try:
        loss_of(model, samples(0, 1)[0])
    except RuntimeError as err:
        return str(err), time.time() - t0
    return "no error", 0.0


def test_waiting_for_an_unpublished_shard_times_out_with_key_peer_and_minibatch():
    (msg, waited), _ = run_ranks(2, _gather_from_absent_peer, pg_timeout=2.0)
    assert "timed out" in msg and "peer rank 1" in msg, msg
    assert "key '<root>'" in msg and "minibatch 1" in msg, msg
    assert 1.5 < waited < 6.0


def _wrong_calls(rank, world):
    import torch_odc

    model = sharded_model(world)
    handle = torch_odc.attach(model)
    numel = handle._keys[0].shard_numel
    errors = {}
    cases = {
        "size": (torch.empty(world * (numel + 1)), torch.zeros(numel + 1)),
        "dtype": (
            torch.empty(world * numel, dtype=torch.float64),
            torch.zeros(numel, dtype=torch.float64),
        ),
    }
    for name, (out, inp) in cases.items():
        try:  # the keyed all-gather as the comm objects call it
            handle._backend._keyed_all_gather(0, out, inp)
            errors[name] = "no error"
        except RuntimeError as err:
            errors[name] = str(err)
    # Ordinary collectives keep working next to the attached model.
    t = torch.ones(3)
    dist.all_reduce(t)
    errors["plain_allreduce"] = t.tolist()
    return errors


def test_wrong_size_and_dtype_keyed_calls_are_clear_errors():
    for errors in run_ranks(2, _wrong_calls):
        assert "key '<root>'" in errors["size"] and "bytes" in errors["size"], errors
        assert "float64" in errors["dtype"], errors
        assert errors["plain_allreduce"] == [2.0, 2.0, 2.0]


def test_attach_without_fsdp_modules_is_a_value_error():
    import torch_odc

    with pytest.raises(ValueError, match="fully_shard"):
        torch_odc.attach(torch.nn.Linear(2, 2))


def test_odc_operations_are_profiler_ranges():
    # Rank 1 runs no microbatch: its keys are published by the barrier (odc::publish_shards).
    names = run_ranks(2, profiled_minibatch, [2, 0])
    keys = {"layers.0", "layers.1"}
    for k in keys:
        assert f"odc::gather {k}" in names[0] and f"odc::push {k}" in names[0], names[0]
    assert "odc::reduce_scatter_call" in names[0] and "odc::unit_pre_forward" in names[0]
    for rank_names in names:
        # odc::barrier_release runs when a rank enters the next minibatch (not profiled here).
        assert {
            "odc::minibatch_barrier",
            "odc::barrier_arrive",
            "odc::wait_device",
            "odc::wait_peers",
            "odc::publish_shards",
        } <= set(rank_names), rank_names
    # Rank 0 ran a forward (eager publish at its first); rank 1 ran none, so it published in
    # the barrier instead.
    assert "odc::publish_all" in names[0] and "odc::publish_all" not in names[1], names


def _direct_keyed_calls(rank, world):
    import torch_odc

    b = torch_odc.odc_backend()
    b._connect_engine(
        [("a", 8, "bfloat16", [8], "float32"), ("b", 4, "float32", [4], "float32")], device_index=-1
    )
    out = {}
    try:
        shard = torch.arange(8, dtype=FP32) / 3 + 100 * rank  # not exact in bf16: the cast
        # One publish of both keys from their parameters' tensors (key "a" as two pieces, cast
        # to its bf16 gather dtype by the copy); key "a" listed twice is copied once.
        out["published"] = b._publish_shards(
            [0, 1, 0], [[shard[:3], shard[3:]], [torch.full((4,), float(rank))], [shard]]
        )
        out["again"] = b._publish_shards([0, 1], [[shard], [torch.zeros(4)]])
        gathered = torch.empty(world * 8, dtype=BF16)
        own = gathered[rank * 8 : (rank + 1) * 8]
        own.copy_(shard)
        out["sync_work"] = b._keyed_all_gather(0, gathered, own)
        out["gathered"] = gathered
        out["async_work"] = type(
            b._keyed_all_gather(1, torch.empty(world * 4), torch.full((4,), float(rank)), True)
        ).__name__
        # Pushes: SUM (the output is zeros until the barrier), PREMUL_SUM with a factor on top,
        # AVG.
        rs_in = torch.arange(world * 8, dtype=FP32)
        rs_out = torch.ones(8)
        b._keyed_reduce_scatter(0, rs_out, rs_in, dist.ReduceOp.SUM)
        out["rs_out"] = rs_out.clone()
        b._keyed_reduce_scatter(0, rs_out, rs_in, dist._make_nccl_premul_sum(0.5), [0], 2.0)
        b._keyed_reduce_scatter(1, torch.zeros(4), torch.ones(world * 4), dist.ReduceOp.AVG)
        for name, (keys, sources) in {
            "size": ([0], [[torch.zeros(7)]]),
            "device_or_dtype": ([0], [[torch.zeros(8, dtype=torch.int64)]]),
            "unknown": ([5], [[torch.zeros(8)]]),
        }.items():
            try:
                b._publish_shards(keys, sources)
                out[name] = "no error"
            except RuntimeError as err:
                out[name] = str(err)
        b._arrive()
        out["acc"] = [b._accumulator(0).clone(), b._accumulator(1).clone()]
        b._release()
    finally:
        b._disconnect_engine()
    return out


def test_direct_keyed_calls_and_one_publish_of_many_keys():
    """The calls attach's comm objects make (no c10d dispatch): a publish of several keys from
    their parameters' tensors in one copy (cast to the gather dtype, exactly as FSDP2's copy-in
    does), gathers (None when synchronous, a Work when asynchronous) and pushes of every reduce
    op; wrong shards are refused naming the key."""
    world = 2
    outs = run_ranks(world, _direct_keyed_calls)
    want_gather = torch.cat(
        [(torch.arange(8, dtype=FP32) / 3 + 100 * r).to(BF16) for r in range(world)]
    )
    for rank, out in enumerate(outs):
        assert out["published"] == [0, 1] and out["again"] == [], out
        assert out["sync_work"] is None and out["async_work"] == "Work", out
        assert torch.equal(out["gathered"].view(torch.int16), want_gather.view(torch.int16))
        assert torch.equal(out["rs_out"], torch.zeros(8))
        rs = torch.arange(world * 8, dtype=FP32).view(world, 8)[rank]
        # SUM, then PREMUL_SUM 0.5 x 2.0 from each rank: 2 x (sum over ranks of rank's chunk)
        assert torch.equal(out["acc"][0], 2 * world * rs), out["acc"][0]
        assert torch.equal(out["acc"][1], torch.ones(4))
        assert "key 'a'" in out["size"] and "7 elements" in out["size"], out["size"]
        assert "key 'a'" in out["device_or_dtype"], out["device_or_dtype"]
        assert "unknown key #5" in out["unknown"], out["unknown"]
