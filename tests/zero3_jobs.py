"""Jobs of the ZeRO-3 tests, run by spawned ranks (importable by module name); planted bugs patch the engine itself."""

from __future__ import annotations

from unittest import mock

import torch
from dist_jobs import error_of_training, summary

from zerotrain.config import Config
from zerotrain.hub.init_from import FileValues
from zerotrain.model import init
from zerotrain.parallel import (Comm, GradientReducer, ReleasedParameterError, ShardedParameters, StaleParameterError,
                                ZeroEngine, sharded)
from zerotrain.training.invariants import InvariantError
from zerotrain.training.loop import build_engine, train


def stage_job(cfg: Config, comm: Comm) -> dict:
    """Train; the log, the final parameters, and the parameter bytes the engine holds (now and at most)."""
    before = comm.snapshot()[0]
    result = train(cfg, comm)
    out = summary(result)
    out["run_calls"] = comm.snapshot()[0] - before  # this run's (the counters span the jobs run in turn)
    engine = result.engine
    out["params"] = engine.full_state_dict()
    out["param_bytes"] = engine.held_params.numel() * engine.held_params.element_size()
    out["param_peak_bytes"] = engine.memory_held()["param_peak_bytes"]
    out["whole_after_step"] = sorted(getattr(engine.placement, "whole", ()))  # stage 3's buckets whole now
    out["unit_buckets"] = getattr(engine.placement, "unit_buckets", None)
    out["grad_peak_bytes"] = engine.memory_held()["grad_peak_bytes"]
    out["plan"] = result.plan
    out["param_norms"] = result.param_norms
    return out


def freed_before_backward_job(cfg: Config, comm: Comm) -> str:
    """Planted bug: a unit's buckets are not gathered again for its backward (released after its forward)."""
    real = ShardedParameters.gather_unit

    def forward_only(self, unit, phase):
        if phase == "forward":
            real(self, unit, phase)

    with mock.patch.object(ShardedParameters, "gather_unit", forward_only):
        return error_of_training(cfg, comm, ReleasedParameterError)


def wrong_unit_job(cfg: Config, comm: Comm) -> str:
    """Planted bug: a block's forward gathers its neighbour's buckets (the two blocks swapped)."""
    real = ShardedParameters.gather_unit

    def neighbour(self, unit, phase):
        blocks = len(self.units) - 1
        real(self, unit % blocks + 1 if unit else 0, phase)

    with mock.patch.object(ShardedParameters, "gather_unit", neighbour):
        return error_of_training(cfg, comm, ReleasedParameterError)


def reduced_twice_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: the buckets of the first block's parameters are reduce-scattered into the shard twice."""
    real = GradientReducer._release

    def again(self, index):
        if index in self.placement.unit_buckets[1] and index in self._bucket_grads:
            b = self.layout.buckets[index]
            out = self.grad_shard[b.shard_offset : b.shard_offset + b.chunk_numel(self.dp.world_size)]
            twice = torch.empty_like(out)
            self.dp.reduce_scatter(twice, self._bucket_grads[index], "reduce_scatter_grads")
            out.add_(twice)
        real(self, index)

    with mock.patch.object(GradientReducer, "_release", again):
        return stage_job(cfg, comm)


def stale_units_job(cfg: Config, comm: Comm) -> str:
    """Planted bug: rank 1 keeps a copy of each bucket as first gathered and computes with it ever after (it still
    takes part in every gather), so after the first update its units are stale. The error invariant (b) raises."""
    if comm.rank != 1:
        return error_of_training(cfg, comm, InvariantError)
    real, first = ShardedParameters._gather_bucket, {}

    def stale(self, index, *args, **kwargs):
        real(self, index, *args, **kwargs)
        if index in first:
            self.bucket_params[index].copy_(first[index])
        else:
            first[index] = self.bucket_params[index].clone()

    with mock.patch.object(ShardedParameters, "_gather_bucket", stale):
        return error_of_training(cfg, comm, InvariantError)


def rolled_back_job(cfg: Config, comm: Comm) -> dict:
    """A NaN loss on rank 1 at step 3: the guard rolls back to the step-2 checkpoint and skips the data steps."""
    with mock.patch.dict("os.environ", {"ZEROTRAIN_FAULTS": "nan@step=3,rank=1"}):
        result = train(cfg, comm)
    return {"losses": [r["loss"] for r in result.records], "rollbacks": result.rollbacks,
            "params": result.engine.full_state_dict()}


