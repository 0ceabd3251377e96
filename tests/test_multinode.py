"""Two torchrun nodes on loopback: a rank of one is killed, both nodes restart, and the group re-forms from the last
checkpoint, in the run folder the first attempt named, and trains on as if nothing had happened.

Each node is a torchrun of its own (`--nnodes 2 --nproc-per-node 1`, c10d rendezvous on 127.0.0.1), so each node's
agent counts its restarts by itself, as on two machines. The restarted nodes are compared with the launcher's run:
their checkpoints of the steps before the kill show that two nodes never stopped train bitwise like zerotrain's own
launcher, the last one that the re-formed group does too.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
from conftest import live_processes

from zerotrain import checkpoint
from zerotrain.cli.main import main
from zerotrain.runtime import launch
from zerotrain.runtime.run_folder import release_run_folders

pytestmark = pytest.mark.timeout(300)

# The tiny model, one rank per node, --threads 1 (a 2-core machine's share for two ranks).
TINY = ["--micro-batch", "2", "--accum", "2", "--no-progress", "--data", "synthetic", "--threads", "1",
        "--steps", "6", "--ckpt-every", "2", "--timeout", "8"]
# Rank 1 dies at step 5 while rank 0 hangs there, as a rank stuck in a collective with a dead peer does (NCCL's):
# rank 1's node restarts for its failure, rank 0's only because the other node asked (torch's agent does not
# count that restart), the case where the nodes' TORCHELASTIC_RESTART_COUNT part. Faults fire in attempt 0 only.
FAULTS = "kill@step=5,rank=1;hang@step=5,rank=0"
# zerotrain's own --max-restarts, given too: rank 0 says as it starts that torchrun's decides (its note counts the
# starts of rank 0, one per attempt of the group).
RESTARTS_NOTE = ("zerotrain: note: --max-restarts 5 is for zerotrain's own launcher; under torchrun, restarts are "
                 "torchrun's --max-restarts (2 for this job)")
SHUTDOWN_S = 3  # how long a node's agent waits for a rank it stops before it kills it
DRILL_S = 150  # a drill that has not ended by then is stopped (a group that never re-forms waits on)

# The old prefix, planted in the ranks the way the product calls it: each node's own restart count as the attempt.
PLANTED = """\
import os, sys
from unittest import mock

from zerotrain.cli.main import main
from zerotrain.runtime import launch


def this_node_s_count(store, rank, world_size, timeout):
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


with mock.patch.object(launch, "_agree_attempt", this_node_s_count):
    sys.exit(main(sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoNodes:
    """`torchrun --nnodes 2 ... ENTRY train TINY --out OUT` twice, one per node, on a port the OS picked, in the
    folder `cwd`; with `out` None, no --out is given, and `out` is the one run folder found in `cwd/runs` once the
    drill is over.

    Rank 0 is sent one SIGTERM as it hangs: it keeps hanging (a stepping rank's first SIGTERM only asks it to save
    after its step), and its agent's SIGTERM, the second, then ends it at once. Where the agent's comes first (a
    loaded machine), or within the rank's SAME_STOP_S of the test's (one stop delivered twice), the agent kills it
    after --shutdown-timeout (SHUTDOWN_S, not torchrun's default 30 s).
    """

    def __init__(self, out: str | None, entry: list[str], *, cwd: str, faults: str | None = None,
                 enough=lambda drill: False):
        self.out, self.cwd, self.enough = out, cwd, enough
        env = {k: v for k, v in os.environ.items() if k != "ZEROTRAIN_FAULTS"}
        if faults:
            env["ZEROTRAIN_FAULTS"] = faults
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--max-restarts", "2", "--shutdown-timeout", str(SHUTDOWN_S), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
               *entry, "train", *TINY, "--max-restarts", "5", *(["--out", out] if out else [])]
        self.begun = time.monotonic()
        self.procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                       cwd=cwd, start_new_session=True) for _ in range(2)]
        self.lines: list[list[str]] = [[], []]
        self.readers = [threading.Thread(target=into.extend, args=(p.stdout,), daemon=True)
                        for p, into in zip(self.procs, self.lines)]
        for t in self.readers:
            t.start()
        self.hang_answered = False
        self.wall_s: float | None = None
        self.returncodes: list[int | None] = [None, None]  # None: still running when the drill was stopped

    @property
    def outputs(self) -> list[str]:
        return ["".join(list(lines)) for lines in self.lines]

    @property
    def rank0_starts(self) -> list[int]:
        return [out.count(RESTARTS_NOTE) for out in self.outputs]

    def poll(self) -> bool:
        """Whether the drill is over: both torchruns ended, `enough(self)`, or DRILL_S passed."""
        if self.wall_s is not None:
            return True
        for node, out in enumerate(self.outputs):
            if not self.hang_answered and "hang at step 5 on rank 0" in out:
                self.hang_answered = True
                for pid in self._ranks([self.procs[node]]):
                    os.kill(pid, signal.SIGTERM)
        if all(p.poll() is not None for p in self.procs) or self.enough(self) or \
                time.monotonic() - self.begun > DRILL_S:
            self.returncodes = [p.poll() for p in self.procs]
            self.wall_s = time.monotonic() - self.begun
        return self.wall_s is not None

    def reap(self) -> None:
        """SIGKILL each torchrun still running and its ranks, which torch starts in sessions of their own: the
        torchruns are stopped first, so that none starts a rank while they are found."""
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            os.killpg(p.pid, signal.SIGSTOP)
        for pid in self._ranks(live):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in live:
            os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(30)
        for t in self.readers:
            t.join(10)
        if self.out is None:
            runs = os.path.join(self.cwd, "runs")
            self.folders = sorted(os.listdir(runs)) if os.path.isdir(runs) else []
            self.out = os.path.join(runs, self.folders[0]) if self.folders else None

    @staticmethod
    def _ranks(procs: list[subprocess.Popen]) -> list[int]:
        agents = {p.pid for p in procs}
        return [pid for pid, parent, _ in live_processes() if parent in agents]


