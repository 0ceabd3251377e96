"""A CPU rank's freed tensors go back to the operating system: glibc's malloc serves large blocks from mmap.

glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB), so the blocks that follow
come from the heap, whose freed middle is never returned. ZeRO-3 frees and re-allocates every unit's parameters and
gradients each step, and the heap kept them: a 296M Llama on 4 CPU ranks at ZeRO-3 peaked at 2.3-2.97 GiB per rank
(the ranks differing by up to 650 MiB from run to run) against 2.22 GiB on every rank with the threshold held at
1 MiB; ZeRO-1 4.02 GiB either way. A fixed threshold (mallopt) also ends the dynamic raising.
A MALLOC_MMAP_THRESHOLD_ the user set is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
LARGE_BLOCK_BYTES = 1 << 20


def return_large_blocks_to_os() -> bool:
    """Hold glibc's mmap threshold at 1 MiB in this process; False where that is not glibc or the user chose."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt to speak of), or no libc found
        return False
