"""The invariants every run checks: no cross-rank drift (b) and the sharded optimizer state's memory (c); where (a)
and (d) live.

(a) Every rank's loss is finite: each rank's flag travels in the step's all-reduce (control.reduce_step)
and the guard refuses the update before the optimizer runs (guard.AnomalyDetector, InvariantError on abort).
(d) Every checkpoint file is the bytes written: the writer takes each file's sha256 from the bytes as it writes
them (checkpoint/stream.py), and every reader checks what it reads against the manifest's (a load, a reshard,
`zerotrain verify`; the demo verifies each checkpoint it saved).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerotrain.errors import InvariantError
from zerotrain.parallel import Comm, Mesh
from zerotrain.parallel.digest import digest_hex


def check_no_drift(step: int, digests: torch.Tensor, mesh: Mesh) -> list[str]:
    """(b) Replicated parameters are bitwise equal on every rank, each TP slice across its DP group, and a KV head
    on several TP ranks across its KV group; with expert parallelism, each rank's experts across the ranks holding
    the same ones.

    `digests` is this rank's engine.param_digests() (rows: replicated, sliced, and with KV groups the KV heads'
    slices; with --ep two more, last: the experts' replicated values and their TP slices); only these few bytes per
    rank travel. Returns each rank's digests as hex, rank order.
    """
    rows = mesh.world.all_gather_rows(digests.to(torch.int64), "all_gather_digests")
    T = mesh.tp_size
    replicated = [r for r in range(len(rows)) if not torch.equal(rows[r, 0], rows[0, 0])]
    # Rank t (DP index 0) holds TP slice t; every rank d*T + t must hold the same values.
    sliced = [r for r in range(len(rows)) if not torch.equal(rows[r, 1], rows[r % T, 1])]
    if replicated:
        what = "replicated parameters" if T > 1 else "parameters"
        raise InvariantError(f"invariant (b) failed: {what} of rank(s) {replicated} differ from rank 0 at step {step}")
    if sliced:
        raise InvariantError(f"invariant (b) failed: the TP slices of rank(s) {sliced} differ from their DP group's "
                             f"first rank ({sorted({r % T for r in sliced})}) at step {step}")
    E = mesh.ep_size
    if E > 1:
        # World rank r = d T + t holds EP rank (d mod E)'s experts, TP slice t: the same as rank (d mod E) T + t, the
        # first of its replica group at its TP index; their replicated values (gpt-oss's down biases; without TP,
        # every expert value) as rank (d mod E) T, its EP rank's first rank.
        first = [((r // T) % E) * T for r in range(len(rows))]
        for row, ref, what in ((-2, first, "replicated values"), (-1, [f + r % T for r, f in enumerate(first)],
                                                                  "TP slices")):
            experts = [r for r in range(len(rows)) if not torch.equal(rows[r, row], rows[ref[r], row])]
            if experts:
                what = "experts" if T == 1 else f"experts' {what}"
                raise InvariantError(f"invariant (b) failed: the {what} of rank(s) {experts} differ from those of "
                                     f"rank(s) {sorted({ref[r] for r in experts})}, which hold the same experts, at "
                                     f"step {step}")
    # A KV group is a run of kv_replicas consecutive ranks of one TP group; its first rank is the reference.
    R = mesh.kv_replicas
    shared = [r for r in range(len(rows)) if R > 1 and not torch.equal(rows[r, 2], rows[r - r % R, 2])]
    if shared:
        raise InvariantError(f"invariant (b) failed: the KV heads of rank(s) {shared} differ from their KV group's "
                             f"first rank ({sorted({r - r % R for r in shared})}) at step {step}")
    return [digest_hex(rows[r].reshape(-1)) for r in range(len(rows))]


@dataclass
class MemoryReport:
    per_rank: list[int]  # optimizer-state bytes measured on each rank
    expected: int  # the sharded optimizer state's formula for one rank (the same at every ZeRO stage)
    bytes_per_value: int
    shard_numel: int

    @property
    def max(self) -> int:
        return max(self.per_rank)

    @property
    def mean(self) -> float:
        return sum(self.per_rank) / len(self.per_rank)


def held_bytes(tensors: list[torch.Tensor], exclude: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`, leaving out those that back `exclude`.

    Measured from the storages themselves: a view costs nothing extra, a copy is counted.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in excluded:
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def check_memory(engine, comm: Comm, step: int = 0) -> MemoryReport:
    """(c) Optimizer state held per rank equals its share's formula (bytes per owned value x shard size), at every
    ZeRO stage: each shards the optimizer state as stage 1 does.

    Measured from the storages behind the optimizer's own state tensors, so it is checked again after
    updates (every --check-every steps and at the end): state AdamW allocates later is counted then.
    """
    measured = held_bytes(engine.optimizer_state_tensors(), exclude=engine.flat_buffers)
    per_rank = comm.all_gather_rows(torch.tensor([measured], dtype=torch.int64), "all_gather_memory")
    report = MemoryReport(
        per_rank=[int(v) for v in per_rank.view(-1).tolist()],
        expected=engine.expected_state_bytes(),
        bytes_per_value=engine.adamw.state_bytes_per_value,
        shard_numel=engine.layout.shard_numel,
    )
    wrong = [r for r, v in enumerate(report.per_rank) if v != report.expected]
    if wrong:
        raise InvariantError(
            f"invariant (c) failed at step {step}: optimizer state on rank(s) {wrong} is "
            f"{[report.per_rank[r] for r in wrong]} bytes, the ZeRO formula expects {report.expected} "
            f"({report.bytes_per_value} x {report.shard_numel})"
        )
    return report
