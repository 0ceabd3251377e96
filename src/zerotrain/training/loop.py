"""The training loop: schedule -> micro-batches -> engine step -> guard and invariants -> metrics -> checkpoint."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from zerotrain import checkpoint
from zerotrain.config import Config
from zerotrain.data import BatchSchedule, StepBatch, make_source
from zerotrain.model.gpt2 import build_model, parallelize, summed_token_loss
from zerotrain.parallel import Comm, Mesh, ZeroOneEngine
from zerotrain.runtime.failures import restart_count
from zerotrain.runtime.launch import rank_device
from zerotrain.runtime.stop import stop_request

from . import control, invariants
from .evaluate import validation_loss
from .faults import Faults
from .guard import AnomalyDetector, RollbackPolicy, data_step, skip_after_rollback
from .metrics import Metrics
from .schedule import lr_at


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
    engine: ZeroOneEngine | None = None  # for callers that inspect the final state
    stopped: dict | None = None  # {"signal", "step", "checkpoint"} when a stop signal ended the run early
    rollbacks: list[dict] = field(default_factory=list)
    resumed_from: str | None = None
    per_rank: dict[str, list[int]] = field(default_factory=dict)  # bytes held and peak RSS, one entry per rank
    wall_s: float = 0.0


def build_engine(cfg: Config, comm: Comm) -> ZeroOneEngine:
    """The model (this rank's TP slice of it when --tp > 1) and its ZeRO-1 engine over the DP group."""
    mesh = Mesh.build(comm, cfg.parallel.tp)
    model = build_model(cfg.model, cfg.loop.seed)
    if mesh.tp_size > 1:
        parallelize(model, mesh.tp_size, mesh.tp_rank, mesh.tp)
    bucket_numel = max(1, int(cfg.parallel.bucket_mb * 2**20 / 4))
    return ZeroOneEngine(model.to(rank_device(cfg)), mesh.dp, cfg.optim, bucket_numel=bucket_numel,
                         precision=cfg.parallel.precision, reduce_in_backward=cfg.reduce_in_backward,
                         gather_in_forward=cfg.gather_in_forward, mesh=mesh)


def accumulate_gradients(engine: ZeroOneEngine, batch: StepBatch, forward=None, loss_factor: float = 1.0) -> float:
    """Forward and backward every micro-batch of this rank; return its summed token loss.

    Each micro-batch's loss is its sum of token losses over the global token count, so the
    accumulated gradient is the global batch's mean-token-loss gradient whatever the split.
    `loss_factor` is 1 except when a fault injects a NaN.
    """
    forward = engine.model if forward is None else forward
    device = engine.flat_params.device
    loss_sum, last = 0.0, len(batch.micro_batches) - 1
    for i, (x, y) in enumerate(batch.micro_batches):
        with engine.no_sync(i < last):  # communicate once per step, after the last micro-batch
            token_loss = summed_token_loss(forward(x.to(device)), y.to(device))
            if loss_factor != 1.0:
                token_loss = token_loss * loss_factor
            (token_loss / batch.global_tokens).backward()
        loss_sum += token_loss.item()
    return loss_sum


def _resume(cfg: Config, engine: ZeroOneEngine, comm: Comm) -> tuple[int, dict, str | None]:
    """Restore the checkpoint the run resumes from: (step, its manifest, folder), or (0, {}, None).

    After an elastic restart every rank resumes from the newest checkpoint that verifies, as rank 0 finds it.
    """
    path = cfg.checkpoint.resume or None
    if restart_count() > 0:
        found = {}
        if comm.rank == 0:
            newest, skipped = checkpoint.find_resumable(cfg.checkpoint.dir)
            found = {"path": newest, "skipped": skipped}
            for folder, reason in skipped:
                print(f"zerotrain: restart: {os.path.basename(folder)} fails verification ({reason})", flush=True)
        found = comm.all_gather_json(found, "agree_resume")[0]
        if found["path"] is None and found["skipped"]:
            raise checkpoint.CheckpointError(f"restart: no checkpoint in {cfg.checkpoint.dir} verifies")
        path = found["path"] or path
    if path is None:
        return 0, {}, None
    manifest = checkpoint.load(path, engine, comm)
    theirs = Config.from_dict(manifest["config"]) if "config" in manifest else None
    schedule = (theirs.loop.steps, theirs.global_batch) if theirs else None
    if comm.rank == 0 and schedule and schedule != (cfg.loop.steps, cfg.global_batch):
        print(f"zerotrain: warning: {os.path.basename(path)} was trained for {schedule[0]} steps of global batch "
              f"{schedule[1]}; this run has {cfg.loop.steps} steps of {cfg.global_batch}: the learning-rate schedule "
              "and the data order continue differently from the original run", flush=True)
    threads = manifest.get("threads_per_rank")
    if comm.rank == 0 and threads and threads != torch.get_num_threads():
        print(f"zerotrain: warning: {os.path.basename(path)} was written with {threads} threads per rank, this run "
              f"has {torch.get_num_threads()}: the continuation is exact only up to float reordering", flush=True)
    return manifest["step"], manifest, path


def train(cfg: Config, comm: Comm, *, after_update: Callable[[int, ZeroOneEngine], None] | None = None,
          announce: bool = True) -> TrainResult:
    """Train to cfg.loop.steps, resuming if asked; `after_update(step, engine)` is a hook for fault drills.

    `announce` prints the start line on rank 0 (the demo prints its own header instead).
    """
    t_start = time.perf_counter()
    engine = build_engine(cfg, comm)
    model = torch.compile(engine.model) if cfg.loop.compile else engine.model  # parameters stay views into the flat buffer
    mesh = engine.mesh  # the TP ranks of a replica read the same micro-batches
    schedule = BatchSchedule(make_source(cfg), micro_batch=cfg.loop.micro_batch, accum=cfg.loop.accum,
                             rank=mesh.dp_rank, world_size=mesh.dp_size)
    val_source = make_source(cfg, split="val") if cfg.loop.eval_every else None
    faults, stop = Faults.from_env(comm.rank, restart_count(), tp=mesh.tp_size), stop_request()
    detector = AnomalyDetector(cfg.guard.spike_factor, cfg.guard.spike_window)
    rollback = RollbackPolicy(cfg.guard.max_rollbacks)
    saver = checkpoint.SaveCadence(cfg, comm, on_commit=rollback.note_commit, halfway_hook=faults.save_hook())
    start, manifest, resumed_from = _resume(cfg, engine, comm)
    skips = manifest.get("data_skips", [])
    if "guard" in manifest:  # the spike window, so a resumed run decides as the uninterrupted one would
        detector.load_state_dict(manifest["guard"])
    memory = invariants.check_memory(engine, comm)
    metrics = Metrics(cfg.logging.metrics, active=comm.rank == 0, progress=cfg.logging.progress, start=start, total=cfg.loop.steps,
                      tensorboard=os.path.join(cfg.logging.out, "tensorboard") if cfg.logging.tensorboard else None)
    if announce:
        metrics.announce(_start_line(cfg, engine, schedule, start, resumed_from))
    if restart_count() > 0:
        lost = metrics.dropped_after - start
        metrics.event({"event": "restart", "attempt": restart_count(), "step": start, "resumed_from": resumed_from,
                       "steps_lost": lost}, f"restart {restart_count()}: resumed from step {start}, {lost} step(s) lost")
    records, rollbacks, stopped = [], [], None
    step = start
    try:
        while step < cfg.loop.steps:
            done = step + 1
            mesh.set_step(done)
            t0 = time.perf_counter()
            faults.before_collectives(done, lambda: stop.requested)
            batch = schedule.batch(data_step(step, skips))
            engine.zero_grad()
            loss_sum = accumulate_gradients(engine, batch, model, faults.loss_factor(done))
            reduced = control.reduce_step(engine, loss_sum, save_by_clock=saver.clock.due(),
                                          stop_signal=stop.signal_name if stop.requested else None,
                                          save_written=saver.writer.local_done())
            loss, grad_norm, decision = reduced.loss_sum / batch.global_tokens, reduced.grad_norm, reduced.decision
            if decision.save_written:
                saver.commit_written()
            # invariant (a) and the spike guard, decided before anything is updated: a bad step is never applied
            anomaly = detector.check(done, loss, grad_norm, reduced.nonfinite_ranks)
            if anomaly:
                step, skips = _handle_anomaly(anomaly, cfg, engine, comm, saver, rollback, detector, skips,
                                              metrics, rollbacks)
                continue
            lr = lr_at(step, cfg.optim, cfg.loop.steps) * faults.lr_factor(done)
            engine.apply(lr, grad_norm)
            detector.accept(done, loss)
            if after_update:
                engine.wait_params()
                after_update(done, engine)
            if cfg.loop.check_every and done % cfg.loop.check_every == 0:
                invariants.check_no_drift(done, engine.param_digests(), mesh)
            records.append(_record(done, loss, grad_norm, lr, batch, schedule, cfg, time.perf_counter() - t0))
            if cfg.loop.eval_every and (done % cfg.loop.eval_every == 0 or done == cfg.loop.steps):
                records[-1]["val_loss"] = validation_loss(engine.model, val_source, mesh, batches=cfg.loop.eval_batches,
                                                          micro_batch=cfg.loop.micro_batch)
            metrics.log(records[-1])
            if saver.due(done, cfg.loop.steps, decision):
                saver.save(done, engine, {"data_skips": skips, "guard": detector.state_dict()},
                           wait=decision.stop or done == cfg.loop.steps)
            if decision.stop:
                stopped = {"signal": decision.stop_signal, "step": done,
                           "checkpoint": saver.committed[-1] if saver.committed else None}
                metrics.event({"event": "stop", "step": done, "signal": stopped["signal"]})
                break
            step = done
        saver.finish()
    finally:
        metrics.close()
    digests = invariants.check_no_drift(comm.step, engine.param_digests(), mesh)
    norm = torch.linalg.vector_norm(engine.flat_params.float()).reshape(1).to(torch.float64)
    norms = comm.all_gather_rows(norm, "all_gather_norms").view(-1).tolist()
    calls, nbytes = mesh.counters()
    return TrainResult(records, start, digests, norms, memory, saver.committed, calls, nbytes,
                       engine.param_count, engine, stopped, rollbacks, resumed_from, _per_rank_bytes(engine, comm),
                       time.perf_counter() - t_start)


def _start_line(cfg: Config, engine: ZeroOneEngine, schedule: BatchSchedule, start: int, resumed_from) -> str:
    """Model size, global batch and its split, data, run folder, and where the run starts."""
    m = cfg.model
    describe = getattr(schedule.source, "describe", None)
    data = describe() if describe else cfg.data.source
    where = f"resumed from step {start} ({resumed_from})" if resumed_from else "starting at step 0"
    if not (cfg.checkpoint.every or cfg.checkpoint.every_minutes):
        where += "; no checkpoints will be saved (--ckpt-every K or --ckpt-every-minutes M to save)"
    split = (f"TP {cfg.parallel.tp} x DP {schedule.world_size} = {cfg.parallel.tp * schedule.world_size} ranks" if cfg.parallel.tp > 1
             else f"{schedule.world_size} ranks")
    return (f"GPT {engine.param_count:,} parameters ({m.n_layer} layers, {m.n_head} heads, width {m.n_embd}, "
            f"seq {m.seq_len}, vocab {m.vocab_size}); global batch {schedule.global_batch} sequences = "
            f"{schedule.global_batch * m.seq_len:,} tokens ({split} x micro {cfg.loop.micro_batch} x "
            f"accum {cfg.loop.accum}); data {data}; run folder {cfg.logging.out}; {where}, {cfg.loop.steps} steps")


def _record(step: int, loss: float, grad_norm: float, lr: float, batch: StepBatch, schedule: BatchSchedule,
            cfg: Config, step_s: float) -> dict:
    """One step's metrics. tokens: unmasked target tokens of the global batch; batch_*: its capacity."""
    return dict(step=step, loss=loss, grad_norm=grad_norm, lr=lr, tokens=batch.global_tokens,
                batch_sequences=schedule.global_batch, batch_tokens=schedule.global_batch * cfg.model.seq_len,
                step_ms=1000 * step_s, tokens_per_s=batch.global_tokens / step_s)


def _handle_anomaly(anomaly, cfg: Config, engine: ZeroOneEngine, comm: Comm, saver: checkpoint.SaveCadence,
                    policy: RollbackPolicy, detector: AnomalyDetector, skips: list, metrics: Metrics,
                    rollbacks: list) -> tuple[int, list]:
    """Abort, or roll back; returns the step to continue from and the data skips then in force."""
    saver.finish()  # commit what is already written: a rollback may need it
    if cfg.guard.on_anomaly == "abort":
        raise invariants.InvariantError(f"invariant (a) failed: {anomaly.reason}")
    step, skips, event = _roll_back(anomaly, policy, skips, engine, comm, cfg)
    detector.rewind(step)
    rollbacks.append(event)
    metrics.event(event, event["message"])
    return step, skips


def _roll_back(anomaly, policy: RollbackPolicy, skips: list, engine: ZeroOneEngine, comm: Comm, cfg: Config):
    """Restore the checkpoint the policy picks, in these processes, and skip the data that led to the anomaly."""
    # Rank 0 committed the checkpoints; the others may not see its last rename yet: its list decides.
    root = cfg.checkpoint.dir
    committed = comm.all_gather_json(checkpoint.committed_step_numbers(root) if comm.rank == 0 else None,
                                     "agree_rollback")[0]
    target = policy.decide(anomaly, committed)
    checkpoint.load(os.path.join(root, checkpoint.step_name(target)), engine, comm)
    if comm.rank == 0:  # a crash from here on resumes the timeline the run continues, not the abandoned one
        checkpoint.point_latest(root, checkpoint.step_name(target))
    # The skips in force now, not the checkpoint's: data a discarded update saw is never trained on again.
    new_skips = skip_after_rollback(skips, target, anomaly.step)
    first = data_step(target, [p for p in skips if p[0] < target]) + 1
    last = data_step(anomaly.step - 1, skips) + 1
    event = {"event": "rollback", "step": anomaly.step, "to_step": target, "reason": anomaly.reason,
             "skipped_data_steps": [first, last], "rollback": policy.rollbacks,
             "message": f"rollback {policy.rollbacks}/{cfg.guard.max_rollbacks}: {anomaly.reason}; restored "
                        f"{checkpoint.step_name(target)}, skipping data steps {first}-{last}"}
    return target, new_skips, event


def _per_rank_bytes(engine: ZeroOneEngine, comm: Comm) -> dict[str, list[int]]:
    """Parameter, gradient and optimizer bytes each rank holds, and its peak resident memory."""
    grads = {id(t): t for t in (engine.flat_grads, engine.grad_accum, engine.grad_shard)}
    row = torch.tensor([
        engine.flat_params.numel() * engine.flat_params.element_size(),
        sum(t.numel() * t.element_size() for t in grads.values()),
        invariants.held_bytes(engine.optimizer_state_tensors(), exclude=[engine.flat_params]),
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux reports KiB
    ], dtype=torch.int64)
    rows = comm.all_gather_rows(row, "all_gather_memory").tolist()
    return {key: [int(r[i]) for r in rows] for i, key in enumerate(("param_bytes", "grad_bytes", "optimizer_bytes",
                                                                    "peak_rss_bytes"))}


def train_job(cfg: Config, comm: Comm) -> dict:
    """The job behind `zerotrain train`: rank 0 returns what the command reports and writes to summary.json."""
    result = train(cfg, comm)
    return {"records": result.records, "digests": result.digests, "checkpoints": result.checkpoints,
            "memory": vars(result.memory), "param_count": result.param_count, "start_step": result.start_step,
            "stopped": result.stopped, "rollbacks": result.rollbacks, "resumed_from": result.resumed_from,
            "per_rank": result.per_rank, "restarts": restart_count(), "wall_s": result.wall_s,
            "threads_per_rank": torch.get_num_threads(), "world_size": comm.world_size, "config": cfg.to_dict()}
