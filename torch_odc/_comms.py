"""The comm objects attach() installs through FSDP2's ``set_custom_all_gather`` /
``set_custom_reduce_scatter``: per module, an all-gather and a reduce-scatter that FSDP2 calls
as it would call ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, served by the engine
(one call into the backend, keyed by the module's index) instead of a collective."""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING

import torch

from torch_odc import _fsdp2
from torch_odc._clock import _profiling

if TYPE_CHECKING:
    from torch_odc._handle import Handle


class _KeyedAllGather(_fsdp2.AllGather):
    """FSDP2's all-gather of one unit, served by the engine: one call into the backend (no c10d
    dispatch). Synchronous calls return None, as ``all_gather_into_tensor`` does: the copy is
    ordered on the current stream (FSDP2's all-gather stream), which FSDP2 orders by events."""

    def __init__(self, handle: Handle, key: int):
        self._handle, self._key = handle, key

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        t0 = perf_counter()
        handle = self._handle
        try:
            if not handle._entered:
                handle._enter_minibatch()
            if group is not handle._group:
                raise RuntimeError(handle._wrong_group(self._key, "all-gather", group))
            if not handle._all_published:
                handle._publish_key(self._key)
            return handle._backend._keyed_all_gather(
                self._key, output_tensor, input_tensor, async_op
            )
        finally:
            handle._clock_gather.s += perf_counter() - t0


class _KeyedReduceScatter(_fsdp2.ReduceScatter):
    def __init__(self, handle: Handle, key: int):
        self._handle, self._key = handle, key
        self._entry = handle._keys[key]

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        t0 = perf_counter()
        try:
            if _profiling():
                with torch.profiler.record_function("odc::reduce_scatter_call"):
                    return self._call(output_tensor, input_tensor, group, op, async_op)
            return self._call(output_tensor, input_tensor, group, op, async_op)
        finally:
            self._handle._clock_push.s += perf_counter() - t0

    def _call(self, output_tensor, input_tensor, group, op, async_op):
        handle = self._handle
        if not handle._entered:
            handle._enter_minibatch()
        if group is not handle._group:
            raise RuntimeError(handle._wrong_group(self._key, "reduce-scatter", group))
        # The common push or the general path: the choice is the key's (_Key.push).
        return self._entry.push(
            handle._backend, self._key, output_tensor, input_tensor, op, async_op
        )
