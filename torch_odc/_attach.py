"""FSDP2 attach, the minibatch barrier and stats: the Python face of the on-demand engine.

attach() installs, through FSDP2's public ``set_custom_all_gather`` / ``set_custom_reduce_scatter``
hooks, comm objects that tag each call with the module's key and then call the ordinary
``all_gather_into_tensor`` / ``reduce_scatter_tensor``; the odc backend sees the key and serves the
call from the engine (csrc/engine) instead of a collective.
"""

from __future__ import annotations

import os
import warnings
from operator import is_
from time import perf_counter

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torch_odc import _C, _fsdp2
from torch_odc._backend import odc_backend

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}
_handles: list[Handle] = []
# HSDP: the accumulators are all-reduced across replicas in buckets of at most this size.
_REPLICA_BUCKET_BYTES = 256 << 20
# The params argument of a push of every trainable parameter in key order (the C++ side uses the
# runs merged at connect for it); never modified.
_ALL_PARAMS: list = []


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
            cls, size, strides=stride, dtype=dtype, device=device, requires_grad=False)
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


# Whether the profiler records (one C call): the per-call ranges below exist only then, since a
# record_function costs more than the rest of a keyed call's Python.
_profiling = torch.autograd._profiler_enabled


class _HostClock:
    """Host seconds spent in ODC's entry points (the comm calls FSDP2 makes, ODC's forward,
    gradient and optimizer hooks, the barrier; the C++ calls they make included):
    ``torch_odc.stats()[i]["host_s"]``, and by entry point in ``host_by_kind_s`` (one clock
    each, below). The barrier's waits are in it; the engine reports them apart
    (``barrier_wait_s``). Not counted: the C++ hooks on the gradient accumulators that note
    which parameters got a gradient (a bit each, no Python)."""

    __slots__ = ("s",)

    def __init__(self):
        self.s = 0.0


# The entry points with a host clock each: FSDP2's all-gather / reduce-scatter comm calls, a
# unit's forward pre-hook, the sharded-.grad hook FSDP2 calls after a reduce-scatter, the root's
# forward pre-hook (entry into the minibatch and the eager publish), the barrier, the optimizer's
# step pre-hook.
_CLOCK_KINDS = ("gather", "push", "unit_pre_forward", "grad_hook", "root_pre_forward", "barrier",
                "step_hook")


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
            return handle._backend._keyed_all_gather(self._key, output_tensor, input_tensor,
                                                     async_op)
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
        if (key.fast_push and not key.any_user
                and _fsdp2.reduce_scatter_order(key.unit) is key._order):
            # The common push, one C++ call: every trainable parameter got a gradient (in key
            # order) and holds its placeholder; the call clears them (FSDP2 sets .grad next) and
            # pushes. False: it changed nothing, and the general path below runs.
            work = key.calls.push_all(output_tensor, input_tensor, op,
                                      key.push_scale(input_tensor.dtype), async_op)
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
            self._key, output_tensor, input_tensor, op, params, scale, async_op)


