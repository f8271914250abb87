"""Builds torch-odc's C++ core as the extension torch_odc._C against the installed torch.

CUDA sources are compiled only when the installed torch has CUDA and an nvcc of the same major
version is found; otherwise the build is CPU-only. ODC_FORCE_CPU=1 forces a CPU-only build;
ODC_WERROR=1 makes compiler warnings errors (CI builds with it).
Build without isolation so the extension links against the torch you run:
    pip install --no-build-isolation -e .
"""

import glob
import os
import re
import shutil
import subprocess

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import (
        CUDA_HOME,
        BuildExtension,
        CppExtension,
        CUDAExtension,
        include_paths,
    )
except ImportError as exc:  # pragma: no cover - setup-time guard
    raise SystemExit(
        "torch-odc builds against an installed torch (2.11 or newer). Install torch first, then "
        "run: pip install --no-build-isolation -e ."
    ) from exc

ROOT = os.path.dirname(os.path.abspath(__file__))


def _nvcc_major():
    if CUDA_HOME is None:
        return None
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"release (\d+)\.", out)
    return int(match.group(1)) if match else None


def _with_cuda():
    if os.environ.get("ODC_FORCE_CPU", "0") == "1" or torch.version.cuda is None:
        return False
    nvcc = _nvcc_major()
    return nvcc is not None and nvcc == int(torch.version.cuda.split(".")[0])


def _sources(with_cuda):
    patterns = [
        "csrc/python_api.cpp",
        "csrc/backend/*.cpp",
        "csrc/engine/*.cpp",
        "csrc/balance/*.cpp",
        "csrc/transport/shm/*.cpp",
    ]
    # What the backend does only with CUDA is behind csrc/backend/device.h: cuda/ defines it in
    # builds with CUDA, cpu_only/ in the others.
    if with_cuda:
        patterns += [
            "csrc/backend/cuda/*.cpp",
            "csrc/transport/cuda_ipc/*.cpp",
            "csrc/transport/cuda_ipc/*.cu",
        ]
    else:
        patterns += ["csrc/backend/cpu_only/*.cpp"]
    found = []
    for pattern in patterns:
        found += sorted(glob.glob(os.path.join(ROOT, pattern)))
    return [os.path.relpath(p, ROOT) for p in found]


# C++20 everywhere: torch 2.15's headers require it (`#error C++20 or later compatible compiler is
# required to use ATen`), and torch 2.11's headers, g++ 12 and nvcc 13 accept it.
CXX_STD = "-std=c++20"
# sm_80 and sm_90 machine code plus compute_90 PTX, which the driver JIT-compiles for newer GPUs.
# attach() checks that the build has a kernel image for the GPU (collective semantics otherwise).
CUDA_ARCH = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]


def _extension():
    with_cuda = _with_cuda()
    # torch's headers as system headers (-isystem after BuildExtension's -I: GCC then drops the
    # -I), so that their warnings stay theirs: torch 2.11's c10/cuda/CUDAEvent.h, included by
    # the CUDA build of backend/cuda/device_cuda.cpp, trips g++ 12's -Winterference-size.
    torch_headers = [f"-isystem{path}" for path in include_paths()]
    cxx = ["-O2", CXX_STD, "-Wall", "-Wno-unused-parameter", *torch_headers]
    nvcc = ["-O3", CXX_STD, *CUDA_ARCH]
    if os.environ.get("ODC_WERROR", "0") == "1":
        cxx.append("-Werror")
        nvcc += ["-Werror=all-warnings", "-Xcompiler=-Wall,-Werror"]
    macros = []
    kwargs = {}
    if with_cuda:
        macros.append(("ODC_WITH_CUDA", "1"))
        kwargs["extra_compile_args"] = {"cxx": cxx, "nvcc": nvcc}
        ext_cls = CUDAExtension
    else:
        kwargs["extra_compile_args"] = {"cxx": cxx}
        ext_cls = CppExtension
    print(
        f"torch-odc: building {'with CUDA' if with_cuda else 'CPU-only'} against torch "
        f"{torch.__version__}"
    )
    return ext_cls(
        name="torch_odc._C",
        sources=_sources(with_cuda),
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=macros,
        libraries=["rt"],
        **kwargs,
    )


def _links_shared_libstdcxx(compiler: str) -> bool:
    """Whether `compiler` links the shared libstdc++ (it resolves libstdc++.so to a file)."""
    try:
        out = subprocess.run(
            [compiler, "-print-file-name=libstdc++.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return True  # not a GCC-style driver: nothing to check
    return os.path.isabs(out)


class _BuildExtension(BuildExtension):
    """Links the extension against the shared libstdc++ that torch loads, never a private copy.

    A private (static) libstdc++ shares the process's iostream and locale data with the loaded
    one but not its code: the first number formatted into an error message then crashes
    (seen on a GPU image whose CXX, /opt/gcc/bin/g++, ships only libstdc++.a: a SIGSEGV in
    c10::str inside OdcBackend::engine). So the C++ compiler, which also links, must resolve
    libstdc++.so (CXX is replaced below when it does not). Also drops -Bsymbolic-functions (added
    by some Pythons' LDSHARED), which binds weak libstdc++ template copies in our .so to
    themselves instead of the loaded libstdc++."""

    def initialize_options(self):
        super().initialize_options()
        # One object directory per torch build, so that switching between the virtual environments
        # of two torch lines (.ci/run tests both) relinks instead of recompiling everything.
        self.build_temp = os.path.join(ROOT, "build", f"temp-torch-{torch.__version__}")

    def build_extensions(self):
        for attr in ("linker_so", "linker_so_cxx"):  # linker_so_cxx: setuptools >= 72, C++ links
            cmd = getattr(self.compiler, attr, None)
            if not cmd:
                continue
            setattr(self.compiler, attr, [a for a in cmd if a != "-Wl,-Bsymbolic-functions"])
        super().build_extensions()


def _shared_libstdcxx_linker(compiler: str) -> str:
    for candidate in (shutil.which("g++"), shutil.which("c++"), "/usr/bin/g++"):
        if candidate and os.path.exists(candidate) and _links_shared_libstdcxx(candidate):
            print(
                f"torch-odc: {compiler} links only a static libstdc++; building with "
                f"{candidate} instead, against the shared libstdc++ torch uses"
            )
            return candidate
    raise SystemExit(
        f"torch-odc: the C++ compiler {compiler} has no shared libstdc++ (only libstdc++.a), and "
        "no g++ on PATH has one. A private libstdc++ in the extension crashes next to torch's: "
        "set CXX to a g++ whose `g++ -print-file-name=libstdc++.so` prints a path."
    )


# The C++ compiler (it also links the extension): one with the shared libstdc++ (see above).
if not _links_shared_libstdcxx(os.environ.get("CXX", "c++")):
    os.environ["CXX"] = _shared_libstdcxx_linker(os.environ.get("CXX", "c++"))

setup(
    name="torch-odc",
    version="0.1.0",
    description="On-Demand Communication: a c10d backend that turns FSDP2 into a decentralized "
    "parameter server",
    packages=find_packages(include=["torch_odc", "torch_odc.*"]),
    # The type stubs of the extension and the PEP 561 marker (tests/test_stubs.py).
    package_data={"torch_odc": ["_C.pyi", "py.typed"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.11,<2.16"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "hypothesis", "numpy"],
        "bench": ["matplotlib", "numpy"],
    },
    ext_modules=[_extension()],
    cmdclass={"build_ext": _BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
