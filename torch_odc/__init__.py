"""torch-odc: On-Demand Communication for FSDP2 as a c10d backend.

Importing this package registers the "odc" backend with torch.distributed:

    import torch_odc
    torch.distributed.init_process_group(backend="odc")
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from torch_odc import _C  # noqa: F401
from torch_odc._attach import attach
from torch_odc._backend import BACKEND_NAME, odc_backend, register
from torch_odc._handle import (
    Handle,
    free_gradient_memory,
    minibatch_barrier,
    release_memory,
    restore_gradient_memory,
    restore_memory,
    stats,
)

register()

__version__ = "0.1.0"
__all__ = [
    "BACKEND_NAME",
    "Handle",
    "__version__",
    "attach",
    "free_gradient_memory",
    "minibatch_barrier",
    "odc_backend",
    "register",
    "release_memory",
    "restore_gradient_memory",
    "restore_memory",
    "stats",
]
