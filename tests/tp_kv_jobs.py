"""Job functions for the tests of TP over few KV heads (each KV head on several TP ranks), run by spawned ranks."""

from __future__ import annotations

from unittest import mock

import torch
from dist_jobs import error_of_training, summary

from zerotrain import checkpoint
from zerotrain.config import Config
from zerotrain.errors import InvariantError
from zerotrain.model import build_model, llama, parallelize
from zerotrain.model.tensor_parallel import TPSlice, _SumOverReplicas, kv_replicas
from zerotrain.parallel import Comm, Mesh
from zerotrain.training.loop import build_engine, train


def batch(cfg: Config) -> torch.Tensor:
    """The same few sequences on every rank."""
    return torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(7))


def logits_job(cfg: Config, comm: Comm) -> dict:
    """Max |logit difference| between this mesh's TP model and the whole model, on every rank: as planned, and with
    the planted bug of KV heads dealt round-robin (rank r holding head r % KV, not the head of its query heads)."""
    tp = cfg.parallel.tp
    mesh = Mesh.build(comm, tp, kv_replicas(cfg.model.kv_heads, tp))
    x = batch(cfg)
    with torch.no_grad():
        whole = build_model(cfg.model, cfg.loop.seed)(x)

    def max_diff() -> float:
        model = build_model(cfg.model, cfg.loop.seed)
        parallelize(model, tp, mesh.tp_rank, mesh.tp, mesh.kv)
        with torch.no_grad():
            diff = (model(x) - whole).abs().max().reshape(1).double()
        return comm.all_gather_rows(diff, "test_logit_diffs").max().item()

    def round_robin(kv_heads, head_dim, tp):
        return tuple(((r % kv_heads * head_dim, (r % kv_heads + 1) * head_dim),) for r in range(tp))

    planned = max_diff()
    with mock.patch.object(llama, "kv_head_blocks", round_robin):
        dealt = max_diff()
    return {"max_diff": planned, "round_robin_max_diff": dealt, "logits": whole}


def train_job(cfg: Config, comm: Comm, after_update=None) -> dict:
    """Train; the log, the full parameters, the bytes sent by purpose and every rank's KV slices."""
    result = train(cfg, comm, after_update=after_update)
    out = summary(result)
    out["params"] = result.engine.full_state_dict()
    out["bytes"], out["plan"] = result.comm_bytes, result.plan
    out["kv_slices"] = kv_slices_on_every_rank(result.engine, comm)
    return out


def kv_slices_on_every_rank(engine, comm: Comm) -> torch.Tensor:
    """(world_size, n): row r is rank r's k_proj and v_proj values, in layout order (placed by hand, not by
    the product's digests)."""
    values = torch.cat([p.detach().reshape(-1) for s, p in zip(engine.layout.slots, engine.params)
                        if s.name.endswith(("k_proj.weight", "v_proj.weight"))])
    return comm.all_gather_rows(values, "test_gather_kv_slices")


def unsummed_replicas_job(cfg: Config, comm: Comm) -> str:
    """Planted bug: each replica of a KV head keeps its own query heads' part of the gradient (the replica group's
    all-reduce skipped); the error invariant (b) raises."""
    with mock.patch.object(_SumOverReplicas, "backward", staticmethod(lambda ctx, grad: (grad, None, None))):
        return error_of_training(cfg, comm, InvariantError)


def averaged_replicas_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: the replica group averages its gradient parts instead of summing them (replicas stay equal)."""

    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, "all_reduce_kv_replica_grads")
        return grad / ctx.comm.world_size, None, None

    with mock.patch.object(_SumOverReplicas, "backward", staticmethod(backward)):
        return train_job(cfg, comm)


def double_counted_norm_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: every replica of a KV head counts its gradient in the global norm (each head twice at TP 4)."""
    with mock.patch.object(TPSlice, "first_holder", lambda self, rank: rank):
        return train_job(cfg, comm)


def full_shard_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """{state key: the full model's tensors} of the engine's masters and moments, gathered over DP then TP."""
    out = {}
    for key, shard in (("master", engine.adamw.master_shard()), ("exp_avg", engine.adamw.exp_avg),
                       ("exp_avg_sq", engine.adamw.exp_avg_sq)):
        shards = torch.empty(engine.dp.world_size * shard.numel())
        engine.dp.all_gather(shards, shard.float().contiguous(), "test_gather_shards")
        flat = engine.layout.assemble(list(shards.chunk(engine.dp.world_size)))
        out[key] = engine.full_tensors(flat)
    return out


def resume_job(cfg: Config, comm: Comm) -> dict:
    """The full state right after loading cfg.checkpoint.resume on this mesh, then the resumed run to the end."""
    engine = build_engine(cfg, comm)
    checkpoint.load_checkpoint(cfg.checkpoint.resume, engine, comm)
    loaded = full_shard_state(engine)
    out = train_job(cfg, comm)
    out["loaded"] = loaded
    return out


def saved_state_job(cfg: Config, comm: Comm) -> dict:
    """Train, saving as cfg says; also the full state right after the step the resume tests start from."""
    saved = {}

    def keep(step, engine):
        if step == cfg.checkpoint.every:
            saved.update(full_shard_state(engine))

    out = train_job(cfg, comm, keep)
    out["saved"] = saved
    return out


def lora_job(cfg: Config, comm: Comm) -> dict:
    """A LoRA run (rank 4 on every linear of the blocks, the base frozen): its log and full adapters, or the error
    invariant (b) raised (the ranks stay together for the next job)."""
    cfg.lora.rank, cfg.lora.alpha = 4, 8.0
    try:
        result = train(cfg, comm)
        return {**summary(result), "params": result.engine.full_state_dict()}
    except InvariantError as e:
        return {"invariant": str(e)}


def lora_unsummed_b_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: the B of a replicated KV head's k_proj or v_proj keeps its own query heads' part of the gradient
    (its replica group's sum skipped), as its base's would without sum_over_replicas."""
    from zerotrain.model import lora

    with mock.patch.object(lora.LoRAUp, "forward", lambda self, h: torch.nn.functional.linear(h, self.weight)):
        return lora_job(cfg, comm)
