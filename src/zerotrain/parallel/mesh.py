"""The 2-D mesh TP x DP: which ranks split each layer (a TP group) and which hold the same slices (a DP group).

Ranks are TP-adjacent: rank = dp_index x tp + tp_index, so a TP group (the ranks that split one
replica's layers and all-reduce activations every layer) is a run of consecutive ranks, which on a
multi-GPU node are the GPUs with the fastest links between them. ZeRO-1 runs over the DP group: the
ranks with the same tp_index hold the same TP slices and average their gradients.

With tp = 1 there is no TP group and the DP group is the whole world, exactly today's data parallelism.

With more TP ranks than KV heads each KV head lives on `kv_replicas` consecutive TP ranks (a KV group),
which sum their k and v weight gradients (model/layers.py, sum_over_replicas).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from .comm import Comm


@dataclass
class Mesh:
    world: Comm  # every rank: the step's one scalar all-reduce, digests, checkpoints
    dp: Comm  # the ranks with this rank's tp_index: ZeRO-1's reduce-scatter and all-gather
    tp: Comm | None  # the ranks of this rank's replica: activation all-reduces; None when tp == 1
    tp_size: int
    tp_rank: int
    kv: Comm | None = None  # the TP ranks holding this rank's KV heads: their gradient all-reduces; None if only it
    kv_replicas: int = 1  # TP ranks per KV head (consecutive TP ranks: TP rank t's group starts at t - t % kv_replicas)
    # Expert parallelism (parallel/experts.py, build_expert_groups): the EP group (ep_size consecutive DP ranks, which
    # split each MoE layer's experts) and the expert replica group (the DP ranks holding this rank's experts)
    ep: Comm | None = None
    expert_dp: Comm | None = None
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def dp_size(self) -> int:
        return self.world.world_size // self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.world.rank // self.tp_size

    def describe(self) -> dict:
        return {"tp": self.tp_size, "dp": self.dp_size, **({"ep": self.ep_size} if self.ep_size > 1 else {})}

    @classmethod
    def single(cls, comm: Comm) -> "Mesh":
        """Plain data parallelism over `comm`."""
        return cls(world=comm, dp=comm, tp=None, tp_size=1, tp_rank=0)

    @classmethod
    def build(cls, world: Comm, tp: int, kv_replicas: int = 1) -> "Mesh":
        """Create the TP and DP process groups (and the KV groups of `kv_replicas` TP ranks, when above 1); every
        rank calls this together, in the same order."""
        W = world.world_size
        if tp == 1:
            return cls.single(world)
        if W % tp:
            raise ValueError(f"world size {W} is not divisible by tp {tp}")
        if tp % kv_replicas:
            raise ValueError(f"tp {tp} is not divisible by kv_replicas {kv_replicas}")
        dp = W // tp
        timeout = datetime.timedelta(seconds=world.timeout_s) if world.timeout_s else None
        mine_tp = mine_dp = None
        # new_group is collective over the whole world: every rank creates every group, in one order.
        for d in range(dp):
            group = dist.new_group([d * tp + t for t in range(tp)], timeout=timeout)
            if d == world.rank // tp:
                mine_tp = group
        for t in range(tp):
            group = dist.new_group([d * tp + t for d in range(dp)], timeout=timeout)
            if t == world.rank % tp:
                mine_dp = group
        mine_kv = None
        if kv_replicas > 1:
            for first in range(0, W, kv_replicas):  # runs of consecutive ranks, within one TP group as tp divides
                group = dist.new_group(list(range(first, first + kv_replicas)), timeout=timeout)
                if first == world.rank - world.rank % kv_replicas:
                    mine_kv = Comm(group, timeout_s=world.timeout_s)
        return cls(world=world, dp=Comm(mine_dp, timeout_s=world.timeout_s),
                   tp=Comm(mine_tp, timeout_s=world.timeout_s), tp_size=tp, tp_rank=world.rank % tp, kv=mine_kv,
                   kv_replicas=kv_replicas)

    def set_step(self, step: int) -> None:
        """The optimizer step the loop is in, for every communicator's failure messages."""
        for comm in (self.world, self.world.io, self.dp, self.tp, self.kv, self.ep, self.expert_dp):
            if comm is not None:
                comm.step = step

    def counters(self) -> tuple[dict, dict]:
        """Calls and bytes by purpose, summed over this rank's communicators."""
        calls, nbytes = {}, {}
        comms = (self.world, self.world.io, self.dp, self.tp, self.kv, self.ep, self.expert_dp)
        for comm in {id(c): c for c in comms if c is not None}.values():
            for k, v in comm.calls.items():
                calls[k] = calls.get(k, 0) + v
            for k, v in comm.bytes.items():
                nbytes[k] = nbytes.get(k, 0) + v
        return calls, nbytes
