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


# The params argument of a push of every trainable parameter in key order (the C++ side uses the
# runs merged at connect for it); never modified.
_ALL_PARAMS: list = []


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
        key = self._entry
        if (
            key.fast_push
            and not key.any_user
            and _fsdp2.reduce_scatter_order(key.unit) is key._order
        ):
            # The common push, one C++ call: every trainable parameter got a gradient (in key
            # order) and holds its placeholder; the call clears them (FSDP2 sets .grad next) and
            # pushes. False: it changed nothing, and the general path below runs.
            work = key.calls.push_all(
                output_tensor, input_tensor, op, key.push_scale(input_tensor.dtype), async_op
            )
            if work is not False:
                key.reduced = key._all_reduced
                return work
        params = key.take_pushed_params(input_tensor.numel() // key.world)
        sets_grad = not key.hsdp or _fsdp2.sets_grad_after_reduce_scatter(key.unit)
        if sets_grad and key.hsdp:
            raise RuntimeError(
                f"torch_odc: {handle._where()}: FSDP2's per-microbatch all-reduce across "
                f"HSDP replicas is on for '{key.name}' (set_requires_gradient_sync(True) or "
                "set_requires_all_reduce(True) after its forward): under ODC replicas meet once, "
                "in torch_odc.minibatch_barrier(), and may run different microbatch counts. "
                "Call set_requires_gradient_sync() before the forward."
            )
        if sets_grad:
            # FSDP2 sets .grad of these parameters right after this call (it would add into a
            # placeholder); the hook it calls next puts the placeholder back.
            key.take_placeholders(params)
        # What FSDP2 applies after the collective (its post-division; under HSDP the replicas'
        # averaging): ODC's output is zeros until the barrier, so it is applied to the push.
        scale = key.push_scale(input_tensor.dtype)
        if params is key._all_trainable and key._all_in_key_order:
            params = _ALL_PARAMS  # the same push, without converting the list
        if not key.fast_push:
            key.enable_fast_push()
        return handle._backend._keyed_reduce_scatter(
            self._key, output_tensor, input_tensor, op, params, scale, async_op
        )
