"""What a new microbatch shape costs the first time it runs: forward and backward of a Llama
model's attention (HF, ``attn_implementation="sdpa"``, the TRL examples' 1B layer shape) on
one GPU, first call and repeat call per shape, under each SDPA backend set.

Why: in TRL on 2 H200 a few ODC microbatches took 1-2.5 s longer than their peers, all of it
host time inside ``aten::_cudnn_attention_forward`` / ``_backward`` (torch.profiler, the
examples' ``--profile-steps``). cuDNN's SDPA builds an execution plan per distinct shape
(batch, heads, sequence, strides; aten/src/ATen/native/cudnn/MHA.cpp caches them by shape).
The unmodified trainer runs ``per_device_train_batch_size`` rows in every microbatch; ODC packs
a varying number of rows. This measures which shape changes are expensive.

    python benchmarks/probes/sdpa_shapes.py --out benchmarks/results/probes/sdpa-shapes_1b_1gpu_h200_2026-11-28.json
Each variant runs in a fresh process (the plan cache lives for the process).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time


def shapes(count: int) -> list[tuple[int, int]]:
    """(rows, padded length) of ``count`` microbatches like ODC's under a ~9k-token cap: 1 to
    16 rows, 128 to 8192 tokens each, at most 16384 tokens; the first is a warm-up."""
    rng = random.Random(0)
    out = [(2, 512)]
    while len(out) < count:
        b = rng.choice((1, 1, 2, 2, 2, 3, 4, 5, 6, 8, 11, 16))
        s = rng.randrange(128, min(8192, 16384 // b) + 1)
        out.append((b, s))
    return out


VARIANTS = {  # name: (SDPA backends, pad the length to a multiple of, environment)
    "default": ("default", 1, {}),
    "pad64": ("default", 64, {}),
    "pad256": ("default", 256, {}),
    "eager-load": ("default", 1, {"CUDA_MODULE_LOADING": "EAGER"}),
    "no-cudnn": ("no-cudnn", 1, {}),
}


def child(variant: str, layers: int, count: int) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import LlamaConfig, LlamaForCausalLM

    backends, multiple, _env = VARIANTS[variant]
    chosen = {
        "default": None,
        "no-cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    }[backends]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=16384,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)

    def step(b: int, s: int) -> float:
        ids = torch.randint(2, 32000, (b, s), device="cuda")
        mask = torch.ones(b, s, dtype=torch.long, device="cuda")
        if b > 1:
            mask[1:, s - s // 3 :] = 0  # padded rows, as a collator pads them
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    rows = []
    ctx = sdpa_kernel(chosen) if chosen else None
    if ctx:
        ctx.__enter__()
    seen = set()
    for b, s in shapes(count):
        s = -(-s // multiple) * multiple
        first = step(b, s)
        again = step(b, s)
        rows.append(
            {
                "rows": b,
                "length": s,
                "seen": (b, s) in seen,
                "first_s": first,
                "repeat_s": again,
                "extra_s": first - again,
            }
        )
        seen.add((b, s))
    if ctx:
        ctx.__exit__(None, None, None)
    later = rows[1:]
    return {
        "variant": variant,
        "layers": layers,
        "rows": rows,
        "seconds": sum(r["first_s"] for r in later),
        "compute_seconds": sum(r["repeat_s"] for r in later),
        "extra_seconds": sum(r["extra_s"] for r in later),
        "slow_shapes": sum(r["extra_s"] > 0.5 for r in later),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "gpu": torch.cuda.get_device_name(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--count", type=int, default=60, help="microbatch shapes")
    ap.add_argument("--variants", default="default,pad64,pad256,eager-load,no-cudnn")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.count)))
        return
    results = []
    for variant in args.variants.split(","):
        t = time.perf_counter()
        p = subprocess.run(
            [
                sys.executable,
                __file__,
                "--out",
                args.out,
                "--layers",
                str(args.layers),
                "--count",
                str(args.count),
                "--child",
                variant,
            ],
            check=False,
            capture_output=True,
            text=True,
            env={**os.environ, **VARIANTS[variant][2]},
        )
        wall = time.perf_counter() - t
        if p.returncode:
            print(p.stderr[-3000:], file=sys.stderr)
            results.append({"variant": variant, "error": p.stderr[-2000:]})
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["process_seconds"] = wall
        results.append(r)
        print(
            f"== {variant}  (torch {r['torch']}, cuDNN {r['cudnn']}, {r['gpu']}): "
            f"{r['seconds']:.2f} s over {len(r['rows']) - 1} shapes, of which "
            f"{r['extra_seconds']:.2f} s first-call extra, {r['slow_shapes']} shapes > 0.5 s "
            f"extra; process {wall:.1f} s"
        )
        for row in r["rows"]:
            if row["extra_s"] > 0.3:
                print(
                    f"   slow: rows {row['rows']:>3} len {row['length']:>5} "
                    f"(seen {row['seen']})  extra {row['extra_s']:.3f} s"
                )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
