"""The invariants every run checks: no cross-rank drift (b) and ZeRO-1 memory (c); where (a) and (d) live.

(a) Every rank's loss is finite: each rank's flag travels in the step's all-reduce (control.reduce_step)
and the guard refuses the update before the optimizer runs (guard.AnomalyDetector, InvariantError on abort).
(d) Every checkpoint file reads back byte-equal: the checkpoint writer checks it before the commit
(checkpoint/save.py, read_back_check).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ZeroTrainError
from .parallel import Comm


class InvariantError(ZeroTrainError):
    pass


def gather_digests(digest: bytes, comm: Comm) -> list[str]:
    row = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    rows = comm.all_gather_rows(row, "all_gather_digests")
    return [bytes(rows[r].tolist()).hex() for r in range(comm.world_size)]


def check_no_drift(step: int, digest: bytes, comm: Comm) -> list[str]:
    """(b) The parameter buffers of all ranks are bitwise identical (sha256 of the bytes)."""
    digests = gather_digests(digest, comm)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise InvariantError(
            f"invariant (b) failed: parameters of rank(s) {differ} differ from rank 0 at step {step}"
        )
    return digests


@dataclass
class MemoryReport:
    per_rank: list[int]  # optimizer-state bytes measured on each rank
    expected: int  # the ZeRO-1 formula for one rank
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


def check_memory(engine, comm: Comm) -> MemoryReport:
    """(c) Optimizer state held per rank equals the ZeRO-1 formula (bytes per owned value x shard size)."""
    measured = held_bytes(engine.optimizer_state_tensors(), exclude=[engine.flat_params])
    per_rank = comm.all_gather_rows(torch.tensor([measured], dtype=torch.int64), "all_gather_memory")
    report = MemoryReport(
        per_rank=[int(v) for v in per_rank.view(-1).tolist()],
        expected=engine.expected_state_bytes_per_value() * engine.layout.shard_numel,
        bytes_per_value=engine.expected_state_bytes_per_value(),
        shard_numel=engine.layout.shard_numel,
    )
    wrong = [r for r, v in enumerate(report.per_rank) if v != report.expected]
    if wrong:
        raise InvariantError(
            f"invariant (c) failed: optimizer state on rank(s) {wrong} is "
            f"{[report.per_rank[r] for r in wrong]} bytes, ZeRO-1 expects {report.expected} "
            f"({report.bytes_per_value} x {report.shard_numel})"
        )
    return report
