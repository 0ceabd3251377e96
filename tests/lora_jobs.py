"""Jobs the LoRA tests run on 2 ranks (importable by module name in the spawned ranks)."""

from __future__ import annotations

import torch
from dist_jobs import summary

from zerotrain.config import Config
from zerotrain.errors import InvariantError
from zerotrain.parallel import Comm
from zerotrain.training.loop import train


# the adapters whose dropout masks lora_job records (a Llama's, by their linears' names: LoRADropout.adapter is
# lora.adapter_key of the name): layer 0's q_proj, a column-parallel base's (A's input replicated over TP), and its
# o_proj, a row-parallel base's (A's input split)
WATCHED = {"model.layers.0.self_attn.q_proj": "q_proj", "model.layers.0.self_attn.o_proj": "o_proj"}


def lora_job(cfg: Config, comm: Comm) -> dict:
    """Train; the log, the full adapters (TP slices gathered), and what each rank holds for the optimizer.

    With --lora-dropout: "masks", every rank's step-1 masks of the WATCHED adapters' inputs, by row of the global batch
    ({adapter: [per rank: {row: [T][F] kept bools}]}), as the product's dropout applied them.
    """
    from zerotrain.model import lora

    real, masks = lora.LoRADropout.forward, {name: {} for name in WATCHED.values()}
    watched = {lora.adapter_key(name): short for name, short in WATCHED.items()}

    def recording(self, x):
        out = real(self, x)
        if comm.step == 1 and self.rows.rows is not None and self.adapter in watched:
            kept = (out != 0).tolist()
            for j, row in enumerate(self.rows.rows):  # the first forward's; a recomputed one overwrites it alike
                masks[watched[self.adapter]][row] = kept[j]
        return out

    lora.LoRADropout.forward = recording
    try:
        result = train(cfg, comm)
    finally:
        lora.LoRADropout.forward = real
    engine = result.engine
    out = summary(result)
    out["params"] = engine.full_state_dict()
    out["per_rank"] = result.per_rank
    out["shard_numel"], out["padded_numel"] = engine.layout.shard_numel, engine.layout.padded_numel
    out["trained"] = [s.name for s in engine.layout.slots]
    out["frozen_grads"] = [n for n, p in engine.frozen if p.grad is not None]
    if cfg.lora.dropout:
        gathered = comm.io.all_gather_json(masks, "lora_masks")
        out["masks"] = {name: [{int(row): torch.tensor(m) for row, m in rank[name].items()} for rank in gathered]
                        for name in masks}
    return out


def lora_rowless_key_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: the dropout key counts a micro-batch's rows from 0, not by their place in the global batch (it
    leaves out the DP rank): the ranks' first rows draw the same mask."""
    from zerotrain.model import lora

    real = lora.row_keys
    lora.row_keys = lambda seed, step, rows: real(seed, step, range(len(rows)))
    try:
        return lora_job(cfg, comm)
    finally:
        lora.row_keys = real


def lora_unsummed_a_grad_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: a column-parallel base's A keeps each TP rank's partial gradient (no all-reduce over TP)."""
    from zerotrain.model import tensor_parallel

    saved = tensor_parallel._SumOverReplicas.backward
    tensor_parallel._SumOverReplicas.backward = staticmethod(lambda ctx, grad: (grad, None, None))
    try:
        return lora_job(cfg, comm)
    except InvariantError as e:  # raised on every rank alike: the ranks stay together for the next job
        return {"invariant": str(e)}
    finally:
        tensor_parallel._SumOverReplicas.backward = saved


def lora_drifted_base_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: after step 1, rank 1's frozen base (not in the engine's buffers) moves by one ulp."""

    def drift(step, engine):
        if step == 1 and comm.rank == 1:
            weight = dict(engine.frozen)["model.norm.weight"]
            with torch.no_grad():
                weight[0] = torch.nextafter(weight[0], torch.tensor(float("inf")))

    try:
        train(cfg, comm, after_update=drift)
    except InvariantError as e:  # raised on every rank alike
        return {"invariant": str(e)}
    return {}


def lora_whole_base_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: ZeRO-3 keeps the frozen base whole on every rank (its layout left empty, so the engine gives each
    frozen parameter its own whole tensor, as stages 1 and 2 do; the plan counts it so too)."""
    import os

    from zerotrain.parallel import units
    from zerotrain.parallel.layout import ShardLayout
    from zerotrain.training import memory_plan

    real, strict = units.frozen_layout_of, os.environ.get(memory_plan.STRICT_ENV)
    units.frozen_layout_of = lambda model, world_size, bucket_numel: ShardLayout.build([], world_size, bucket_numel)
    os.environ[memory_plan.STRICT_ENV] = "0"  # the plan's sharded base would stop the run before its summary
    try:
        return lora_job(cfg, comm)
    finally:
        units.frozen_layout_of = real
        os.environ[memory_plan.STRICT_ENV] = strict or ""


def lora_lossy_resume_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: a ZeRO-3 resume restores the adapters but not AdamW's second moments."""
    from zerotrain.parallel import ZeroEngine

    real = ZeroEngine.load_shard_state_dict
    ZeroEngine.load_shard_state_dict = lambda self, sd: real(self, {**sd, "exp_avg_sq":
                                                                    torch.zeros_like(sd["exp_avg_sq"])})
    try:
        return lora_job(cfg, comm)
    finally:
        ZeroEngine.load_shard_state_dict = real


