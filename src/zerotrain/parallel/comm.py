"""Counted collectives: every torch.distributed call zerotrain makes, with calls and bytes per purpose.

The counts let tests assert "one reduce-scatter round and one all-gather round per optimizer step"
and let benchmarks report bytes on the wire. Bytes are what this rank sends under the ring
algorithm for the tensors actually passed: (W-1)/W of the buffer for reduce-scatter and all-gather,
2(W-1)/W for all-reduce, whichever torch calls implement the collective. Which torch calls run each
collective is chosen here, per backend, by measurement.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter

import torch
import torch.distributed as dist

from zerotrain.errors import ZeroTrainError

from . import collective_watchdog
from .comm_stream import CommStream, stream_api

# torch 2.13 renames the flat variants; older releases only have the *_tensor names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(ZeroTrainError):
    """A collective failed: a peer stopped answering within the timeout, or is gone (`peer_lost`)."""

    def __init__(self, message: str, peer_lost: bool):
        super().__init__(message)
        self.peer_lost = peer_lost


# NCCL's errors as ProcessGroupNCCL raises them at the rank's wait (launch.NCCL_ERRORS_AT_THE_CALL): its watchdog's
# timeout, "[PG ID 0 PG GUID 0(default_pg) Rank 1] Watchdog caught collective operation timeout: WorkNCCL(...) ran for
# 5003 milliseconds before timing out.", and NCCL's own errors, of which only ncclRemoteError ("remote process exited
# or there was a network error") is a peer's; the others (unhandled cuda error, system, internal) are this rank's.
_NCCL_PREFIX = re.compile(r"^\[(PG |Rank )[^\]]*\]\s*")
_PEER_GONE = ("remote process exited", "ncclremoteerror", "connection closed by peer", "connection reset by peer")


def collective_error(error: RuntimeError, where: str, timeout_s: float | None,
                     timeout_flag: str = "--timeout") -> CollectiveError:
    """The one line for a collective `where` that raised `error` (gloo's at the call, NCCL's from its watchdog at
    the wait): a timeout (a peer stopped answering), a peer gone (peer_lost), or on NCCL a failure of this rank's."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = _NCCL_PREFIX.sub("", text.split(" This is typically")[0])  # gloo appends generic advice, NCCL its group
    lower = text.lower()
    if "timed out" in lower or "timeout" in lower:
        bound = f" after {timeout_s:g} s" if timeout_s else ""
        return CollectiveError(f"{where} timed out{bound}: another rank stopped answering (hung, or slower than "
                               f"{timeout_flag} allows)", peer_lost=False)
    whole = str(error).lower()  # NCCL says a peer is gone on a later line ("Last error: ... remote peer")
    if "nccl" in lower and not any(sign in whole for sign in (*_PEER_GONE, "remote peer")):
        return CollectiveError(f"{where} failed on this rank ({text})", peer_lost=False)
    return CollectiveError(f"{where} failed: another rank is gone ({text})", peer_lost=True)


class _Works:
    """Several async collectives that together make one; `wait()` waits for all, then runs `then`."""

    def __init__(self, works: list, then=None, guard=None):
        self.works, self.then, self.guard = works, then, guard or contextlib.nullcontext

    def wait(self) -> None:
        with self.guard():
            for work in self.works:
                work.wait()
        self.works = []  # gloo work objects must not outlive the process group
        if self.then:
            self.then()
            self.then = None


def _finish(work, async_op: bool):
    """An async handle for async_op, else wait now (a synchronous torch call returns None). On NCCL the wait, with no
    timeout (never passed here), is the stream's, not the CPU's (docs/design.md, "The parallel package")."""
    if async_op:
        return work
    if work is not None:
        work.wait()
    return None


