import os
import sys

import pytest

# Spawned ranks import test helpers by module name; make tests/ importable for them too.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# ---- running the GPU suite on several pytest-xdist workers (benchmarks/device_run.sh tests) ----
# Every test's ranks rendezvous over a FileStore in a fresh temporary directory and ODC's
# regions are named per process, so tests of different workers can share the GPUs. Three rules:
# - `serial` tests assert durations or that /dev/shm holds no new region: device_run.sh runs
#   them on their own (`-m serial`, no workers) before the others (`-m "not serial"`).
# - Tests that share one expensive result (a module-scoped fixture; an explicit
#   `xdist_group` mark where a functools.cache shares it) run on one worker: under
#   `--dist loadgroup` they are one unit of work, so the result is computed once.
# - Under xdist the longest units start first (COST_S below, seconds on one H100 rank pair).

COST_S = {
    "test_integrations_trl_grpo.py": 120,
    "test_integrations_trl_dpo.py": 60,
    "test_framework_forwarding.py": 60,
    "test_integrations_hf_checkpoint.py": 45,
    "test_integrations_hf.py": 40,
    "test_demo.py": 40,
    "test_hsdp.py": 35,
    "test_bench_step.py": 30,
    "test_gpu_forwarding.py": 30,
    "test_gpu_odc.py": 25,
    "test_conformance.py": 12,
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "serial: asserts a duration or the state of /dev/shm; not run beside other tests "
        "(benchmarks/device_run.sh runs these alone)")
    config.addinivalue_line(
        "markers", "xdist_group(name): tests that share one result run on one pytest-xdist "
        "worker (--dist loadgroup)")


def _shared_fixture_group(item):
    """The group of a test that uses a module- or session-scoped fixture defined in the test
    files (not pytest's own): the fixture's name and where it is defined."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in item.fixturenames:
        for fixturedef in info.name2fixturedefs.get(name, ()):
            if fixturedef.scope in ("module", "package", "session") and fixturedef.baseid:
                return f"{fixturedef.baseid}::{name}"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = _shared_fixture_group(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))
    if getattr(config.option, "numprocesses", None) in (None, 0) and not os.environ.get(
            "PYTEST_XDIST_WORKER"):
        return  # without workers: collection order (CI)
    # Costliest modules first, each module's tests in their order (a group stays together).
    items.sort(key=lambda it: -COST_S.get(os.path.basename(str(it.path)), 5))
