"""How the extension is linked: against the shared libstdc++ that torch loads.

A private (static) libstdc++ inside torch_odc._C shares the process's iostream and locale data
with torch's but not its code; the first integer formatted into an error message then crashes
the process (a SIGSEGV in c10::str, seen with a compiler that ships only libstdc++.a). setup.py
links with a compiler that has the shared library; this checks the result."""

import shutil
import subprocess

import torch_odc


def test_extension_needs_the_shared_libstdcxx_and_has_no_private_copy():
    so = torch_odc._C.__file__
    readelf = shutil.which("readelf")
    assert readelf, "readelf (binutils, which building the extension needs) is not on PATH"
    dynamic = subprocess.run([readelf, "-d", so], capture_output=True, text=True, check=True).stdout
    assert "[libstdc++.so" in dynamic, dynamic
    symbols = subprocess.run(
        [readelf, "-W", "--dyn-syms", so], capture_output=True, text=True, check=True
    ).stdout
    # std::cin is defined only where libstdc++ itself is linked in.
    defined_cin = [
        line
        for line in symbols.splitlines()
        if line.split()[-1:] == ["_ZSt3cin"] and " UND " not in line
    ]
    assert not defined_cin, defined_cin