def failed_ranks(drill: TwoNodes) -> list[str]:
    """The one-line reports of ranks that failed (a rank killed by a signal, or stopped by its agent, reports none)."""
    return [line for out in drill.outputs for line in out.splitlines() if line.startswith("zerotrain: rank ")]


def _a_failure_or_a_third_start(drill: TwoNodes) -> bool:
    return bool(failed_ranks(drill)) or sum(drill.rank0_starts) > 2 or \
        any(rc not in (None, 0) for rc in (p.poll() for p in drill.procs))


@pytest.fixture(scope="module")
def drills(tmp_path_factory) -> dict[str, TwoNodes | str]:
    """The run folder of zerotrain's own launcher on 2 ranks (TINY, never stopped: the files the restarted nodes must
    end with), then two two-node runs at once (each mostly waits on its own starts): rank 1 killed at step 5, with
    no --out (the ranks name the run folder); the same with the old store prefix planted in the ranks, stopped as
    soon as a rank fails."""
    root = tmp_path_factory.mktemp("two_nodes")
    launcher = str(root / "launcher")
    try:
        assert main(["train", "--nproc", "2", *TINY, "--out", launcher]) == 0
    finally:
        release_run_folders()
    wrapper = root / "planted_zerotrain.py"
    wrapper.write_text(PLANTED)
    (root / "restarted").mkdir()
    runs: dict[str, TwoNodes] = {}
    try:
        runs["restarted"] = TwoNodes(None, ["-m", "zerotrain"], cwd=str(root / "restarted"), faults=FAULTS)
        runs["planted"] = TwoNodes(str(root / "planted"), [str(wrapper)], cwd=str(root), faults=FAULTS,
                                   enough=_a_failure_or_a_third_start)
        while not all([run.poll() for run in runs.values()]):
            time.sleep(0.1)
    finally:
        for run in runs.values():
            run.reap()
    for name, run in runs.items():
        print(f"two nodes, {name}: {run.wall_s:.1f} s, exit codes {run.returncodes}, rank 0 started "
              f"{run.rank0_starts} time(s) on each node")
    return {"launcher": launcher, **runs}


def re_formed_at_the_first_restart(drill: TwoNodes) -> str:
    """'' if both torchruns exited 0, no rank failed, and rank 0 started twice only (the first attempt and one
    restart), on one node; otherwise what went wrong."""
    if failed_ranks(drill):
        return f"a rank failed: {failed_ranks(drill)[0]}"
    if drill.returncodes != [0, 0]:
        return f"torchrun exit codes {drill.returncodes} after {drill.wall_s:.0f} s"
    if sorted(drill.rank0_starts) != [0, 2]:
        return f"rank 0 started {drill.rank0_starts} time(s) on each node"
    return ""


def records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def model_tensors(run_dir: str, step: int) -> dict[str, bytes]:
    """Every data file of the step's checkpoint (the model and each rank's optimizer state), byte for byte."""
    folder = os.path.join(run_dir, "checkpoints", checkpoint.step_name(step))
    return {name: open(os.path.join(folder, name), "rb").read()
            for name in sorted(os.listdir(folder)) if name.endswith(".safetensors")}


