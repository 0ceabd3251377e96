"""Expert parallelism at ZeRO-3 (--ep E --zero 3) trains what --ep 1 trains, resumes bitwise, exports, and holds what
the memory plan says.

One 4-rank job of the tiny Qwen3-MoE with 8 experts (top-2), 3 steps, on the same global batch: --ep 1, 2 and 4 at
ZeRO-3 and --ep 1 at ZeRO-1. Losses agree within 1e-6 (relative) and the final weights (read from the checkpoints)
within 1e-5. An --ep 2 run saved at step 2 and resumed ends bitwise where the uninterrupted run does, and its export
reads in transformers with zerotrain's logits. Planted in the product's path and caught:
  - the experts' engine over the wrong group (the EP group, whose ranks hold other experts, in place of the replica
    group): the losses and the weights leave --ep 1's, and invariant (b) names the experts;
  - the experts' engine keeping a block's experts whole after the block's forward (release_unit): the run holds more
    parameters at once than the memory plan (strict under the tests) allows.
The memory plan's expert rows are each rank's expert bytes (summary.json's) exactly at --ep 1, 2 and 4, and the io
plan's start-up draws (each rank's owned values of its dense share and of its block of experts) and saves are each
rank's counters exactly; an expert layout planned over every DP rank instead of the replica group is caught.
And a rank whose experts get no rows at all (ranks 2 and 3 route no token to experts 4-7, so rank 3, EP rank 1 of
its group, computes nothing, while its replica, rank 1, does) trains what --ep 1 does under the same routing: every
member of a replica group gathers a block's experts for the backward, and reduces their gradients, at the same
point. Planted: the MoE layer's backward hook left out (the experts gathered at the first expert weight the backward
unpacks, reduced where a gradient arrives), the replica group's collectives part ways and the run fails.
Those runs use buckets of 0.01 MiB (several per block, the experts of a block in several), at ZeRO-3 with --ep 1 and 2
and at ZeRO-2 with --ep 2 (step, and --grad-reduce micro-batch at --accum 2): each trains what ZeRO-1 does under the
same routing (losses within 1e-6), the reduce-scatters starting where sharded.py's schedule says on every rank. Planted:
each bucket launched where its last expected gradient arrives (stage 3's gate and the units' end points left out),
a bucket that no gradient reaches on ranks 2 and 3 goes out at another point among the gathers there, and gloo aborts.
"""

from __future__ import annotations

import datetime
import json

import pytest
import torch
import torch.distributed as dist
from test_checkpoint import spawn
from test_expert_parallel import close, config, export_tensors

from zerotrain.errors import InvariantError
from zerotrain.model import moe
from zerotrain.parallel import Comm, GradientReducer, Mesh, ZeroEngine, experts
from zerotrain.parallel.sharded import ShardedParameters
from zerotrain.checkpoint.stream import bytes_counted
from zerotrain.training import memory_plan
from zerotrain.training.io_plan import differences, io_plan
from zerotrain.training.loop import train

pytestmark = pytest.mark.timeout(300)

STEPS = 3
SAVED = 2  # the --ep 2 run's first checkpoint: resumed from, and the wrong group's run compared with it
# Buckets of 2,621 values: a block (27,984 parameters, 24,576 of them its 8 experts) spans several, so that each unit
# gathers and releases buckets of its own (at the default 4 MiB each engine's parameters are one bucket)
ZERO3 = ("--steps", str(STEPS), "--zero", "3", "--bucket-mb", "0.01")
# The runs where some experts get no rows on some ranks, with several buckets per block: a bucket that no gradient
# reaches on one rank and some do on another is reduce-scattered at the same point among the units' gathers on both
# (sharded.py's schedule); launched where its last gradient arrives instead, the DP group's messages part ways.
NO_ROWS = ("--steps", "2", "--bucket-mb", "0.01")


def run(comm, out, *flags) -> dict:
    before = bytes_counted()["checkpoint_bytes_written"]  # this process's, over the job's runs
    result = train(config(out, *ZERO3, *flags), comm, announce=False)
    return {"losses": [r["loss"] for r in result.records], "expert_bytes": result.per_rank.get("expert_bytes"),
            "param_peak_bytes": result.per_rank.get("param_peak_bytes"), "flags": (*ZERO3, *flags),
            "drawn": result.per_rank["init_values_drawn"], "saves": len(result.checkpoints),
            "written": result.per_rank["checkpoint_bytes_written"][comm.rank] - before}


