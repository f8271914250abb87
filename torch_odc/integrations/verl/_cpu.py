"""A CPU platform for verl (0.9.1 registers CUDA, NPU and ROCm only), for CPU-rank runs: tests,
the example, debugging. Registered through verl's own ``PlatformRegistry`` and selected with
``VERL_PLATFORM=cpu``; :func:`use_cpu_platform` does both and points verl's engine lookup at
the registered engines (``VERL_ENGINE_DEVICE``)."""

from __future__ import annotations

import contextlib
import os
import types

import torch

from . import _compat

PlatformBase = _compat.load("verl.plugin.platform", "PlatformBase")
PlatformRegistry = _compat.load("verl.plugin.platform", "PlatformRegistry")
get_platform = _compat.load("verl.plugin.platform", "get_platform")

__all__ = ["PlatformCPU", "use_cpu_platform"]


def _zero(*_args, **_kwargs) -> int:
    return 0


def _nothing(*_args, **_kwargs) -> None:
    return None


def _host_memory() -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


# What verl calls on its "device module" (torch.cuda on GPUs) that torch.cpu does not have:
# memory statistics for its logs (allocator figures reported as 0, host memory as free/total)
# and cache control.
_DEVICE_MODULE = types.SimpleNamespace(
    **{
        **{name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")},
        "max_memory_allocated": _zero,
        "max_memory_reserved": _zero,
        "memory_allocated": _zero,
        "memory_reserved": _zero,
        "mem_get_info": _host_memory,
        "reset_peak_memory_stats": _nothing,
        "empty_cache": _nothing,
        "manual_seed": torch.manual_seed,
        "manual_seed_all": torch.manual_seed,
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: "cpu",
        "get_device_name": lambda *_: "CPU",
    }
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on CPU tensors: device "cpu", Gloo for collectives, no
    profiler ranges, no IPC."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.SimpleNamespace:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # never auto-detected: VERL_PLATFORM=cpu selects it

    def current_device(self):
        return "cpu"  # verl moves tensors with .to(get_device_id())

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def use_cpu_platform(engine_device: str = "cuda") -> None:
    """Makes this process's verl run on CPU tensors: selects :class:`PlatformCPU`
    (``VERL_PLATFORM=cpu``) and looks engines up under ``engine_device`` (verl registers its
    FSDP engines for "cuda" and "npu" only; ODC's engines are registered for "cpu" too). Call it
    before verl first asks for its platform (before building a worker or an engine)."""
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ.setdefault("VERL_ENGINE_DEVICE", engine_device)
    if get_platform().device_name != "cpu":
        raise RuntimeError(
            "torch_odc.integrations.verl.use_cpu_platform(): verl already chose the "
            f"'{get_platform().device_name}' platform in this process; call it first, or set "
            "VERL_PLATFORM=cpu in the environment before starting the process."
        )
