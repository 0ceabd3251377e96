"""The training loop: schedule -> micro-batches -> engine step -> invariants -> metrics -> checkpoint."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import checkpoint, invariants
from .config import Config
from .data import BatchSchedule, StepBatch, make_source
from .launch import rank_device
from .metrics import Metrics
from .model import build_model, summed_token_loss
from .parallel import Comm, ZeroOneEngine
from .schedule import lr_at


@dataclass
class TrainResult:
    records: list[dict]  # one metrics record per step run here
    start_step: int
    digests: list[str]  # per-rank sha256 of the final parameters
    param_norms: list[float]  # per-rank L2 norm of the final parameters
    memory: invariants.MemoryReport
    checkpoints: list[str] = field(default_factory=list)
    comm_calls: dict[str, int] = field(default_factory=dict)  # totals over the run, by purpose
    comm_bytes: dict[str, int] = field(default_factory=dict)
    param_count: int = 0
    engine: ZeroOneEngine | None = None  # for callers that inspect the final state


def build_engine(cfg: Config, comm: Comm) -> ZeroOneEngine:
    model = build_model(cfg.model, cfg.run.seed).to(rank_device(cfg))
    bucket_numel = max(1, int(cfg.run.bucket_mb * 2**20 / 4))
    return ZeroOneEngine(model, comm, cfg.optim, bucket_numel=bucket_numel, precision=cfg.run.precision,
                         reduce_in_backward=cfg.run.reduce_in_backward, gather_in_forward=cfg.run.gather_in_forward)


def accumulate_gradients(engine: ZeroOneEngine, batch: StepBatch, forward=None) -> float:
    """Forward and backward every micro-batch of this rank; return its summed token loss.

    Each micro-batch's loss is its sum of token losses over the global token count, so the
    accumulated gradient is the global batch's mean-token-loss gradient whatever the split.
    """
    forward = engine.model if forward is None else forward
    device = engine.flat_params.device
    loss_sum, last = 0.0, len(batch.micro_batches) - 1
    for i, (x, y) in enumerate(batch.micro_batches):
        with engine.no_sync(i < last):  # communicate once per step, after the last micro-batch
            token_loss = summed_token_loss(forward(x.to(device)), y.to(device))
            (token_loss / batch.global_tokens).backward()
        loss_sum += token_loss.item()
    return loss_sum


def train(cfg: Config, comm: Comm, *, after_update: Callable[[int, ZeroOneEngine], None] | None = None) -> TrainResult:
    """Train to cfg.run.steps, resuming if asked; `after_update(step, engine)` is a hook for fault drills."""
    r = cfg.run
    engine = build_engine(cfg, comm)
    model = engine.model
    if r.compile:
        model = torch.compile(model)  # parameters stay views into the engine's flat buffer
    schedule = BatchSchedule(make_source(cfg), micro_batch=r.micro_batch, accum=r.accum,
                             rank=comm.rank, world_size=comm.world_size)
    resume = checkpoint.resolve_resume(cfg.checkpoint.resume, cfg.checkpoint.dir)
    start = checkpoint.load(resume, engine, comm) if resume else 0
    memory = invariants.check_memory(engine, comm)
    metrics = Metrics(r.metrics, active=comm.rank == 0, progress=r.progress, start=start, total=r.steps)
    records, saved = [], []
    try:
        for step in range(start, r.steps):
            t0 = time.perf_counter()
            batch = schedule.batch(step)
            engine.zero_grad()
            loss_sum = accumulate_gradients(engine, batch, model)
            flags = invariants.nonfinite_flags(loss_sum, comm)
            grad_norm, totals = engine.reduce_grads(torch.cat([torch.tensor([loss_sum], dtype=torch.float64), flags]))
            loss = float(totals[0]) / batch.global_tokens
            invariants.check_finite(step + 1, loss, grad_norm, totals[1:])
            lr = lr_at(step, cfg.optim, r.steps)
            engine.apply(lr, grad_norm)
            done = step + 1
            if after_update:
                engine.wait_params()
                after_update(done, engine)
            if r.check_every and done % r.check_every == 0:
                invariants.check_no_drift(done, engine.param_digest(), comm)
            step_s = time.perf_counter() - t0
            # tokens: unmasked target tokens of the global batch; batch_*: the effective batch's capacity
            record = dict(step=done, loss=loss, grad_norm=grad_norm, lr=lr, tokens=batch.global_tokens,
                          batch_sequences=schedule.global_batch, batch_tokens=schedule.global_batch * cfg.model.seq_len,
                          step_ms=1000 * step_s,
                          tokens_per_s=batch.global_tokens / step_s)
            records.append(record)
            metrics.log(record)
            if cfg.checkpoint.every and (done % cfg.checkpoint.every == 0 or done == r.steps):
                path, written, manifest = checkpoint.save(
                    cfg.checkpoint.dir, done, engine, comm, cfg.to_dict(), keep=cfg.checkpoint.keep)
                invariants.check_roundtrip(path, written, manifest)
                saved.append(path)
    finally:
        metrics.close()
    digests = invariants.check_no_drift(r.steps, engine.param_digest(), comm)
    norm = torch.linalg.vector_norm(engine.flat_params.float()).reshape(1).to(torch.float64)
    norms = comm.all_gather_rows(norm, "all_gather_norms").view(-1).tolist()
    return TrainResult(records, start, digests, norms, memory, saved, dict(comm.calls), dict(comm.bytes),
                       engine.layout.numel, engine)


def train_job(cfg: Config, comm: Comm) -> dict:
    """The job behind `zerotrain train`: rank 0 returns a summary."""
    result = train(cfg, comm)
    return {"records": result.records, "digests": result.digests, "checkpoints": result.checkpoints,
            "memory": vars(result.memory), "param_count": result.param_count,
            "start_step": result.start_step}


def resolve_paths(cfg: Config) -> Config:
    """Fill the run folder, metrics file and checkpoint folder defaults (before workers start)."""
    r, c = cfg.run, cfg.checkpoint
    if not r.out:
        r.out = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    r.out = os.path.abspath(r.out)
    if not r.metrics:
        r.metrics = os.path.join(r.out, "metrics.jsonl")
    if not c.dir:
        c.dir = os.path.join(r.out, "checkpoints")
    c.dir = os.path.abspath(c.dir)
    return cfg