def failed(comm, out, *flags) -> dict:
    """A run expected to raise: what it said, and the losses its metrics logged before."""
    try:
        train(config(out, *ZERO3, *flags), comm, announce=False)
        said = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        said = f"{type(e).__name__}: {e}"
    metrics = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {"said": said, "losses": [r["loss"] for r in records if "event" not in r and "loss" in r]}


def masked_routing(rank: int):
    """Ranks 2 and 3 route none of their tokens to experts 4-7 (their gate's logits for them pushed down)."""
    real = moe.MoE.route

    def route(self, flat, B, T):
        if rank >= 2 and not hasattr(self, "masked"):
            self.masked = self.gate.register_forward_hook(
                lambda _m, _a, out: out.index_fill(-1, torch.arange(4, 8, device=out.device), -30.0))
        return real(self, flat, B, T)

    return real, route


def four_rank_job(rank, comm, tmp_path):
    out = {f"ep{e}": run(comm, tmp_path / f"ep{e}", "--ep", str(e), "--ckpt-every", str(SAVED if e == 2 else STEPS))
           for e in (1, 2, 4)}
    zero1 = train(config(tmp_path / "zero1", "--steps", str(STEPS)), comm, announce=False)
    out["zero1"] = {"losses": [r["loss"] for r in zero1.records]}
    out["resumed"] = run(comm, tmp_path / "resumed", "--ep", "2", "--ckpt-every", str(STEPS), "--resume",
                         str(tmp_path / "ep2" / "checkpoints" / f"step_{SAVED:08d}"))

    real_build = Mesh.__dict__["build"]

    def wrong_group(*args, **kwargs):  # planted: the experts reduced and gathered over the EP group, not their replicas
        mesh = real_build.__func__(Mesh, *args, **kwargs)
        mesh.dp_shard_mod_ep = mesh.ep
        return mesh

    Mesh.build = wrong_group
    out["wrong_group"] = failed(comm, tmp_path / "wrong_group", "--ep", "2", "--steps", str(SAVED), "--ckpt-every",
                               str(SAVED))
    Mesh.build = real_build

    real_release = ShardedParameters.release_unit

    def kept_whole(self, unit, phase):  # planted: the experts' engine keeps a block's experts after its forward
        if phase == "forward" and experts.is_expert_parameter(self.engine.layout.slots[0].name):
            return
        real_release(self, unit, phase)

    ShardedParameters.release_unit = kept_whole
    out["kept_whole"] = failed(comm, tmp_path / "kept_whole", "--ep", "2", "--steps", "1")
    ShardedParameters.release_unit = real_release

    real_route, route = masked_routing(rank)
    moe.MoE.route = route
    out["no_rows_ep1"] = run(comm, tmp_path / "no_rows_ep1", *NO_ROWS)
    out["no_rows"] = run(comm, tmp_path / "no_rows", "--ep", "2", *NO_ROWS)
    for key, flags in (("no_rows_zero1", ()), ("no_rows_zero1_accum", ("--accum", "2"))):
        zero1 = train(config(tmp_path / key, *NO_ROWS, *flags), comm, announce=False)
        out[key] = {"losses": [r["loss"] for r in zero1.records]}
    # ZeRO-2 with --ep: the experts' replica group reduces in the backward, between the EP groups' all-to-alls
    out["no_rows_zero2"] = run(comm, tmp_path / "no_rows_zero2", "--ep", "2", *NO_ROWS, "--zero", "2")
    out["no_rows_zero2_micro"] = run(comm, tmp_path / "no_rows_zero2_micro", "--ep", "2", *NO_ROWS, "--zero", "2",
                                     "--grad-reduce", "micro-batch", "--accum", "2")
    # ... with accumulation reduced once a step: the window's first backward begins the units too, and the last one's
    # schedule starts again (every backward's end resets it)
    out["no_rows_zero2_accum"] = run(comm, tmp_path / "no_rows_zero2_accum", "--ep", "2", *NO_ROWS, "--zero", "2",
                                     "--accum", "2")
    moe.MoE.route = real_route
    return out


