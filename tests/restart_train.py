"""FSDP2 + torch_odc training that survives a killed rank under ``torchrun --max-restarts``.

Launched by tests/test_restart.py, 2 CPU ranks:

    python -m torch.distributed.run --standalone \\
        --nnodes=1 --nproc-per-node=2 --max-restarts=1 --monitor-interval=0.5 \\
        tests/restart_train.py --out DIR [--kill-step S]

Every rank runs (step + rank) % 3 + 1 microbatches per step (samples seeded by step and
rank), then minibatch_barrier(), optimizer.step(); every CKPT_EVERY steps a DCP checkpoint
of model + optimizer is saved under DIR/ckpt and DIR/ckpt/latest names it. A (re)started attempt
resumes from the latest checkpoint: build, fully_shard, load, then attach. With --kill-step S,
rank 1 of the first attempt (TORCHELASTIC_RESTART_COUNT == 0) SIGKILLs itself before the second
microbatch of step S. At the end rank 0 saves the full parameters to DIR/final.pt.

Each process writes DIR/attempt<A>-rank<R>.json (pid, times, resumed step, error if any): the
test reads them to check the restart and the shared-memory regions of exactly these pids.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time

START = time.time()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # odc_training

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from odc_training import MAXLEN, VOCAB, loss_of, sharded_model
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import torch_odc

STEPS = 6
CKPT_EVERY = 2  # checkpoints after steps 1, 3, 5: a kill in step 3 replays steps 2 and 3
LR = 0.1
PG_TIMEOUT_S = 10.0


def microbatches(step: int, rank: int) -> int:
    return (step + rank) % 3 + 1


def step_samples(step: int, rank: int) -> list[torch.Tensor]:
    """This rank's sequences of `step`: a function of (step, rank) only."""
    gen = torch.Generator().manual_seed(100_003 * step + 7919 * rank + 17)
    lengths = torch.randint(5, MAXLEN - 1, (microbatches(step, rank),), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (1, n + 1), generator=gen) for n in lengths]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kill-step", type=int, default=-1)
    args = ap.parse_args()

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    record = {"attempt": attempt, "rank": rank, "pid": os.getpid(), "start": START}
    record_path = os.path.join(args.out, f"attempt{attempt}-rank{rank}.json")

    def write_record():
        tmp = record_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, record_path)

    write_record()  # before any region exists: the test checks /dev/shm for this pid
    torch.set_num_threads(1)
    dist.init_process_group(backend="odc", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    world = dist.get_world_size()
    record["pg_ready"] = time.time()
    write_record()
    try:
        train(args, attempt, rank, world, record, write_record)
    except BaseException as err:  # recorded for the test, then re-raised
        record["error"] = f"{type(err).__name__}: {err}"
        record["error_time"] = time.time()
        write_record()
        raise
    record["done"] = time.time()
    write_record()
    dist.destroy_process_group()


def train(args, attempt, rank, world, record, write_record) -> None:
    ckpt_root = os.path.join(args.out, "ckpt")
    latest = os.path.join(ckpt_root, "latest")
    model = sharded_model(world)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    start_step = 0
    if os.path.exists(latest):  # written by rank 0 only after a complete save
        with open(latest) as f:
            done_step = int(f.read())
        state = dict(zip(("model", "optim"), get_state_dict(model, opt)))
        dcp.load(state, checkpoint_id=os.path.join(ckpt_root, f"step{done_step}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start_step = done_step + 1
    record["resumed_at_step"] = start_step
    record["resumed"] = time.time()
    write_record()
    handle = torch_odc.attach(model)

    for step in range(start_step, STEPS):
        # Every rank's token count: the loss is the mean over all of the step's tokens.
        tokens = sum(s.shape[1] - 1 for r in range(world) for s in step_samples(step, r))
        for i, seq in enumerate(step_samples(step, rank)):
            if attempt == 0 and rank == 1 and step == args.kill_step and i == 1:
                record["killed"] = time.time()
                write_record()
                os.kill(os.getpid(), signal.SIGKILL)
            # FSDP2 averages over ranks (ReduceOp.AVG): scale by world to get the plain mean.
            (loss_of(model, seq) * world / tokens).backward()
        torch_odc.minibatch_barrier()
        before = [p.to_local().detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        # The largest change of this rank's shards in this step: the test checks that its
        # tolerance is far below one step's update (a replayed or skipped step would show).
        update = max(
            (
                (p.to_local() - b).abs().max().item()
                for p, b in zip(model.parameters(), before)
                if b.numel()
            ),
            default=0.0,
        )
        record.setdefault("steps_done", []).append(step)
        record.setdefault("update_max", []).append(update)
        write_record()
        if (step + 1) % CKPT_EVERY == 0:
            path = os.path.join(ckpt_root, f"step{step}")
            dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), checkpoint_id=path)
            if rank == 0:  # dcp.save returned on the coordinator: the checkpoint is complete
                with open(latest + ".tmp", "w") as f:
                    f.write(str(step))
                os.replace(latest + ".tmp", latest)

    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, os.path.join(args.out, "final.pt"))
    handle.detach()


if __name__ == "__main__":
    main()
