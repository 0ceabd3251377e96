"""Deterministic fault injection for tests and drills, planned by the ZEROTRAIN_FAULTS environment variable.

    ZEROTRAIN_FAULTS="kind@step=N[,rank=R][,factor=F];..."

N is the 1-based optimizer step; R is the rank that misbehaves (default 0); F is lr_spike's factor (default 100),
slow_staging's delay in seconds (default 1), slow_storage's seconds per MiB (default 1) or sigterm_in_slow_step's
bound in seconds (default 60).
kill, hang and slow_storage also take step=0: while the rank starts, before its first step.
group_sigint_in_reference counts the forwards of DPO's reference pass instead, crash_in_reference takes step=0 only.

    kill           the rank SIGKILLs itself during step N, before that step's collectives
    hang           the rank blocks forever before step N's collectives (only being killed ends it)
    nan            the rank's loss of step N becomes NaN (loss_factor)
    lr_spike       step N's learning rate is multiplied by F (lr_factor); with --tp on every rank of R's TP
                   group, which update the replicated parameters together (one rank alone would split replicas)
    crash_in_save  the rank exits with CRASH_IN_SAVE_EXIT halfway through writing its shard of checkpoint N
    crash_in_commit
                   rank 0 (which alone commits; no other rank is accepted) exits with CRASH_IN_SAVE_EXIT while it
                   commits checkpoint N, between moving the step's existing folder aside and renaming the new one
                   into place (a re-save: a run resumed from an earlier checkpoint reached N; when N has no folder
                   yet, just before the rename)
    save_error     the rank's writer fails (an OSError, the rank lives on) halfway through its shard of checkpoint N
    disk_full      the rank's disk fills halfway through its shard of checkpoint N: the write fails with ENOSPC,
                   naming no file, as the operating system's write does
    slow_staging   the rank's async save of checkpoint N copies its state F seconds late (default 1), as a writer
                   with no core of its own would: the next update waits for the copy
    sigterm        the rank sends SIGTERM to its launcher after step N's update, then waits until its own stop
                   request is seen, so the stop lands after step N whatever the signal's delivery time: step N
                   is saved (the stop's save starts as step N+1 begins; step N+1 is not applied)
    group_sigint, group_sigterm
                   the same with SIGINT or SIGTERM sent to the launcher's whole process group (the launcher, the
                   ranks' server, every rank), as a terminal's Ctrl-C, `timeout` or `kill -- -PGID` send it; run
                   the job in a process group of its own (setsid)
    sigterm_in_slow_step
                   the rank sends SIGTERM to its launcher in step N's second forward (run it with --accum 2 or
                   more), waits until its own stop request is seen, then blocks there until the stop's checkpoint
                   of step N-1 is committed (`latest` names it), as a step longer than torchrun's 30 s grace
                   period would: it fails the rank if none is within F seconds (default 60), and says so on
                   stderr when one is
    group_sigint_in_commit
                   rank 0 sends SIGINT to the launcher's whole process group while it commits checkpoint N (every
                   rank's files durable, the manifest written, before the rename; as crash_in_commit), SAME_STOP_S
                   after the launcher's stop file appeared: with a stop at step N, a second request inside its save.
                   It waits until its own handler has seen the signal, then commits
    group_sigint_in_reference
                   the rank sends SIGINT to the launcher's whole process group after its Nth forward of DPO's
                   precomputed reference pass (before step 1), then waits until its own stop request is seen
    crash_in_reference
                   rank 0 (which alone writes it) exits with CRASH_IN_SAVE_EXIT halfway through writing the
                   precomputed DPO reference beside the checkpoints: scored before step 1, or copied there by a
                   resume from another folder's checkpoint (step=0)
    oom            the rank runs out of memory during step N, before that step's collectives (torch's
                   OutOfMemoryError, as an allocation beyond the device raises it)
    slow_storage   from step N on (0: from its start), every checkpoint file the rank reads or writes costs F seconds
                   per MiB and at least F per file: hashing --init-from's files, saves, commits, retention, loads,
                   verification (storage shared by many nodes, or far away)

Faults fire only in the first attempt of an elastic job (a restart must be able to recover), and each at most
once per process: after a rollback the same step number comes again and must run clean. Each method fires a
fault on its first call for the step, so the loop calls each once per step (loss_factor once per micro-batch
is fine: one NaN micro-batch makes the step's loss NaN).
"""

