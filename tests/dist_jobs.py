"""Job functions run by spawned ranks in the multi-process tests (importable by module name)."""

from __future__ import annotations

import copy
import functools
import importlib
import os
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

from zerotrain import checkpoint
from zerotrain.config import Config
from zerotrain.parallel import Comm
from zerotrain.training import loop as train_module
from zerotrain.training import objectives
from zerotrain.training.loop import train


def summary(result) -> dict:
    return {
        "losses": [r["loss"] for r in result.records],
        "grad_norms": [r["grad_norm"] for r in result.records],
        "digests": result.digests,
        "memory": vars(result.memory),
        "calls": result.comm_calls,
        "start": result.start_step,
    }


def error_of_training(cfg: Config, comm: Comm, error: type[Exception]) -> str:
    """Train; the message of the `error` the run raised (on every rank alike, so the ranks stay together for the
    next job), or "no error"."""
    try:
        train(cfg, comm)
    except error as e:
        return str(e)
    return "no error"


def in_turn_job(cfg: Config, comm: Comm, jobs: list[tuple[Callable[[Config, Comm], Any], Config]]) -> list:
    """Run the (job, config) pairs one after another on the same ranks; their results, in order.

    Starting the ranks (spawn, import torch, rendezvous) costs more than training the tiny model, so a test
    that needs several runs at one world size starts the ranks once. `cfg` only launches them: every config
    in `jobs` must have its world size. A planted job restores what it patched, so the jobs after it run the
    real code.
    """
    return [job(c, comm) for job, c in jobs]


def run_in_turn(out: dict, jobs: dict, time_limit: float) -> None:
    """{name: (job, config)} run in turn on one start of the first config's ranks (in_turn_job); each job's result
    put in `out` under its name."""
    from zerotrain.runtime.launch import run_job  # the launcher's side: the ranks never call this
    pairs = list(jobs.values())
    out.update(zip(jobs, run_job(functools.partial(in_turn_job, jobs=pairs), pairs[0][1], time_limit=time_limit)))


def undurable_rollback_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: `zerotrain train` whose rollbacks are not made durable (the restored step is not saved again with
    the new data skips and guard state), in every attempt of an elastic job."""
    with mock.patch.object(checkpoint.Checkpointer, "recommit", lambda self, step, engine, state: None):
        return train_module.train_job(cfg, comm)


def stop_saved_after_the_step_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: `zerotrain train` whose stop's save waits for the step (the watcher's call to start it at once does
    nothing: the save starts once every rank has agreed to stop, in the step's all-reduce)."""
    with mock.patch.object(checkpoint.Checkpointer, "stop_requested", lambda self: None):
        return train_module.train_job(cfg, comm)


def stop_save_of_another_step_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: `zerotrain train` whose rank 1 arms the step before the one it completed, so that a stop saves
    another step there than on the other ranks."""
    arm = checkpoint.Checkpointer.arm

    def arm_behind(self, step, engine, state):
        return arm(self, step - 1 if comm.rank == 1 and step > 0 else step, engine, state)

    with mock.patch.object(checkpoint.Checkpointer, "arm", arm_behind):
        return train_module.train_job(cfg, comm)


def params_job(cfg: Config, comm: Comm) -> dict:
    """Train; return the log and the final parameters by name."""
    result = train(cfg, comm)  # no after_update hook: it would wait for the all-gather every step
    out = summary(result)
    out["params"] = result.engine.full_state_dict()
    return out


def naive_mean_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: weight every micro-batch equally (its mean loss times its capacity) on varlen data."""

    def mean_weighted(logits, targets):
        mean = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1),
                                                 ignore_index=-100)
        return mean * targets.numel()

    with mock.patch.object(objectives, "summed_token_loss", mean_weighted):
        return params_job(cfg, comm)


def interrupted_job(cfg: Config, comm: Comm) -> dict:
    """Uninterrupted run, then a fresh run resumed from the first checkpoint; both summaries."""
    first = params_job(cfg, comm)
    resumed = copy.deepcopy(cfg)
    resumed.checkpoint.resume = os.path.join(cfg.checkpoint.dir, checkpoint.step_name(cfg.checkpoint.every))
    resumed.checkpoint.every = 0
    resumed.logging.metrics = ""
    return {"first": first, "resumed": params_job(resumed, comm)}