class _Key:
    """One FSDP2 module served on demand: its shard layout, and which of its parameters got a
    gradient in backward since its last reduce-scatter (FSDP2 reduce-scatters exactly those)."""

    def __init__(self, unit: _fsdp2.Unit, world: int):
        self.unit, self.world = unit, world
        self.name = unit.name
        self.gather_dtype = _fsdp2.gather_dtype(unit, unit.params[0])
        self.accum_dtype = torch.float64 if self.gather_dtype == torch.float64 else torch.float32
        self.shard_numel = sum(_fsdp2.padded_shard_numel(fp) for fp in unit.params)
        # Frozen parameters have no accumulator span (and cost no accumulator memory).
        self.grad_numels = [
            _fsdp2.padded_shard_numel(fp) if _fsdp2.trainable(fp) else 0 for fp in unit.params
        ]
        self.accum_offsets = [sum(self.grad_numels[:i]) for i in range(len(unit.params))]
        # (index, FSDPParam) of the parameters with an accumulator span (fixed at attach).
        self._trainable_params = [(i, fp) for i, fp in enumerate(unit.params)
                                  if self.grad_numels[i]]
        self.prev_all_gather, self.prev_reduce_scatter = _fsdp2.comms(unit)
        # Set by attach: the C++ side of this key's pushes (_C.KeyCalls): which parameters got a
        # gradient since the last push (noted by C++ hooks on the unsharded parameters'
        # gradient accumulators), and the common push in one call (fast_push: enabled).
        self.calls = None
        self.fast_push = False
        self.accumulator: torch.Tensor | None = None  # set at attach (a view of the region)
        # Per parameter, what its sharded .grad was when this rank entered the minibatch (see
        # Handle._enter_minibatch): None, _CARRY (a view of its accumulator span, kept there),
        # _USER (another tensor, left in .grad) or a tensor (HSDP: a copy of the view).
        self.prior: list = [None] * len(unit.params)
        self._grad_hooks: list = []
        self.hsdp = _fsdp2.replicate_group(unit) is not None
        # Parameters reduce-scattered since this rank entered the minibatch (replaced, never
        # changed in place: it may be _all_reduced).
        self.reduced: set[int] | frozenset[int] = set()
        self._all_reduced: frozenset[int] = frozenset()  # every trainable parameter
        self._where = None  # set by attach: "rank r, minibatch m" for messages
        # Made once and reused every minibatch (no tensor or DTensor built per call): per
        # parameter its accumulator span (set_accumulator), the DTensor .grad that views it
        # (first barrier) and the no-memory placeholder (first use, after FSDP2's lazy init).
        self.spans: list = [None] * len(unit.params)
        self._grad_views: list = [None] * len(unit.params)
        self._placeholders: list = [None] * len(unit.params)
        self._scales: dict = {}  # push_scale by (reduce dtype, FSDP2's divide settings)
        # The handle's clocks of the unit pre-forward hook and the .grad hook (set by attach).
        self.clock, self.grad_clock = _HostClock(), _HostClock()
        self._order = None  # take_pushed_params: FSDP2's order, and every trainable one in it
        self._all_trainable: list[int] = []
        self._all_trainable_set: set[int] = set()
        self._all_numel = 0
        self._all_in_key_order = False  # _all_trainable is every trainable index, ascending
        self._all_fps: list = []  # the FSDPParams of _all_trainable
        self._all_placeholders: list | None = None  # theirs, once all made (else None)
        # The sharded parameters fast_push swaps .grad of (FSDP2 may replace them: _apply).
        self._fast_params: list = []
        self._hooked_params: list = []  # the sharded parameters hook_sharded_grads hooked
        # Whether some prior is _USER (set where prior changes): the fast paths skip it.
        self.any_user = False
        # watch_grads: the unsharded parameters at its last full pass, and those of them it
        # left unhooked because they did not require grad (None: no pass yet).
        self._watched: tuple | None = None
        self.watch_due = True  # watch_grads at the next forward (set when entering a minibatch)
        # This minibatch was entered by calls.place_all: every prior is None, no .grad was kept.
        self.entered_clean = False

    def set_accumulator(self, accumulator: torch.Tensor | None) -> None:
        self.accumulator = accumulator
        self.spans = [None] * len(self.unit.params)
        self._grad_views = [None] * len(self.unit.params)
        if accumulator is None:
            return
        for index, fp in enumerate(self.unit.params):
            if self.grad_numels[index]:
                self.spans[index] = _fsdp2.shard_view(fp, accumulator, self.accum_offsets[index])

    def grad_view(self, index: int):
        """Parameter `index`'s sharded .grad as FSDP2 sets it (a DTensor), viewing its span."""
        view = self._grad_views[index]
        if view is None:
            view = self._grad_views[index] = _fsdp2.sharded_dtensor(
                self.unit.params[index], self.spans[index])
        return view

    def push_scale(self, reduce_dtype: torch.dtype) -> float:
        """`_fsdp2.push_scale`, cached per reduce dtype and divide settings (read per call:
        set_gradient_divide_factor may change them between minibatches)."""
        cache_key = (reduce_dtype, *_fsdp2.divide_settings(self.unit))
        scale = self._scales.get(cache_key)
        if scale is None:
            scale = self._scales[cache_key] = _fsdp2.push_scale(self.unit, reduce_dtype)
        return scale

    def spec(self) -> tuple:
        return (self.name, self.shard_numel, _DTYPE_NAMES[self.gather_dtype], self.grad_numels,
                _DTYPE_NAMES[self.accum_dtype])

    def before_forward(self) -> None:
        t0 = perf_counter()
        try:
            if _profiling():
                with torch.profiler.record_function("odc::unit_pre_forward"):
                    return self._before_forward()
            return self._before_forward()
        finally:
            self.clock.s += perf_counter() - t0

    def _before_forward(self) -> None:
        if self.watch_due:  # once per minibatch: FSDP2 makes the unsharded parameters once
            self.watch_due = False
            self.watch_grads()
        self.restore_placeholders()
        if self.hsdp:
            # set_requires_gradient_sync(True) (the last microbatch of no-sync accumulation)
            # also turns FSDP2's per-microbatch all-reduce across replicas back on: replicas
            # running different microbatch counts would hang in it. ODC all-reduces once, at
            # the barrier.
            self.unit.module.set_requires_all_reduce(False, recurse=False)
        # HSDP with FSDP2's all-reduce off: FSDP2 adds each backward's reduce-scatter output
        # (zeros under ODC) into a partial buffer, which torch 2.11 cannot do once the set of
        # parameters with a gradient changes between microbatches. Nothing in it is needed.
        _fsdp2.drop_partial_reduce_output(self.unit)

    def watch_grads(self) -> None:
        """Hooks every unsharded parameter (created by FSDP2 at its first all-gather, then
        reused) so that a gradient autograd accumulates into it is recorded. Nothing to do
        when they are the objects of its last pass and none it left unhooked for not requiring
        grad requires it now."""
        params = _fsdp2.unsharded_params(self.unit)
        last = self._watched
        if (last is not None and all(map(is_, params, last[0]))
                and not (last[1] and any(p.requires_grad for p in last[1]))):
            return
        self._watched = (params, [p for p in params if p is not None and not p.requires_grad])
        calls = self.calls
        for index, param in enumerate(params):
            if param is not None and param.requires_grad:
                calls.watch(index, param)  # a no-op where it already watches this tensor

    def unwatch_grads(self) -> None:
        self.disable_fast_push()
        self.calls.unwatch_all()
        self._watched = None
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()

    def hook_sharded_grads(self) -> None:
        """FSDP2's post-reduce sets each sharded .grad to a view of the reduce-scatter output
        (zeros under ODC: the gradient arrives at the barrier), a shard-sized buffer per module
        kept until the barrier. A hook FSDP2 calls right after drops it again, so during the
        microbatches .grad holds nothing (a .grad of the user's own is left alone)."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()
        self._hooked_params = _fsdp2.sharded_params(fp for _, fp in self._trainable_params)
        for (index, _), param in zip(self._trainable_params, self._hooked_params):
            self._grad_hooks.append(param.register_post_accumulate_grad_hook(
                lambda p, i=index: self._drop_fsdp_grad(i, p)))

    def _drop_fsdp_grad(self, index: int, param) -> None:
        # `param` is the sharded parameter FSDP2 calls the hook with (its ``sharded_param``).
        t0 = perf_counter()
        if self.prior[index] is not _USER:
            placeholder = self._placeholders[index]
            if placeholder is None:
                self.place_placeholder(index)
            else:
                param.grad = placeholder
        self.grad_clock.s += perf_counter() - t0

    def place_placeholder(self, index: int) -> None:
        """Puts the no-memory placeholder in parameter `index`'s ``.grad`` (see
        :class:`_NoGradBeforeBarrier`), made once per parameter."""
        fp = self.unit.params[index]
        placeholder = self._placeholders[index]
        if placeholder is None:
            size, stride, dtype, device = _fsdp2.grad_meta(fp)
            placeholder = self._placeholders[index] = _fsdp2.sharded_dtensor(
                fp, _NoGradBeforeBarrier(size, stride, dtype, device,
                                         _param_name(self.unit, index), self._where))
            self._all_placeholders = None
            self.disable_fast_push()
        _fsdp2.sharded_param(fp).grad = placeholder

    def forget_placeholders(self) -> None:
        """Drops the cached placeholders (FSDP2's lazy init may change the gradient dtype)."""
        self._placeholders = [None] * len(self.unit.params)
        self._all_placeholders = None
        self.disable_fast_push()

    def restore_placeholders(self) -> None:
        """Puts the placeholder back where zero_grad() (to None) dropped nothing: no gradient
        kept from the last minibatch, none pushed in this one (e.g. zero_grad() after an
        evaluation forward that started the minibatch)."""
        prior, reduced = self.prior, self.reduced
        if reduced is self._all_reduced or (self.fast_push and self.calls.all_grads_set()):
            return  # every parameter reduced, or none whose .grad is None
        for index, fp in self._trainable_params:
            if (prior[index] is None and index not in reduced
                    and _fsdp2.sharded_param(fp).grad is None):
                self.place_placeholder(index)

    def dropped_grads(self) -> list[str]:
        """Parameters whose placeholder was replaced by None (``zero_grad()``) after this rank
        entered the minibatch, where that drops a gradient ODC cannot drop: one carried from
        the last minibatch (kept in the accumulator span), or one already pushed in this
        minibatch. Dropping before anything was carried or pushed changes nothing."""
        return [_param_name(self.unit, i) for i, fp in enumerate(self.unit.params)
                if self.grad_numels[i] and self.prior[i] is not _USER
                and _fsdp2.sharded_param(fp).grad is None
                and (self.prior[i] is not None or i in self.reduced)]

    def take_placeholders(self, params: list[int]) -> None:
        """Before FSDP2 sets the .grad of `params` after their reduce-scatter: removes their
        placeholders, raising first where the user dropped a gradient ODC cannot drop (as
        dropped_grads, for these parameters)."""
        if params is self._all_trainable and not self.any_user:
            # The common case, every trainable parameter with its placeholder in .grad: the
            # loop below would only clear them.
            placeholders = self._all_placeholders
            if placeholders is None:
                placeholders = self._make_all_placeholders()
            grads = _fsdp2.sharded_grads(self._all_fps)
            if placeholders is not None and all(map(is_, grads, placeholders)):
                self.reduced = self._all_reduced
                _fsdp2.clear_sharded_grads(self._all_fps)
                return
        prior, reduced, fps = self.prior, self.reduced, self.unit.params
        placeholders = self._placeholders
        grads = [_fsdp2.sharded_param(fps[i]).grad for i in params]
        if any(grad is None for grad in grads):
            dropped = [_param_name(self.unit, i) for i, grad in zip(params, grads)
                       if grad is None and prior[i] is not _USER
                       and (prior[i] is not None or i in reduced)]
            if dropped:
                raise RuntimeError(_dropped_message(self._where(), dropped))
        self.reduced = reduced.union(params)
        for index, grad in zip(params, grads):
            if grad is not None and prior[index] is not _USER and (
                    grad is placeholders[index] or _is_placeholder(grad)):
                _fsdp2.sharded_param(fps[index]).grad = None

    def _make_all_placeholders(self) -> list | None:
        """The placeholders of `_all_trainable`, in its order, cached once every one is made."""
        placeholders = [self._placeholders[i] for i in self._all_trainable]
        if any(p is None for p in placeholders):
            return None
        self._all_placeholders = placeholders
        return placeholders

    def enable_fast_push(self) -> None:
        """Hands the common push to C++ (``calls.push_all``) once it can do it exactly as
        `take_pushed_params` + `take_placeholders` would: FSDP2 reduce-scatters in key order,
        every placeholder is made, no HSDP (FSDP2 may keep the output apart)."""
        if self.hsdp or self._order is None or not self._all_in_key_order or not self._all_fps:
            return
        placeholders = self._all_placeholders or self._make_all_placeholders()
        if placeholders is None:
            return
        self._fast_params = [_fsdp2.sharded_param(fp) for fp in self._all_fps]
        self.calls.set_placeholders(self._all_trainable, self._fast_params, placeholders)
        self.fast_push = True
        # The barrier's .grad in C++ too, where each is the span's own view (no dtype cast).
        if all(self.spans[i].dtype == _fsdp2.grad_dtype(self.unit.params[i])
               for i in self._all_trainable):
            self.calls.set_views([self.grad_view(i) for i in self._all_trainable])

    def disable_fast_push(self) -> None:
        if self.fast_push:
            self.calls.set_placeholders([], [], [])
            self.fast_push = False

    def check_params(self) -> bool:
        """Whether the sharded parameters are the ones hooked (hook_sharded_grads) and, with
        fast_push, handed to C++. FSDP2 replaces them in ``reset_sharded_param`` (after
        ``load_state_dict(assign=True)`` or ``module._apply``): then the .grad hooks move to the
        new ones and fast_push turns off (the next push turns it on again with them), and this
        returns False. Runs when this rank enters a minibatch and at the barrier."""
        if all(map(is_, _fsdp2.sharded_params(fp for _, fp in self._trainable_params),
                   self._hooked_params)):
            return True
        self.disable_fast_push()
        self.hook_sharded_grads()
        return False

    def span(self, index: int) -> torch.Tensor:
        """Parameter `index`'s sharded gradient as a view of its accumulator span."""
        return self.spans[index]

    def take_pushed_params(self, chunk_numel: int) -> list[int]:
        """The parameters one reduce-scatter input covers, in the input's order: those that got
        a gradient since the last one (or, where FSDP2 reduce-scatters zeros for unused
        parameters, every trainable one). Raises rather than guess."""
        order = _fsdp2.reduce_scatter_order(self.unit)
        if order is not self._order:  # FSDP2's order object (made at its lazy init)
            self._order = order
            self._all_trainable = [i for i in order if self.grad_numels[i] > 0]
            self._all_trainable_set = set(self._all_trainable)
            self._all_numel = sum(self.grad_numels[i] for i in self._all_trainable)
            self._all_in_key_order = self._all_trainable == [
                i for i, n in enumerate(self.grad_numels) if n]
            self._all_fps = [self.unit.params[i] for i in self._all_trainable]
            self._all_reduced = frozenset(self._all_trainable)
            self._all_placeholders = None
            self.disable_fast_push()
        pushed = set(self.calls.take_pushed())
        if pushed == self._all_trainable_set and chunk_numel == self._all_numel:
            return self._all_trainable  # every trainable parameter, in order
        candidates = [[i for i in order if i in pushed]]
        if _fsdp2.reduces_unused_params(self.unit):
            candidates.append([i for i in order if self.grad_numels[i] > 0])
        for params in candidates:
            if sum(self.grad_numels[i] for i in params) == chunk_numel:
                return params
        names = [_param_name(self.unit, i) for i in candidates[0]]
        raise RuntimeError(
            f"torch_odc: reduce-scatter of FSDP unit '{self.name}' covers {chunk_numel} elements "
            f"per rank, but the parameters that got a gradient since its last reduce-scatter "
            f"({', '.join(names) or 'none'}) add up to "
            f"{sum(self.grad_numels[i] for i in candidates[0])}. Parameters frozen after attach "
            "(requires_grad changed) need a re-attach."
        )

    def pending_grads(self) -> list[str]:
        return [_param_name(self.unit, i) for i in self.calls.pushed()]


def _param_name(unit: _fsdp2.Unit, index: int) -> str:
    return unit.param_names[index]


class Handle:
    """The attachment of one FSDP2 model to the odc backend; see :func:`attach`."""

    def __init__(self, model, backend, keys: list[_Key], device: torch.device,
                 eager_publish: bool = True, replicate_group=None):
        self.model, self._backend, self._keys, self.device = model, backend, keys, device
        self._replicate = replicate_group  # HSDP: one all-reduce per minibatch across replicas
        self._group = None  # the shard group the engine runs over (set by attach)
        self._lazy_done = False  # FSDP2's lazy init of every unit ran (_lazy_init)
        self._clocks = {kind: _HostClock() for kind in _CLOCK_KINDS}
        self._clock_gather, self._clock_push = self._clocks["gather"], self._clocks["push"]
        for key in keys:
            key.clock = self._clocks["unit_pre_forward"]
            key.grad_clock = self._clocks["grad_hook"]
        self._attached = True
        self._eager = eager_publish
        self._publish_pending = eager_publish  # no forward has run in this minibatch yet
        self._hooks: list = []
        self._step_hook = None
        self._params = list(model.parameters())
        self._param_ids = {id(p) for p in self._params}
        # Misuse detection: a barrier since attach, and the optimizers stepped since the last one.
        self._barrier_done = False
        self._stepped: set[int] = set()
        # Whether this rank entered the minibatch in progress (released the last one's
        # gradients): at its first forward or keyed call after a barrier, or at the next barrier.
        self._entered = False

    @property
    def keys(self) -> list[str]:
        return [k.name for k in self._keys]

    def _where(self) -> str:
        info = self._backend._stats()
        # Between a barrier and this rank's next keyed call the engine is still in the finished
        # minibatch; what the user runs then belongs to the next one.
        minibatch = info["minibatch"] + (1 if self._backend._arrived else 0)
        return f"rank {info['rank']}, minibatch {minibatch}"

    def _wrong_group(self, key: int, op: str, group) -> str:
        return (f"torch_odc: {self._where()}: FSDP2's {op} of '{self._keys[key].name}' came "
                f"with process group {group}, not the group the model was attached over "
                f"({self._group}); re-attach after changing the mesh")

    def _lazy_init(self) -> None:
        """FSDP2's lazy init of every unit (idempotent; what its own ``unshard()`` runs first):
        it may re-pad the sharded parameters (after ``load_state_dict(assign=True)``) and sets
        the mixed-precision dtypes, so it runs before the first publish reads the shards."""
        if self._lazy_done:
            return
        for key in self._keys:
            _fsdp2.lazy_init(key.unit)
            key.forget_placeholders()
        self._lazy_done = True

    def barrier(self) -> None:
        t0 = perf_counter()
        try:
            self._barrier()
        finally:
            self._clocks["barrier"].s += perf_counter() - t0

    def _barrier(self) -> None:
        if not self._attached:
            raise RuntimeError("torch_odc: this model was detached")
        self._check_barrier()
        b = self._backend
        # (0) A rank that ran no microbatch enters the minibatch only now.
        self._enter_minibatch()
        # (1) Publish what this rank has not published in this minibatch (a rank that ran no
        # microbatch, or attached with eager_publish=False).
        self._publish_unpublished()
        # (2) Wait until every rank has arrived: all pushes into our accumulators have landed.
        b._arrive()
        # (3) Finalize: .grad from the accumulators. They are released (zeroed, and open to the
        # next minibatch's pushes) when this rank enters the next minibatch, after its optimizer
        # step: peers' pushes of that minibatch wait for it.
        self._entered = False
        self._publish_pending = self._eager
        got_grad = [b._grad_params(index) for index in range(len(self._keys))]
        if self._replicate is not None:
            got_grad = self._reduce_across_replicas(got_grad)
        for index, key in enumerate(self._keys):
            # A unit a forward without backward left unsharded (an evaluation, a root with
            # reshard_after_forward=False) on a rank that then ran no microbatch: FSDP2 reshards
            # only in post-backward, so the unsharded parameters would stay registered on the
            # module (clipping and the optimizer would see them, without .grad) and be reused,
            # stale, after the optimizer step. Reshard as post-backward would have, after ending
            # a forward FSDP2 left unfinished (a unit one of whose modules never ran).
            _fsdp2.end_unfinished_forward(key.unit)
            key.unit.module.reshard()
            _finalize(key, got_grad[index])
            _fsdp2.drop_partial_reduce_output(key.unit)
        self._barrier_done, self._stepped = True, set()

    def _enter_minibatch(self) -> None:
        """Starts this rank's next minibatch, once, before its first keyed call (or in the
        barrier, for a rank that runs no microbatch): after the optimizer step, gradient
        clipping and zero_grad() of the last one. Records what each sharded .grad holds, so
        that the barrier can add the next gradient to it as FSDP2 would, zeroes the accumulator
        spans that do not carry it, and releases the accumulators to the peers' pushes."""
        if self._entered or not self._attached:
            return
        self._lazy_init()
        self._entered = True
        b = self._backend
        releasing = b._arrived  # False only before the first minibatch after attach
        carried = False
        for key in self._keys:
            key.reduced = set()
            key.watch_due = True
            if not key.check_params():  # replaced: the step check must know the new ones
                self._params = list(self.model.parameters())
                self._param_ids = {id(p) for p in self._params}
            # The common case in one C++ call: no parameter kept a .grad (zero_grad() to None),
            # so every prior stays None (the barrier left them so) and each gets its placeholder.
            key.entered_clean = key.fast_push and key.calls.place_all()
            if key.entered_clean:
                key.any_user = False
                continue
            for index, fp in enumerate(key.unit.params):
                if key.grad_numels[index] == 0:
                    continue
                grad = _fsdp2.sharded_grad(fp)
                if grad is None or isinstance(grad, _NoGradBeforeBarrier):
                    key.prior[index] = None
                elif releasing and (grad is key.spans[index]
                                    or _same_view(grad, key.spans[index])):
                    # Not zero_grad()-ed (or zeroed in place): the next gradient adds to it.
                    # Across HSDP replicas the accumulators are summed, so it is kept apart.
                    key.prior[index] = (grad.clone() if self._replicate is not None else _CARRY)
                    carried = carried or key.prior[index] is _CARRY
                else:
                    key.prior[index] = _USER
                if key.prior[index] is not _USER:
                    # FSDP2 must not add into the accumulator; reads raise until the barrier.
                    key.place_placeholder(index)
            key.any_user = any(p is _USER for p in key.prior)
        if not releasing:
            return  # fresh accumulators: zero since connect
        with self._release_stream():
            if carried:
                for key in self._keys:
                    for index in range(len(key.unit.params)):
                        if key.grad_numels[index] and key.prior[index] is not _CARRY:
                            key.span(index).zero_()
            b._release(zero=not carried)

    def _release_stream(self):
        """On CUDA: the current stream, ordered after the default stream (where the optimizer
        step ran), so that the zeroing and the release follow the step."""
        if self.device.type != "cuda":
            import contextlib

            return contextlib.nullcontext()
        current = torch.cuda.current_stream(self.device)
        default = torch.cuda.default_stream(self.device)
        if current != default:
            current.wait_stream(default)
        return torch.cuda.stream(current)

    def _reduce_across_replicas(self, got_grad: list[list[bool]]) -> list[list[bool]]:
        """HSDP: every replica's shard group has arrived, so its accumulators are final. Sums
        them over the replicate group (the inner backend: NCCL for CUDA, Gloo for CPU) in a few
        large buckets, and ORs which parameters got a gradient on any replica. Pushes were
        already scaled for FSDP2's averaging over the replicas, so the sum is the gradient."""
        group = self._replicate
        flags = torch.tensor([g for key in got_grad for g in key], dtype=torch.uint8)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        section = self._backend._accumulator_section()
        per_bucket = _REPLICA_BUCKET_BYTES // section.element_size()
        for start in range(0, section.numel(), per_bucket):
            dist.all_reduce(section[start:start + per_bucket], group=group)
        out, at = [], 0
        for key in got_grad:
            out.append([bool(f) for f in flags[at:at + len(key)].tolist()])
            at += len(key)
        return out

    def _check_barrier(self) -> None:
        """Raises, before anything changes, on a barrier that would silently train wrong."""
        dropped = [n for k in self._keys for n in k.dropped_grads()] if self._entered else []
        if dropped:
            raise RuntimeError(_dropped_message(self._where(), dropped))
        pending = [n for k in self._keys for n in k.pending_grads()]
        if pending:
            raise RuntimeError(
                f"torch_odc: {self._where()}: minibatch_barrier() while gradients of "
                f"{', '.join(pending[:3])}{', ...' if len(pending) > 3 else ''} were never "
                "reduce-scattered (set_requires_gradient_sync(False) on the minibatch's last "
                "microbatch?). Enable gradient sync for the last backward of every minibatch."
            )
        if self._barrier_done and not self._stepped and any(
                p.grad is not None and not _is_placeholder(p.grad) for p in self._params):
            raise RuntimeError(
                f"torch_odc: {self._where()}: a second minibatch_barrier() without "
                "optimizer.step() since the last one would add this minibatch's gradients onto "
                "the last one's. Call optimizer.step() (or optimizer.zero_grad() to drop them) "
                "between two barriers."
            )

    def _publish_unpublished(self) -> None:
        """Publishes every key this rank has not published in this minibatch: one copy of each
        unit's shards into its published cache, exactly the bytes FSDP2's all-gather would send
        (its all-gather input: each parameter's padded shard, cast to the param dtype; no
        unsharded parameter is allocated and nothing is gathered), all units in one multi-tensor
        copy on the current stream (after the optimizer step). A publish reads no peer and waits
        for nobody, so this cannot deadlock."""
        self._lazy_init()
        keys, sources = [], []
        for index, key in enumerate(self._keys):
            dtype, shards = _fsdp2.all_gather_input(key.unit)
            if dtype != key.gather_dtype:
                raise RuntimeError(
                    f"torch_odc: {self._where()}: FSDP2 now all-gathers '{key.name}' in {dtype}, "
                    f"but it was attached with {key.gather_dtype}; re-attach after changing "
                    "parameter or mixed-precision dtypes")
            keys.append(index)
            sources.append(shards)
        self._backend._publish_shards(keys, sources)

    def _pre_forward(self, module, args) -> None:
        # The first forward of a minibatch publishes every shard up front. Published lazily (at
        # the owner's own all-gather of each module), a peer's first forward would wait at each
        # module for the owner to reach it: the first microbatch of every rank would advance
        # in lockstep with the slowest one, as under collectives (measured on 4 H200: up to
        # 0.23 s per minibatch on long-context SFT, docs/benchmarks.md).
        if not self._attached:
            return
        t0 = perf_counter()
        try:
            if not self._entered:
                self._enter_minibatch()
            if self._publish_pending:
                self._publish_pending = False
                if _profiling():
                    with torch.profiler.record_function("odc::publish_all"):
                        self._publish_unpublished()
                else:
                    self._publish_unpublished()
        finally:
            self._clocks["root_pre_forward"].s += perf_counter() - t0

    def _check_step(self, optimizer, args, kwargs) -> None:
        t0 = perf_counter()
        try:
            self._check_step_impl(optimizer)
        finally:
            self._clocks["step_hook"].s += perf_counter() - t0

    def _check_step_impl(self, optimizer) -> None:
        # Raises before the step changes anything. A step over this model's parameters needs
        # a barrier since this optimizer's last step (on a rank that ran no microbatch nothing
        # else would notice: peers would read its post-step shards in the minibatch), and no
        # forward in between (this rank's shards for the minibatch in progress are published:
        # peers would read the pre-step values).
        if not self._attached or not any(
            id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"]
        ):
            return
        if all(float(g.get("lr", 1.0)) == 0.0 for g in optimizer.param_groups):
            return  # changes no parameter: e.g. DCP's optimizer-state initialization
        if not self._barrier_done or id(optimizer) in self._stepped:
            raise RuntimeError(
                f"torch_odc: {self._where()}: optimizer.step() without "
                "torch_odc.minibatch_barrier() since "
                f"{'this optimizer last stepped' if self._barrier_done else 'attach'}: call the "
                "barrier on every rank after the minibatch's last backward (also on a rank that "
                "ran no microbatch), then step."
            )
        if self._entered:
            raise RuntimeError(
                f"torch_odc: {self._where()}: optimizer.step() after this rank started the next "
                "minibatch (a forward or an all-gather since the barrier): its shards are "
                "published and its gradients released. Call torch_odc.minibatch_barrier() after "
                "the minibatch's last backward and before optimizer.step(), and run no forward "
                "in between"
            )
        self._stepped.add(id(optimizer))

    def stats(self) -> dict:
        out = self._backend._stats()
        out["host_by_kind_s"] = {kind: c.s for kind, c in self._clocks.items()}
        out["host_s"] = sum(out["host_by_kind_s"].values())  # see _HostClock
        return out

    def detach(self) -> None:
        """Restores FSDP2's own all-gather and reduce-scatter and releases the engine.

        Collective, like attach: every rank of the group calls it. A rank frees its region only
        after every rank's ODC work has completed (a peer may still be reading its shards or
        pushing into its accumulators until then)."""
        if not self._attached:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self._group)
        for hook in [*self._hooks, self._step_hook]:
            if hook is not None:
                hook.remove()
        self._hooks, self._step_hook = [], None
        for key in self._keys:
            key.unwatch_grads()
            # .grad views of the accumulators outlive the region as copies.
            for index, fp in enumerate(key.unit.params):
                grad = _fsdp2.sharded_grad(fp)
                if isinstance(grad, _NoGradBeforeBarrier):
                    _fsdp2.set_grad(fp, None)
                elif key.grad_numels[index] and grad is not None and _same_view(
                        grad, key.span(index)):
                    _fsdp2.set_grad(fp, grad.clone())
            key.set_accumulator(None)
            if self._replicate is not None:
                key.unit.module.set_requires_all_reduce(True, recurse=False)
            key.unit.module.set_custom_all_gather(key.prev_all_gather)
            key.unit.module.set_custom_reduce_scatter(key.prev_reduce_scatter)
        self._backend._disconnect_engine()
        self._attached = False
        if self in _handles:
            _handles.remove(self)