from __future__ import annotations

import errno
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from zerotrain.checkpoint import WriterHooks, read_latest, step_name
from zerotrain.checkpoint.stream import slow_storage
from zerotrain.errors import ConfigError, ZeroTrainError
from zerotrain.runtime.rank_start import launcher_pid
from zerotrain.runtime.failures import restart_count
from zerotrain.runtime.stop import SAME_STOP_S, stop_request

ENV = "ZEROTRAIN_FAULTS"
KINDS = ("kill", "hang", "nan", "lr_spike", "crash_in_save", "crash_in_commit", "save_error", "disk_full",
         "slow_staging", "sigterm", "group_sigint", "group_sigterm", "oom", "slow_storage", "group_sigint_in_commit",
         "group_sigint_in_reference", "crash_in_reference", "sigterm_in_slow_step")
SAVE_KINDS = ("crash_in_save", "save_error", "disk_full")  # the kinds the checkpoint writer's halfway hook fires
STARTUP_KINDS = ("kill", "hang", "slow_storage", "crash_in_reference")  # the kinds that step=0 fires as the rank starts
RANK_0_KINDS = ("crash_in_commit", "group_sigint_in_commit", "crash_in_reference")  # rank 0 alone commits, writes
FORMAT = "kind@step=N[,rank=R][,factor=F]"
# Distinct from Python's 1 and a signal's 128+n, so a drill can tell this crash from an ordinary failure.
CRASH_IN_SAVE_EXIT = 75
DEFAULT_LR_FACTOR = 100.0
DEFAULT_STAGING_DELAY_S = 1.0
STOP_POLL_S = 0.01
STOP_WAIT_S = 60.0
FACTOR_DEFAULTS = {"lr_spike": DEFAULT_LR_FACTOR, "slow_staging": DEFAULT_STAGING_DELAY_S,
                   "slow_storage": 1.0, "sigterm_in_slow_step": STOP_WAIT_S}  # the kinds that take a factor
SLOW_STEP_FORWARD = 2  # sigterm_in_slow_step fires in this forward of its step: one micro-batch is done
SIGNALS = {"sigterm": signal.SIGTERM, "group_sigint": signal.SIGINT, "group_sigterm": signal.SIGTERM}
# sigterm: how often and how long the rank polls for its own stop request after signalling the launcher
# (STOP_POLL_S, STOP_WAIT_S above).


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # 1-based optimizer step
    rank: int = 0
    factor: float = DEFAULT_LR_FACTOR  # lr_spike's factor; slow_staging's delay in seconds; slow_storage's s per MiB

    def describe(self) -> str:
        what = {"lr_spike": f"lr_spike x{self.factor:g}", "slow_staging": f"slow_staging {self.factor:g} s",
                "slow_storage": f"slow_storage {self.factor:g} s per MiB",
                "sigterm_in_slow_step": f"sigterm_in_slow_step (up to {self.factor:g} s)"}.get(self.kind, self.kind)
        when = "before the first step" if self.step == 0 else f"at step {self.step}"
        if self.kind == "group_sigint_in_reference":
            when = f"after forward {self.step} of the reference pass"
        return f"{what} {when} on rank {self.rank}"


