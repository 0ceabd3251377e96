"""A rank's freed large blocks go back to the OS (runtime/allocator.py), where glibc's heap would keep them."""

import subprocess
import sys

from zerotrain.runtime.allocator import return_large_blocks_to_os

# Fresh processes (the threshold is process-wide): a 2 MiB block freed (glibc raises its threshold to 2 MiB), then
# 32 blocks of 2 MiB, all freed but the newest, which pins the heap's top. What the process still holds is printed.
HELD_AFTER_FREEING = """
import sys
from zerotrain.runtime import allocator
applied = allocator.return_large_blocks_to_os() if sys.argv[1] == "fixed" else False
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
first = bytearray(2 << 20); del first
before = rss_mib()
blocks = [bytearray(2 << 20) for _ in range(32)]
del blocks[:-1]
print(applied, rss_mib() - before)
"""


def held_after_freeing(arm: str) -> tuple[bool, float]:
    out = subprocess.run([sys.executable, "-c", HELD_AFTER_FREEING, arm], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    return out[0] == "True", float(out[1])


def test_freed_large_blocks_leave_the_process_and_glibcs_default_keeps_them():
    applied, held = held_after_freeing("fixed")
    assert applied
    assert held < 8, held  # the one block kept (2 MiB), not the 31 freed
    applied, held = held_after_freeing("default")  # planted: the threshold left to glibc
    assert not applied
    assert held > 40, held  # glibc's heap kept the freed blocks


def test_a_threshold_the_user_set_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert return_large_blocks_to_os() is False
