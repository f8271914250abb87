"""Host microseconds of one keyed reduce-scatter (push) call in a hot loop, split into its parts.

One small FSDP2 model attached to ODC (4 units of Linear-LayerNorm-Linear), steady state inside a
minibatch; the unit's push comm call is called as FSDP2 calls it (with the .grad hooks FSDP2
calls after it), then the C++ entry alone (pybind included), then the Python bookkeeping alone.
The C++ clock (``stats()["cpp_host_s"]``) gives the C++ part of each. Best of 5 rounds.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 benchmarks/probes/keyed_call_micro.py [--calls 5000]

A hot loop shows what a call costs at best; in a training step the same Python costs several
times more (docs/benchmarks.md, "Where a keyed call's host time goes, in place").
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.fsdp import fully_shard

import torch_odc
from torch_odc import _comms


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=5000)
    args = p.parse_args()
    dist.init_process_group("odc")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[
            torch.nn.Sequential(
                torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 32)
            )
            for _ in range(4)
        ]
    )
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    handle = torch_odc.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):  # the last minibatch stays open: the calls below push into it
        model(torch.randn(4, 32)).sum().backward()
        if step < 2:
            torch_odc.minibatch_barrier()
            opt.step()
            opt.zero_grad()
    key = handle._keys[1]
    comm = _comms._KeyedReduceScatter(handle, 1)
    numel = key._all_numel * key.world
    inp, out = torch.randn(numel), torch.empty(numel // key.world)
    every = list(key._all_trainable)
    backend, n = handle._backend, args.calls

    def hooks():  # what FSDP2 calls after setting each sharded .grad
        for i, fp in enumerate(key.unit.params):
            key._drop_fsdp_grad(i, fp.sharded_param)

    def full():  # the common push: one C++ call (KeyCalls.push_all)
        assert key.fast_push
        for _ in range(n):
            key.calls.note(every)  # what the gradient accumulators' hooks note in a backward
            comm(out, inp, handle._group, ReduceOp.SUM)
            hooks()

    def general():  # the same push through the general path (Python bookkeeping)
        key.fast_push = False
        try:
            for _ in range(n):
                key.calls.note(every)
                comm(out, inp, handle._group, ReduceOp.SUM)
                hooks()
        finally:
            key.fast_push = True

    def cpp_entry():
        for _ in range(n):
            backend._keyed_reduce_scatter(1, out, inp, ReduceOp.SUM, [], 1.0, False)

    def python_parts():
        for _ in range(n):
            key.calls.note(every)
            key.take_placeholders(key.take_pushed_params(numel // key.world))
            key.push_scale(inp.dtype)
            hooks()

    rows = []
    for name, fn in (
        ("push comm call + .grad hooks", full),
        ("  the same, general path", general),
        ("C++ entry via pybind", cpp_entry),
        ("general path's bookkeeping + hooks", python_parts),
    ):
        best = None
        for _ in range(5):
            c0 = backend._stats()["cpp_host_s"]["push"]
            t0 = time.perf_counter()
            fn()
            us = (time.perf_counter() - t0) / n * 1e6
            cpp = (backend._stats()["cpp_host_s"]["push"] - c0) / n * 1e6
            if best is None or us < best[0]:
                best = (us, cpp)
        rows.append((name, *best))
    if dist.get_rank() == 0:
        for name, us, cpp in rows:
            print(f"{name:<34} {us:7.2f} us per call (C++ clock {cpp:.2f} us)")
    torch_odc.minibatch_barrier()
    opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
