"""A CPU rank's freed tensors go back to the operating system: glibc's malloc serves large blocks from mmap.

glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB), so the blocks that follow
come from the heap, whose freed middle is never returned. ZeRO-3 frees and re-allocates every unit's parameters and
gradients each step, and the heap kept them: a 296M Llama on 4 CPU ranks at ZeRO-3 peaked at 2.3-2.97 GiB per rank
(the ranks differing by up to 650 MiB from run to run) against 2.22 GiB on every rank with the threshold held at
1 MiB; ZeRO-1 4.02 GiB either way. A fixed threshold (mallopt) also ends the dynamic raising.
The threshold is held where the parameters' placement gathers units (stage 3: launch._rank). At stages 1 and 2
every buffer is allocated once and the heap keeps what a step frees for the next step, where each block taken from
mmap is new memory to fault in: a SmolLM-135M step on one CPU rank (ZeRO-1, 128 tokens, one thread; alternated
rounds on a shared machine) spent 0.12-0.16 s of system time with glibc's default, 0.54 s with the threshold held at
1 MiB, 0.87-1.05 s with huge pages asked for too, for the same peak (2-rank ZeRO-1 runs: 2,512 MiB per rank against
2,488).
A MALLOC_MMAP_THRESHOLD_ the user set is left as it is.

Every block malloc takes from mmap is new memory, faulted in 4 KiB at a time: a GPT-2 124M step on one CPU rank
took 180,000 page faults (0.34-0.38 s of system time in a 1.9 s step). Where the kernel gives transparent huge
pages on request (`madvise`, as most distributions), the local launcher's ranks start with glibc asking for them
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`): 20,000-25,000 faults and 0.19-0.21 s, peak resident memory within
5 MiB. glibc reads its tunables when a process starts, so the setting goes to the process the ranks fork from
(rank_start.py), not to the launcher; under torchrun it is the user's to export. A GLIBC_TUNABLES the user set
is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
LARGE_BLOCK_BYTES = 1 << 20
HUGE_PAGES_ON_REQUEST = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def return_large_blocks_to_os() -> bool:
    """Hold glibc's mmap threshold at 1 MiB in this process; False where that is not glibc or the user chose."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt to speak of), or no libc found
        return False


def rank_allocator(gathers_units: bool) -> bool:
    """A rank's malloc for where its parameters live: large blocks back to the OS where its placement frees and
    gathers units every step (sharded.ShardedParameters), glibc's default where every buffer is allocated once."""
    return return_large_blocks_to_os() if gathers_units else False


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode (always, madvise or never; "" where there is none to read)."""
    try:
        with open(THP_MODE) as f:
            modes = f.read().split()
    except OSError:
        return ""
    return next((m.strip("[]") for m in modes if m.startswith("[")), "")


def huge_pages_environment() -> dict[str, str]:
    """What a rank's process needs in its environment at its start for malloc to ask for huge pages: nothing where
    the kernel gives them anyway or never, or where the user set GLIBC_TUNABLES."""
    if not sys.platform.startswith("linux") or "GLIBC_TUNABLES" in os.environ or transparent_huge_pages() != "madvise":
        return {}
    return dict(HUGE_PAGES_ON_REQUEST)
