"""Ring attention at C ranks (gloo, one process each) against one process attending over the whole row: the time of a
forward and backward, and the most bytes of tensors a rank holds at once during them (its inputs included).

    PYTHONPATH=src python scripts/bench_ring_attention.py --seq-len 4096 --cp 2 [--packed] [--explicit]

Bytes are counted by a dispatch mode: every tensor an aten op makes is counted from its creation until it is freed
(kernels' internal scratch is not seen). Timings: the median of --repeats after one warm-up, 1 thread per process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from zerotrain.model.attention import attend, document_mask
from zerotrain.parallel import ring_attention as ring
from zerotrain.parallel.ring_attention import gather_segments, ring_attention, zigzag_split


class HeldBytes(TorchDispatchMode):
    """Bytes of the live storages that ops made while the mode is on, and their most at once: a storage is counted
    from the op that made it until the last tensor an op returned on it (views included) is freed."""

    def __init__(self, start: int = 0):
        super().__init__()
        self.now = self.peak = start
        self.users: dict[int, int] = {}  # storage -> live tensors on it
        self.made: set[int] = set()  # storages made under the mode (not the inputs')

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or not t.untyped_storage().nbytes():
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.users and ptr not in inputs:
                self.made.add(ptr)
                self.now += t.untyped_storage().nbytes()
                self.peak = max(self.peak, self.now)
            if ptr in self.made:
                self.users[ptr] = self.users.get(ptr, 0) + 1
                weakref.finalize(t, self._drop, ptr, t.untyped_storage().nbytes())
        return out

    def _drop(self, ptr: int, n: int) -> None:
        self.users[ptr] -= 1
        if not self.users[ptr]:
            del self.users[ptr]
            self.made.discard(ptr)
            self.now -= n


def tensors(args, rank: int | None):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, args.seq_len, args.head_dim, generator=g) for h in (args.heads, args.kv_heads,
                                                                                       args.kv_heads))
    lengths = torch.full((args.seq_len // 512,), 512)  # records of 512 tokens
    segments = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None]
    if rank is not None:
        q, k, v = (zigzag_split(t, args.cp, rank, dim=2) for t in (q, k, v))
        segments = zigzag_split(segments, args.cp, rank)
    return [t.requires_grad_() for t in (q, k, v)], segments


def measure(args, step) -> dict:
    times = []
    for i in range(args.repeats + 1):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        step()
        if i:
            times.append(time.perf_counter() - start)
    (q, k, v), _ = args.inputs
    counted = HeldBytes(sum(t.numel() * t.element_size() for t in (q, k, v)))
    with counted:
        step()
    return {"seconds": statistics.median(times), "peak_bytes": counted.peak}


def single(args) -> dict:
    args.inputs = tensors(args, None)
    (q, k, v), segments = args.inputs

    def step():
        documents = document_mask(segments, q.dtype) if args.packed else None
        attend(q, k, v, documents=documents).sum().backward()
    return measure(args, step)


def rank_main(rank: int, args, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.cp)
    args.inputs = tensors(args, rank)
    (q, k, v), segments = args.inputs

    def step():
        documents = gather_segments(segments) if args.packed else None
        ring_attention(q, k, v, documents=documents).sum().backward()
    result = measure(args, step)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--packed", action="store_true", help="records of 512 tokens (document masks)")
    p.add_argument("--explicit", action="store_true", help="the hops' scores as tensors, not the fused CPU kernel")
    args = p.parse_args(argv)
    if args.explicit:
        ring.hop_kernel = lambda device: "explicit"
    torch.set_num_threads(1)
    one = single(args)
    folder = tempfile.mkdtemp()
    mp.start_processes(rank_main, (args, os.path.join(folder, "store"), os.path.join(folder, "out")),
                       nprocs=args.cp, start_method="fork")
    ranks = [json.load(open(os.path.join(folder, f"out.{r}"))) for r in range(args.cp)]
    print(json.dumps({"seq_len": args.seq_len, "packed": args.packed, "explicit": args.explicit, "single": one,
                      f"ring, {args.cp} ranks": {"seconds": max(r["seconds"] for r in ranks),
                                                 "peak_bytes": max(r["peak_bytes"] for r in ranks)}}))


if __name__ == "__main__":
    sys.exit(main())
