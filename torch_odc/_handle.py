"""The attachment of one model (Handle) and what runs between and at barriers: entering a
minibatch, the eager publish, the minibatch barrier (with HSDP's all-reduce across replicas and
the ``.grad`` it leaves), the optimizer-step check, stats and detach; the registry of attached
models behind ``torch_odc.minibatch_barrier()`` and ``torch_odc.stats()``."""

from __future__ import annotations

from time import perf_counter

import torch
import torch.distributed as dist

from torch_odc import _fsdp2
from torch_odc._clock import _CLOCK_KINDS, _HostClock, _profiling
from torch_odc._keys import _CARRY, _USER, _Key
from torch_odc._placeholder import _dropped_message, _is_placeholder, _NoGradBeforeBarrier

# The attached models: what minibatch_barrier() and stats() go over (attach adds, detach removes,
# and _attached() drops those whose process group was destroyed).
_handles: list[Handle] = []
# HSDP: the accumulators are all-reduced across replicas in buckets of at most this size.
_REPLICA_BUCKET_BYTES = 256 << 20


class Handle:
    """The attachment of one FSDP2 model to the odc backend; see :func:`attach`."""

    def __init__(
        self,
        model,
        backend,
        keys: list[_Key],
        device: torch.device,
        eager_publish: bool = True,
        replicate_group=None,
    ):
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
        # Why attach left this model on FSDP2's own collectives (None: served on demand).
        self.collective_reason: str | None = None
        self._eager = eager_publish
        self._publish_pending = eager_publish  # no forward has run in this minibatch yet
        # Every key published in this minibatch; else those published so far (by index).
        self._all_published = False
        self._published: set[int] = set()
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
        # The generation of the accumulators the keys view (set by attach).
        self._accumulator_generation = None
        # release_memory(): the engine (region, shard caches, accumulators) is gone until
        # restore_memory(); the stats at the release stand in for the engine's.
        self._released = False
        self._released_stats: dict | None = None
        self._releases = 0  # release_memory() calls that gave memory back

    @property
    def on_demand(self) -> bool:
        """Whether ODC serves this model's all-gathers and reduce-scatters (False after
        :meth:`detach`, and when attach kept FSDP2's collective semantics for it: the reason is
        ``collective_reason``). Only then may ranks run different numbers of microbatches."""
        return self._attached

    @property
    def keys(self) -> list[str]:
        return [k.name for k in self._keys]

    @property
    def released(self) -> bool:
        """Whether :meth:`release_memory` gave ODC's memory back (until :meth:`restore_memory`
        or the next forward or barrier)."""
        return self._released

    def _where(self) -> str:
        if self._released:
            return f"rank {dist.get_rank(self._group)}, memory released"
        info = self._backend._stats()
        # Between a barrier and this rank's next keyed call the engine is still in the finished
        # minibatch; what the user runs then belongs to the next one.
        minibatch = info["minibatch"] + (1 if self._backend._arrived else 0)
        return f"rank {info['rank']}, minibatch {minibatch}"

    def _wrong_group(self, key: int, op: str, group) -> str:
        return (
            f"torch_odc: {self._where()}: FSDP2's {op} of '{self._keys[key].name}' came "
            f"with process group {group}, not the group the model was attached over "
            f"({self._group}); re-attach after changing the mesh"
        )

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
        if self.collective_reason is not None:
            return  # FSDP2 reduced every microbatch's gradients itself (as attach warned)
        if not self._attached:
            raise RuntimeError("torch_odc: this model was detached")
        self.restore_memory()  # a rank that ran no microbatch since release_memory()
        self._check_barrier()
        b = self._backend
        # (0) A rank that ran no microbatch enters the minibatch only now.
        self._enter_minibatch()
        # (1) Publish what this rank has not published in this minibatch (a rank that ran no
        # microbatch, or attached with eager_publish=False).
        self._publish_unpublished()
        # (2) Wait until every rank has arrived: all pushes into our accumulators have landed.
        # (After free_gradient_memory() the engine has restored them by now.)
        b._arrive()
        self._refresh_accumulators()
        # (3) Finalize: .grad from the accumulators. They are released (zeroed, and open to the
        # next minibatch's pushes) when this rank enters the next minibatch, after its optimizer
        # step: peers' pushes of that minibatch wait for it.
        self._entered = False
        self._publish_pending = self._eager
        self._all_published, self._published = False, set()
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

    def free_gradient_memory(self) -> bool:
        """See :func:`torch_odc.free_gradient_memory`. Whether the accumulators are out now
        (False for a model that kept collective semantics at attach)."""
        if not self._attached or self.collective_reason is not None:
            return False
        if self._released:
            return True  # nothing is held
        self._backend._free_accumulators()
        for key in self._keys:
            key.drop_accumulator()
        return True

    def restore_gradient_memory(self) -> None:
        """See :func:`torch_odc.restore_gradient_memory`."""
        if not self._attached or self._released:
            return  # released: restore_memory() brings the accumulators back
        self._backend._restore_accumulators()
        self._refresh_accumulators()

    def release_memory(self) -> bool:
        """See :func:`torch_odc.release_memory`. Whether ODC's memory is out now (False for a
        model that kept collective semantics at attach)."""
        if not self._attached or self.collective_reason is not None:
            return False
        if self._released:
            return True
        if self._entered:
            # Forwards only since the barrier (an evaluation, log-probs before an update): the
            # minibatch in progress holds nothing yet and starts again after the restore. A
            # gradient noted, pushed or carried would be lost: refused.
            holding = [
                k.name
                for k in self._keys
                if k.reduced
                or k.calls.pushed()
                or any(p is _CARRY or isinstance(p, torch.Tensor) for p in k.prior)
            ]
            if holding:
                raise RuntimeError(
                    f"torch_odc: {self._where()}: release_memory() inside a minibatch that "
                    f"holds gradients (of {', '.join(holding[:3])}"
                    f"{', ...' if len(holding) > 3 else ''}): they would be lost. Call it "
                    "between minibatches: after minibatch_barrier() (and optimizer.step()), or "
                    "after forwards without backward"
                )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # Every rank is past its last keyed call: no peer reads this rank's shards or pushes
        # into its accumulators any more (a peer that went on into the next minibatch would
        # wait here for this rank's release, and this rank for it: the process group's timeout).
        dist.barrier(group=self._group)
        self._released_stats = self._backend._stats()
        for key in self._keys:
            _leave_region(key)
            key.prior = [_USER if p is _USER else None for p in key.prior]
            key.reduced, key.entered_clean = set(), False
        # A minibatch entered by forwards only starts again at the next forward.
        self._entered = False
        self._publish_pending = self._eager
        self._all_published, self._published = False, set()
        # The parameters living in the shard caches move into memory of their own (on the
        # same device: ``model.to("cpu")`` moves them on, as under FSDP2 alone).
        self._backend._evict_shards()
        self._backend._disconnect_engine()
        self._released = True
        self._releases += 1
        self._accumulator_generation = None
        # Every rank has closed its mappings of every other rank's memory: what release
        # returns is free on every rank once this returns.
        dist.barrier(group=self._group)
        return True

    def restore_memory(self) -> None:
        """See :func:`torch_odc.restore_memory`."""
        if not self._released:
            return
        for index, key in enumerate(self._keys):
            shards = self._shards(index)  # raises where the gather dtype changed
            away = {str(t.device) for t in shards if t.device != self.device}
            if away:
                raise RuntimeError(
                    f"torch_odc: {self._where()}: restoring ODC's memory, but the parameters of "
                    f"'{key.name}' are on {', '.join(sorted(away))}, and the model was attached "
                    f"on {self.device}: move the model back first (model.to({str(self.device)!r}))"
                )
        b = self._backend
        b._connect_engine(
            [k.spec() for k in self._keys], self.device.index if self.device.type == "cuda" else -1
        )
        for index, key in enumerate(self._keys):
            key.refresh_accumulator(b._accumulator(index))
        self._accumulator_generation = b._accumulator_generation
        self._released, self._released_stats = False, None
        self._place_shards()

    def _refresh_accumulators(self) -> None:
        """Views of the accumulators' current generation (the engine restores them at the first
        push or the barrier after free_gradient_memory())."""
        b = self._backend
        generation = b._accumulator_generation
        if generation == self._accumulator_generation:
            return
        for index, key in enumerate(self._keys):
            key.refresh_accumulator(b._accumulator(index))
        self._accumulator_generation = generation

    def _enter_minibatch(self) -> None:
        """Starts this rank's next minibatch, once, before its first keyed call (or in the
        barrier, for a rank that runs no microbatch): after the optimizer step, gradient
        clipping and zero_grad() of the last one. Records what each sharded .grad holds, so
        that the barrier can add the next gradient to it as FSDP2 would, zeroes the accumulator
        spans that do not carry it, and releases the accumulators to the peers' pushes."""
        if self._entered or not self._attached:
            return
        self.restore_memory()
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
            if key.enter_clean():
                continue
            for index, fp in enumerate(key.unit.params):
                if key.grad_numels[index] == 0:
                    continue
                grad = _fsdp2.sharded_grad(fp)
                if grad is None or isinstance(grad, _NoGradBeforeBarrier):
                    key.prior[index] = None
                elif (
                    releasing
                    and key.spans[index] is not None
                    and (grad is key.spans[index] or _same_view(grad, key.spans[index]))
                ):
                    # Not zero_grad()-ed (or zeroed in place): the next gradient adds to it.
                    # Across HSDP replicas the accumulators are summed, so it is kept apart.
                    key.prior[index] = grad.clone() if self._replicate is not None else _CARRY
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
            dist.all_reduce(section[start : start + per_bucket], group=group)
        out, at = [], 0
        for key in got_grad:
            out.append([bool(f) for f in flags[at : at + len(key)].tolist()])
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
        if (
            self._barrier_done
            and not self._stepped
            and any(p.grad is not None and not _is_placeholder(p.grad) for p in self._params)
        ):
            raise RuntimeError(
                f"torch_odc: {self._where()}: a second minibatch_barrier() without "
                "optimizer.step() since the last one would add this minibatch's gradients onto "
                "the last one's. Call optimizer.step() (or optimizer.zero_grad() to drop them) "
                "between two barriers."
            )

    def _publish_unpublished(self) -> None:
        """Publishes every key this rank has not published in this minibatch: each unit's shard
        cache holds the bytes its all-gather input is made of (each parameter's padded shard;
        no unsharded parameter is allocated and nothing is gathered), then its flag is released,
        on the current stream (after the optimizer step). Parameters that live in their cache
        (attach moved them in) are not copied; any other is, all units in one multi-tensor copy.
        A publish reads no peer and waits for nobody, so this cannot deadlock."""
        self._lazy_init()
        keys = range(len(self._keys))
        self._backend._publish_shards(keys, [self._shards(index) for index in keys])
        self._all_published = True

    def _publish_key(self, index: int) -> None:
        """Publishes one key at its all-gather, if this rank has not yet in this minibatch (no
        eager publish): the same copy as `_publish_unpublished`, from the sharded parameters."""
        if index in self._published:
            return
        self._lazy_init()
        self._backend._publish_shards([index], [self._shards(index)])
        self._published.add(index)

    def _shards(self, index: int) -> list[torch.Tensor]:
        key = self._keys[index]
        dtype, shards = _fsdp2.all_gather_input(key.unit)
        if dtype != key.gather_dtype:
            raise RuntimeError(
                f"torch_odc: {self._where()}: FSDP2 now all-gathers '{key.name}' in {dtype}, "
                f"but it was attached with {key.gather_dtype}; re-attach after changing "
                "parameter or mixed-precision dtypes"
            )
        return shards

    def _place_shards(self) -> None:
        """At attach: fills every shard cache, moving the sharded parameters in where it holds
        their dtype (see `_Key.cache_dtype`); publishes nothing. Units still on the meta device
        (``to_empty`` after attach) move in at their first publish."""
        keys, sources = [], []
        for index, key in enumerate(self._keys):
            shards = _fsdp2.all_gather_input(key.unit)[1]
            if not any(t.is_meta for t in shards):
                keys.append(index)
                sources.append(shards)
        self._backend._publish_shards(keys, sources, True)

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
            if self._released:
                self.restore_memory()
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
        if self.collective_reason is not None:  # nothing of the engine's: FSDP2's own path
            return {
                "on_demand": False,
                "collective_reason": self.collective_reason,
                "memory": {},
                "gradient_memory": {},
                "host_by_kind_s": {},
                "host_s": 0.0,
            }
        if self._released:  # the engine's counters at the release; no memory held
            out = dict(self._released_stats)
            out["region_bytes"] = 0
            out["memory"] = {k: 0 for k in out["memory"]}
            out["released"] = True
        else:
            out = self._backend._stats()
            out["released"] = False
        out["releases"] = self._releases
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
        released = self._released
        for hook in [*self._hooks, self._step_hook]:
            if hook is not None:
                hook.remove()
        self._hooks, self._step_hook = [], None
        for key in self._keys:
            key.unwatch_grads()
            _leave_region(key)
            if self._replicate is not None:
                key.unit.module.set_requires_all_reduce(True, recurse=False)
            key.unit.module.set_custom_all_gather(key.prev_all_gather)
            key.unit.module.set_custom_reduce_scatter(key.prev_reduce_scatter)
        if not released:
            # The parameters living in the shard caches move back into memory of their own.
            self._backend._evict_shards()
            self._backend._disconnect_engine()
        self._attached, self._released = False, False
        if self in _handles:
            _handles.remove(self)


