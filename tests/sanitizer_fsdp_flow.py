"""FSDP2 + torch_odc.attach on 2 GPUs without NCCL in the processes: the workload for
compute-sanitizer over the whole on-demand path (publish, gather, push, barrier, finalize).
Uneven microbatch counts (zero included), fp32 and bf16/bf16 (freeing the gradient memory
between minibatches); compared with the single-process reference. Two ranks may share one GPU.

    compute-sanitizer --tool memcheck --target-processes all python tests/sanitizer_fsdp_flow.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multiproc import run_ranks
from odc_training import join_shards, reference, train_odc

PLAN = [[2, 0], [3, 1], [1, 1]]


def main() -> None:
    for mp, tol in ((None, 1e-4), ((torch.bfloat16, torch.bfloat16), 5e-2)):
        # Local shards, joined here: no all-gather, so no NCCL in the ranks at all.
        # bf16: the gradient memory is freed after every step and comes back (new IPC
        # allocations, opened and closed by the peer).
        odc = join_shards(
            run_ranks(
                2,
                train_odc,
                PLAN,
                False,
                mp,
                True,
                0.1,
                None,
                "cuda",
                True,
                True,
                None,
                mp is not None,
                backend="odc",
                cuda=True,
            )
        )
        ref = reference(PLAN, False, 0.1)
        worst = max((odc[n] - ref[n].float()).abs().max().item() for n in ref)
        print(f"mp={mp}: max |odc - reference| = {worst:.2e}", flush=True)
        assert worst < tol, worst
    print("sanitizer FSDP flow: ok")


if __name__ == "__main__":  # spawned ranks import this module: run only in the parent
    main()
