"""The one device mesh of a run: named dimensions dp_replicate x dp_shard x cp x tp, expert groups inside dp_shard.

Built once, as a run starts (Mesh.build); every communicator is named by the dimensions it spans (each dimension, and
the rank order: docs/design.md, "The mesh").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch.distributed as dist

from .collective_watchdog import process_group_timeout
from .comm import Comm


@dataclass
class Mesh:
    world: Comm  # every rank: the step's one scalar all-reduce, digests, checkpoints
    dp_shard: Comm  # the ranks ZeRO shards over: this rank's tp_index, replica index
    tp: Comm | None  # the ranks of this rank's replica: activation all-reduces; None when tp == 1
    tp_size: int
    tp_rank: int
    kv: Comm | None = None  # the TP ranks holding this rank's KV heads: their gradient all-reduces; None if only it
    kv_replicas: int = 1  # TP ranks per KV head (consecutive TP ranks: TP rank t's group starts at t - t % kv_replicas)
    # Hybrid sharding: the ranks holding this rank's shard in the other replica groups; None at one replica group
    dp_replicate: Comm | None = None
    dp_replicate_size: int = 1
    # Expert parallelism (parallel/experts.py): the EP group (ep_size consecutive dp_shard ranks, which split each MoE
    # layer's experts) and the dp_shard ranks holding this rank's experts, which shard their state
    ep: Comm | None = None
    dp_shard_mod_ep: Comm | None = None
    ep_size: int = 1
    ep_rank: int = 0
    # Context parallelism: the ranks splitting this rank's rows along their length (the ring); None at cp 1
    cp: Comm | None = None
    cp_size: int = 1
    cp_rank: int = 0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (dp_replicate x dp_shard): the batch is split over them (a replica's CP ranks share
        its rows)."""
        return self.world.world_size // (self.tp_size * self.cp_size)

    @property
    def dp_rank(self) -> int:
        return self.world.rank // (self.tp_size * self.cp_size)

    @property
    def dp_shard_size(self) -> int:
        return self.dp_size // self.dp_replicate_size

    @property
    def dp_replicate_rank(self) -> int:
        """This rank's replica group (0 at one replica group): replica group 0 writes the checkpoint's shards."""
        return self.dp_rank // self.dp_shard_size

    def describe(self) -> dict:
        """The mesh as a checkpoint records it: the TP degree and the ranks the state is sharded over ("dp"); "ep",
        "dp_replicate" and "cp" only say what trained it (any mesh reads it)."""
        return {"tp": self.tp_size, "dp": self.dp_shard.world_size, **({"ep": self.ep_size} if self.ep_size > 1 else {}),
                **({"dp_replicate": self.dp_replicate_size} if self.dp_replicate_size > 1 else {}),
                **({"cp": self.cp_size} if self.cp_size > 1 else {})}

    @classmethod
    def single(cls, comm: Comm) -> "Mesh":
        """Plain data parallelism over `comm`."""
        return cls(world=comm, dp_shard=comm, tp=None, tp_size=1, tp_rank=0)

    @classmethod
    def build(cls, world: Comm, tp: int = 1, kv_replicas: int = 1, *, dp_replicate: int = 1, ep: int = 1,
              cp: int = 1) -> "Mesh":
        """Create every communicator of the mesh; every rank calls this together, in the same order (new_group is
        collective over the whole world: every rank creates every group, in one order)."""
        W = world.world_size
        if W % tp:
            raise ValueError(f"world size {W} is not divisible by tp {tp}")
        if tp % kv_replicas:
            raise ValueError(f"tp {tp} is not divisible by kv_replicas {kv_replicas}")
        if (W // tp) % cp:
            raise ValueError(f"world size {W} is not divisible by tp {tp} x cp {cp}")
        D = W // (tp * cp)
        if D % dp_replicate:
            raise ValueError(f"the data-parallel size {D} is not divisible by dp_replicate {dp_replicate}")
        S = D // dp_replicate
        if (S * cp) % ep:
            raise ValueError(f"the shard group's size {S} x cp {cp} is not divisible by ep {ep}")
        if tp == 1 and dp_replicate == 1 and ep == 1 and cp == 1:
            return cls.single(world)
        timeout = process_group_timeout(world.timeout_s, world.backend) if world.timeout_s else None
        rank, t, c, d = world.rank, world.rank % tp, (world.rank // tp) % cp, world.rank // (tp * cp)

        def comm(ranks_of: list[list[int]]) -> Comm:
            """Each group of `ranks_of` created on every rank; this rank's as a Comm."""
            mine = None
            for ranks in ranks_of:
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine = group
            return Comm(mine, timeout_s=world.timeout_s)

        def world_rank(replica: int, shard: int, tp_index: int, cp_index: int = 0) -> int:
            return ((replica * S + shard) * cp + cp_index) * tp + tp_index

        mesh = cls(world=world, dp_shard=world, tp=None, tp_size=tp, tp_rank=t, kv_replicas=kv_replicas,
                   dp_replicate_size=dp_replicate, cp_size=cp, cp_rank=c)
        if tp > 1:
            mesh.tp = comm([[k * tp + i for i in range(tp)] for k in range(D * cp)])
        if tp > 1 or dp_replicate > 1:  # shard-major, CP inside: the shard group's rank is shard x cp + cp_index
            mesh.dp_shard = comm([[world_rank(r, s, i, j) for s in range(S) for j in range(cp)] for i in range(tp)
                                  for r in range(dp_replicate)])
        if cp > 1:
            mesh.cp = comm([[world_rank(r, s, i, j) for j in range(cp)] for i in range(tp) for r in range(dp_replicate)
                            for s in range(S)])
        if kv_replicas > 1:  # runs of consecutive ranks, within one TP group as tp divides
            mesh.kv = comm([list(range(first, first + kv_replicas)) for first in range(0, W, kv_replicas)])
        if ep > 1:
            # EP groups are E consecutive ranks of the shard group dp_shard x cp (index k = shard x cp + cp_index): as
            # torchtitan folds cp into the ranks EP borrows, so --cp 2 --ep 2 on 2 ranks is one EP group of the two
            # CP ranks, each routing its own part of the rows
            def shard_cp_rank(r: int, k: int, i: int) -> int:
                return world_rank(r, k // cp, i, k % cp)

            mesh.ep_size, mesh.ep_rank = ep, ((d % S) * cp + c) % ep
            mesh.ep = comm([[shard_cp_rank(r, first + e, i) for e in range(ep)] for i in range(tp)
                            for r in range(dp_replicate) for first in range(0, S * cp, ep)])
            mesh.dp_shard_mod_ep = comm([[shard_cp_rank(r, k, i) for k in range(e, S * cp, ep)] for i in range(tp)
                                         for r in range(dp_replicate) for e in range(ep)])
        if dp_replicate > 1:
            mesh.dp_replicate = comm([[world_rank(r, s, i, j) for r in range(dp_replicate)] for i in range(tp)
                                      for s in range(S) for j in range(cp)])
        return mesh

    def communicators(self) -> list[Comm]:
        """This rank's communicators, each once."""
        comms = (self.world, self.world.io, self.dp_shard, self.tp, self.kv, self.dp_replicate, self.ep,
                 self.dp_shard_mod_ep, self.cp)
        return list({id(c): c for c in comms if c is not None}.values())

    def set_step(self, step: int) -> None:
        """The optimizer step the loop is in, for every communicator's failure messages."""
        for comm in self.communicators():
            comm.step = step

    def counters(self) -> tuple[dict, dict]:
        """Calls and bytes by purpose, summed over this rank's communicators."""
        calls, nbytes = Counter(), Counter()
        for comm in self.communicators():
            calls.update(comm.calls)
            nbytes.update(comm.bytes)
        return dict(calls), dict(nbytes)