def recompute_not_gathered_job(cfg: Config, comm: Comm) -> str:
    """Planted bug: a block's forward recomputed in its backward (activation checkpointing) is not gathered."""
    real = ShardedParameters.gather_unit

    def not_in_backward(self, unit, phase):
        if unit == 0 or not sharded.in_backward():
            real(self, unit, phase)

    with mock.patch.object(ShardedParameters, "gather_unit", not_in_backward):
        return error_of_training(cfg, comm, ReleasedParameterError)


def root_not_held_job(cfg: Config, comm: Comm) -> str:
    """Planted bug: the root unit (embeddings, final norm, head) is released after the forward, not held for the
    backward, where the head's backward (recomputed with --activation-checkpointing full) comes first."""
    real = ShardedParameters.gather_unit

    def forward_only_root(self, unit, phase):
        if unit or phase == "forward":
            real(self, unit, phase)

    with mock.patch.object(ShardedParameters, "gather_unit", forward_only_root):
        return error_of_training(cfg, comm, ReleasedParameterError)


def prefetch_skips_a_unit_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: each prefetch gathers the unit after the one that runs next (block u+2 while u runs)."""
    real = ShardedParameters.prefetch_unit

    def one_too_far(self, unit):
        if unit + 1 < len(self.units):
            real(self, unit + 1)

    with mock.patch.object(ShardedParameters, "prefetch_unit", one_too_far):
        return stage_job(cfg, comm)


def stale_prefetch_job(cfg: Config, comm: Comm) -> str:
    """Planted bug: block 1's gather is prefetched as the step releases its units, before the optimizer updates the
    shard, and the next step's forward computes with it (from step 2 on: after step 1 the memory plan's check would
    find the bucket held past the step first)."""
    real = ShardedParameters.release_all

    def prefetch_before_the_update(self):
        real(self)
        if self._updates:
            self.prefetch_unit(1)

    with mock.patch.object(ShardedParameters, "release_all", prefetch_before_the_update):
        return error_of_training(cfg, comm, StaleParameterError)


def initial_model_job(cfg: Config, comm: Comm) -> dict:
    """The engine's initial model, gathered whole after its construction, before any step."""
    return build_engine(cfg, comm).full_state_dict()


def owner_seeded_init_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: each parameter's generator is seeded with the rank too, so each owner draws its chunks on its
    own (the same values on one rank as ever, other ones wherever another rank owns a part)."""
    real = init.parameter_key
    with mock.patch.object(init, "parameter_key", lambda seed, name: real(seed, f"{name}/{comm.rank}")):
        return initial_model_job(cfg, comm)


def rank_seeded_start_job(cfg: Config, comm: Comm) -> str:
    """Planted bug at stages 1 and 2: the replicas start from other models (generators seeded with the rank); the
    run's error, or "no error"."""
    real = init.parameter_key
    with mock.patch.object(init, "parameter_key", lambda seed, name: real(seed, f"{name}/{comm.rank}")):
        return error_of_training(cfg, comm, InvariantError)


def init_from_reads_job(cfg: Config, comm: Comm) -> dict:
    """--init-from: the initial model, the ranges of the parameters this rank read (name, first, last value) in order,
    the owned ranges of each parameter whose flat range lies partly in this rank's chunks, and the bytes it read."""
    real, read = FileValues.flat_values, []

    def recorded(self, name, shape, lo, hi):
        read.append((name, lo, hi))
        return real(self, name, shape, lo, hi)

    with mock.patch.object(FileValues, "flat_values", recorded):
        engine = build_engine(cfg, comm)
    L, W = engine.layout, comm.world_size
    chunks = [L.buckets[s.bucket].chunk(comm.rank, W) for s in L.slots]
    owned = [(s.name, max(lo, s.offset) - s.offset, min(hi, s.offset + s.numel) - s.offset)
             for s, (lo, hi) in zip(L.slots, chunks) if max(lo, s.offset) < min(hi, s.offset + s.numel)]
    return {"initial": engine.full_state_dict(), "read": read, "owned": owned, "bytes_read": engine.init_bytes_read}


def gradients_held_job(cfg: Config, comm: Comm) -> str:
    """Planted bug: stage 3 holds every bucket's gradients through the accumulation window (its engine built for
    --grad-reduce step) where the run planned the default, each micro-batch reduced into the shard; the run's error."""
    real = ZeroEngine.__init__

    def held(self, *args, **kwargs):
        real(self, *args, **{**kwargs, "grad_reduce": "step"})

    with mock.patch.object(ZeroEngine, "__init__", held):
        return error_of_training(cfg, comm, InvariantError)
