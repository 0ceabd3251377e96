"""Context parallelism with a mixture of experts (--cp 2 with and without --ep 2): each row split over 2 ranks trains
as one rank holding the whole rows does, its balancing loss the whole row's (the routing counts of every part)."""

from __future__ import annotations

import functools

import cp_jobs
import dist_jobs
import pytest
from conftest import tiny_config
from test_hsdp import worst_gap
from test_packing import make_records, write_records

from zerotrain.config import apply_preset, resolve, validate

STEPS, SEQ = 3, 64
LIMIT = 900
pytestmark = pytest.mark.timeout(3 * LIMIT)


def config(tmp, name, data, nproc, zero=1, cp=1, ep=1, **run):
    """The tiny Qwen3-MoE (2 layers of 8 experts, top-2) on packed records of several lengths in rows of 64; a global
    batch of 4 rows (2 micro-batches of 2); the balancing loss weighted 0.1 (its gradient moves the routers); every
    step clipped, invariant (b) every step."""
    cfg = tiny_config(tmp / name, nproc=nproc, zero=zero, micro=2, accum=2,
                      **{"steps": STEPS, "threads": 1, "check_every": 1, **run})
    apply_preset(cfg, "qwen3-moe-tiny")
    cfg.data.source, cfg.model.vocab_size, cfg.model.seq_len = str(data), 256, SEQ
    cfg.model.n_experts, cfg.objective.moe_aux_coef = 8, 0.1
    cfg.parallel.cp, cfg.parallel.ep = cp, ep
    cfg.optim.grad_clip = 0.5
    return resolve(validate(cfg))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each job's rank-0 result by name: one start of 2 ranks (--cp 2 --ep 2, --cp 2, the planted one), one of 1 (the
    references)."""
    tmp = tmp_path_factory.mktemp("cpmoe")
    data = write_records(tmp / "data", make_records(400))  # 4 records a row on average, of 5 to 18 tokens
    out = {}

    start = functools.partial(dist_jobs.run_in_turn, out, time_limit=LIMIT)

    job = cp_jobs.moe_trained_job
    start({"cp2 ep2": (job, config(tmp, "cp2-ep2", data, 2, cp=2, ep=2)),
           "cp2 ep2 z3": (job, config(tmp, "cp2-ep2-z3", data, 2, zero=3, cp=2, ep=2)),
           "cp2": (job, config(tmp, "cp2", data, 2, cp=2)),
           "per chunk": (cp_jobs.per_chunk_balancing_job, config(tmp, "per-chunk", data, 2, cp=2, ep=2))})
    start({"cp1": (job, config(tmp, "cp1", data, 1))})
    return out


def relative_gaps(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


def test_a_mixture_at_cp2_ep2_trains_as_one_rank_with_the_whole_rows_and_a_balancing_loss_per_chunk_is_caught(runs):
    # 2 ranks, each row's two zig-zag halves on the two ranks, which are also the EP group (each holds 4 of the 8
    # experts): losses and gradient norms within 1e-6 relative of one rank's over 3 clipped steps, final weights
    # within 1e-5, at ZeRO 1 and 3 (one rank's reference at ZeRO-1 for both: at one rank they train bitwise alike,
    # measured); and with the experts whole on each rank (--cp 2 alone). Measured: 1.8e-7 at most
    for mine, theirs in (("cp2 ep2", "cp1"), ("cp2 ep2 z3", "cp1"), ("cp2", "cp1")):
        assert max(relative_gaps(runs[mine]["losses"], runs[theirs]["losses"])) < 1e-6, mine
        assert worst_gap(runs[mine], runs[theirs]) < 1e-5, mine
        # the balancing loss (each row's, over all its tokens) and the expert loads are the whole rows'
        assert max(relative_gaps(runs[mine]["aux_losses"], runs[theirs]["aux_losses"])) < 1e-6, mine
        assert runs[mine]["expert_loads"] == runs[theirs]["expert_loads"], mine
    # (invariant (b) was checked at every step: the dense replicas the same bits, each expert block on its EP rank)
    # planted: each CP rank's balancing loss over its own half of the row (f, T and the trained rows its own): the
    # balancing losses 1.0 off, the losses 3.8e-2
    planted = runs["per chunk"]
    assert max(relative_gaps(planted["aux_losses"], runs["cp1"]["aux_losses"])) > 1e-3
    assert max(relative_gaps(planted["losses"], runs["cp1"]["losses"])) > 1e-5


def ep_groups(world: int, monkeypatch, **degrees) -> dict[int, tuple]:
    """Each world rank's (EP group, dp_shard_mod_ep group, cp group) as Mesh.build makes them (the groups recorded,
    not created)."""
    from types import SimpleNamespace

    from zerotrain.parallel import mesh as mesh_module

    monkeypatch.setattr(mesh_module.dist, "new_group", lambda ranks, timeout=None: tuple(ranks))
    monkeypatch.setattr(mesh_module, "Comm", lambda group, timeout_s=None: group)
    built = {r: mesh_module.Mesh.build(SimpleNamespace(world_size=world, rank=r, timeout_s=None), **degrees)
             for r in range(world)}
    return {r: (m.ep, m.dp_shard_mod_ep, m.cp, m.ep_rank) for r, m in built.items()}


def test_expert_groups_are_consecutive_ranks_of_dp_shard_x_cp(monkeypatch):
    # 2 ranks, --cp 2 --ep 2: the one EP group is the CP pair, each its own expert block, nobody to shard them with
    assert ep_groups(2, monkeypatch, cp=2, ep=2) == {0: ((0, 1), (0,), (0, 1), 0), 1: ((0, 1), (1,), (0, 1), 1)}
    # 8 ranks, --tp 2 --cp 2 --ep 2 (world rank = (shard x 2 + cp_index) x 2 + tp_index): per TP index, EP groups of
    # a shard's 2 CP ranks; the ranks holding the same experts are the other shard's, at the same CP index
    groups = ep_groups(8, monkeypatch, tp=2, cp=2, ep=2)
    assert [groups[r][0] for r in range(8)] == [(0, 2), (1, 3), (0, 2), (1, 3), (4, 6), (5, 7), (4, 6), (5, 7)]
    assert [groups[r][1] for r in range(8)] == [(0, 4), (1, 5), (2, 6), (3, 7), (0, 4), (1, 5), (2, 6), (3, 7)]
    # --cp 2 --ep 4 on 4 ranks: EP borrows both shards' CP ranks (ep = 4 consecutive ranks of dp_shard x cp)
    groups = ep_groups(4, monkeypatch, cp=2, ep=4)
    assert [groups[r][0] for r in range(4)] == [(0, 1, 2, 3)] * 4 and [groups[r][3] for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="the shard group's size 1 x cp 2 is not divisible by ep 4"):
        ep_groups(2, monkeypatch, cp=2, ep=4)