def no_hook_job(rank, comm, tmp_path):
    """The masked routing, at --ep 2, without the MoE layer's backward hook (planted); a replica group whose members
    send different collectives fails (a short wait: a hang times out) or aborts (gloo: a message of another size)."""
    moe.MoE.route = masked_routing(rank)[1]
    experts.join_at_moe_output = lambda model, group: None  # planted: no hook
    short = Comm(dist.new_group(timeout=datetime.timedelta(seconds=2)), timeout_s=2, io=comm)
    return failed(short, tmp_path / "no_hook", "--ep", "2", *NO_ROWS)


def arrival_order_job(rank, comm, tmp_path):
    """The masked routing at --ep 1 --zero 3 with several buckets per block, each bucket launched where its last
    expected gradient arrives (planted: the reduce schedule's gate and the units' end points left out, as before):
    the DP group's collectives part ways, and the run fails (a short wait: a hang times out) or aborts."""
    moe.MoE.route = masked_routing(rank)[1]
    GradientReducer._may_start = lambda self, index: True  # planted: no gate, a bucket starts when its grads are in
    GradientReducer._watch_unit_input = lambda self, unit, args: None  # planted: no unit end points
    short = Comm(dist.new_group(timeout=datetime.timedelta(seconds=2)), timeout_s=2, io=comm)
    return failed(short, tmp_path / "arrival_order", *NO_ROWS)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_zero3")
    codes, results = spawn(four_rank_job, 4, tmp, timeout=280)
    assert codes == [0, 0, 0, 0], codes
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    results[0]["folder"] = str(tmp)
    return results


def final_weights(folder: str, key: str, step: int = STEPS) -> dict[str, torch.Tensor]:
    """A checkpoint's whole model (the final one's), each expert read from the shards of the EP rank that holds it."""
    import zerotrain

    return zerotrain.load_model(f"{folder}/{key}/checkpoints/step_{step:08d}").state_dict()


def weight_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and any(".experts." in n for n in a)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize("key", ["ep2", "ep4"])
def test_ep_at_zero3_trains_what_ep1_trains_and_a_wrong_expert_group_is_caught(four_ranks, key):
    got, folder = four_ranks[0], four_ranks[0]["folder"]
    for base in ("ep1", "zero1"):
        assert close(got[key]["losses"], got[base]["losses"], 1e-6), (key, base, got[key]["losses"],
                                                                      got[base]["losses"])
    assert weight_gap(final_weights(folder, key), final_weights(folder, "ep1")) < 1e-5
    # planted: the experts' engine over the EP group: the steps leave --ep 1's, and invariant (b) says so at the end
    planted = got["wrong_group"]
    assert len(planted["losses"]) == SAVED and not close(planted["losses"], got["ep1"]["losses"], 1e-6)
    assert weight_gap(final_weights(folder, "wrong_group", SAVED), final_weights(folder, "ep2", SAVED)) > 1e-5
    assert planted["said"].startswith("InvariantError: invariant (b) failed: the experts of rank(s)"), planted


def test_the_memory_plan_counts_the_experts_units_and_experts_kept_whole_are_caught(four_ranks):
    # every run above ran under the strict plan (tests/conftest.py): its parameter peak within the plan's units
    said = four_ranks[0]["kept_whole"]["said"]
    assert said and said.startswith("InvariantError: memory plan failed at step 1") and "parameters at once" in said, \
        said