_CARRY, _USER = "carry", "user"


def _dropped_message(where: str, names: list[str]) -> str:
    return (
        f"torch_odc: {where}: zero_grad() on {', '.join(names[:3])}"
        f"{', ...' if len(names) > 3 else ''} between this rank's first forward of the "
        "minibatch and torch_odc.minibatch_barrier(): under on-demand communication gradients "
        "cannot be dropped then (each backward pushed them to their owners; a gradient kept "
        "from the last minibatch stays in the accumulator). Call optimizer.zero_grad() after "
        "optimizer.step() and before the next forward (evaluation forwards included)."
    )


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _finalize(key: _Key, got_grad: list[bool]) -> None:
    """Gives every trainable parameter of `key` its ``.grad`` as FSDP2's post-backward would
    leave it after the minibatch: the reduced gradient, added to what ``.grad`` held before.
    Where the gradient dtype is the accumulator's (fp32 / fp64 models), ``.grad`` is a view of
    the accumulator span (no copy; released when this rank enters the next minibatch)."""
    if (key.entered_clean and key.check_params() and key.fast_push
            and key.calls.finalize(got_grad)):
        # Every prior None: .grad is the view where a gradient came, else None (one C++ call).
        key.entered_clean = False
        return
    key.entered_clean = False
    for index, fp in enumerate(key.unit.params):
        if key.grad_numels[index] == 0:
            continue
        prior, got = key.prior[index], got_grad[index]
        key.prior[index] = None
        span = key.span(index)
        if prior is _USER:  # the user's own tensor: FSDP2 adds into it
            if got:
                _fsdp2.add_grad(fp, span.to(dtype=_fsdp2.grad_dtype(fp), copy=True))
            continue
        if isinstance(prior, torch.Tensor):  # HSDP: what .grad held, kept apart from the sum
            span += prior
        if not got and prior is None:
            _fsdp2.set_grad(fp, None)
        elif span.dtype == _fsdp2.grad_dtype(fp):
            _fsdp2.sharded_param(fp).grad = key.grad_view(index)
        else:  # e.g. bf16 parameters without mixed precision: a copy, rounded once
            _fsdp2.set_grad(fp, span.to(dtype=_fsdp2.grad_dtype(fp), copy=True))
    key.any_user = False  # every prior is None again