def lora_misread_base_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: ZeRO-3 fills each rank's share of the frozen base from the start of each tensor, not from the
    range it owns."""
    from zerotrain.parallel import ZeroEngine

    real = ZeroEngine.initial_range
    ZeroEngine.initial_range = lambda self, name, p, lo, hi: \
        real(self, name, p, lo, hi) if p.requires_grad else real(self, name, p, 0, hi - lo)
    try:
        return lora_job(cfg, comm)
    finally:
        ZeroEngine.initial_range = real


def lora_drifted_frozen_gather_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: from step 2 on, rank 1 computes with a frozen bucket one ulp off what the shards gather (its
    copy of the base drifts; the shards themselves are intact)."""
    from zerotrain.parallel import ShardedParameters

    real = ShardedParameters._gather_bucket

    def drifted(self, index, *args, **kwargs):
        real(self, index, *args, **kwargs)
        if comm.rank == 1 and index >= len(self.engine.layout.buckets) and self._updates >= 1:
            with torch.no_grad():
                value = self.bucket_params[index][0]
                self.bucket_params[index][0] = torch.nextafter(value, torch.tensor(float("inf")))

    ShardedParameters._gather_bucket = drifted
    try:
        train(cfg, comm)
    except InvariantError as e:  # raised on every rank alike
        return {"invariant": str(e)}
    finally:
        ShardedParameters._gather_bucket = real
    return {}


def frozen_copy_job(cfg: Config, comm: Comm, planted: bool = False) -> dict:
    """A ZeRO-3 model (full fine-tuning, no step taken) and two all-frozen copies of it sharded like it
    (frozen_copy.shard_frozen_copy): one from the engine's shard, one drawn from the seed. Their logits under no_grad, the
    model's own, what each rank held of a copy at most, and the refusal of a forward with gradients.
    `planted`: the copies' blocks gather nothing (their units' buckets left out)."""
    from zerotrain.model import meta_model
    from zerotrain.model.init import SeedValues
    from zerotrain.parallel import frozen_copy, units
    from zerotrain.training.loop import build_engine

    real = units.unit_buckets
    engine = build_engine(cfg, comm)
    if planted:
        units.unit_buckets = lambda model, layout, trained=True: [real(model, layout, trained)[0]] + \
            [()] * (len(real(model, layout, trained)) - 1)
    try:
        copies = []
        for source in ("like", "init"):
            module = meta_model(cfg.model).requires_grad_(False)
            copies.append(frozen_copy.shard_frozen_copy(
                module, engine.dp, bucket_numel=cfg.parallel.bucket_numel, like=engine if source == "like" else None,
                init=SeedValues(cfg.model, cfg.loop.seed, {}, 0)))
    finally:
        units.unit_buckets = real
    idx = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    out = {"held": [c.param_shard.numel() * c.param_shard.element_size() for c in copies]}
    try:
        with torch.no_grad():
            out["logits"] = [c.module(idx) for c in copies] + [engine.model(idx)]
        out["peak"] = [c.param_peak_bytes for c in copies]
        out["after"] = [c.param_bytes() for c in copies]
        copies[0].module(idx)  # with gradients
    except Exception as e:  # noqa: BLE001 - the test reads which
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def ungathered_frozen_copy_job(cfg: Config, comm: Comm) -> dict:
    return frozen_copy_job(cfg, comm, planted=True)


def lora_stale_save_job(cfg: Config, comm: Comm) -> dict:
    """Planted bug: a ZeRO-3 checkpoint holds each rank's shard as it was before the step's update."""
    from zerotrain.parallel import ZeroEngine

    real_apply, real_save, real_views = ZeroEngine.apply, ZeroEngine.shard_state_dict, ZeroEngine.master_views
    before = {}  # kept outside the engine, whose tensors the plan's check counts

    def apply(self, lr, grad_norm):
        before["master"] = self.adamw.master_shard().detach().float().clone()
        real_apply(self, lr, grad_norm)

    ZeroEngine.apply = apply
    # both ways a checkpoint takes the masters: the shard's state, or the masters where they lie (fp32 on the CPU)
    ZeroEngine.shard_state_dict = lambda self: {**real_save(self), "master": before["master"]}
    ZeroEngine.master_views = lambda self: [before["master"]]
    try:
        return lora_job(cfg, comm)
    finally:
        ZeroEngine.apply, ZeroEngine.shard_state_dict, ZeroEngine.master_views = real_apply, real_save, real_views