def _attached() -> list[Handle]:
    """The attached models whose process group still exists. destroy_process_group() shuts the
    odc backend down: a model attached through it can no longer gather or push, and training a
    new model over a new process group in the same process (a second run, a restart in place)
    must not reach it. Its handle is dropped here with its hooks, so that the registry no longer
    keeps the model alive; the model itself, like an FSDP2 model whose process group is gone,
    can no longer run (its keyed calls name the shut-down backend)."""
    for handle in [h for h in _handles if h._backend.is_shutdown]:
        for hook in [*handle._hooks, handle._step_hook]:
            if hook is not None:
                hook.remove()
        handle._hooks, handle._step_hook = [], None
        for key in handle._keys:
            key.unwatch_grads()  # what C++ holds of the parameters (the .grad placeholders)
        handle._attached = False
        _handles.remove(handle)
    return list(_handles)


def _leave_region(key: _Key) -> None:
    """Before the region goes (detach, release_memory): no ``.grad`` of `key` and nothing here
    views it any more. Placeholders become None; ``.grad`` views of the accumulators become
    copies of their own (as FSDP2 would hold them)."""
    key.disable_fast_push()
    for index, fp in enumerate(key.unit.params):
        grad = _fsdp2.sharded_grad(fp)
        if isinstance(grad, _NoGradBeforeBarrier):
            _fsdp2.set_grad(fp, None)
        elif (
            key.grad_numels[index]
            and grad is not None
            and key.span(index) is not None
            and _same_view(grad, key.span(index))
        ):
            _fsdp2.set_grad(fp, grad.clone())
    key.set_accumulator(None)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _finalize(key: _Key, got_grad: list[bool]) -> None:
    """Gives every trainable parameter of `key` its ``.grad`` as FSDP2's post-backward would
    leave it after the minibatch: the reduced gradient, added to what ``.grad`` held before.
    Where the gradient dtype is the accumulator's (fp32 / fp64 models), ``.grad`` is a view of
    the accumulator span (no copy; released when this rank enters the next minibatch)."""
    if key.finalize_clean(got_grad):
        return
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