def test_expert_bytes_are_counted_at_zero3_and_the_units_whole_shrink_with_ep(four_ranks):
    per_rank = {e: four_ranks[0][f"ep{e}"]["expert_bytes"] for e in (1, 2, 4)}
    assert all(per_rank[e] and min(per_rank[e]) > 0 for e in per_rank), per_rank
    # ZeRO-3 shards the experts' parameters and state over the 4 ranks at --ep 1, and over the replica group (4 / E
    # ranks) of a block of 8 / E experts at --ep E: about the same share either way (padding apart)
    mean = {e: sum(v) / len(v) for e, v in per_rank.items()}
    assert all(abs(mean[e] / mean[1] - 1) < 0.2 for e in (2, 4)), per_rank
    # what --ep buys at ZeRO-3: a block gathers its 8 / E experts, not all 8
    peak = {e: max(four_ranks[0][f"ep{e}"]["param_peak_bytes"]) for e in (1, 2, 4)}
    assert peak[4] < peak[2] < peak[1], peak


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_the_plans_give_each_ranks_expert_bytes_draws_and_saves_at_zero3(four_ranks, tmp_path, monkeypatch, ep):
    got = four_ranks[0][f"ep{ep}"]
    cfg = config(tmp_path / "plan", *got["flags"])
    # the memory plan's expert rows: each rank's experts' shard and its state (at --ep 1 the owned pieces of the
    # experts' slots, which differ by rank), as summary.json's expert_bytes counts them
    assert memory_plan.memory_plan(cfg).expert_bytes_by_rank == got["expert_bytes"]
    plan = io_plan(cfg)
    measured = {"init_values_drawn": got["drawn"], "checkpoint_bytes_written": [r[f"ep{ep}"]["written"]
                                                                                for r in four_ranks]}
    assert got["saves"] and differences(plan, measured, saves=got["saves"]) == []
    assert measured["init_values_drawn"] == [r.startup_drawn for r in plan.ranks]  # exactly: the owned values
    assert measured["checkpoint_bytes_written"] == [r.save_written * got["saves"] for r in plan.ranks]
    if ep == 4:  # planted: the expert layout over every DP rank, not the replica group of DP / E
        real = memory_plan.layout_of  # what planned_layouts lays the model out with, for the I/O plan too
        monkeypatch.setattr(memory_plan, "layout_of", lambda model, dp, bucket, select=None: real(
            model, 4 if select is experts.is_expert_parameter else dp, bucket, select))
        said = differences(io_plan(cfg), measured, saves=got["saves"])
        assert sum("init_values_drawn" in line for line in said) >= 2, said


def test_resume_at_zero3_on_the_same_ep_layout_is_bitwise(four_ranks):
    got, folder = four_ranks[0], four_ranks[0]["folder"]
    assert got["resumed"]["losses"] == got["ep2"]["losses"][SAVED:]
    mine, theirs = final_weights(folder, "resumed"), final_weights(folder, "ep2")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)


def test_a_rank_whose_experts_get_no_rows_gathers_with_its_replicas_and_a_gather_at_first_use_fails(four_ranks,
                                                                                                      tmp_path):
    got = four_ranks[0]
    assert close(got["no_rows"]["losses"], got["no_rows_ep1"]["losses"], 1e-6), got["no_rows"]
    codes, results = spawn(no_hook_job, 4, tmp_path, timeout=120)  # planted: in processes of its own, which may abort
    said = [r["said"] if r else None for r in results]
    assert any(code != 0 for code in codes) or any(s and "CollectiveError" in s for s in said), (codes, said)


def test_an_ep_zero3_checkpoint_exports_and_transformers_reads_it(four_ranks, capfd, tmp_path):
    import transformers  # the [test] extra installs it: a missing one fails, never skips

    import zerotrain

    ckpt = f"{four_ranks[0]['folder']}/ep2/checkpoints/step_{STEPS:08d}"
    ours = export_tensors(capfd, ckpt, tmp_path / "ep2")
    base = final_weights(four_ranks[0]["folder"], "ep1")
    assert max(float((ours[n].float() - base[n]).abs().max()) for n in base) < 1e-5
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "ep2")).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, mine = hf(ids).logits, zerotrain.load_model(ckpt)(ids)
    assert float((theirs - mine).abs().max()) < 1e-5


def test_ranks_routing_nothing_to_some_experts_reduce_in_one_schedule_and_arrival_order_is_caught(four_ranks,
                                                                                                  tmp_path):
    got = four_ranks[0]
    for key, base in (("no_rows_ep1", "no_rows_zero1"), ("no_rows", "no_rows_zero1"),  # ZeRO-3, --ep 1 and 2
                      ("no_rows_zero2", "no_rows_zero1"), ("no_rows_zero2_micro", "no_rows_zero1_accum"),
                      ("no_rows_zero2_accum", "no_rows_zero1_accum")):
        assert close(got[key]["losses"], got[base]["losses"], 1e-6), (key, got[key], got[base])
    codes, results = spawn(arrival_order_job, 4, tmp_path, timeout=120)  # planted, in processes that may abort
    said = [r["said"] if r else None for r in results]
    assert any(code != 0 for code in codes) or any(s and "CollectiveError" in s for s in said), (codes, said)
