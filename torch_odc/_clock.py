"""Host-time accounting of ODC's Python entry points: the clocks behind
``torch_odc.stats()[i]["host_s"]`` / ``["host_by_kind_s"]``, and the one-call check whether the
profiler records (the entry points open a ``record_function`` range only then)."""

from __future__ import annotations

import torch

# Whether the profiler records (one C call): the entry points' per-call ranges exist only then,
# since a record_function costs more than the rest of a keyed call's Python.
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
_CLOCK_KINDS = (
    "gather",
    "push",
    "unit_pre_forward",
    "grad_hook",
    "root_pre_forward",
    "barrier",
    "step_hook",
)
