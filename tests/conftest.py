import json
import os
import shutil
import sys
import tempfile

import pytest

# Spawned ranks import test helpers by module name; make tests/ importable for them too.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# ---- running the GPU suite on several pytest-xdist workers (benchmarks/device/device_run.sh tests) ----
# Every test's ranks rendezvous over a FileStore in a fresh temporary directory and ODC's
# regions are named per process, so tests of different workers can share the GPUs. Three rules:
# - `serial` tests assert durations or that /dev/shm holds no new region: device_run.sh runs
#   them on their own (`-m serial`, no workers) before the others (`-m "not serial"`).
# - Tests that share one expensive result (a module-scoped fixture; an explicit
#   `xdist_group` mark where a functools.cache shares it) run on one worker, one after the
#   other, so the result is computed once: with `--dist loadgroup` the scheduler below sends
#   each group as one unit of work. (It reads the groups from the workers' collection, written
#   to a file: xdist's own loadgroup renames the tests' node ids, which pytest 9.2 ignores.)
# - Under xdist the longest units start first (COST_S below, seconds on one H100 rank pair).
# Without xdist (CI) none of this changes anything.

COST_S = {
    "test_integrations_trl_grpo.py": 120,
    "test_integrations_trl_dpo.py": 60,
    "test_framework_forwarding.py": 60,
    "test_hsdp.py": 60,  # 4 ranks on 2 GPUs
    "test_integrations_hf_checkpoint.py": 45,
    "test_integrations_hf.py": 40,
    "test_demo.py": 40,
    "test_bench_step.py": 30,
    "test_gpu_forwarding.py": 30,
    "test_gpu_odc.py": 25,
    "test_conformance.py": 12,
}
_GROUPS_ENV = "ODC_XDIST_GROUPS"
_TMP_ENV = "ODC_TESTS_TMP"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "serial: asserts a duration or the state of /dev/shm; not run beside other tests "
        "(benchmarks/device/device_run.sh runs these alone)",
    )
    config.addinivalue_line(
        "markers",
        "xdist_group(name): tests that share one result run on one pytest-xdist "
        "worker (--dist loadgroup)",
    )
    if not os.environ.get(_TMP_ENV):
        # Every temporary file of the run (the tests', their ranks', the trainers' output
        # directories) under one directory that goes with the run: spawned ranks and xdist
        # workers inherit TMPDIR.
        config._odc_tmp_root = tempfile.mkdtemp(prefix="odc-tests-")
        os.environ[_TMP_ENV] = os.environ["TMPDIR"] = tempfile.tempdir = config._odc_tmp_root
    if _dist(config) == "loadgroup" and not os.environ.get("PYTEST_XDIST_WORKER"):
        # The controller: its workers (started later, inheriting the environment) write the
        # groups of what they collected here.
        config._odc_groups_dir = tempfile.mkdtemp(prefix="odc-xdist-groups-")
        os.environ[_GROUPS_ENV] = os.path.join(config._odc_groups_dir, "groups.json")


def pytest_unconfigure(config):
    if getattr(config, "_odc_tmp_root", None):
        shutil.rmtree(config._odc_tmp_root, ignore_errors=True)
    if getattr(config, "_odc_groups_dir", None):
        shutil.rmtree(config._odc_groups_dir, ignore_errors=True)
        os.environ.pop(_GROUPS_ENV, None)


def _dist(config):
    try:
        return config.getoption("dist")
    except ValueError:  # no xdist
        return None


def _group(item):
    """The test's group: its xdist_group mark, else the module- or session-scoped fixture it
    uses from the test files (not pytest's own), else None."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    info = getattr(item, "_fixtureinfo", None)
    for name in item.fixturenames if info is not None else ():
        for fixturedef in info.name2fixturedefs.get(name, ()):
            if fixturedef.scope in ("module", "package", "session") and fixturedef.baseid:
                return f"{fixturedef.baseid}::{name}"
    return None


@pytest.hookimpl(trylast=True)  # after -k / -m deselection and any node id change
def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # without workers: collection order (CI)
    # Costliest modules first, each module's tests in their order (a group stays together).
    items.sort(key=lambda it: -COST_S.get(os.path.basename(str(it.path)), 5))
    path = os.environ.get(_GROUPS_ENV)
    if path:
        groups = {it.nodeid: g for it in items if (g := _group(it)) is not None}
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(groups, f)
        os.replace(tmp, path)  # every worker collects the same tests: any complete file will do


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if _dist(config) != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GroupScheduling(LoadGroupScheduling):
        """xdist's loadgroup, with the groups read from the workers' collection."""

        _groups = None

        def _split_scope(self, nodeid):
            if self._groups is None:
                try:
                    with open(os.environ[_GROUPS_ENV]) as f:
                        self._groups = json.load(f)
                except (KeyError, OSError, ValueError) as err:
                    sys.stderr.write(
                        f"tests/conftest.py: no test groups ({err!r}): tests "
                        "sharing a module fixture may run on several workers\n"
                    )
                    self._groups = {}
            return self._groups.get(nodeid) or super()._split_scope(nodeid)

    return GroupScheduling(config, log)