def attach(model: torch.nn.Module, *, eager_publish: bool = True) -> Handle:
    """Serves every FSDP2 module of `model` on demand through the "odc" backend.

    Every rank must call it at the same point, after ``fully_shard``. From then on the ranks
    synchronize only in :func:`minibatch_barrier`, which must be called once per minibatch on
    every rank (before ``optimizer.step()``); between two barriers ranks may run different
    numbers of microbatches (zero included).

    With ``eager_publish`` (the default) the first forward of `model` in each minibatch first
    publishes this rank's shard of every module (after the optimizer step, before any layer
    runs), so that peers never wait for this rank to reach a module. With False each shard is
    published at this rank's own first all-gather of its module.
    """
    try:
        found = _fsdp2.units(model)
    except _fsdp2.Unsupported as e:
        raise NotImplementedError(f"torch_odc.attach: {e}") from None
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("torch_odc.attach: the model has no FSDP2 module; call fully_shard first")
    groups, devices = set(), set()  # (shard group, replicate group or None) per unit
    for unit in found:
        problem = _fsdp2.unsupported_reason(unit)
        if problem:
            raise NotImplementedError(f"torch_odc.attach: module '{unit.name}': {problem}")
        gather = _fsdp2.gather_dtype(unit, unit.params[0])
        if gather not in _DTYPE_NAMES:
            raise NotImplementedError(
                f"torch_odc.attach: module '{unit.name}': parameters in {gather}")
        groups.add((_fsdp2.shard_group(unit), _fsdp2.replicate_group(unit)))
        devices.add(_fsdp2.device(unit))
    if len(groups) != 1 or len(devices) != 1:
        raise NotImplementedError(
            "torch_odc.attach: every FSDP2 module must shard over the same process group and device"
        )
    (group, replicate), device = groups.pop(), devices.pop()
    backend = odc_backend(group)
    world = dist.get_world_size(group)
    entries = [_Key(unit, world) for unit in found]
    handle = Handle(model, backend, entries, device, eager_publish, replicate)
    handle._group = group
    reason = _collective_fallback_reason(group, device, replicate)
    if reason:
        warnings.warn(
            f"torch_odc.attach: {reason}; this model keeps collective semantics and "
            "minibatch_barrier() is a no-op for it.",
            stacklevel=2,
        )
        handle._attached = False
        return handle
    backend._connect_engine([k.spec() for k in entries],
                            device.index if device.type == "cuda" else -1)
    for index, key in enumerate(entries):
        key._where = handle._where
        key.calls = _C.KeyCalls(backend, index, len(key.unit.params))
        key.set_accumulator(backend._accumulator(index))
        key.hook_sharded_grads()
        if replicate is not None:  # FSDP2's per-microbatch all-reduce across replicas: off
            key.unit.module.set_requires_all_reduce(False, recurse=False)
        key.unit.module.set_custom_all_gather(_KeyedAllGather(handle, index))
        key.unit.module.set_custom_reduce_scatter(_KeyedReduceScatter(handle, index))
        # After FSDP2's own pre-forward (registered with prepend=True), which creates the
        # unsharded parameters at the unit's first all-gather. A unit of several modules runs
        # FSDP2's pre-forward at whichever of them runs first: each gets the hook.
        for module in key.unit.modules:
            handle._hooks.append(
                module.register_forward_pre_hook(lambda *_, k=key: k.before_forward()))
    # Before FSDP2's own root pre-forward (which may start the root's all-gather).
    handle._hooks.append(model.register_forward_pre_hook(handle._pre_forward, prepend=True))
    handle._step_hook = register_optimizer_step_pre_hook(handle._check_step)
    _handles.append(handle)
    return handle