def minibatch_barrier() -> None:
    """The one synchronization point per minibatch of every attached model.

    When it returns, every parameter's ``.grad`` holds the gradient reduced over all ranks and
    all their microbatches since the previous barrier, as FSDP2 with gradient accumulation
    computes it. Call it on every rank, before ``optimizer.step()``.
    """
    if _profiling():
        with torch.profiler.record_function("odc::minibatch_barrier"):
            for handle in _attached():
                handle.barrier()
    else:
        for handle in _attached():
            handle.barrier()


def free_gradient_memory() -> None:
    """Returns the memory of every attached model's gradient accumulators until the next
    backward, for a phase that holds no gradients (RL generation, evaluation).

    Call it on every rank (it is collective) after ``optimizer.step()`` and
    ``optimizer.zero_grad()`` (set to None: a ``.grad`` still held keeps its memory until it is
    dropped, and stays valid), before the next minibatch's first backward. The accumulators
    come back, zeroed, at :func:`restore_gradient_memory` or else at every rank's first backward
    or barrier (where the ranks then wait for each other once). Raises if this rank already
    pushed gradients in the current minibatch: they would be lost.
    """
    for handle in _attached():
        handle.free_gradient_memory()


def restore_gradient_memory() -> None:
    """Allocates the accumulators :func:`free_gradient_memory` returned. Collective: call it on
    every rank where they meet anyway (before the minibatch's first backward), or leave it to
    the first backward."""
    for handle in _attached():
        handle.restore_gradient_memory()


