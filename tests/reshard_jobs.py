"""Job functions for tests/test_reshard_reads.py, run by spawned ranks (importable by module name), and the reshard
zerotrain did before it read by ranges: every rank reads every old shard whole and builds full flat buffers, the
reference the ranged reads must equal bitwise (and, planted, the reader the byte bound must catch)."""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import torch
from safetensors.torch import save_file

from zerotrain.checkpoint import load as load_module
from zerotrain.checkpoint.format import STATE_KEYS, mesh_of
from zerotrain.checkpoint.stream import bytes_counted
from zerotrain.config import Config
from zerotrain.parallel import Comm
from zerotrain.training.loop import build_engine, train

READ, WRITTEN = "checkpoint_bytes_read", "checkpoint_bytes_written"


def whole_shards_state(shards, old, old_slices, old_tp, new, new_slices, tp_rank, dp_rank) -> dict:
    """The shard state of (tp_rank, dp_rank) in layout `new` from every old world rank's shard (shards[r]), as the
    reshard before ranged reads built it: per state key, each old TP rank's padded flat buffer assembled from its DP
    group's shards (world ranks d x old_tp + t), the full tensors placed from them (a split tensor's parts from the
    first TP rank holding each; a replicated one TP rank 0's), this rank's TP slices taken into its new flat
    buffer (zeros in the padding), and its DP rank's chunks of that kept. The step is world rank 0's."""
    old_dp = len(shards) // old_tp
    state = {"step": shards[0]["step"]}
    for key in STATE_KEYS:
        flats = [old.assemble([shards[d * old_tp + t][key] for d in range(old_dp)]) for t in range(old_tp)]
        flat = torch.zeros(new.padded_numel, dtype=flats[0].dtype)
        was = {s.name: s for s in old.slots}
        for s in new.slots:
            o = was[s.name]
            if s.name in old_slices:
                full = torch.empty(old_slices[s.name].full_shape, dtype=flat.dtype)
                for t, piece in enumerate(f[o.offset : o.offset + o.numel].view(o.shape) for f in flats):
                    if old_slices[s.name].first_holder(t) == t:
                        old_slices[s.name].place(full, piece, t)
            else:
                full = flats[0][o.offset : o.offset + o.numel].view(o.shape)
            local = new_slices[s.name].take(full, tp_rank) if s.name in new_slices else full
            flat[s.offset : s.offset + s.numel] = local.reshape(-1)
        state[key] = new.shard(flat, dp_rank)
    return state


def whole_shards_reshard(path, manifest, homes, new, new_slices, tp_rank, dp_rank, prefix="") -> dict:
    """Planted in place of load.py's _reshard: the reshard before ranged reads, every old shard read whole (of a
    checkpoint without --ep: `prefix` is "")."""
    assert not prefix, "the whole-shard reshard knows no expert layout"
    shards = [load_module.read_shard(path, manifest, r) for r in range(manifest["world_size"])]
    return whole_shards_state(shards, homes.layout, homes.tp_slices, mesh_of(manifest)[0], new, new_slices, tp_rank,
                              dp_rank)


def save_job(cfg: Config, comm: Comm) -> dict:
    """Train, saving as cfg says; each rank's checkpoint bytes as the run reports them, and as counted around it."""
    before = bytes_counted()
    result = train(cfg, comm)
    counted = {k: v - before[k] for k, v in bytes_counted().items()}
    return {"per_rank": result.per_rank, "counted": comm.io.all_gather_json(counted, "test_counted"),
            "checkpoints": result.checkpoints}


def load_job(cfg: Config, comm: Comm, planted: bool = False) -> dict:
    """Load cfg.checkpoint.resume into a fresh engine of this mesh; each rank's bytes read verifying and in all,
    and its shard state in out/state-rank{r}.safetensors. `planted`: every rank reads every old shard whole."""
    engine = build_engine(cfg, comm)
    verified, real_verify = [], load_module.verify_together
    homes_built, real_homes = [], load_module.CheckpointHomes.of

    def counting_homes(manifest, path):
        homes_built.append(path)
        return real_homes(manifest, path)

    def counting_verify(path, comm_):
        start = bytes_counted()[READ]
        checks = real_verify(path, comm_)
        verified.append(bytes_counted()[READ] - start)
        return checks

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(load_module, "verify_together", counting_verify))
        patches.enter_context(mock.patch.object(load_module.CheckpointHomes, "of", counting_homes))
        if planted:
            patches.enter_context(mock.patch.object(load_module, "_reshard", whole_shards_reshard))
        start = bytes_counted()[READ]
        load_module.load_checkpoint(cfg.checkpoint.resume, engine, comm)
        total = bytes_counted()[READ] - start
    state = {k: v.detach().cpu().contiguous().clone() for k, v in engine.shard_state_dict().items()}
    os.makedirs(cfg.logging.out, exist_ok=True)
    save_file(state, os.path.join(cfg.logging.out, f"state-rank{comm.rank}.safetensors"))
    mine = {"verify": sum(verified), "total": total, "verified": bool(verified), "tp_rank": engine.mesh.tp_rank,
            "dp_rank": engine.dp.rank, "homes_built": len(homes_built)}
    return {"ranks": comm.io.all_gather_json(mine, "test_load_bytes"), "layout": engine.layout.to_dict(),
            "tp_slices": {n: s.to_dict() for n, s in engine.tp_slices.items()}}


def planted_load_job(cfg: Config, comm: Comm) -> dict:
    return load_job(cfg, comm, planted=True)
