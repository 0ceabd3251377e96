"""The out-of-memory line recommends --zero 2 only where stage 2 holds less than stage 1, by the plan's own rows."""

import pytest
from conftest import tiny_config

from zerotrain.training import memory_plan as mp


def gradient_bytes(cfg) -> int:
    """The plan's gradient bytes at the peak of a step: held between steps plus the buckets in flight."""
    rows = mp.memory_plan(cfg).rows
    return rows["gradients"] + rows["gradient_buckets"]


@pytest.mark.parametrize("nproc, accum", [(2, 1), (2, 4), (1, 1)])
def test_zero_2_is_recommended_exactly_where_its_plan_holds_fewer_gradient_bytes(tmp_path, nproc, accum):
    cfg = tiny_config(tmp_path, nproc=nproc, micro=2, accum=accum)
    stage2 = tiny_config(tmp_path, nproc=nproc, micro=2, accum=accum, zero=2)
    saves = gradient_bytes(stage2) < gradient_bytes(cfg)
    assert saves == (accum == 1 and nproc > 1)  # what the hint below must follow
    line = mp.out_of_memory(mp.memory_plan(cfg), cfg, 3, MemoryError("out of memory"))
    assert line.startswith("out of memory in step 3 (out of memory); the plan for this run is ")
    assert ("--zero 2" in line) == saves, line
    assert "--activation-checkpointing full" in line  # the other hints stay