def release_memory() -> None:
    """Gives back all memory ODC holds for every attached model, for a phase in which the model
    neither trains nor runs (RL generation by another engine, memory handed to a colocated
    rollout): the shard caches, the accumulators and the control words; the sharded parameters
    that lived in the shard caches move into memory of their own on the same device first, so
    that ``model.to("cpu")`` then frees them as it does under FSDP2 alone (a ``.grad`` still
    held becomes a copy of its own, as FSDP2 holds it). ODC's memory on every rank is free when
    this returns.

    Collective: call it on every rank at the same point, between minibatches (after
    ``minibatch_barrier()`` and ``optimizer.step()``, before the next forward). Raises on a
    rank that already started the next minibatch. :func:`restore_memory` brings it back, or
    else the next forward or barrier of each rank does (collective too: every rank meets there
    once); the model must be back on the device it was attached on by then.
    """
    for handle in _attached():
        handle.release_memory()


def restore_memory() -> None:
    """Brings back what :func:`release_memory` gave back: the engine's memory again, the sharded
    parameters moved into their shard caches (the same values: no step can run in between), the
    accumulators zero. Collective: call it on every rank, with the model on the device it was
    attached on (``model.to(device)`` first), or leave it to each rank's next forward or barrier.
    Training afterwards equals training without the release."""
    for handle in _attached():
        handle.restore_memory()


def stats() -> list[dict]:
    """Per-rank counters of every attached model: for the minibatch in progress ("current"),
    the last completed one ("last") and all so far ("total")."""
    return [handle.stats() for handle in _attached()]