def host_id() -> str:
    """This process's host, as attach compares it: ``ODC_HOST_ID`` if set (tests present ranks
    of one machine as several hosts with it), else the host name."""
    import socket

    return os.environ.get("ODC_HOST_ID") or socket.gethostname()


def _collective_fallback_reason(group, device: torch.device, replicate=None) -> str | None:
    """Why on-demand mode cannot run for this shard group and device, or None when it can.
    Collective over the group; every rank of it gets the same answer."""
    if device.type == "cuda" and not _C._has_cuda_transport():
        return "this build has no CUDA transport (built without an nvcc matching torch's CUDA)"
    if device.type not in ("cpu", "cuda"):
        return f"no on-demand transport for {device.type} tensors"
    if dist.get_world_size(group) == 1:
        if replicate is not None:
            return ("HSDP shard groups of one rank: FSDP2's own path runs (a reduce-scatter of "
                    "one and an all-reduce across replicas per microbatch)")
        return "a group of one rank has nothing to communicate (FSDP2 calls no collective)"
    if device.type == "cuda":
        # Collective: peer access and native atomics for every GPU pair, a kernel image here.
        problem = odc_backend(group)._cuda_transport_problem(device.index)
        if problem:
            return f"the CUDA IPC transport cannot run here: {problem}"
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, host_id(), group=group)
    if len(set(hosts)) > 1:
        n, per = len(set(hosts)), len(hosts) // len(set(hosts))
        if replicate is not None:
            return (f"its shard groups span {n} hosts; one-sided access needs each shard group "
                    "on one host: make the mesh's shard dimension the GPUs of one host")
        return (f"the group spans {n} hosts; one-sided access needs one host. Use hybrid "
                "sharding, on-demand inside each host and one all-reduce per minibatch across "
                f"them: mesh = init_device_mesh(device, ({n}, {per}), mesh_dim_names="
                '("replicate", "shard")); fully_shard(module, mesh=mesh)')
    return None


def minibatch_barrier() -> None:
    """The one synchronization point per minibatch of every attached model.

    When it returns, every parameter's ``.grad`` holds the gradient reduced over all ranks and
    all their microbatches since the previous barrier, as FSDP2 with gradient accumulation
    computes it. Call it on every rank, before ``optimizer.step()``.
    """
    if _profiling():
        with torch.profiler.record_function("odc::minibatch_barrier"):
            for handle in _handles:
                handle.barrier()
    else:
        for handle in _handles:
            handle.barrier()


def stats() -> list[dict]:
    """Per-rank counters of every attached model: for the minibatch in progress ("current"),
    the last completed one ("last") and all so far ("total")."""
    return [handle.stats() for handle in _handles]
