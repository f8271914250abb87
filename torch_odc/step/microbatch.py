"""One microbatch of a step, explicit: the trainer's tensors for its rows, which rows they are,
the padded shape they were laid out at, and the weights that make its loss a share of the
step's loss wherever the rows ran."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["Microbatch"]


class Microbatch(dict):
    """A mapping of the trainer's tensors (what its step and loss read, unchanged) and, beside
    them:

    Attributes:
        rows: the rows it holds, as positions into the rank's rows of the step (after the
            exchange: the plan's order).
        shape: its padded shape (rows, then each padded width: ``(rows, length)``, or
            ``(rows, prompt, completion)`` for left/right-padded rollouts).
        weights: per-row weights, each a tensor over its rows (the weight of a row's summed
            token losses that reproduces the trainer's normalization for the whole step), or
            per-row facts the loss needs beside them; empty when the loss is weighted per token.
        token_weight: the weight of every loss token (a loss normalized by the step's token
            count over all ranks: ``world / tokens``), or None.
    """

    def __init__(
        self,
        tensors: Mapping,
        rows: Sequence[int] = (),
        shape: tuple[int, ...] = (),
        weights: Mapping[str, torch.Tensor] | None = None,
        token_weight: float | None = None,
    ):
        super().__init__(tensors)
        self.rows = list(rows)
        self.shape = tuple(shape)
        self.weights = dict(weights or {})
        self.token_weight = token_weight

    @property
    def padded_tokens(self) -> int:
        """Its tokens once padded (rows times the sum of the padded widths)."""
        if not self.shape:
            return 0
        return self.shape[0] * sum(self.shape[1:])

    def __repr__(self) -> str:
        return (
            f"Microbatch(rows={self.rows}, shape={self.shape}, keys={sorted(map(str, self))}, "
            f"weights={sorted(self.weights)}, token_weight={self.token_weight})"
        )
