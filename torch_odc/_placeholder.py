"""What a sharded parameter's ``.grad`` holds between this rank's first microbatch of a minibatch
and its barrier: a no-memory placeholder tensor whose every use raises an error naming the
barrier, and the error for gradients ``zero_grad()`` would drop then."""

from __future__ import annotations

import torch

from torch_odc import _fsdp2


class _NoGradBeforeBarrier(torch.Tensor):
    """What a sharded parameter's ``.grad`` holds from this rank's first microbatch of a
    minibatch to its barrier: a tensor with the gradient's size, stride, dtype and device but no
    storage (no memory), whose every op raises an error naming the barrier. Under ODC the
    gradient exists only at the barrier (pushed into the owners' accumulators until then); a
    None there would let ``clip_grad_norm_`` or a grad-norm log silently see no gradient (HF
    Trainer clips before any callback). ``.grad is None`` checks, assigning ``.grad`` and
    reading its metadata still work."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, size, stride, dtype, device, param: str, where):
        self = torch.Tensor._make_wrapper_subclass(
            cls, size, strides=stride, dtype=dtype, device=device, requires_grad=False
        )
        self._param, self._where = param, where
        return self

    def _message(self, what: str) -> str:
        return (
            f"torch_odc: {self._where()}: the gradient of {self._param} was used ({what}) "
            "between this rank's first microbatch of the minibatch and "
            "torch_odc.minibatch_barrier(). Under on-demand communication gradients are reduced "
            "at the barrier; until then .grad holds none. Call torch_odc.minibatch_barrier() on "
            "every rank after the minibatch's last backward, then read, clip or log gradients "
            "(clip_grad_norm_, grad norms), then optimizer.step()."
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        placeholder = next(t for t in tree_leaves((args, kwargs or {})) if isinstance(t, cls))
        if "zero_" in str(func):  # zero_grad(set_to_none=False)
            raise RuntimeError(_dropped_message(placeholder._where(), [placeholder._param]))
        raise RuntimeError(placeholder._message(str(func)))

    def __repr__(self) -> str:
        return f"<no gradient before torch_odc.minibatch_barrier(): {self._param}>"


def _is_placeholder(grad) -> bool:
    return grad is not None and isinstance(_fsdp2.local_tensor(grad), _NoGradBeforeBarrier)


def _dropped_message(where: str, names: list[str]) -> str:
    return (
        f"torch_odc: {where}: zero_grad() on {', '.join(names[:3])}"
        f"{', ...' if len(names) > 3 else ''} between this rank's first forward of the "
        "minibatch and torch_odc.minibatch_barrier(): under on-demand communication gradients "
        "cannot be dropped then (each backward pushed them to their owners; a gradient kept "
        "from the last minibatch stays in the accumulator). Call optimizer.zero_grad() after "
        "optimizer.step() and before the next forward (evaluation forwards included)."
    )
