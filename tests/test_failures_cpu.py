"""Failures on CPU ranks (shared-memory transport) end fast and name the peer: a SIGKILLed peer is
reported within seconds and a hung one at the process group's timeout, however many operations
the survivor queued (several microbatches, eager and lazy publishing); nothing is left in
/dev/shm. The transport's own failure paths (spoofed segments, a rank dying during attach or
holding an accumulation lock) are tested in tests/cpp/test_shm_failures.cpp."""

import pytest
from failure_cases import PG_TIMEOUT, check_failure_report, fail_in_second_minibatch, odc_shm_names
from multiproc import run_ranks

pytestmark = pytest.mark.serial  # durations against the timeout, /dev/shm before/after


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "lazy"])
@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_dead_or_hung_peer_is_reported_fast_naming_it(how, eager):
    before = odc_shm_names()
    results = run_ranks(
        2, fail_in_second_minibatch, how, eager, pg_timeout=PG_TIMEOUT, may_die=(1,)
    )
    msg, elapsed = results[0]
    check_failure_report(how, eager, msg, elapsed, before)
    if how == "kill":
        assert elapsed < PG_TIMEOUT / 2, (elapsed, msg)  # liveness, not the timeout