def _parse_int(entry: str, key: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(f"{ENV}: {key} must be an integer >= {minimum}, got {text!r} in {entry!r}")
    return value


def _parse_entry(entry: str) -> Fault:
    kind, at, params = entry.partition("@")
    kind = kind.strip()
    if kind not in KINDS:
        raise ConfigError(f"{ENV}: unknown fault kind {kind!r} in {entry!r} (known: {', '.join(KINDS)})")
    if not at:
        raise ConfigError(f"{ENV}: {entry!r} names no step (format: {FORMAT})")
    values: dict[str, str] = {}
    for item in params.split(","):
        key, eq, value = (s.strip() for s in item.partition("="))
        if key not in ("step", "rank", "factor") or not eq:
            raise ConfigError(f"{ENV}: cannot read {item.strip()!r} in {entry!r} (format: {FORMAT})")
        if key in values:
            raise ConfigError(f"{ENV}: {key} is given twice in {entry!r}")
        values[key] = value
    if "step" not in values:
        raise ConfigError(f"{ENV}: {entry!r} names no step (format: {FORMAT})")
    fault = Fault(kind, _parse_int(entry, "step", values["step"], 0 if kind in STARTUP_KINDS else 1),
                  _parse_int(entry, "rank", values.get("rank", "0"), 0))
    if kind in RANK_0_KINDS and fault.rank != 0:
        what = "writes the reference" if kind == "crash_in_reference" else "commits checkpoints"
        raise ConfigError(f"{ENV}: {kind} fires on rank 0, which alone {what}, not rank {fault.rank}, in {entry!r}")
    if kind == "crash_in_reference" and fault.step != 0:
        raise ConfigError(f"{ENV}: crash_in_reference takes step=0 (the reference is written before step 1), not "
                          f"step={fault.step}, in {entry!r}")
    if "factor" in values:
        if kind not in FACTOR_DEFAULTS:
            raise ConfigError(f"{ENV}: factor applies only to {', '.join(FACTOR_DEFAULTS)}, not {kind}, in {entry!r}")
        try:
            factor = float(values["factor"])
        except ValueError:
            factor = math.nan
        if not (math.isfinite(factor) and factor > 0):
            raise ConfigError(f"{ENV}: factor must be a positive number, got {values['factor']!r} in {entry!r}")
        fault = Fault(kind, fault.step, fault.rank, factor)
    elif kind in FACTOR_DEFAULTS:
        fault = Fault(kind, fault.step, fault.rank, FACTOR_DEFAULTS[kind])
    return fault


def _announce(fault: Fault) -> None:
    # Said before acting, on stderr: a rank that dies or hangs on purpose should not look like a bug.
    print(f"zerotrain: {ENV}: {fault.describe()}", file=sys.stderr, flush=True)


class Faults:
    """The faults planned for one process, each fired at most once."""

    def __init__(self, planned: list[Fault] | tuple[Fault, ...] = ()):
        self.planned: tuple[Fault, ...] = tuple(planned)
        self.fired: set[Fault] = set()

    @classmethod
    def parse(cls, text: str) -> "Faults":
        """Every fault in `text` (all ranks); raises ConfigError naming the first bad entry."""
        entries = [e.strip() for e in text.split(";")]
        return cls([_parse_entry(e) for e in entries if e])

    def check_ranks(self, world_size: int) -> "Faults":
        """ConfigError naming the first fault planned for a rank the job does not have: it would never fire."""
        for fault in self.planned:
            if fault.rank >= world_size:
                raise ConfigError(f"{ENV}: {fault.kind}@step={fault.step},rank={fault.rank} names rank {fault.rank}, "
                                  f"but the job has {world_size} rank(s) (0-{world_size - 1})")
        return self

    @classmethod
    def from_env(cls, rank: int, attempt: int | None = None, tp: int = 1) -> "Faults":
        """This rank's faults from ZEROTRAIN_FAULTS; attempt defaults to the one the job's ranks agreed on."""
        if attempt is None:
            attempt = restart_count()
        # Parsed in every attempt, so a typo is reported even when nothing would fire.
        return cls.parse(os.environ.get(ENV, "")).for_rank(rank, attempt, tp)

    def for_rank(self, rank: int, attempt: int = 0, tp: int = 1) -> "Faults":
        """The faults of `rank` (lr_spike: of its TP group of `tp` ranks); none after an elastic restart (attempt > 0)."""
        def mine(f: Fault) -> bool:
            return f.rank // tp == rank // tp if f.kind == "lr_spike" else f.rank == rank

        return Faults([f for f in self.planned if mine(f) and attempt == 0])

    def describe(self) -> str:
        if not self.planned:
            return "no faults planned"
        return "faults planned: " + "; ".join(f.describe() for f in self.planned)

    def _fire(self, step: int, *kinds: str) -> list[Fault]:
        due = [f for f in self.planned if f.step == step and f.kind in kinds and f not in self.fired]
        self.fired.update(due)
        return due

    def before_collectives(self, step: int, stop_seen: Callable[[], bool] | None = None,
                           stop_wait_s: float = STOP_WAIT_S) -> None:
        """kill, hang, oom and slow_storage of step `step`, in the order written; call before the step's first
        collective (step 0: as the rank starts, before it reads or hashes any file).

        `stop_seen()` tells whether this rank's own stop request (set by its SIGTERM handler) has arrived.
        """
        for fault in self._fire(step, "kill", "hang", "oom", "slow_storage"):
            _announce(fault)
            if fault.kind == "slow_storage":
                slow_storage(fault.factor)
            elif fault.kind == "oom":
                raise torch.OutOfMemoryError(f"{ENV}: {fault.describe()}")
            elif fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "hang":
                while True:  # sleep resumes after a handled signal (PEP 475): only SIGKILL ends this
                    time.sleep(3600)

    def after_update(self, step: int, stop_seen: Callable[[], bool] | None = None,
                     stop_wait_s: float = STOP_WAIT_S) -> None:
        """sigterm, group_sigint and group_sigterm of step `step`: call once its update is applied (its save, if due,
        done). A stop then lands between steps, where every rank saves step `step`: the drills that need the stop
        inside a step use sigterm_in_slow_step."""
        for fault in self._fire(step, *SIGNALS):
            _announce(fault)
            self._signal_launcher(fault, stop_seen, stop_wait_s)

    def watch_forwards(self, model: torch.nn.Module, checkpoint_dir: str, current_step: Callable[[], int]) -> None:
        """sigterm_in_slow_step, fired by a forward pre-hook on `model` in the SLOW_STEP_FORWARD-th forward of its step
        (`current_step()`, the step the loop is in); nothing is hooked if none is planned."""
        if not any(f.kind == "sigterm_in_slow_step" for f in self.planned):
            return
        forwards: dict[int, int] = {}

        def in_forward(_module, _args) -> None:
            step = current_step()
            forwards[step] = forwards.get(step, 0) + 1
            if forwards[step] != SLOW_STEP_FORWARD:
                return
            for fault in self._fire(step, "sigterm_in_slow_step"):
                _announce(fault)
                self._signal_launcher(Fault("sigterm", step, fault.rank), lambda: stop_request().requested,
                                      STOP_WAIT_S)
                _wait_for_commit(fault, checkpoint_dir, step - 1)

        model.register_forward_pre_hook(in_forward)

    @staticmethod
    def _signal_launcher(fault: Fault, stop_seen: Callable[[], bool] | None, stop_wait_s: float) -> None:
        if stop_seen is None:
            raise ValueError(f"the {fault.kind} fault needs stop_seen(), the rank's own stop request")
        if fault.kind == "sigterm":
            os.kill(launcher_pid(), signal.SIGTERM)
        else:
            os.killpg(os.getpgid(launcher_pid()), SIGNALS[fault.kind])
        deadline = time.monotonic() + stop_wait_s
        while not stop_seen():
            if time.monotonic() > deadline:
                raise ZeroTrainError(
                    f"{ENV}: {fault.describe()}: no stop request reached this rank within {stop_wait_s:g} s "
                    f"of signalling the launcher (pid {launcher_pid()})")
            time.sleep(STOP_POLL_S)

    def loss_factor(self, step: int) -> float:
        """NaN if a nan fault is due at `step`, else 1.0; the loop multiplies this rank's loss by it before backward."""
        return math.nan if self._fire(step, "nan") else 1.0

    def lr_factor(self, step: int) -> float:
        """The product of the lr_spike factors due at `step` (1.0 if none)."""
        return math.prod(f.factor for f in self._fire(step, "lr_spike"))

    def save_hook(self) -> Callable[[int], None] | None:
        """The checkpoint writer's halfway_hook(step), exiting at a planned crash_in_save step or failing at a
        save_error or disk_full step; None if none is planned."""
        if not any(f.kind in SAVE_KINDS for f in self.planned):
            return None

        def fail_halfway(step: int) -> None:
            for fault in self._fire(step, *SAVE_KINDS):
                _announce(fault)
                if fault.kind == "crash_in_save":
                    os._exit(CRASH_IN_SAVE_EXIT)  # no cleanup, no flush: like a machine losing power mid-write
                if fault.kind == "disk_full":
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                raise OSError(f"{ENV}: injected write failure ({fault.describe()})")

        return fail_halfway

    def writer_hooks(self) -> WriterHooks:
        """What the checkpoint writer is handed: save_hook, staging_hook and commit_hook."""
        return WriterHooks(halfway=self.save_hook(), staging=self.staging_hook(), commit=self.commit_hook())

    def commit_hook(self) -> Callable[[int], None] | None:
        """The checkpoint writer's commit_hook(step), run by rank 0's commit between its two renames: exits at a
        planned crash_in_commit step, signals at a group_sigint_in_commit step; None if neither is planned."""
        if not any(f.kind in ("crash_in_commit", "group_sigint_in_commit") for f in self.planned):
            return None

        def between_renames(step: int) -> None:
            for fault in self._fire(step, "crash_in_commit", "group_sigint_in_commit"):
                _announce(fault)
                if fault.kind == "crash_in_commit":
                    os._exit(CRASH_IN_SAVE_EXIT)  # the step's folder is moved aside, the new one not yet in place
                _second_group_sigint(fault)

        return between_renames

    def in_reference_pass(self, forward: int) -> None:
        """group_sigint_in_reference after the reference pass's `forward`th forward (1-based)."""
        for fault in self._fire(forward, "group_sigint_in_reference"):
            _announce(fault)
            self._signal_launcher(Fault("group_sigint", fault.step, fault.rank), lambda: stop_request().requested,
                                  STOP_WAIT_S)

    def reference_hook(self) -> Callable[[], None] | None:
        """The reference writer's halfway hook: exits at a planned crash_in_reference; None if none is planned."""
        if not any(f.kind == "crash_in_reference" for f in self.planned):
            return None

        def crash_halfway() -> None:
            for fault in self._fire(0, "crash_in_reference"):
                _announce(fault)
                os._exit(CRASH_IN_SAVE_EXIT)  # half of the file written: like a machine losing power mid-write

        return crash_halfway

    def staging_hook(self) -> Callable[[int], None] | None:
        """The async writer's staging_hook(step), run in its thread before it copies the state; None if no
        slow_staging is planned."""
        if not any(f.kind == "slow_staging" for f in self.planned):
            return None

        def late(step: int) -> None:
            for fault in self._fire(step, "slow_staging"):
                _announce(fault)
                time.sleep(fault.factor)

        return late


def _second_group_sigint(fault: Fault) -> None:
    """SIGINT to the launcher's whole process group as a second stop request, inside the save of that stop; returns
    once this rank's own handler has seen it.

    A request counts as a second one SAME_STOP_S after the first (stop.py): every rank's first signal came before the
    step whose save this is, and the launcher's before it wrote its stop file, so waiting SAME_STOP_S from the stop
    file's appearance makes this a second request everywhere, whatever the machine's load.
    """
    stop = stop_request()
    deadline = time.monotonic() + STOP_WAIT_S
    while stop.stop_file and not os.path.exists(stop.stop_file):
        if time.monotonic() > deadline:
            raise ZeroTrainError(f"{ENV}: {fault.describe()}: no stop file from the launcher within {STOP_WAIT_S:g} s")
        time.sleep(STOP_POLL_S)
    time.sleep(SAME_STOP_S)
    seen = stop.ignored
    os.killpg(os.getpgid(launcher_pid()), signal.SIGINT)
    deadline = time.monotonic() + STOP_WAIT_S
    while stop.ignored == seen:
        if time.monotonic() > deadline:
            raise ZeroTrainError(f"{ENV}: {fault.describe()}: this rank's handler did not see the signal within "
                                 f"{STOP_WAIT_S:g} s")
        time.sleep(STOP_POLL_S)


def _wait_for_commit(fault: Fault, root: str, step: int) -> None:
    """Block the step in flight until `latest` under `root` names checkpoint `step` (the stop's save of the last
    completed step, committed while this step is still inside its micro-batches), at most fault.factor seconds."""
    deadline = time.monotonic() + fault.factor
    while read_latest(root) != step_name(step):
        if time.monotonic() > deadline:
            raise ZeroTrainError(f"{ENV}: {fault.describe()}: step {fault.step} was still in its forward {fault.factor:g} "
                                 f"s after the stop, and no {step_name(step)} was committed: the stop's save waited "
                                 "for the step")
        time.sleep(STOP_POLL_S)
    print(f"zerotrain: {ENV}: {step_name(step)} committed while step {fault.step} was in its forward "
          f"{SLOW_STEP_FORWARD}", file=sys.stderr, flush=True)
