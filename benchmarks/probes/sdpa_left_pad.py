"""Whether a left-padded batch's forward and backward stay finite under each SDPA backend: a
Llama model (HF, ``attn_implementation="sdpa"``, the TRL examples' 1B layer shape, 2 layers)
on one GPU, rows laid out as TRL's GRPO lays them out (prompts left-padded, completions
right-padded), the loss on the completion tokens only (GRPO's per-token log-probabilities).

Why: under ODC the GRPO update with prompt and completion widths rounded up to multiples of
64 gave a NaN gradient norm on the first step (1B, 4 H200, bf16), the same step without the
rounding and the unmodified trainer a finite one. Left padding leaves query rows with no key to
attend to (a pad position sees only pads before it); rounding the prompt width up gives every
row such rows, the longest prompt included. This runs the layouts side by side per backend.

    python benchmarks/probes/sdpa_left_pad.py --out benchmarks/results/probes/sdpa-left-pad_1b_1gpu_h200_2026-11-28.json
"""

from __future__ import annotations

import argparse
import json


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


PROMPTS = [101, 333, 777, 1501]
COMPLETIONS = [77, 12, 40, 63]
LAYOUTS = {  # name: (prompt width, completion width)
    "trl": (max(PROMPTS), max(COMPLETIONS)),  # TRL's own: the longest of each
    "pad64-both": (round_up(max(PROMPTS), 64), round_up(max(COMPLETIONS), 64)),
    "pad64-right": (max(PROMPTS), round_up(max(PROMPTS) + max(COMPLETIONS), 64) - max(PROMPTS)),
    "left+5": (max(PROMPTS) + 5, max(COMPLETIONS)),  # every row left-padded, length unaligned
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=args.layers,
            num_attention_heads=16,
            num_key_value_heads=8,
            max_position_embeddings=4096,
            pad_token_id=0,
            attn_implementation="sdpa",
        )
    ).cuda()
    backends = {
        "default": None,
        "cudnn": [SDPBackend.CUDNN_ATTENTION],
        "flash": [SDPBackend.FLASH_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION],
        "math": [SDPBackend.MATH],
        "no-cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    }
    gen = torch.Generator().manual_seed(1)
    results = []
    for layout, (pw, cw) in LAYOUTS.items():
        ids = torch.zeros(len(PROMPTS), pw + cw, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
            ids[r, pw - p : pw + c] = torch.randint(2, 32000, (p + c,), generator=gen)
            mask[r, pw - p : pw + c] = 1
        ids, mask = ids.cuda(), mask.cuda()
        for name, chosen in backends.items():
            model.zero_grad(set_to_none=True)
            row = {"layout": layout, "length": pw + cw, "backend": name}
            try:
                ctx = sdpa_kernel(chosen) if chosen else torch.enable_grad()
                with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(input_ids=ids, attention_mask=mask).logits[:, pw - 1 : -1]
                    logps = (
                        torch.log_softmax(logits.float(), -1)
                        .gather(-1, ids[:, pw:].unsqueeze(-1))
                        .squeeze(-1)
                    )
                    keep = mask[:, pw:].float()
                    loss = -(logps * keep).sum() / keep.sum()
                loss.backward()
                torch.cuda.synchronize()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                row.update(
                    loss=float(loss),
                    loss_finite=bool(torch.isfinite(loss)),
                    grads_finite=all(bool(torch.isfinite(g).all()) for g in grads),
                    nan_params=sum(int(not torch.isfinite(g).all()) for g in grads),
                )
            except RuntimeError as err:  # a backend that refuses the inputs
                row["error"] = str(err).split("\n")[0][:160]
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(),
                    "prompts": PROMPTS,
                    "completions": COMPLETIONS,
                    "rows": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
