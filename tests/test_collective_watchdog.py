"""Without blocking waits (NCCL's collectives waited on by the stream, not the CPU), a hung collective still ends the
run in one line naming the rank, the step and the collective: the rank's own watchdog (parallel/collective_watchdog.py).

On CPU the watchdog runs the same code over gloo, armed by the test as the launcher arms it for NCCL, with a shorter
timeout than gloo's own (which would otherwise raise at the call first); its CUDA marker (an event the stream
reaches after the collective) is a fake whose query() the test decides. Nothing here ran on CUDA.
"""

from __future__ import annotations

import time

import pytest
from conftest import child_pids, tiny_config

from zerotrain.parallel import collective_watchdog
from zerotrain.parallel.collective_watchdog import CollectiveWatchdog, process_group_timeout
from zerotrain.runtime.launch import JobFailed, process_group_environment, run_job

pytestmark = pytest.mark.timeout(300)

WATCH_S = 2.0  # the watchdog's timeout in the drill; gloo's own is GLOO_S
GLOO_S = 40


def test_nccl_ranks_set_no_blocking_wait_and_their_watchdog_speaks_before_ncclss_abort():
    # the CPU waits for no collective; NCCL's watchdog aborts the communicator and leaves the process to the rank
    assert process_group_environment("nccl", {}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert process_group_environment("nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}  # the agent's 1 (kill the process) never stays
    assert process_group_environment("gloo") == {}
    # NCCL's own timeout comes after the rank's watchdog; gloo's is --timeout itself, as before
    assert process_group_timeout(5, "nccl").total_seconds() == 5 + collective_watchdog.NCCL_TIMEOUT_GRACE_S
    assert process_group_timeout(5, "gloo").total_seconds() == 5


class Marker:
    """A CUDA event's stand-in: done when the test says the stream got there."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_collective_the_stream_has_not_finished_by_its_timeout_is_reported_by_name_and_a_finished_one_is_not():
    now, said, markers = [0.0], [], []

    def marker():
        markers.append(Marker())
        return markers[-1]

    watch = CollectiveWatchdog(lambda where, after, flag: said.append((where, after, flag)), marker=marker,
                               clock=lambda: now[0])
    first = watch.started("reduce_scatter_grads", 3, 5.0, "--timeout")
    watch.returned(first)  # the CPU went on: queued, not done
    second = watch.started("step_flags", 3, 5.0, "--timeout")
    watch.returned(second)
    assert watch.check() == 5.0 and said == []  # seconds to the oldest deadline
    now[0] = 4.0
    markers[0].done = True  # the stream finished the first in time
    assert watch.check() == pytest.approx(1.0) and len(watch.pending) == 1
    now[0] = 5.5  # the second is overdue: the one line names it and its step
    watch.check()
    assert said == [("collective step_flags at step 3", 5.0, "--timeout")]
    # a collective whose call raised is its own error's to report; a gloo call (no marker) is done on return
    watch = CollectiveWatchdog(lambda *a: said.append(a), clock=lambda: now[0])
    watch.failed(watch.started("all_gather", 4, 5.0, "--timeout"))
    watch.returned(watch.started("all_gather", 4, 5.0, "--timeout"))
    now[0] = 100.0
    assert watch.check() is None and len(said) == 1
    # a communicator without a timeout is not watched
    assert watch.started("barrier", 4, None, "--timeout") is None


def watched_job(cfg, comm):
    """Train with the rank's watchdog armed as the launcher arms it on NCCL (its line, its exit), over gloo, with a
    timeout shorter than gloo's own."""
    import dist_jobs

    from zerotrain.runtime import launch

    launch.arm_collective_watchdog(comm.rank, cfg, timeout_s=WATCH_S)
    return dist_jobs.params_job(cfg, comm)


def unwatched_job(cfg, comm):
    """Planted: the watchdog armed but told of no collective (Comm's note of each start left out)."""
    import dist_jobs

    watch = CollectiveWatchdog(lambda *a: None, timeout_s=WATCH_S)
    watch.started = lambda *a: None
    collective_watchdog.install(watch.start())
    return dist_jobs.params_job(cfg, comm)


def test_a_hung_rank_is_named_by_the_watchdog_with_step_and_collective_and_an_unwatched_run_waits_for_gloo(
        tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_FAULTS", "hang@step=3,rank=1")
    cfg = tiny_config(tmp_path, nproc=2, micro=2, steps=6, timeout=GLOO_S)
    t0 = time.monotonic()
    with pytest.raises(JobFailed, match=rf"rank 0: collective \w+ at step 3 timed out after {WATCH_S:g} s: another "
                                        r"rank stopped answering"):
        run_job(watched_job, cfg, time_limit=120)
    assert time.monotonic() - t0 < GLOO_S  # the watchdog's line, not gloo's timeout
    assert child_pids() == []
    # planted: no collective noted, so only gloo's own timeout ends the run, after --timeout (5 s, as
    # test_production's hung rank without a watchdog: long enough for a loaded machine's steps)
    cfg = tiny_config(tmp_path / "planted", nproc=2, micro=2, steps=6, timeout=5)
    with pytest.raises(JobFailed, match=r"rank 0: collective \w+ at step 3 timed out after 5 s"):
        run_job(unwatched_job, cfg, time_limit=120)
    assert child_pids() == []
