"""Fault injection: ZEROTRAIN_FAULTS parsing, which call fires which fault once, and what each fault does to a process.

The faults that end or block a process run in child processes, so the test process survives them.
"""

import math
import signal
import subprocess
import textwrap

import pytest
from forked_child import ForkedChild, run_forked

from zerotrain.errors import ConfigError
from zerotrain.training.faults import CRASH_IN_SAVE_EXIT, ENV, Fault, Faults


def run_child(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`code` run as `python -c CODE` would run it, in a child forked from this process (forked_child.py)."""
    return run_forked(textwrap.dedent(code), timeout=timeout)


# --- parsing ---------------------------------------------------------------------------------------------------

def test_a_spec_parses_into_faults_with_rank_0_and_factor_100_by_default():
    faults = Faults.parse(" kill@step=3,rank=1; lr_spike@step=5 ;lr_spike@step=6,factor=2.5,rank=2;"
                          "nan@step=2;hang@step=9;crash_in_save@step=10;sigterm@step=4;")
    assert faults.planned == (
        Fault("kill", 3, 1), Fault("lr_spike", 5, 0, 100.0), Fault("lr_spike", 6, 2, 2.5), Fault("nan", 2, 0),
        Fault("hang", 9, 0), Fault("crash_in_save", 10, 0), Fault("sigterm", 4, 0))
    assert faults.for_rank(2).describe() == "faults planned: lr_spike x2.5 at step 6 on rank 2"
    assert Faults.parse("  ").planned == () and Faults.parse("").describe() == "no faults planned"


@pytest.mark.parametrize("spec, message", [
    ("explode@step=3", ("unknown fault kind 'explode' in 'explode@step=3' "
                        "(known: kill, hang, nan, lr_spike, crash_in_save, crash_in_commit, save_error, disk_full, "
                        "slow_staging, sigterm, group_sigint, group_sigterm, oom, slow_storage, group_sigint_in_commit, "
                        "group_sigint_in_reference, crash_in_reference, sigterm_in_slow_step)")),
    ("crash_in_commit@step=4,rank=1", ("crash_in_commit fires on rank 0, which alone commits checkpoints, not rank 1, "
                                       "in 'crash_in_commit@step=4,rank=1'")),
    ("group_sigint_in_commit@step=4,rank=1", ("group_sigint_in_commit fires on rank 0, which alone commits "
                                              "checkpoints, not rank 1, in 'group_sigint_in_commit@step=4,rank=1'")),
    ("crash_in_reference@step=0,rank=1", ("crash_in_reference fires on rank 0, which alone writes the reference, not "
                                          "rank 1, in 'crash_in_reference@step=0,rank=1'")),
    ("crash_in_reference@step=2", ("crash_in_reference takes step=0 (the reference is written before step 1), not "
                                   "step=2, in 'crash_in_reference@step=2'")),
    ("group_sigint_in_reference@step=0", ("step must be an integer >= 1, got '0' in "
                                          "'group_sigint_in_reference@step=0'")),
    ("kill", "'kill' names no step (format: kind@step=N[,rank=R][,factor=F])"),
    ("kill@rank=1", "'kill@rank=1' names no step (format: kind@step=N[,rank=R][,factor=F])"),
    ("kill@step=x", "step must be an integer >= 0, got 'x' in 'kill@step=x'"),  # kill, hang: 0 is start-up
    ("kill@step=-1", "step must be an integer >= 0, got '-1' in 'kill@step=-1'"),
    ("nan@step=0", "step must be an integer >= 1, got '0' in 'nan@step=0'"),
    ("sigterm@step=2.5", "step must be an integer >= 1, got '2.5' in 'sigterm@step=2.5'"),
    ("nan@step=2,rank=-1", "rank must be an integer >= 0, got '-1' in 'nan@step=2,rank=-1'"),
    ("nan@step=2,when=now", ("cannot read 'when=now' in 'nan@step=2,when=now' "
                             "(format: kind@step=N[,rank=R][,factor=F])")),
    ("nan@step=2,rank", "cannot read 'rank' in 'nan@step=2,rank' (format: kind@step=N[,rank=R][,factor=F])"),
    ("nan@step=2,step=3", "step is given twice in 'nan@step=2,step=3'"),
    ("nan@step=2,factor=5", "factor applies only to lr_spike, slow_staging, slow_storage, sigterm_in_slow_step, not nan, in 'nan@step=2,factor=5'"),
    ("lr_spike@step=2,factor=inf", "factor must be a positive number, got 'inf' in 'lr_spike@step=2,factor=inf'"),
    ("lr_spike@step=2,factor=big", "factor must be a positive number, got 'big' in 'lr_spike@step=2,factor=big'"),
])
def test_each_malformed_spec_is_a_one_line_error_naming_the_entry(spec, message):
    with pytest.raises(ConfigError) as e:
        Faults.parse(f"kill@step=1; {spec}")
    assert str(e.value) == f"{ENV}: {message}"
    assert "\n" not in str(e.value)


# --- which call fires what -------------------------------------------------------------------------------------

def test_nan_and_lr_spike_change_only_their_step_and_rank():
    faults = Faults.parse("nan@step=2,rank=1;lr_spike@step=3,rank=1;lr_spike@step=4,rank=1,factor=0.5")
    rank0, rank1 = faults.for_rank(0), faults.for_rank(1)
    assert [rank0.loss_factor(s) for s in (1, 2, 3)] == [1.0, 1.0, 1.0]
    assert [rank0.lr_factor(s) for s in (3, 4)] == [1.0, 1.0]
    assert rank1.loss_factor(1) == 1.0 and math.isnan(rank1.loss_factor(2)) and rank1.loss_factor(3) == 1.0
    assert [rank1.lr_factor(s) for s in (2, 3, 4, 5)] == [1.0, 100.0, 0.5, 1.0]


def test_each_fault_fires_once_even_when_a_rollback_replays_its_step():
    faults = Faults.parse("nan@step=7;lr_spike@step=7,factor=10").for_rank(0)
    assert math.isnan(faults.loss_factor(7)) and faults.lr_factor(7) == 10.0
    # rolled back to step 5: steps 6 and 7 come again and run clean
    assert [faults.loss_factor(s) for s in (6, 7)] == [1.0, 1.0]
    assert faults.lr_factor(7) == 1.0
    assert faults.fired == {Fault("nan", 7), Fault("lr_spike", 7, 0, 10.0)}


def test_faults_come_from_the_environment_for_this_rank_and_only_in_the_first_attempt(monkeypatch):
    monkeypatch.setenv(ENV, "nan@step=2,rank=1;crash_in_save@step=4,rank=1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert Faults.from_env(rank=1).planned == (Fault("nan", 2, 1), Fault("crash_in_save", 4, 1))
    assert Faults.from_env(rank=0).planned == ()
    restarted = Faults.from_env(rank=1, attempt=1)
    assert restarted.planned == () and restarted.loss_factor(2) == 1.0 and restarted.save_hook() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert Faults.from_env(rank=1).planned == ()
    monkeypatch.setenv(ENV, "nan@step=two")  # a typo is reported in every attempt
    with pytest.raises(ConfigError, match="nan@step=two"):
        Faults.from_env(rank=0)


def test_only_a_planned_crash_in_save_gives_the_writer_a_hook():
    assert Faults.parse("crash_in_save@step=4,rank=1").for_rank(0).save_hook() is None
    assert Faults.parse("nan@step=4").for_rank(0).save_hook() is None
    assert callable(Faults.parse("crash_in_save@step=4").for_rank(0).save_hook())


def test_before_collectives_of_other_steps_and_ranks_returns_at_once():
    faults = Faults.parse("kill@step=3,rank=1;hang@step=4,rank=1;sigterm@step=5,rank=1").for_rank(0)
    for step in range(1, 7):
        faults.before_collectives(step, stop_seen=lambda: False)
    assert faults.fired == set()


# --- what a fault does to the process --------------------------------------------------------------------------

def test_kill_sigkills_the_rank_at_its_step():
    child = run_child("""
        from zerotrain.training.faults import Faults
        faults = Faults.parse("kill@step=3,rank=1").for_rank(1)
        for step in range(1, 6):
            faults.before_collectives(step)
            print("survived step", step, flush=True)
    """)
    assert child.returncode == -signal.SIGKILL
    assert child.stdout.split("\n") == ["survived step 1", "survived step 2", ""]
    assert "kill at step 3 on rank 1" in child.stderr


def test_hang_blocks_until_killed_and_shrugs_off_sigterm():
    child = ForkedChild("""
        import signal
        from zerotrain.training.faults import Faults
        signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM handled", flush=True))
        faults = Faults.parse("hang@step=2").for_rank(0)
        faults.before_collectives(1)
        print("entering step 2", flush=True)
        faults.before_collectives(2)
        print("returned from step 2", flush=True)
    """)
    try:
        assert child.stdout.readline() == "entering step 2\n"
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=1.0)
        child.send_signal(signal.SIGTERM)  # a handled signal interrupts the sleep, which resumes
        assert child.stdout.readline() == "SIGTERM handled\n"
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.5)
    finally:
        child.kill()
        out, err = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert "returned" not in out and "hang at step 2 on rank 0" in err


@pytest.mark.parametrize("spec, rank, hook", [("crash_in_save@step=4,rank=1", 1, "save_hook"),
                                               ("crash_in_commit@step=4", 0, "commit_hook")])
def test_a_crash_in_a_save_or_its_commit_exits_with_its_code_at_its_step_and_only_then(spec, rank, hook):
    """crash_in_save halfway through writing the rank's shard, crash_in_commit between the commit's renames."""
    child = run_child(f"""
        from zerotrain.training.faults import Faults
        hook = Faults.parse("{spec}").for_rank({rank}).{hook}()
        for step in (2, 4, 6):
            print("before", step, flush=True)
            hook(step)
            print("after", step, flush=True)
    """)
    assert child.returncode == CRASH_IN_SAVE_EXIT == 75
    assert child.stdout.split("\n") == ["before 2", "after 2", "before 4", ""]
    assert f"{spec.split('@')[0]} at step 4 on rank {rank}" in child.stderr


def test_only_the_commit_kinds_give_the_writer_a_commit_hook():
    assert Faults.parse("crash_in_save@step=4").for_rank(0).commit_hook() is None  # the writer's commit runs as ever
    assert callable(Faults.parse("crash_in_commit@step=4").for_rank(0).commit_hook())
    assert callable(Faults.parse("group_sigint_in_commit@step=4").for_rank(0).commit_hook())
    assert Faults.parse("crash_in_commit@step=4").for_rank(0).reference_hook() is None


@pytest.mark.parametrize("planted", [False, True], ids=["whole-or-absent", "planted-in-place"])
def test_a_crash_halfway_through_writing_the_reference_leaves_the_file_it_replaces_whole(tmp_path, planted):
    """crash_in_reference exits halfway through the reference's write (durable.write_atomic, which the first write
    and a resume's copy both use): the file it was replacing is still there, whole. Planted: the write in place, as
    the resume's copy once was (shutil.copyfile): half a file, which every checkpoint recording the reference's
    sha256 would be refused for."""
    path = tmp_path / "dpo_reference.safetensors"
    path.write_bytes(b"old" * 1000)
    child = run_child(f"""
        from zerotrain import durable
        from zerotrain.training.faults import Faults
        if {planted}:
            def in_place(path, data, *, durable=True, halfway=None):
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    halfway()
                    f.write(data[len(data) // 2 :])
            durable.write_atomic = in_place
        durable.write_atomic({str(path)!r}, b"new" * 1000,
                             halfway=Faults.parse("crash_in_reference@step=0").for_rank(0).reference_hook())
        print("written", flush=True)
    """)
    assert child.returncode == CRASH_IN_SAVE_EXIT and child.stdout == ""
    assert "crash_in_reference before the first step on rank 0" in child.stderr
    assert path.read_bytes() == (b"new" * 500 if planted else b"old" * 1000)


# the worker is forked from the launcher (itself a ForkedChild), which is its parent as a launcher is a rank's
LAUNCHER = """
    import multiprocessing, os, signal
    received = []
    def on_sigterm(signum, frame):
        received.append(signum)
        if {forward}:
            os.kill(worker.pid, signal.SIGTERM)  # as the elastic agent forwards a stop to its workers
    signal.signal(signal.SIGTERM, on_sigterm)
    worker = multiprocessing.get_context("fork").Process(target=exec, args=({worker!r}, {{"__name__": "__main__"}}))
    worker.start()
    worker.join()
    rc = worker.exitcode
    print("launcher received", len(received), "SIGTERM; worker exit", rc, flush=True)
"""

WORKER = """
import signal
from zerotrain.errors import ZeroTrainError
from zerotrain.training.faults import Faults
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(True))  # the rank's own stop request
faults = Faults.parse("sigterm@step=3").for_rank(0)
try:
    for step in range(1, 10):
        faults.before_collectives(step, stop_seen=lambda: bool(stop), stop_wait_s=1.0)
        faults.after_update(step, stop_seen=lambda: bool(stop), stop_wait_s=1.0)
        if stop:
            print("worker stopped at step", step, flush=True)
            break
except ZeroTrainError as e:
    print(e, flush=True)
"""


def test_sigterm_signals_the_launcher_and_waits_until_the_stop_reaches_this_rank():
    launcher = run_child(LAUNCHER.format(forward=True, worker=WORKER))
    assert launcher.returncode == 0, launcher.stderr
    assert launcher.stdout == "worker stopped at step 3\nlauncher received 1 SIGTERM; worker exit 0\n"


def test_sigterm_whose_stop_never_arrives_fails_after_the_bounded_wait():
    launcher = run_child(LAUNCHER.format(forward=False, worker=WORKER))
    lines = launcher.stdout.splitlines()
    assert lines[0].startswith(f"{ENV}: sigterm at step 3 on rank 0: no stop request reached this rank within 1 s")
    assert lines[1] == "launcher received 1 SIGTERM; worker exit 0"


def test_an_lr_spike_fires_on_every_rank_of_its_tp_group_and_other_faults_on_their_rank_only():
    planned = Faults.parse("lr_spike@step=3,rank=3,factor=10;nan@step=3,rank=3")
    # with --tp 2, ranks 2 and 3 are one replica: both update the replicated parameters with the spike
    assert [f.kind for f in planned.for_rank(2, tp=2).planned] == ["lr_spike"]
    assert [f.kind for f in planned.for_rank(3, tp=2).planned] == ["lr_spike", "nan"]
    assert planned.for_rank(1, tp=2).planned == ()
    assert planned.for_rank(2, tp=1).planned == ()  # without TP, rank 3's alone
    assert planned.for_rank(3, tp=2).lr_factor(3) == 10.0
