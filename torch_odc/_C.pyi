# ruff: noqa: N999  (the name is the extension module's)
"""Type stubs of torch_odc._C, the pybind11 extension (csrc/python_api.cpp).

Every name the binding defines, with its arguments as bound (``arg0``: bound without a name,
so positional only). Names with a leading underscore are torch_odc's private API: torch_odc's
Python layer calls them, user code should not. tests/test_stubs.py checks this file against
the built extension.
"""

import datetime
from collections.abc import Callable, Sequence
from typing import Any, Literal

from torch import Tensor
from torch._C._distributed_c10d import Backend, ReduceOp, Store, Work
from typing_extensions import Buffer

class OdcBackend(Backend):
    """The "odc" c10d backend: forwards collectives to its inner backends and, once an attached
    model connects the engine, serves FSDP2's keyed all-gathers and reduce-scatters on demand."""

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        cpu_backend: Backend,
        cuda_factory: Callable[[], Backend] | None = None,
    ) -> None: ...
    @property
    def timeout(self) -> datetime.timedelta: ...
    @property
    def cpu_backend(self) -> Backend: ...
    @property
    def cuda_backend(self) -> Backend | None:
        """The inner backend of CUDA tensors, None until the group's first CUDA collective."""
    @property
    def is_shutdown(self) -> bool: ...

    # The engine's lifecycle (torch_odc.attach).
    def _connect_engine(self, keys: Sequence[tuple[Any, ...]], device_index: int = -1) -> None:
        """Connects the engine for `keys`: per key (name, shard numel, gather dtype name,
        per-parameter gradient numels, accumulator dtype name[, cache dtype name]).
        `device_index`: the CUDA device, or -1 for CPU ranks."""
    def _disconnect_engine(self) -> None: ...
    @property
    def _has_engine(self) -> bool: ...
    def _cuda_transport_problem(self, device_index: int) -> str:
        """Collective: why the CUDA IPC transport cannot run on this GPU and group, or ''."""

    # The keyed collectives of FSDP2's comm objects.
    @property
    def _epoch(self) -> int: ...
    def _published(self, arg0: int, /) -> bool: ...
    def _keyed_all_gather(
        self, key: int, output: Tensor, input: Tensor, async_op: bool = False
    ) -> Work | None: ...
    def _keyed_reduce_scatter(
        self,
        key: int,
        output: Tensor,
        input: Tensor,
        op: ReduceOp | ReduceOp.RedOpType,
        params: Sequence[int] = ...,
        scale: float = 1.0,
        async_op: bool = False,
    ) -> Work | None: ...
    def _publish_shards(
        self, keys: Sequence[int], sources: Sequence[Sequence[Tensor]], place_only: bool = False
    ) -> list[int]: ...
    def _evict_shards(self) -> None: ...

    # The minibatch barrier and the gradient accumulators.
    def _arrive(self) -> None: ...
    def _grad_params(self, arg0: int, /) -> list[bool]: ...
    def _accumulator(self, arg0: int, /) -> Tensor: ...
    def _accumulator_section(self) -> Tensor: ...
    def _release(self, zero: bool = True) -> None: ...
    def _free_accumulators(self) -> None: ...
    def _restore_accumulators(self) -> None: ...
    @property
    def _accumulator_generation(self) -> int: ...
    @property
    def _region_span(self) -> tuple[int, int]:
        """The own region without the accumulators: (address, bytes)."""
    @property
    def _accumulators_resident(self) -> bool: ...
    @property
    def _arrived(self) -> bool: ...

    # Statistics (torch_odc.stats).
    def _stats(self) -> dict[str, Any]: ...

class KeyCalls:
    """One key's gradient notes (C++ hooks on its unsharded parameters' gradient
    accumulators), its placeholders, and its common push."""

    def __init__(self, backend: OdcBackend, key: int, num_params: int) -> None: ...
    def watch(self, index: int, param: Tensor) -> bool: ...
    def unwatch_all(self) -> None: ...
    def note(self, indices: Sequence[int]) -> None: ...
    def pushed(self) -> list[int]: ...
    def take_pushed(self) -> list[int]: ...
    def set_placeholders(
        self, indices: Sequence[int], sharded: list[Tensor], placeholders: Sequence[Tensor]
    ) -> None: ...
    def place_all(self) -> bool: ...
    def set_views(self, views: list[Tensor]) -> None: ...
    def finalize(self, got: Sequence[bool]) -> bool: ...
    def all_grads_set(self) -> bool: ...
    def push_all(
        self,
        output: Tensor,
        input: Tensor,
        op: ReduceOp | ReduceOp.RedOpType,
        scale: float,
        async_op: bool,
    ) -> Work | Literal[False] | None:
        """None, or a Work with async_op; False (nothing changed) where the common push does
        not apply."""

def _has_cuda_transport() -> bool: ...
def _plan_balance(
    lengths: Buffer, costs: Buffer, world_size: int, max_tokens_per_microbatch: int, micro: bool
) -> tuple[list[list[list[int]]], list[float], float, float, list[int]]:
    """Plans one minibatch (torch_odc.balance.plan): (microbatches, rank_costs, makespan,
    lower_bound, oversized). int64 lengths and float64 costs, contiguous 1-D buffers."""