class Comm:
    """A process group plus call and byte counters keyed by purpose (e.g. "reduce_scatter_grads")."""

    def __init__(self, group=None, timeout_s: float | None = None, *, io: "Comm | None" = None,
                 timeout_flag: str = "--timeout"):
        self.group, self.timeout_s, self.timeout_flag = group, timeout_s, timeout_flag
        # The same ranks with a longer wait (--io-timeout), for the collectives that wait on checkpoint I/O:
        # one rank writing the model file or verifying while the others wait. This one when none was made.
        self.io = io if io is not None else self
        self.step = 0  # the optimizer step the loop is in, for failure messages
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        # NCCL moves only CUDA tensors; small metadata rows travel through the current device.
        cuda = self.backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self._tag = 0
        self._scratch_buffers: dict[tuple, torch.Tensor] = {}
        # The bucket collectives' stream (comm_stream.py): on CUDA their own, ordered by events; here the current one
        self.stream = CommStream(stream_api(self.device))

    def _count(self, purpose: str, nbytes: float) -> None:
        self.calls[purpose] += 1
        self.bytes[purpose] += int(nbytes)

    @contextlib.contextmanager
    def _guard(self, purpose: str):
        """Turn a collective's failure into one line naming this rank's step and the collective's purpose; where the
        CPU does not wait for it (NCCL), the rank's watchdog (collective_watchdog.py) says that line for a hang."""
        watchdog = collective_watchdog.installed()
        pending = watchdog.started(purpose, self.step, self.timeout_s, self.timeout_flag) if watchdog else None
        try:
            yield
        except RuntimeError as e:  # torch.distributed's errors derive from RuntimeError
            if watchdog:
                watchdog.failed(pending)
            if isinstance(e, ZeroTrainError):
                raise
            raise collective_error(e, f"collective {purpose} at step {self.step}", self.timeout_s,
                                   self.timeout_flag) from None
        if watchdog:
            watchdog.returned(pending)

    def _guarded(self, work, purpose: str, async_op: bool):
        """Wait now, or hand back an async handle whose wait is guarded."""
        if isinstance(work, _Works):
            work.guard = lambda: self._guard(purpose)
            return _finish(work, async_op)
        if async_op:
            return _Works([work] if work is not None else [], guard=lambda: self._guard(purpose))
        with self._guard(purpose):
            return _finish(work, False)

    def snapshot(self) -> tuple[Counter, Counter]:
        return Counter(self.calls), Counter(self.bytes)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, purpose: str, async_op=False):
        """Sum `input` (a flat bucket) over ranks; rank r receives chunk r of it in `output`: on CUDA on the
        communication stream (comm_stream.py), the handle's wait the compute stream's."""
        return self.stream.run(lambda is_async: self._reduce_scatter(output, input, purpose, is_async),
                               (output, input), async_op)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, purpose: str, async_op: bool):
        """reduce_scatter on the current stream.

        On gloo it runs point to point: every rank sends chunk k straight to its owner k and sums the
        W-1 chunks it receives with its own, in rank order. Each rank sends (W-1)/W of the bucket, as in
        a ring, in one round, where gloo's reduce-scatter and one reduce per chunk take several.
        """
        W = self.world_size
        self._count(purpose, input.numel() * input.element_size() * (W - 1) / W)
        if W == 1:  # the sum over one rank is its own values: nothing moves (nothing at all where they alias)
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _finish(_Works([]), async_op)
        if self.backend != "gloo":
            with self._guard(purpose):
                work = _reduce_scatter_flat(output, input, group=self.group, async_op=async_op)
            return self._guarded(work, purpose, async_op)
        chunks, me = input.chunk(W), self.rank
        peers = [k for k in range(W) if k != me]
        # The first peer's chunk lands in `output` itself; any others need room of their own.
        received = {peers[0]: output}
        received.update({k: self._scratch(output, i) for i, k in enumerate(peers[1:])})
        works = self._exchange({k: chunks[k] for k in peers}, received, purpose)

        def total():
            # received[peers[0]] + the rest in rank order: the sum in rank order, since a + b == b + a.
            for k in range(W):
                if k != peers[0]:
                    output.add_(chunks[me] if k == me else received[k])

        return self._guarded(_Works(works, then=total), purpose, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, purpose: str, async_op=False):
        """Concatenate every rank's `input` into `output`; `input` may be this rank's chunk of it: on CUDA on the
        communication stream (comm_stream.py), the handle's wait the compute stream's."""
        return self.stream.run(lambda is_async: self._all_gather(output, input, purpose, is_async),
                               (output, input), async_op)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor, purpose: str, async_op: bool):
        """all_gather on the current stream.

        On gloo it runs point to point: every rank sends its chunk to every other rank, which receives
        it in place, with no copy out of a staging buffer (gloo's all-gather) and no round per chunk.
        """
        W = self.world_size
        self._count(purpose, output.numel() * output.element_size() * (W - 1) / W)
        if self.backend != "gloo":
            with self._guard(purpose):
                work = _all_gather_flat(output, input, group=self.group, async_op=async_op)
            return self._guarded(work, purpose, async_op)
        chunks, me = output.chunk(W), self.rank
        if chunks[me].data_ptr() != input.data_ptr():
            chunks[me].copy_(input)
        peers = [k for k in range(W) if k != me]
        works = self._exchange({k: chunks[me] for k in peers}, {k: chunks[k] for k in peers}, purpose)
        return self._guarded(_Works(works), purpose, async_op)

    def _exchange(self, sends: dict, receives: dict, purpose: str) -> list:
        """Post every send, then every receive (peer -> tensor), under a fresh tag: concurrent collectives never match
        each other's messages."""
        self._tag = tag = (self._tag + 1) % 2**30
        with self._guard(purpose):
            return [dist.isend(t, group_dst=k, group=self.group, tag=tag) for k, t in sends.items()] + \
                [dist.irecv(t, group_src=k, group=self.group, tag=tag) for k, t in receives.items()]

    def _scratch(self, output: torch.Tensor, index: int) -> torch.Tensor:
        """Receive room for a reduce-scatter with W > 2, made once per output buffer (keyed by its memory, so buckets
        in flight together never share it) and reused."""
        key = (output.data_ptr(), output.numel(), output.dtype, index)
        buf = self._scratch_buffers.get(key)
        if buf is None:
            buf = self._scratch_buffers[key] = torch.empty_like(output)
        return buf

    def all_to_all(self, input: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   purpose: str) -> torch.Tensor:
        """Rows of `input` to every rank (in_splits[k] rows to rank k, in rank order), and theirs back: out_splits[k]
        rows from rank k, in rank order. Bytes counted: the rows sent to other ranks."""
        row = input.shape[1:].numel() * input.element_size()  # a rank may send no rows at all
        self._count(purpose, row * (sum(in_splits) - in_splits[self.rank]))
        output = input.new_empty((sum(out_splits), *input.shape[1:]))
        with self._guard(purpose):
            dist.all_to_all_single(output, input, out_splits, in_splits, group=self.group)
        return output

    def all_reduce(self, tensor: torch.Tensor, purpose: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        W = self.world_size
        self._count(purpose, tensor.numel() * tensor.element_size() * 2 * (W - 1) / W)
        with self._guard(purpose):
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int, purpose: str) -> torch.Tensor:
        self._count(purpose, tensor.numel() * tensor.element_size() if self.rank == src else 0)
        with self._guard(purpose):
            dist.broadcast(tensor, group_src=src, group=self.group)  # src: a rank of this group
        return tensor

    def all_gather_rows(self, row: torch.Tensor, purpose: str) -> torch.Tensor:
        """Stack one small tensor from every rank into a (world_size, *row.shape) CPU tensor."""
        row = row.to(self.device)
        out = torch.empty((self.world_size, *row.shape), dtype=row.dtype, device=self.device)
        self.all_gather(out.view(-1), row.reshape(-1), purpose)
        return out.cpu()

    def all_gather_json(self, obj, purpose: str) -> list:
        """Small JSON metadata (file names, sizes, hashes) from every rank; JSON, never pickle."""
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        sizes = self.all_gather_rows(torch.tensor([data.numel()]), purpose)
        padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        padded[: data.numel()] = data
        rows = self.all_gather_rows(padded, purpose)
        return [json.loads(bytes(rows[r, : int(sizes[r])].tolist())) for r in range(self.world_size)]

    def barrier(self, purpose: str) -> None:
        self._count(purpose, 0)
        with self._guard(purpose):
            dist.barrier(group=self.group)
