"""The end-to-end benchmark's model: a packed microbatch (documents back to back, positions
restarting per document, document-causal attention) has exactly the loss of its documents run
one by one. On CUDA this checks the varlen flash-attention path against per-sequence SDPA."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_e2e import MODELS, Llama


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_packed_microbatch_equals_its_documents(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Llama(*MODELS["tiny"]).to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, MODELS["tiny"][5], (n,), generator=gen).to(device)
            for n in (17, 5, 33, 2)]
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