def test_two_torchrun_nodes_restart_a_killed_rank_re_form_the_group_in_its_run_folder_and_finish_bitwise_like_no_fault(
        drills):
    whole, restarted = drills["launcher"], drills["restarted"]
    assert re_formed_at_the_first_restart(restarted) == "", "\n".join(restarted.outputs)
    assert "kill at step 5 on rank 1" in "".join(restarted.outputs)
    # one folder: the first attempt's ranks agreed on one default name, and the restarted group kept it; said once,
    # by the first attempt's rank 0, since no --out named it
    assert len(restarted.folders) == 1, restarted.folders
    said = f"zerotrain: no --out given: this run's folder (summary.json, logs/) is {restarted.out}\n"
    assert "".join(restarted.outputs).count(said) == 1, "\n".join(restarted.outputs)
    steps = [r["step"] for r in records(restarted.out) if "event" not in r]
    restarts = [r for r in records(restarted.out) if r.get("event") == "restart"]
    assert [(r["attempt"], r["step"], r["steps_lost"]) for r in restarts] == [(1, 4, 0)]
    assert restarts[0]["failed_rank"] is None and "not known here (under torchrun" in restarts[0]["cause"]
    assert steps == [1, 2, 3, 4, 5, 6]
    with open(os.path.join(restarted.out, "summary.json")) as f:
        assert json.load(f)["restarts"] == 1
    # steps 1-4, the first attempt's (never stopped), then 5-6, the re-formed group's, bitwise like the launcher's
    assert [model_tensors(restarted.out, step) == model_tensors(whole, step) for step in (2, 4, 6)] == [True] * 3
    manifest = checkpoint.read_manifest(os.path.join(restarted.out, "checkpoints", checkpoint.step_name(6)))
    assert manifest["threads_per_rank"] == 1  # --threads 1 keeps a node's one rank off the other's core


def test_an_attempt_counted_by_each_node_planted_in_the_ranks_never_re_forms_the_group(drills):
    """The old store prefix, TORCHELASTIC_RESTART_COUNT: after the kill, rank 0's node still counts 0 and looks for
    the dead group's addresses under attempt 0, while rank 1's waits under attempt 1."""
    planted = drills["planted"]
    assert "kill at step 5 on rank 1" in "".join(planted.outputs)  # the drill got as far as the kill
    assert re_formed_at_the_first_restart(planted).startswith("a rank failed: zerotrain: rank "), \
        "\n".join(planted.outputs)


def test_the_ranks_of_each_new_group_agree_on_one_attempt_whatever_the_job_store_holds_from_earlier_ones():
    """launch._agree_attempt on one store, three ranks as threads, group after group: a rank may ask before rank 0
    has counted, a group may fail to form; each new group is the next attempt on every rank. A rank that took the
    count as it stands instead (planted) takes the last group's."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=10)

    def client():
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)

    def group(ranks, first=(), timeout=timeout):
        """The attempt each rank of `ranks` agrees on; the ranks in `first` ask before the others start."""
        got, errors = {}, {}

        def one(rank):
            try:
                got[rank] = launch._agree_attempt(client(), rank, 3, timeout)
            except Exception as e:  # noqa: BLE001 - reported below
                errors[rank] = e

        asks, watch = [f"zerotrain/ask/rank{r}" for r in first], client()
        stale = [watch.get(ask) if watch.check([ask]) else None for ask in asks]  # the last group's
        early = [threading.Thread(target=one, args=(r,)) for r in first]
        for t in early:
            t.start()
        deadline = time.monotonic() + 10
        while not all(watch.check([ask]) and watch.get(ask) != old for ask, old in zip(asks, stale)):
            assert time.monotonic() < deadline, "an early rank never asked"
            time.sleep(0.01)
        rest = [threading.Thread(target=one, args=(r,)) for r in ranks if r not in first]
        for t in rest:
            t.start()
        for t in early + rest:
            t.join()
        return got, errors

    assert group([0, 1, 2]) == ({0: 0, 1: 0, 2: 0}, {})
    assert group([0, 1, 2], first=[2]) == ({0: 1, 1: 1, 2: 1}, {})  # rank 2 asked before rank 0 counted
    got, errors = group([0, 2], timeout=datetime.timedelta(seconds=1))  # rank 1 dies before it asks
    assert set(errors) == {0} and "did not all join attempt 2" in str(errors[0])
    assert got == {2: 2}
    assert group([0, 1, 2], first=[1, 2]) == ({0: 3, 1: 3, 2: 3}, {})
    # planted: a rank that took the count as it stands, before rank 0 of its group has counted, takes the last
    # group's attempt (3) while rank 0 starts attempt 4
    as_it_stands = client().add(launch._ATTEMPTS, 0) - 1
    assert (as_it_stands, group([0, 1, 2])[0][0]) == (3, 4)
