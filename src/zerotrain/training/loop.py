"""The training loop: schedule -> micro-batches -> engine step -> guard and invariants -> metrics -> checkpoint."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from zerotrain import checkpoint
from zerotrain.checkpoint.stream import bytes_counted
from zerotrain.config import QWEN35, Config
from zerotrain.data import BatchSchedule, StepBatch
from zerotrain.errors import ZeroTrainError
from zerotrain.hub.adapter import base_mismatch
from zerotrain.hub.init_from import WeightSource, initial_model, weight_source
from zerotrain.model import ARCH_NAMES, fused_delta_rule, param_count
from zerotrain.model.compiled import compiled
from zerotrain.model.init import materialise
from zerotrain.model.lora import add_adapters
from zerotrain.model.tensor_parallel import kv_replicas
from zerotrain.parallel import Comm, Mesh, ZeroEngine, expert_bytes, shard_experts
from zerotrain.parallel.comm import CollectiveError
from zerotrain.parallel.context import context_parallel
from zerotrain.parallel.params import param_dtype
from zerotrain.parallel.parts import parts_for
from zerotrain.runtime.failures import restart_cause, restart_count
from zerotrain.runtime.launch import rank_device
from zerotrain.runtime.run_folder import say
from zerotrain.runtime.stop import StopWatch, stop_request

from . import control, invariants
from .faults import Faults
from .guard import AnomalyDetector, RollbackPolicy, data_step, skip_after_rollback
from .metrics import Metrics, summarize
from .memory_plan import MemoryPlan, memory_plan, out_of_memory
from .memory_plan import check as check_plan
from .objectives import accumulate_gradients, objective_for  # noqa: F401  (sft's step: bench and equivalence run it)
from .offload import offload_activations
from .profiling import StepProfiler
from .routing_bias import RoutingBias, routing_bias_for
from .schedule import lr_at
from .throughput import Peak, Throughput, current_rss, peak_flops, peak_memory


@dataclass
class TrainResult:
    records: list[dict]  # one metrics record per step run here
    start_step: int
    digests: list[str]  # per-rank digest of the final parameters (replicated, then TP-sliced values)
    param_norms: list[float]  # per-rank L2 norm of the final parameters
    memory: invariants.MemoryReport
    checkpoints: list[str] = field(default_factory=list)
    comm_calls: dict[str, int] = field(default_factory=dict)  # totals over the run, by purpose
    comm_bytes: dict[str, int] = field(default_factory=dict)
    param_count: int = 0
    engine: ZeroEngine | None = None  # for callers that inspect the final state
    stopped: dict | None = None  # {"signal", "step", "checkpoint"} when a stop signal ended the run early
    rollbacks: list[dict] = field(default_factory=list)
    resumed_from: str | None = None
    per_rank: dict[str, list[int]] = field(default_factory=dict)  # bytes held, peak RSS, checkpoint I/O: one per rank
    wall_s: float = 0.0
    plan: dict = field(default_factory=dict)  # the memory plan's rows and what the run measured against them
    report: dict = field(default_factory=dict)  # what train_job returns; with summary.json's figures on rank 0


def build_engine(cfg: Config, comm: Comm, restored: bool = False, source: WeightSource | None = None) -> ZeroEngine:
    """The model (this rank's TP slice of it when --tp > 1) and its ZeRO engine (--zero 1, 2 or 3) over the run's mesh:
    sharded over its shard group (the DP ranks, or with --dp-replicate R those of this rank's replica group; with --cp
    C each DP rank's C CP ranks too, whose gradients are partial sums over their parts of the rows).

    The model is built (and TP-sliced) on the meta device; the engine fills its flat buffers from the initial values,
    from the seed (model/init.py) or with --init-from from those files (the slices this rank trains), one parameter
    at a time: stage 3 keeps only its owned chunks, so no rank holds the whole model. A LoRA run's frozen base is
    materialised whole first, in the run's precision, at stages 1 and 2; at stage 3 it stays on the meta device until
    the engine fills its shard of it (its owned ranges alone read or drawn). Its adapters are made at once.
    `restored`: a checkpoint is restored over every trained value before step 1 (loop._restores), so none is read
    or drawn. `source`: --init-from's weight_source, where the caller has it (its headers are read once a rank).
    """
    p = cfg.parallel
    mesh = Mesh.build(comm, p.tp, kv_replicas(cfg.model.kv_heads, p.tp), dp_replicate=p.dp_replicate, ep=p.ep,
                      cp=p.cp)
    model, init = initial_model(cfg, mesh, restored, source)
    model.context_parallel = context_parallel(mesh)  # --cp: its part of each row, attention around the cp ring
    shard_experts(model, mesh)
    if cfg.lora.rank:  # the base frozen, adapters on its linears: only they train
        base_dtype = param_dtype(cfg.parallel.precision)
        if parts_for(cfg).placement.holds_whole_model:  # else the engine fills its shard of the base from `init`
            materialise(model, init, rank_device(cfg), base_dtype)
        add_adapters(model, cfg.lora, cfg.loop.seed, mesh.tp_rank, mesh.tp if mesh.tp_size > 1 else None,
                     device=rank_device(cfg), dtype=base_dtype)
    checkpointing = cfg.parallel.activation_checkpointing  # model/recompute.py: run_block's `recompute`
    model.recompute_blocks = "selective" if checkpointing == "selective" else checkpointing in ("blocks", "full")
    model.recompute_head = checkpointing == "full"
    if cfg.parallel.offload_activations:  # what the forward saves waits for the backward in host memory
        offload_activations(model)
    settings = dict(bucket_numel=cfg.parallel.bucket_numel, precision=cfg.parallel.precision,
                    reduce_in_backward=cfg.reduce_in_backward, overlap_gathers=cfg.gather_in_forward,
                    stage=cfg.parallel.zero, grad_reduce=cfg.grad_reduce, init=init, device=rank_device(cfg))
    # with --ep this rank's block of experts is a group of its own, over dp_shard_mod_ep; the rest over the shard group
    return ZeroEngine(model, mesh.dp_shard, cfg.optim, mesh=mesh, **settings)


def _resume_searches(cfg: Config) -> list[tuple[str, str, bool]]:
    """Where _resume looks, in order: (what the messages call it, folder, whether it is a checkpoint root to
    search)."""
    spec, searches = cfg.checkpoint.resume, []
    if restart_count() > 0:
        searches.append(("restart", cfg.checkpoint.dir, True))
    elif spec == "auto":
        searches.append(("--resume auto", cfg.checkpoint.dir, True))
    if spec not in ("", "auto"):
        searches.append((f"--resume {spec}", spec, checkpoint.is_checkpoint_root(spec)))
    return searches


def _restores(cfg: Config) -> bool:
    """Whether this run restores a checkpoint over its initial values before step 1, or stops: a full fine-tuning
    (a LoRA run's checkpoint holds its adapters, not its base) with a checkpoint folder to resume from, or a
    checkpoint root holding candidates (_resume restores one of them or raises). Its engine then neither reads
    --init-from's files nor draws from the seed: a resumed run at Llama-3-8B DP 64 read 0.25 GB a rank of the base
    it overwrote."""
    if cfg.lora.rank:
        return False
    return any(not search or any(checkpoint.resume_candidates(target)) for _, target, search in _resume_searches(cfg))


def _resume(cfg: Config, engine: ZeroEngine, comm: Comm, base: dict | None,
            objective) -> tuple[int, dict, str | None]:
    """Restore the checkpoint the run resumes from: (step, its manifest, folder), or (0, {}, None).

    After an elastic restart and with --resume auto, the newest checkpoint in --ckpt-dir that verifies; with --resume
    PATH that folder (a checkpoint root: its newest that verifies); a restart of a run started with --resume PATH
    falls back to PATH when its own folder has none. The ranks verify as they read (checkpoint.resume): each file's
    data is read by one rank, waiting for the others up to --io-timeout; rank 0 says which newer checkpoints failed.
    `base`: the record of the --init-from files (hashed once, for the manifests too), which a LoRA checkpoint's must
    match.
    """
    if restart_count() > 0 and comm.rank == 0:  # a crash between a re-save's renames: before rank 0 names them
        checkpoint.put_back_moved_aside(cfg.checkpoint.dir)
    searches = _resume_searches(cfg)

    def refuse(manifest: dict, path: str) -> str | None:  # the same adapters (or none) on the same base, method
        return base_mismatch(manifest, cfg, path, base) or objective.refuse(manifest, path, base)

    for label, target, search in searches:
        try:
            path, manifest, skipped = checkpoint.resume(target, engine, comm, search=search, refuse=refuse)
        except checkpoint.CheckpointError as e:
            raise checkpoint.CheckpointError(f"{label}: {e}") from None
        for name, reason in skipped if comm.rank == 0 else ():
            say(f"{label}: {name} fails verification ({reason})")
        if path is None and skipped:
            raise checkpoint.CheckpointError(f"{label}: no checkpoint in {target} verifies")
        if path is not None:
            if skipped and comm.rank == 0:
                say(f"{label}: falling back to {os.path.basename(path)}, the newest checkpoint that verifies")
            break
    else:
        return 0, {}, None
    comm.io.barrier("checkpoint_loaded")  # a rank slower to read waits out --io-timeout, not the next step's --timeout
    threads = manifest.get("threads_per_rank")
    if comm.rank == 0 and threads and threads != torch.get_num_threads():
        print(f"zerotrain: warning: {os.path.basename(path)} was written with {threads} threads per rank, this run "
              f"has {torch.get_num_threads()}: the continuation is exact only up to float reordering", flush=True)
    return manifest["step"], manifest, path


@dataclass
class _Run:
    """What one run on this rank is made of, and what it has done so far."""

    engine: ZeroEngine
    model: torch.nn.Module  # the engine's model, or its compiled forward (parameters stay views of the flat buffer)
    objective: object  # what --method trains on (objectives.py): its schedule, step and figures
    schedule: BatchSchedule
    val_source: object | None
    faults: Faults
    stop: object  # this rank's stop request
    detector: AnomalyDetector
    policy: RollbackPolicy
    checkpointer: checkpoint.Checkpointer
    metrics: Metrics
    memory: invariants.MemoryReport
    start: int
    resumed_from: str | None
    skips: list  # data steps skipped after rollbacks, in force now
    plan: MemoryPlan
    throughput: Throughput
    profiler: StepProfiler
    saved_bytes: list = field(default_factory=list)  # what the first micro-batch kept for its backward
    plan_checked: bool = False
    routing_bias: RoutingBias | None = None  # DeepSeek-V3's load-balancing bias, moved with each step (routing_bias.py)
    records: list[dict] = field(default_factory=list)
    rollbacks: list[dict] = field(default_factory=list)
    unread: list[_Unread] = field(default_factory=list)  # steps applied since the host last read the device
    saving: checkpoint.SaveFlags | None = None  # this rank's checkpoint flags in the last step's all-reduce
    stopped: dict | None = None
    # this rank's resident bytes when train() began, and its peak once started (built, read, resumed): io_plan's
    # start-up and resume figures are measured against these
    start_memory: tuple[int, int] = (0, 0)

    @property
    def mesh(self) -> Mesh:
        return self.engine.mesh


def _continue_data(cfg: Config, comm: Comm, schedule: BatchSchedule, manifest: dict, start: int) -> None:
    """Continue the checkpoint's data where its run stopped (records: at the row, whatever the global batch now);
    rank 0 says what a changed --steps or global batch changes."""
    if "config" not in manifest:  # a fresh run
        return
    theirs = Config.from_dict(manifest["config"])
    schedule.resume(manifest, data_step(start, manifest.get("data_skips", [])), theirs.global_batch)
    if comm.rank != 0:
        return
    layout = schedule.state_dict().get("data_layout")
    epochs = None
    if cfg.loop.epochs and layout and len(layout) > 1:  # --epochs counted steps as if the batch had never changed
        epochs = (cfg.loop.epochs, schedule.source.first_step(cfg.loop.epochs))
    before, now = (theirs.loop.steps, theirs.global_batch), (cfg.loop.steps, cfg.global_batch)
    if before != now or epochs and epochs[1] != cfg.loop.steps:
        print(f"zerotrain: warning: {_schedule_change(before, now, records=bool(layout), epochs=epochs)}", flush=True)


def _schedule_change(theirs: tuple[int, int], ours: tuple[int, int], *, records: bool = False,
                     epochs: tuple[int, int] | None = None) -> str:
    """What a resume with another --steps or global batch changes: the learning rate spans --steps; records in epochs
    read on from the row where the checkpoint's run stopped, so a new global batch changes only how many a step takes;
    token windows are sequences 0..G-1 of each step, so the data changes only with the global batch. `epochs`:
    (--epochs N, the step where N epochs end over this run's layout), when --epochs derived the steps."""
    (steps, batch), (new_steps, new_batch) = theirs, ours
    said = []
    if new_steps != steps:
        said.append(f"--steps {new_steps} instead of {steps} continues on another learning-rate schedule")
    if new_batch != batch and records:
        said.append(f"a global batch of {new_batch} sequences instead of {batch} reads the epoch on from the row where "
                    f"the checkpoint's run stopped, {new_batch} rows a step (each record still once per epoch), and "
                    "changes the learning rate's per-token scale")
    elif new_batch != batch:
        said.append(f"a global batch of {new_batch} sequences instead of {batch} changes each step's data (step s "
                    f"reads sequences 0-{new_batch - 1} of step s) and the learning rate's per-token scale")
    if epochs and epochs[1] != new_steps:
        n, end = epochs
        said.append(f"--epochs {n} counted {new_steps} steps as if every step had had {new_batch} rows, but over this "
                    f"run's global batches its {n} epoch{'s' * (n != 1)} end at step {end} (--steps {end} in place of "
                    f"--epochs {n} ends there)")
    return "resuming with " + "; ".join(said) + " (the checkpoint's run is otherwise continued exactly)"


def train(cfg: Config, comm: Comm, *, after_update: Callable[[int, ZeroEngine], None] | None = None,
          announce: bool = True) -> TrainResult:
    """Train to cfg.loop.steps, resuming if asked; `after_update(step, engine)` is a hook for fault drills.

    `announce` prints the start line on rank 0 (the demo prints its own header instead).
    """
    t_start, rss_before = time.perf_counter(), current_rss()
    run = _start(cfg, comm, announce)
    run.start_memory = (rss_before, peak_memory(run.engine.device)["peak_host_bytes"])
    step, result = run.start, None
    watch = StopWatch(run.stop, run.checkpointer.stop_requested)  # a stop's save starts at once, not after the step
    try:
        while step < cfg.loop.steps:
            done = step + 1
            run.mesh.set_step(done)
            t0 = time.perf_counter()
            run.profiler.at_step(done)
            reads = reads_at(cfg, done, run.start)
            if reads:
                # the steps since the last read, judged before a stop may save the state they left
                target = _judge_unread(cfg, run, comm)
                if target is not None:
                    step = target
                    continue
                run.checkpointer.arm(step, run.engine, _loop_state(run))  # what a stop during this step saves
            run.faults.before_collectives(done, lambda: run.stop.requested)
            batch = run.schedule.batch(data_step(step, run.skips))
            run.engine.zero_grad()
            # a compiled graph, and fla's kernels in Qwen3.5's linear layers, save other tensors than the plan counts
            count = None if run.plan_checked or cfg.loop.compile or fused_linear_layers(cfg) else run.saved_bytes
            loss_sum = run.objective.accumulate(run.engine, batch, run.model, run.faults.loss_factor(done), count)
            values = _reduce(run, loss_sum)
            if not reads:  # applied now, judged at the next read (a rollback goes back as far as it must)
                _apply_unread(cfg, run, step, batch, values, t0, after_update)
                step = done
                continue
            reduced = _agree(run, control.read([values], run.mesh.world.world_size)[0])
            if reduced.decision.stop:  # the step is not applied: its save is of `step`, and a resume redoes it
                _stop(run, reduced.decision)
                break
            units = run.objective.loss_units(batch)
            loss, grad_norm = reduced.loss_sum / units, reduced.grad_norm
            # invariant (a) and the spike guard, decided before anything is updated: a bad step is never applied
            anomaly = run.detector.check(done, loss, grad_norm, reduced.nonfinite_ranks, units)
            if anomaly:
                step = _handle_anomaly(anomaly, cfg, run, comm)
                continue
            lr = lr_at(step, cfg.optim, cfg.loop.steps) * run.faults.lr_factor(done)
            if run.routing_bias is not None:  # from the step's global expert loads, applied with AdamW's step
                run.routing_bias.take(values)
            run.engine.apply(lr, values[0])
            run.detector.accept(done, loss, grad_norm)
            _check_after_update(cfg, run, done, after_update)
            step_s = time.perf_counter() - t0
            record = _record(done, loss, grad_norm, lr, batch, run.schedule, cfg, step_s)
            _log_step(cfg, run, {**record, **run.objective.figures(reduced.extras, batch)})
            run.checkpointer.after_step(done, run.engine, _loop_state(run), reduced.decision, step_s)
            run.faults.after_update(done, lambda: run.stop.requested)
            step = done
        run.checkpointer.finish()
        run.profiler.close()
        result = _finish(run, comm, t_start, cfg)
    except (torch.OutOfMemoryError, MemoryError) as e:
        raise ZeroTrainError(out_of_memory(run.plan, cfg, step + 1, e)) from e
    finally:
        watch.close()
        run.metrics.close(result.report.get("summary") if result else None)
    return result


def _start(cfg: Config, comm: Comm, announce: bool) -> _Run:
    """Build the engine, the data, the guard, the checkpointer and the metrics; resume if asked; say where the run
    starts."""
    restores = _restores(cfg)
    # one source a rank: the record below and the engine's reads take its headers, read once (none when restoring:
    # the record needs the folder's files, not their tensors)
    source = weight_source(cfg.checkpoint.init_from, verify=False, listed=not restores) \
        if cfg.checkpoint.init_from else None
    engine = build_engine(cfg, comm, restored=restores, source=source)
    mesh = engine.mesh  # the TP ranks of a replica read the same micro-batches
    objective = objective_for(cfg)
    schedule = objective.schedule(mesh)
    # --compile: the whole model's forward, or at ZeRO-3 each block's, its gathers in eager hooks between them
    model = compiled(engine.model, parts_for(cfg).placement.gathers_units) if cfg.loop.compile else engine.model
    val_source = objective.validation_source() if cfg.loop.eval_every else None
    faults = Faults.from_env(comm.rank, restart_count(), tp=mesh.tp_size)
    faults.before_collectives(0)  # step=0 faults: while the rank starts, before it reads or hashes a file
    faults.watch_forwards(engine.model, cfg.checkpoint.dir, lambda: mesh.world.step)
    detector = AnomalyDetector(cfg.guard.spike_factor, cfg.guard.spike_window, rule=objective.loss_rule())
    policy = RollbackPolicy(cfg.guard.max_rollbacks)
    # the manifests record --init-from's files, hashed by the ranks together: whatever the cadence, since a stop
    # signal or a rollback saves too (and a LoRA checkpoint's base is this record)
    origin = {}
    if cfg.checkpoint.init_from:
        origin = {"init_from": source.record(comm)}
    start, manifest, resumed_from = _resume(cfg, engine, comm, origin.get("init_from"), objective)
    if restores and resumed_from is None:  # _restores's promise, made from each rank's own view of the folders
        raise checkpoint.CheckpointError(f"rank {comm.rank}: a checkpoint was to be restored over the initial values "
                                         "it never read, and none was (do the ranks see the same checkpoint folders?)")
    _continue_data(cfg, comm, schedule, manifest, start)
    stop = stop_request()
    # From here a signal saves rather than ending the rank at once: DPO's reference pass, which may score the pairs
    # for a long while, is finished and kept by the first step's checkpoint, not lost
    stop.begin_stepping()
    # every rank can save before any begins the pass: else a signal sent from one rank's pass (or the user's, then)
    # finds another still starting, which ends it at once and the job with nothing saved
    comm.io.barrier("begin_stepping")
    origin.update(objective.prepare(engine, comm, manifest, resumed_from, origin.get("init_from")))
    # the manifests record the folder this run resumed from, whatever --resume said (auto, a checkpoint root)
    recorded = replace(cfg, checkpoint=replace(cfg.checkpoint, resume=resumed_from or ""))
    checkpointer = checkpoint.Checkpointer(recorded, comm, on_commit=policy.note_commit, hooks=faults.writer_hooks(),
                                           manifest_extra=origin, on_stop_save=stop.begin_save)
    if engine.placement.holds_whole_model:  # invariant (b) before step 1: every replica holds the same model
        invariants.check_no_drift(start, engine.param_digests(), mesh)
    try:  # the spike window and the rollbacks so far, so a resumed run decides as the uninterrupted one would
        if "guard" in manifest:
            detector.load_state_dict(manifest["guard"])
        if "rollback" in manifest:
            policy.load_state_dict(manifest["rollback"])
    except ValueError as e:  # the manifest is JSON a person can edit
        raise checkpoint.CheckpointError(f"{os.path.join(resumed_from, checkpoint.MANIFEST)}: {e}") from None
    if resumed_from:  # committed: as the uninterrupted run's policy heard when it saved it
        policy.note_commit(start)
    memory = invariants.check_memory(engine, comm)
    tensorboard = os.path.join(cfg.logging.out, "tensorboard") if cfg.logging.tensorboard else None
    metrics = Metrics(cfg.logging.metrics, active=comm.rank == 0, progress=cfg.logging.progress, start=start,
                      total=cfg.loop.steps, log_every=cfg.logging.log_every, tensorboard=tensorboard, wandb=cfg.logging.wandb, config=cfg)
    packed = getattr(schedule.source, "pack", False)  # packed records (alone or in a mixture): rows carry segments
    plan = memory_plan(cfg, world_size=comm.world_size, documents=packed)
    # rank 0 logs the records, so it alone finds the peak MFU is measured against (on CPU: times a matmul)
    peak = peak_flops(cfg, rank_device(cfg)) if comm.rank == 0 else Peak(None, "rank 0's")
    throughput = Throughput(cfg, comm.world_size, peak)
    if announce:
        metrics.announce(_start_line(cfg, engine, schedule, start, resumed_from) + "; " + plan.summary() + "; "
                         + throughput.describe() + metrics.where())
    if restart_count() > 0:
        lost, (failed_rank, cause) = metrics.dropped_after - start, restart_cause()
        metrics.event({"event": "restart", "attempt": restart_count(), "step": start, "resumed_from": resumed_from,
                       "steps_lost": lost, "failed_rank": failed_rank, "cause": cause},
                      f"restart {restart_count()}: resumed from step {start}, {lost} step(s) lost; attempt "
                      f"{restart_count() - 1} failed: {cause}")
    return _Run(routing_bias=routing_bias_for(cfg, engine),
                engine=engine, model=model, objective=objective, schedule=schedule, val_source=val_source,
                faults=faults, stop=stop, detector=detector, policy=policy, checkpointer=checkpointer,
                metrics=metrics, memory=memory,
                start=start, resumed_from=resumed_from, skips=manifest.get("data_skips", []), plan=plan,
                throughput=throughput, profiler=StepProfiler(cfg.logging.profile_steps, cfg.logging.out, comm.rank,
                                                             rank_device(cfg)))


def reads_at(cfg: Config, done: int, start: int) -> bool:
    """Whether the host reads the step's values at step `done` (and those of the steps since the last read): every
    --log-every steps, at the last step and where a checkpoint by --ckpt-every or a validation is due (they save and
    judge what the guard accepted), and at the run's first step (`start` + 1: a stop that came while the run started,
    in DPO's reference pass, saves the state it started from). Between these steps nothing of the step is read from
    the device. GRPO reads every step: its next step samples from the model, which must be judged first (a NaN
    update would fail the sampling before the guard saw it), and its sampling reads the device anyway."""
    every = (cfg.logging.log_every, cfg.checkpoint.every, cfg.loop.eval_every)
    return (cfg.objective.method == "grpo" or done in (start + 1, cfg.loop.steps)
            or any(n and done % n == 0 for n in every))


@dataclass
class _Unread:
    """A step applied before the host read its values: judged, recorded and logged at the next read."""

    done: int
    lr: float
    batch: StepBatch
    values: torch.Tensor  # control.reduce_step's, on the device
    step_s: float


def _apply_unread(cfg: Config, run: _Run, step: int, batch: StepBatch, values: torch.Tensor, t0: float,
                  after_update) -> None:
    """A step between reads: its update applied with the norm where the all-reduce left it, its values kept unread
    for the next read step."""
    done = step + 1
    lr = lr_at(step, cfg.optim, cfg.loop.steps) * run.faults.lr_factor(done)
    if run.routing_bias is not None:
        run.routing_bias.take(values)
    run.engine.apply(lr, values[0])
    _check_after_update(cfg, run, done, after_update)
    run.unread.append(_Unread(done, lr, batch, values, time.perf_counter() - t0))
    run.faults.after_update(done, lambda: run.stop.requested)


def _judge_unread(cfg: Config, run: _Run, comm: Comm) -> int | None:
    """Read the steps applied since the last read, in one transfer, and judge them in order as if each had been
    judged before its update: accepted and logged, or an anomaly, which rolls back to a checkpoint before it and
    skips the data of every step since (their updates are discarded). The step to continue from after a rollback,
    else None."""
    unread, run.unread = run.unread, []
    for u, reduced in zip(unread, control.read([u.values for u in unread], run.mesh.world.world_size)):
        units = run.objective.loss_units(u.batch)
        loss, grad_norm = reduced.loss_sum / units, reduced.grad_norm
        anomaly = run.detector.check(u.done, loss, grad_norm, reduced.nonfinite_ranks, units)
        if anomaly:
            return _handle_anomaly(anomaly, cfg, run, comm, through=unread[-1].done)
        run.detector.accept(u.done, loss, grad_norm)
        run.checkpointer.count_step(u.step_s)
        record = _record(u.done, loss, grad_norm, u.lr, u.batch, run.schedule, cfg, u.step_s)
        _log_step(cfg, run, {**record, **run.objective.figures(reduced.extras, u.batch)})
    return None


def _reduce(run: _Run, loss_sum: torch.Tensor) -> torch.Tensor:
    """The step's one all-reduce, with this rank's control flags: its values on the device, unread."""
    saving = run.saving = run.checkpointer.flags()

    def stop_signal() -> str | None:  # read after the reduce-scatter, as late as the all-reduce allows
        run.checkpointer.disarm()  # a stop seen from here on is saved once all agree: else it would race the update
        return run.stop.signal_name if run.stop.requested else None

    return control.reduce_step(run.engine, loss_sum, saving=saving, stop_signal=stop_signal,
                               extras=run.objective.extras())


def _agree(run: _Run, reduced: control.Reduced) -> control.Reduced:
    """At a read step: the checkpointer acts on what was agreed.

    A failed async save is said in the all-reduce, not raised before it: every rank then stops together,
    the failed one with its own error, the others naming it.
    """
    failed = reduced.decision.failed_ranks
    if failed:
        if run.saving.error is not None:
            raise run.saving.error
        step = run.engine.mesh.world.step
        raise CollectiveError(f"step {step}: rank {failed[0]} failed before the step's all-reduce (its own line says "
                              "why)", peer_lost=True)
    message = run.checkpointer.after_reduce(reduced.decision)
    if message:
        run.metrics.event({"event": "async_save_off", "step": run.engine.mesh.world.step, "message": message},
                          message)
    return reduced


def _check_after_update(cfg: Config, run: _Run, done: int, after_update) -> None:
    """The fault drills' hook, the memory plan after the first step, then invariants (b) and (c) every
    --check-every steps."""
    if after_update:
        run.engine.wait_params()
        after_update(done, run.engine)
    if not run.plan_checked:
        run.plan_checked = True
        # A state row off the plan is an event and a line here (an error under the tests: memory_plan.strict)
        warning = check_plan(run.plan, run.engine, run.mesh.world, run.saved_bytes[0] if run.saved_bytes else None,
                             done, on_difference=lambda record, line: run.metrics.event(record, "warning: " + line),
                             outside=run.objective.held_state())
        if warning:
            run.metrics.event({"event": "plan_activations", "step": done, "measured": run.saved_bytes[0],
                               "planned": run.plan.rows["activations"]}, "warning: " + warning)
    if cfg.loop.check_every and done % cfg.loop.check_every == 0:
        invariants.check_no_drift(done, run.engine.param_digests(), run.mesh)
        run.memory = invariants.check_memory(run.engine, run.mesh.world, done)


def _log_step(cfg: Config, run: _Run, record: dict) -> None:
    """The step's record, with its throughput, this rank's peak memory and the validation loss when it is due, to
    the metrics."""
    done = record["step"]
    record.update(run.throughput.of_step(record["step_ms"] / 1000, record["tokens"], record["batch_tokens"]),
                  **peak_memory(run.engine.device))
    if cfg.loop.eval_every and (done % cfg.loop.eval_every == 0 or done == cfg.loop.steps):
        record.update(run.objective.validate(run.engine, run.val_source))
    run.records.append(record)
    run.metrics.log(record)


def _stop(run: _Run, decision: control.Decision) -> None:
    """Every rank agreed to stop: wait for the stop's save of the last completed step (begun at once where the signal
    was seen, while the step went on), then end the run, recorded."""
    step, path = run.checkpointer.stop()
    run.stopped = {"signal": decision.stop_signal, "step": step, "checkpoint": path}
    run.metrics.event({"event": "stop", "step": step, "signal": run.stopped["signal"]})


def _finish(run: _Run, comm: Comm, t_start: float, cfg: Config) -> TrainResult:
    """Invariant (b) at the end, each rank's final norm and bytes held, the run's collective counts; what the
    command reports, and on rank 0 the summary."""
    engine = run.engine
    digests = invariants.check_no_drift(comm.step, engine.param_digests(), run.mesh)
    run.memory = invariants.check_memory(engine, comm, comm.step)  # (c) as the run ends, after every update
    norms = comm.all_gather_rows(engine.param_norm(), "all_gather_norms").view(-1).tolist()
    norms = engine.placement.computed_norms(norms, engine.mesh.tp_size)  # of what each rank computes with
    calls, nbytes = run.mesh.counters()
    result = TrainResult(run.records, run.start, digests, norms, run.memory, run.checkpointer.committed, calls, nbytes,
                         engine.param_count, engine, run.stopped, run.rollbacks, run.resumed_from,
                         {**_per_rank_bytes(engine, comm), **_checkpoint_bytes(comm), **_start_memory(run, comm)},
                         time.perf_counter() - t_start,
                         _plan_report(run))
    result.report = _report(result, cfg, comm, run.throughput)
    if run.metrics.active:  # rank 0 wrote the metrics: summary.json's figures, and W&B's summary
        result.report["summary"] = summarize(result.report)
    return result


def _start_memory(run: _Run, comm: Comm) -> dict[str, list[int]]:
    """Each rank's resident bytes when its train() began (start_rss_bytes) and its peak resident bytes once it had
    built its engine, read or drawn its model and resumed (startup_peak_rss_bytes)."""
    rows = comm.all_gather_rows(torch.tensor(run.start_memory, dtype=torch.int64), "all_gather_start_memory")
    return {"start_rss_bytes": [int(v) for v in rows[:, 0].tolist()],
            "startup_peak_rss_bytes": [int(v) for v in rows[:, 1].tolist()]}


def _checkpoint_bytes(comm: Comm) -> dict[str, list[int]]:
    """The checkpoint bytes each rank's process has written and read (saves, loads, reshards, verification), one
    entry per rank."""
    counted = bytes_counted()
    rows = comm.all_gather_rows(torch.tensor(list(counted.values()), dtype=torch.int64), "all_gather_checkpoint_bytes")
    return {key: [int(v) for v in rows[:, i].tolist()] for i, key in enumerate(counted)}


def _start_line(cfg: Config, engine: ZeroEngine, schedule: BatchSchedule, start: int, resumed_from) -> str:
    """Model size, global batch and its split, data, run folder, and where the run starts."""
    m = cfg.model
    describe = getattr(schedule.source, "describe", None)
    data = describe() if describe else cfg.data.source
    where = (f"resuming from step {start} ({resumed_from}) to step {cfg.loop.steps}" if resumed_from
             else f"training steps 1-{cfg.loop.steps}")
    epochs = getattr(schedule.source, "epochs_in", None)  # records: what the steps cover
    if epochs:
        where += f" ({epochs(cfg.loop.steps)})"
    if cfg.checkpoint.init_from:  # fine-tuning's own defaults (config.FINE_TUNING) unless set: say what applies
        o = cfg.optim
        where += (f"; fine-tuning at lr {o.lr:g}, weight decay {o.weight_decay:g}, warmup {o.warmup_steps} "
                  f"step{'s' * (o.warmup_steps != 1)}")
    if not (cfg.checkpoint.every or cfg.checkpoint.every_minutes):
        where += ("; a checkpoint at the end only (--ckpt-every K or --ckpt-every-minutes M to save during the run)"
                  if cfg.checkpoint.final_save else "; no checkpoints will be saved (--no-final-save)")
    tp, cp, dp = cfg.parallel.tp, cfg.parallel.cp, schedule.world_size
    inner = [f"TP {tp}"] * (tp > 1) + [f"CP {cp}"] * (cp > 1)  # the ranks sharing a DP replica's rows
    split = f"{' x '.join(inner)} x DP {dp} = {tp * cp * dp} ranks" if inner else f"{dp} rank{'s' * (dp != 1)}"
    heads = f"{m.n_head} heads" + (f" ({m.kv_heads} KV)" if m.kv_heads != m.n_head else "")
    size = f"{engine.param_count:,} parameters"
    if cfg.lora.rank:  # the engine's are the adapters
        size = (f"{param_count(m):,} parameters, frozen, with LoRA rank {cfg.lora.rank} adapters on "
                f"{', '.join(cfg.lora.modules(m.arch))}: {engine.param_count:,} trained")
    unit, rows = getattr(schedule.source, "unit", ("sequences", 1))  # preference pairs: 2 sequences each
    return (f"{ARCH_NAMES[m.arch]} {size} ({m.n_layer} layers, {heads}, width {m.n_embd}, "
            f"seq {m.seq_len}, vocab {m.vocab_size}); global batch {schedule.global_batch} {unit} = "
            f"{schedule.global_batch * rows * m.seq_len:,} tokens ({split} x micro {cfg.loop.micro_batch} x "
            f"accum {cfg.loop.accum}); data {data}; run folder {cfg.logging.out}; {where}")


def _record(step: int, loss: float, grad_norm: float, lr: float, batch: StepBatch, schedule: BatchSchedule,
            cfg: Config, step_s: float) -> dict:
    """One step's metrics. tokens: unmasked target tokens of the global batch; batch_*: its capacity."""
    rows = schedule.global_batch * getattr(schedule.source, "unit", ("sequences", 1))[1]  # pairs: 2 rows each
    record = dict(step=step, loss=loss, grad_norm=grad_norm, lr=lr, tokens=batch.global_tokens,
                  batch_sequences=rows, batch_tokens=rows * cfg.model.seq_len,
                  step_ms=1000 * step_s, tokens_per_s=batch.global_tokens / step_s)
    if batch.epoch is not None:  # records read in epochs: which one this step's rows are from
        record["epoch"] = batch.epoch
    if batch.source_tokens is not None:  # a mixture: the tokens each source gave, and its sources' epochs
        record["source_tokens"] = batch.source_tokens
    if batch.source_epochs:
        record["source_epochs"] = batch.source_epochs
    return record


def _loop_state(run: _Run) -> dict:
    """What the loop itself puts in a checkpoint's manifest: the data skips in force, the records' layout of global
    batches, the guard's window and the rollback policy's state, so a resumed run trains on the same data and
    decides as the uninterrupted one."""
    return {"data_skips": run.skips, **run.schedule.state_dict(), "guard": run.detector.state_dict(),
            "rollback": run.policy.state_dict()}


def _handle_anomaly(anomaly, cfg: Config, run: _Run, comm: Comm, through: int | None = None) -> int:
    """Abort, or roll back; returns the step to continue from (the data skips then in force are the run's).
    `through`: the last step whose data was trained on (the anomaly's, unless later steps were applied before the
    host read the anomaly's values): the data of every step from the anomaly's to it is skipped.

    A rollback's decision is made durable before training goes on: the restored step is saved again with the new
    skips, window and rollback count (Checkpointer.recommit), so a crash at any later moment resumes the rolled-back
    timeline (and before it commits, the run as it was before the anomaly)."""
    run.checkpointer.finish()  # commit what is already written: a rollback may need it
    if cfg.guard.on_anomaly == "abort":
        raise invariants.InvariantError(f"invariant (a) failed: {anomaly.reason}")
    run.unread = []  # their updates are discarded with the anomaly's
    step, run.skips, event, manifest = _roll_back(anomaly, run.policy, run.skips, run.engine, comm, cfg,
                                                  through or anomaly.step)
    if "guard" in manifest:  # the window the restored step had: a resumed run's history may not reach back to it
        run.detector.load_state_dict(manifest["guard"])
    else:
        run.detector.rewind(step)
    run.checkpointer.recommit(step, run.engine, _loop_state(run))
    run.rollbacks.append(event)
    run.metrics.rewind(step)  # the abandoned steps' records go; the replay logs them again
    run.metrics.event(event, event["message"])
    return step


def _roll_back(anomaly, policy: RollbackPolicy, skips: list, engine: ZeroEngine, comm: Comm, cfg: Config,
               through: int):
    """Restore the checkpoint the policy picks, in these processes, and skip the data that led to the anomaly and
    that of the steps after it up to `through`: (its step, the skips now in force, the rollback's event, its
    manifest)."""
    # Rank 0 committed the checkpoints; the others may not see its last rename yet: its list decides.
    root = cfg.checkpoint.dir
    committed = comm.io.all_gather_json(checkpoint.committed_step_numbers(root) if comm.rank == 0 else None,
                                        "agree_rollback")[0]
    target = policy.decide(anomaly, committed)
    manifest = checkpoint.load_checkpoint(os.path.join(root, checkpoint.step_name(target)), engine, comm)
    comm.io.barrier("checkpoint_loaded")
    # The skips in force now, not the checkpoint's: data a discarded update saw is never trained on again.
    new_skips = skip_after_rollback(skips, target, through)
    first = data_step(target, [p for p in skips if p[0] < target]) + 1
    last = data_step(through - 1, skips) + 1
    event = {"event": "rollback", "step": anomaly.step, "to_step": target, "reason": anomaly.reason,
             "skipped_data_steps": [first, last], "rollback": policy.rollbacks,
             "message": f"rollback {policy.rollbacks}/{cfg.guard.max_rollbacks}: {anomaly.reason}; restored "
                        f"{checkpoint.step_name(target)}, skipping data steps {first}-{last}"}
    return target, new_skips, event, manifest


def _per_rank_bytes(engine: ZeroEngine, comm: Comm) -> dict[str, list[int]]:
    """Parameter, gradient and optimizer bytes each rank holds (parameters and gradients: between steps, and the most
    held at once during one, stage 3's units whole and stage 2's buckets in flight included), what its start read
    from --init-from's files or drew from the seed, its peak resident memory and, on CUDA, its device's peak."""
    peaks = peak_memory(engine.device)
    held = engine.memory_held()  # expert parallelism: the experts' too; ZeRO-3: the shard and the units whole at once
    row = torch.tensor([
        *(held[key] for key in ("param_bytes", "param_peak_bytes", "grad_bytes", "grad_peak_bytes")),
        invariants.held_bytes(engine.optimizer_state_tensors(), exclude=engine.flat_buffers),
        engine.init_bytes_read,  # what building this rank's share of the model read from --init-from's files
        engine.init_values_drawn,  # ... or drew from the seed
        held["frozen_bytes"],  # the frozen parameters (a LoRA run's base) it holds: ZeRO-3's shard of them
        expert_bytes(engine),  # a mixture of experts': its experts' parameters and optimizer state held here
        peaks["peak_host_bytes"],
        *([peaks["peak_device_bytes"]] if "peak_device_bytes" in peaks else []),
    ], dtype=torch.int64)
    rows = comm.all_gather_rows(row, "all_gather_memory").tolist()
    keys = ("param_bytes", "param_peak_bytes", "grad_bytes", "grad_peak_bytes", "optimizer_bytes", "init_bytes_read",
            "init_values_drawn", "frozen_bytes", "expert_bytes", "peak_rss_bytes", "peak_device_bytes")
    return {key: [int(r[i]) for r in rows] for i, key in enumerate(keys[:len(row)])}


def fused_linear_layers(cfg: Config) -> bool:
    """Whether this rank's Qwen3.5 linear-attention layers run fla's kernels (model/fused_delta_rule.py)."""
    return cfg.model.arch in QWEN35 and fused_delta_rule.fused_on(rank_device(cfg))


def _plan_report(run: _Run) -> dict:
    """The plan's rows and total, beside the activations rank 0's first micro-batch saved (None: not counted)."""
    return {"rows": run.plan.rows, "total": run.plan.total, "micro_batch": run.plan.micro_batch,
            "activations_measured": run.saved_bytes[0] if run.saved_bytes else None}


def train_job(cfg: Config, comm: Comm) -> dict:
    """The job behind `zerotrain train`: rank 0 returns what the command reports and writes to summary.json."""
    return train(cfg, comm).report


def _report(result: TrainResult, cfg: Config, comm: Comm, throughput: Throughput) -> dict:
    """What the command reports of a run (rank 0's is what it gets)."""
    return {"records": result.records, "digests": result.digests, "checkpoints": result.checkpoints,
            "memory": vars(result.memory), "param_count": result.param_count, "start_step": result.start_step,
            "stopped": result.stopped, "rollbacks": result.rollbacks, "resumed_from": result.resumed_from,
            "per_rank": result.per_rank, "restarts": restart_count(), "wall_s": result.wall_s,
            "threads_per_rank": torch.get_num_threads(), "world_size": comm.world_size, "config": cfg.to_dict(),
            "plan": result.plan, "throughput": throughput.state()}