def without_moments(load):
    """Planted bug: `load` that then loses AdamW's moments."""

    def load_without_moments(path, engine, comm):
        manifest = load(path, engine, comm)
        engine.adamw.exp_avg.zero_()
        engine.adamw.exp_avg_sq.zero_()
        return manifest

    return load_without_moments


def resume_without_moments():
    """Planted bug: a resume (checkpoint.resume, which the loop calls) that loses AdamW's moments."""
    real = train_module.checkpoint.resume

    def lossy(target, engine, comm, **kwargs):
        found = real(target, engine, comm, **kwargs)
        engine.adamw.exp_avg.zero_()
        engine.adamw.exp_avg_sq.zero_()
        return found

    return mock.patch.object(train_module.checkpoint, "resume", lossy)


def forgetful_resume_job(cfg: Config, comm: Comm) -> dict:
    with resume_without_moments():
        return interrupted_job(cfg, comm)


def forgetful_train_job(cfg: Config, comm: Comm) -> dict:
    """`zerotrain train` (train_job) whose resume loses AdamW's moments."""
    with resume_without_moments():
        return train_module.train_job(cfg, comm)


def resume_job(cfg: Config, comm: Comm) -> dict:
    return params_job(cfg, comm)


def reshard_without_moments_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug in the resharding path itself: the state it rebuilds for another world size loses the moments."""
    from zerotrain.checkpoint import load as load_module

    real, called = load_module._reshard, []

    def lossy(*args, **kwargs):
        called.append(True)
        state = real(*args, **kwargs)
        return {k: (v.zero_() if k in ("exp_avg", "exp_avg_sq") else v) for k, v in state.items()}

    with mock.patch.object(load_module, "_reshard", lossy):
        return {**params_job(cfg, comm), "resharded": bool(called)}


def drift_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: rank 1 nudges one parameter after step 2."""

    def nudge(step, engine):
        if step == 2 and comm.rank == 1:
            with torch.no_grad():
                engine.held_params[7] += 1e-3

    return summary(train(cfg, comm, after_update=nudge))


def nan_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: rank 1's parameters become NaN after step 2."""

    def poison(step, engine):
        if step == 2 and comm.rank == 1:
            with torch.no_grad():
                engine.held_params.fill_(float("nan"))

    return summary(train(cfg, comm, after_update=poison))


def crash_in_save_job(cfg: Config, comm: Comm) -> dict:
    """Rank 1 dies while writing the step-4 checkpoint, after rank 0 wrote its files."""
    save_module = importlib.import_module("zerotrain.checkpoint.save")
    real_write = save_module.write_safetensors

    def write_safetensors(path, tensors, **kwargs):
        if comm.rank == 1 and "step_00000004" in path:
            os._exit(9)
        return real_write(path, tensors, **kwargs)

    save_module.write_safetensors = write_safetensors
    return summary(train(cfg, comm))


def no_sync_ignored_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: communication starts on every micro-batch, before accumulation is complete."""
    from contextlib import nullcontext

    from zerotrain.parallel import GradientReducer

    GradientReducer.no_sync = lambda self, enabled=True: nullcontext()
    return params_job(cfg, comm)


def collectives_job(cfg: Config, comm: Comm) -> dict:
    """Three buckets in flight at once through Comm's reduce-scatter, then through its all-gather.

    Rank r's bucket b holds values fixed by (r, b), so the test can rebuild every rank's input.
    """
    W, sizes = comm.world_size, [6 * comm.world_size, 9 * comm.world_size, 3 * comm.world_size]
    inputs = [collective_input(comm.rank, b, n) for b, n in enumerate(sizes)]
    shards = [torch.full((n // W,), float("nan")) for n in sizes]
    works = [comm.reduce_scatter(s, x.clone(), "test", async_op=True) for s, x in zip(shards, inputs)]
    for w in works:
        w.wait()
    gathered = [torch.full((n,), float("nan")) for n in sizes]
    works = [comm.all_gather(g, s, "test", async_op=True) for g, s in zip(gathered, shards)]
    for w in works:
        w.wait()
    return {"rank": comm.rank, "shards": shards, "gathered": gathered, "sizes": sizes}


def collective_input(rank: int, bucket: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * bucket + rank)
    return torch.randn(numel, generator=gen)


def unwaited_forward_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: forward reads parameters without waiting for their bucket's all-gather."""
    from zerotrain.parallel import ReplicatedParameters

    real_wait = ReplicatedParameters.wait

    def wait(self, buckets=None):
        if buckets is None:  # the forward pre-hooks name their buckets; they now skip the wait
            real_wait(self)

    ReplicatedParameters.wait = wait
    return params_job(cfg, comm)


