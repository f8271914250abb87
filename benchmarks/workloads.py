"""Seeded sequence-length distributions shared by the benchmarks (lengths in tokens)."""

import numpy as np


def long_context(rng: np.random.Generator, n: int) -> np.ndarray:
    """Lognormal (median 11K, sigma 0.6) truncated to [8K, 64K]: mean ~16.4K, p99 ~46K."""
    out = np.empty(0, dtype=np.int64)
    while out.size < n:
        draw = rng.lognormal(np.log(11000.0), 0.6, size=2 * n)
        out = np.concatenate([out, draw[(draw >= 8192) & (draw <= 65536)].astype(np.int64)])
    return out[:n]


def rl_like(rng: np.random.Generator, n: int) -> np.ndarray:
    """Prompt uniform in [128, 2048] plus a response lognormal (median 4K, sigma 1.0) truncated
    at 20K, as when generation stops at the length limit (~5% do): mean ~7K."""
    prompt = rng.integers(128, 2049, size=n)
    response = np.minimum(rng.lognormal(np.log(4000.0), 1.0, size=n), 20480).astype(np.int64)
    return prompt + np.maximum(response, 1)


def equal(rng: np.random.Generator, n: int) -> np.ndarray:
    """Every sequence 16K tokens."""
    return np.full(n, 16384, dtype=np.int64)
