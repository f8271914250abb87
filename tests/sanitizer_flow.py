"""The ODC primitive flow on 2 GPUs, without FSDP or NCCL: the workload for
compute-sanitizer (memcheck, racecheck). Connects the engine with one key, runs a keyed gather
(bf16), keyed pushes (fp32, and bf16 widened into the fp32 accumulator), the barrier and a detach,
and prints what it read. Two ranks may share one GPU (CUDA IPC within a device).

    compute-sanitizer --tool memcheck --target-processes all \
        torchrun --nproc-per-node=2 tests/sanitizer_flow.py
"""

import faulthandler
import os

import torch
import torch.distributed as dist

import torch_odc

faulthandler.enable()
r = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(r % torch.cuda.device_count())
dist.init_process_group("odc")
b = torch_odc.odc_backend()
print(r, "connect", flush=True)
# 10000 elements per rank: the push runs its bulk path on sm_90 (two 4096-element tiles) and
# its element path for the 1808-element tail.
N = 10000
b._connect_engine([("k0", N, "bfloat16", [N], "float32")], torch.cuda.current_device())
print(r, "connected", flush=True)
inp = torch.full((N,), float(r + 1), device="cuda", dtype=torch.bfloat16)
out = torch.empty(2 * N, device="cuda", dtype=torch.bfloat16)
b._keyed_all_gather(0, out, inp)  # as attach's comm objects call it
torch.cuda.synchronize()
print(r, "gather", out[::N].tolist(), flush=True)
assert out[::N].tolist() == [1.0, 2.0]
g = torch.ones(2 * N, device="cuda")
o = torch.empty(N, device="cuda")
for grad in (g, g.to(torch.bfloat16)):
    b._keyed_reduce_scatter(0, o.to(grad.dtype), grad, dist.ReduceOp.SUM)
torch.cuda.synchronize()
b._arrive()
acc = b._accumulator(0)[:N]
print(r, "acc", acc[:2].tolist(), flush=True)
assert bool((acc == 4.0).all()), acc.unique().tolist()
b._release()
b._disconnect_engine()
print(r, "done", flush=True)
dist.destroy_process_group()