def raising_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: an ordinary exception (not a zerotrain error) in rank 1."""
    if comm.rank == 1:
        raise ValueError("a bug in rank 1")
    comm.barrier("test")
    return {}


def tp_params_job(cfg: Config, comm: Comm) -> dict:
    """Train with TP; the log, the full parameters, and every rank's replicated parameters (rank order)."""
    result = train(cfg, comm)
    out = summary(result)
    out["params"] = result.engine.full_state_dict()
    out["replicated"] = _replicated_on_every_rank(result.engine, comm)
    return out


def _replicated_on_every_rank(engine, comm: Comm) -> torch.Tensor:
    """(world_size, n) tensor: row r is rank r's replicated parameter values, in layout order."""
    values = torch.cat([p.detach().reshape(-1) for s, p in zip(engine.layout.slots, engine.params)
                        if s.name not in engine.tp_slices])
    return comm.all_gather_rows(values, "test_gather_replicated")


def tp_no_grad_all_reduce_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: the column-parallel input's backward skips its all-reduce (each rank keeps a partial sum)."""
    from zerotrain.model import tensor_parallel

    tensor_parallel._CopyToTP.backward = staticmethod(lambda ctx, grad: (grad, None, None))
    return tp_params_job(cfg, comm)


def tp_averaged_grad_all_reduce_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: the column-parallel input's backward averages over the TP group instead of summing."""
    from zerotrain.model import tensor_parallel

    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, ctx.purpose)
        return grad / ctx.comm.world_size, None, None

    with mock.patch.object(tensor_parallel._CopyToTP, "backward", staticmethod(backward)):
        return tp_params_job(cfg, comm)


def tp_double_counted_norm_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: every TP rank counts the replicated gradients in the global norm (T times in all)."""
    from zerotrain.parallel import GradientReducer

    def counted(self, engine):
        return self._owned(engine.sliced_ranges) + self._owned(engine.replicated_ranges)

    with mock.patch.object(GradientReducer, "_counted_ranges", counted):
        return tp_params_job(cfg, comm)


def _nudge_job(cfg: Config, comm: Comm, rank: int, sliced: bool) -> dict:
    def nudge(step, engine):
        if step == 2 and comm.rank == rank:
            slot = next(s for s in engine.layout.slots if (s.name in engine.tp_slices) == sliced)
            with torch.no_grad():
                engine.held_params[slot.offset] = torch.nextafter(engine.held_params[slot.offset],
                                                                  torch.tensor(float("inf")))  # one ulp

    return summary(train(cfg, comm, after_update=nudge))


def tp_drift_replicated_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: TP rank 1 of replica 0 (rank 1) moves one replicated value by one ulp after step 2."""
    return _nudge_job(cfg, comm, rank=1, sliced=False)


def tp_drift_sliced_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: rank 3 (TP rank 1 of replica 1) moves one value of its TP slice by one ulp after step 2."""
    return _nudge_job(cfg, comm, rank=3, sliced=True)


def environment_probe_job(cfg, comm):
    """Each rank prints and returns ZT_PROBE as it finds it: the launcher's value at launch, not the forkserver's."""
    print(f"rank {comm.rank} sees ZT_PROBE={os.environ.get('ZT_PROBE')}", flush=True)
    return os.environ.get("ZT_PROBE")
