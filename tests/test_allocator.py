"""A rank's freed large blocks go back to the OS, and its new ones come in huge pages (runtime/allocator.py)."""

import os
import subprocess
import sys

from zerotrain.runtime import allocator
from zerotrain.runtime.allocator import return_large_blocks_to_os

# Fresh processes (the threshold is process-wide): a 2 MiB block freed (glibc raises its threshold to 2 MiB), then
# 32 blocks of 2 MiB, all freed but the newest, which pins the heap's top. What the process still holds is printed.
# Only the stage arms import the placements (and torch with them, 2-3 s a process): allocator.py imports no torch.
HELD_AFTER_FREEING = """
import sys
from zerotrain.runtime import allocator
arm = sys.argv[1]
if arm.startswith("stage"):  # as launch._rank asks: the run's parameter placement
    from zerotrain.config import Config
    from zerotrain.parallel.parts import parts_for
    cfg = Config()
    cfg.parallel.zero = int(arm[-1])
    applied = allocator.rank_allocator(parts_for(cfg).placement.gathers_units)
else:
    applied = allocator.return_large_blocks_to_os() if arm == "fixed" else False
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


def test_a_rank_holds_the_threshold_at_stage_3_only():
    """launch._rank's choice: stage 3 frees and gathers its units every step (the heap would keep them); at stages 1
    and 2 the heap's blocks serve the next step without new page faults."""
    applied, held = held_after_freeing("stage3")
    assert applied and held < 8, held
    applied, held = held_after_freeing("stage1")
    assert not applied and held > 40, held


def test_a_threshold_the_user_set_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert return_large_blocks_to_os() is False


# A process forked from the server the local launcher's ranks fork from (rank_start.start_server) touches 64 MiB
# and prints how much of what it holds is in huge pages, and the launcher's GLIBC_TUNABLES after the start.
RANK_MODULE = """
def huge_mib(queue):
    block = bytearray(64 << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    with open("/proc/self/smaps_rollup") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
    queue.put(kib / 1024)
"""
HUGE_IN_A_RANK = """
import multiprocessing, os, sys
from zerotrain.runtime import rank_start
import touch
rank_start.PRELOAD = []  # what the server imports is not the point here: torch stays out (3 s of CPU)
if sys.argv[1] == "planted":
    rank_start.huge_pages_environment = lambda: {}
rank_start.start_server()
ctx = multiprocessing.get_context(rank_start.START_METHOD)
queue = ctx.Queue()
p = ctx.Process(target=touch.huge_mib, args=(queue,))
p.start()
print(queue.get(timeout=60), os.environ.get("GLIBC_TUNABLES"))
p.join(60)
"""


def huge_mib_in_a_rank(tmp_path, arm: str) -> tuple[float, str]:
    (tmp_path / "touch.py").write_text(RANK_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    out = subprocess.run([sys.executable, "-c", HUGE_IN_A_RANK, arm], capture_output=True, text=True, timeout=120,
                         env=env, check=True).stdout.split()
    return float(out[0]), out[1]


def test_ranks_ask_for_huge_pages_where_the_kernel_gives_them_on_request_and_the_launcher_keeps_its_environment(
        tmp_path, monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    if allocator.transparent_huge_pages() != "madvise":
        assert allocator.huge_pages_environment() == {}  # the kernel gives them always, or never: nothing to ask
        return
    assert allocator.huge_pages_environment() == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    huge, launchers = huge_mib_in_a_rank(tmp_path, "product")
    assert huge >= 32, huge
    assert launchers == "None"  # set for the server's start only
    huge, _ = huge_mib_in_a_rank(tmp_path, "planted")  # planted: the server started without asking
    assert huge < 8, huge


def test_tunables_the_user_set_are_left_alone(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert allocator.huge_pages_environment() == {}
