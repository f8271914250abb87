"""The Hugging Face LoRA example (docs/examples/hf_lora_sft.py) on CPU ranks: a LlamaForCausalLM
from a config with peft LoRA adapters, fully_shard per decoder layer plus the root, trained for a
few minibatches of variable-length sequences. Under ODC with uneven microbatch counts per rank
(zero included) and under FSDP2's own collectives (equal counts) it ends with the adapter
weights of a single process trained on the union of the samples; frozen weights never move."""

import functools
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "examples")
)

import hf_lora_sft as example
from multiproc import run_ranks

WORLD = 2
LR = 0.1
SEQUENCES = 6  # per minibatch
SETTINGS = {
    "size": "tiny",
    "minibatches": 3,
    "sequences": SEQUENCES,
    "min_len": 6,
    "max_len": 40,
    "max_tokens_per_microbatch": 80,
    "device": "cpu",
    "optimizer": "sgd",
    "lr": LR,
    "seed": 3,
    "return_params": True,
}
# plans[mb][rank]: rank's microbatches (indices into the minibatch's sequences).
UNEVEN = [
    [[[0, 1], [2], [3, 4, 5]], []],  # rank 1 runs nothing
    [[[0]], [[1, 2], [3], [4], [5]]],
    [[[5, 4], [3]], [[0], [1, 2]]],
]
EQUAL = [  # FSDP2 collectives need the same number of microbatches on every rank
    [[[0, 1], [2]], [[3], [4, 5]]],
    [[[0], [1, 2]], [[3, 4], [5]]],
    [[[5]], [[0, 1, 2, 3, 4]]],
]
ATOL = 1e-5  # fp32 on CPU


def _train(rank, world, lora, plans, attach):
    return example.train(rank, world, lora=lora, plans=plans, attach=attach, **SETTINGS)


@functools.cache
def reference(lora: bool) -> dict:
    """One process, no FSDP: SGD on the token-mean loss of every minibatch's sequences."""
    torch.manual_seed(0)
    model = example.build_model(SETTINGS["size"], lora, SETTINGS["seed"])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    vocab = example.SIZES[SETTINGS["size"]]["vocab_size"]
    for mb in range(SETTINGS["minibatches"]):
        seqs = example.minibatch(
            mb, SEQUENCES, vocab, SETTINGS["min_len"], SETTINGS["max_len"], SETTINGS["seed"]
        )
        num_tokens = sum(len(s) - 1 for s in seqs)
        for s in seqs:  # one sequence at a time: no padding in the reference
            (example.summed_token_loss(model, [s], "cpu") / num_tokens).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def initial(lora: bool) -> dict:
    model = example.build_model(SETTINGS["size"], lora, SETTINGS["seed"])
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def collective_run(lora: bool):
    """The same training under FSDP2's collectives (no attach), equal counts per rank."""
    return run_ranks(WORLD, _train, lora, EQUAL, False)


def check_against_reference(results, lora):
    want, init = reference(lora), initial(lora)
    for rank, out in enumerate(results):
        params, trainable = out["params"], set(out["trainable"])
        assert params.keys() == want.keys()
        if lora:
            assert trainable and all("lora_" in n for n in trainable), trainable
        moved = 0.0
        for name, ref in want.items():
            if name in trainable:
                torch.testing.assert_close(
                    params[name],
                    ref,
                    rtol=0,
                    atol=ATOL,
                    msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
                )
                moved = max(moved, (ref - init[name]).abs().max().item())
            else:  # frozen: bit for bit what it was
                assert torch.equal(params[name], init[name]), f"rank {rank}: {name} moved"
        assert moved > 100 * ATOL, "training barely moved the adapters: the check is too weak"


def test_lora_under_fsdp2_collectives_matches_a_single_process():
    check_against_reference(collective_run(True), lora=True)


@pytest.mark.parametrize("plans", ["uneven", "lb-mini"])
def test_lora_under_odc_matches_a_single_process_and_fsdp2_collectives(plans):
    results = run_ranks(WORLD, _train, True, UNEVEN if plans == "uneven" else None, True)
    counts = [r["counts"] for r in results]
    if plans == "uneven":
        assert counts == [[3, 1, 2], [0, 4, 2]], counts
    check_against_reference(results, lora=True)
    for odc, coll in zip(results, collective_run(True)):
        for name in odc["trainable"]:
            torch.testing.assert_close(
                odc["params"][name], coll["params"][name], rtol=0, atol=ATOL, msg=name
            )
        # Same samples, same model: the same global loss per minibatch either way.
        assert odc["losses"] == pytest.approx(coll["losses"], rel=1e-5)


def test_full_finetuning_of_the_hf_model_under_odc_matches_a_single_process():
    """The same model without LoRA (every weight trains), uneven counts with a zero."""
    results = run_ranks(WORLD, _train, False, UNEVEN, True)
    assert [r["counts"] for r in results] == [[3, 1, 2], [0, 4, 2]]
    check_against_reference(results, lora=False)
