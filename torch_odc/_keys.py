"""One FSDP2 module ("key") served on demand, over a minibatch: its shard layout and accumulator
spans, which of its parameters got a gradient, the placeholders in their ``.grad``, and the
bookkeeping of its pushes (the general path in Python, the common one handed to C++:
``_C.KeyCalls``). The comm objects (_comms.py) and the handle (_handle.py) drive it."""

from __future__ import annotations

from operator import is_
from time import perf_counter

import torch

from torch_odc import _fsdp2
from torch_odc._clock import _HostClock, _profiling
from torch_odc._placeholder import _dropped_message, _is_placeholder, _NoGradBeforeBarrier

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}
# The params argument of a push of every trainable parameter in key order (the C++ side uses the
# runs merged at connect for it); never modified.
_ALL_PARAMS: list = []
# What _Key.prior holds for a parameter whose .grad is kept across the barrier: a view of its
# accumulator span, kept there (_CARRY), or a tensor of the user's own, left in .grad (_USER).
_CARRY, _USER = "carry", "user"


class _Key:
    """One FSDP2 module served on demand: its shard layout, and which of its parameters got a
    gradient in backward since its last reduce-scatter (FSDP2 reduce-scatters exactly those)."""

    def __init__(self, unit: _fsdp2.Unit, world: int):
        self.unit, self.world = unit, world
        self.name = unit.name
        self.gather_dtype = _fsdp2.gather_dtype(unit, unit.params[0])
        self.accum_dtype = torch.float64 if self.gather_dtype == torch.float64 else torch.float32
        # What the shard cache holds: the sharded parameters in their own dtype where a read can
        # turn them into the all-gather input (the same dtype, or fp32 rounded to bf16/fp16
        # mixed precision); they then move into the cache (no second copy of them). Otherwise
        # their all-gather input, copied in at each publish.
        source = _fsdp2.shard_dtype(unit)
        self.cache_dtype = (
            source
            if source is not None
            and (
                source == self.gather_dtype
                or (
                    source == torch.float32 and self.gather_dtype in (torch.bfloat16, torch.float16)
                )
            )
            else self.gather_dtype
        )
        self.shard_numel = sum(_fsdp2.padded_shard_numel(fp) for fp in unit.params)
        # Frozen parameters have no accumulator span (and cost no accumulator memory).
        self.grad_numels = [
            _fsdp2.padded_shard_numel(fp) if _fsdp2.trainable(fp) else 0 for fp in unit.params
        ]
        self.accum_offsets = [sum(self.grad_numels[:i]) for i in range(len(unit.params))]
        # (index, FSDPParam) of the parameters with an accumulator span (fixed at attach).
        self._trainable_params = [
            (i, fp) for i, fp in enumerate(unit.params) if self.grad_numels[i]
        ]
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
        self._hooked_ids: list[int] = []  # and the tensors inside them (see check_params)
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

    def drop_accumulator(self) -> None:
        """free_gradient_memory(): no view of the accumulators stays here or in C++ (the
        memory is returned once no ``.grad`` views it either)."""
        self.set_accumulator(None)
        if self.calls is not None:
            self.calls.set_views([])

    def refresh_accumulator(self, accumulator: torch.Tensor) -> None:
        """The accumulators of a new generation (after free_gradient_memory())."""
        self.set_accumulator(accumulator)
        if self.fast_push:
            self._set_fast_views()

    def _set_fast_views(self) -> None:
        # The barrier's .grad in C++ too, where each is the span's own view (no dtype cast).
        if all(
            self.spans[i].dtype == _fsdp2.grad_dtype(self.unit.params[i])
            for i in self._all_trainable
        ):
            self.calls.set_views([self.grad_view(i) for i in self._all_trainable])

    def grad_view(self, index: int):
        """Parameter `index`'s sharded .grad as FSDP2 sets it (a DTensor), viewing its span."""
        view = self._grad_views[index]
        if view is None:
            view = self._grad_views[index] = _fsdp2.sharded_dtensor(
                self.unit.params[index], self.spans[index]
            )
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
        return (
            self.name,
            self.shard_numel,
            _DTYPE_NAMES[self.gather_dtype],
            self.grad_numels,
            _DTYPE_NAMES[self.accum_dtype],
            _DTYPE_NAMES[self.cache_dtype],
        )

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
        if (
            last is not None
            and all(map(is_, params, last[0]))
            and not (last[1] and any(p.requires_grad for p in last[1]))
        ):
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
        self._hooked_ids = _tensor_ids(self._hooked_params)
        for (index, _), param in zip(self._trainable_params, self._hooked_params):
            self._grad_hooks.append(
                param.register_post_accumulate_grad_hook(
                    lambda p, i=index: self._drop_fsdp_grad(i, p)
                )
            )

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
                fp,
                _NoGradBeforeBarrier(
                    size, stride, dtype, device, _param_name(self.unit, index), self._where
                ),
            )
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
            if (
                prior[index] is None
                and index not in reduced
                and _fsdp2.sharded_param(fp).grad is None
            ):
                self.place_placeholder(index)

    def dropped_grads(self) -> list[str]:
        """Parameters whose placeholder was replaced by None (``zero_grad()``) after this rank
        entered the minibatch, where that drops a gradient ODC cannot drop: one carried from
        the last minibatch (kept in the accumulator span), or one already pushed in this
        minibatch. Dropping before anything was carried or pushed changes nothing."""
        return [
            _param_name(self.unit, i)
            for i, fp in enumerate(self.unit.params)
            if self.grad_numels[i]
            and self.prior[i] is not _USER
            and _fsdp2.sharded_param(fp).grad is None
            and (self.prior[i] is not None or i in self.reduced)
        ]

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
            dropped = [
                _param_name(self.unit, i)
                for i, grad in zip(params, grads)
                if grad is None and prior[i] is not _USER and (prior[i] is not None or i in reduced)
            ]
            if dropped:
                raise RuntimeError(_dropped_message(self._where(), dropped))
        self.reduced = reduced.union(params)
        for index, grad in zip(params, grads):
            if (
                grad is not None
                and prior[index] is not _USER
                and (grad is placeholders[index] or _is_placeholder(grad))
            ):
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
        if self.accumulator is not None:  # else at refresh_accumulator
            self._set_fast_views()

    def disable_fast_push(self) -> None:
        if self.fast_push:
            self.calls.set_placeholders([], [], [])
            self.fast_push = False

    def check_params(self) -> bool:
        """Whether the sharded parameters are the ones hooked (hook_sharded_grads) and, with
        fast_push, handed to C++. FSDP2 replaces them in ``reset_sharded_param`` (after
        ``load_state_dict(assign=True)``), and ``model.to()`` (``module._apply``) swaps the
        tensor inside each parameter object and inside its ``.grad`` (``swap_tensors``): the
        objects stay, their tensors change, and with them what the views and placeholders made
        here stand for. Then the .grad hooks move to the new ones, the views and placeholders
        are made again, fast_push turns off (the next push turns it on again with them), and
        this returns False. Runs when this rank enters a minibatch and at the barrier."""
        params = _fsdp2.sharded_params(fp for _, fp in self._trainable_params)
        if all(map(is_, params, self._hooked_params)) and all(
            map(int.__eq__, _tensor_ids(params), self._hooked_ids)
        ):
            return True
        self.disable_fast_push()
        self.hook_sharded_grads()
        self.forget_placeholders()
        self.set_accumulator(self.accumulator)  # the .grad views, made again when needed
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
                i for i, n in enumerate(self.grad_numels) if n
            ]
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

    # The common case and the general path: every choice between them is made by the three
    # methods below (entering a minibatch, a push, the barrier's .grad), from fast_push (the
    # common push is handed to C++), entered_clean and any_user.
    def enter_clean(self) -> bool:
        """Entering a minibatch, the common case in one C++ call (``calls.place_all``): no
        parameter kept a .grad (zero_grad() to None), so every prior stays None (the barrier
        left them so) and each gets its placeholder. False: nothing changed, the caller records
        each parameter's prior."""
        self.entered_clean = self.fast_push and self.calls.place_all()
        if self.entered_clean:
            self.any_user = False
        return self.entered_clean

    def finalize_clean(self, got_grad: list[bool]) -> bool:
        """The barrier, where enter_clean applied: every prior None, so each .grad is its
        accumulator view where a gradient came, else None (one C++ call, ``calls.finalize``).
        False: nothing changed, the caller finalizes each parameter."""
        done = bool(
            self.entered_clean
            and self.check_params()
            and self.fast_push
            and self.calls.finalize(got_grad)
        )
        self.entered_clean = False
        return done

    def push(self, backend, index: int, output, input, op, async_op: bool):
        """FSDP2's reduce-scatter of this unit (key `index` of `backend`), served by the engine:
        the one place that chooses between the common push, one C++ call (``calls.push_all``),
        and the general path (the bookkeeping here, then ``backend._keyed_reduce_scatter``).
        None, or a Work with `async_op`."""
        if (
            self.fast_push
            and not self.any_user
            and _fsdp2.reduce_scatter_order(self.unit) is self._order
        ):
            # Every trainable parameter got a gradient (in key order) and holds its
            # placeholder: the call clears them (FSDP2 sets .grad next) and pushes. False: it
            # changed nothing, and the general path below runs.
            work = self.calls.push_all(output, input, op, self.push_scale(input.dtype), async_op)
            if work is not False:
                self.reduced = self._all_reduced
                return work
        params = self.take_pushed_params(input.numel() // self.world)
        sets_grad = not self.hsdp or _fsdp2.sets_grad_after_reduce_scatter(self.unit)
        if sets_grad and self.hsdp:
            raise RuntimeError(
                f"torch_odc: {self._where()}: FSDP2's per-microbatch all-reduce across "
                f"HSDP replicas is on for '{self.name}' (set_requires_gradient_sync(True) or "
                "set_requires_all_reduce(True) after its forward): under ODC replicas meet once, "
                "in torch_odc.minibatch_barrier(), and may run different microbatch counts. "
                "Call set_requires_gradient_sync() before the forward."
            )
        if sets_grad:
            # FSDP2 sets .grad of these parameters right after this call (it would add into a
            # placeholder); the hook it calls next puts the placeholder back.
            self.take_placeholders(params)
        # What FSDP2 applies after the collective (its post-division; under HSDP the replicas'
        # averaging): ODC's output is zeros until the barrier, so it is applied to the push.
        scale = self.push_scale(input.dtype)
        if params is self._all_trainable and self._all_in_key_order:
            params = _ALL_PARAMS  # the same push, without converting the list
        if not self.fast_push:
            self.enable_fast_push()
        return backend._keyed_reduce_scatter(index, output, input, op, params, scale, async_op)

    def pending_grads(self) -> list[str]:
        return [_param_name(self.unit, i) for i in self.calls.pushed()]


def _param_name(unit: _fsdp2.Unit, index: int) -> str:
    return unit.param_names[index]


def _tensor_ids(tensors: list) -> list[int]:
    """The C++ tensor inside each Python tensor object (``_cdata``): ``torch.utils.swap_tensors``
    (``module._apply``) changes it and keeps the object."""
    return [t._cdata for t in tensors]
