"""Expert parallelism (--ep) trains what EP 1 trains, holds a rank's share of the experts, resumes bitwise, and
reshards onto another --ep or world size exactly.

One 4-rank job of the tiny Qwen3-MoE with 8 experts (top-2): 4 steps at --ep 1, 2 and 4 (ZeRO-1) and --ep 2 at ZeRO-2,
on the same global batch. Losses agree within 1e-6 (relative) and the final weights within 1e-5; the received rows
put in another order (planted in parallel/experts.py's expert_major_order, which the dispatch runs) are caught. An
--ep 2 run saved at step 2 and resumed ends bitwise where the uninterrupted run does.

Reshards (the step-2 checkpoints): --ep 2 (ZeRO-2) -> --ep 4, --ep 1 (the experts in the one flat layout) -> --ep 2,
--ep 2 -> --ep 1, and a 2-rank --ep 2 run (a job of its own first, micro-batch 4: the same global batch) -> 4 ranks at
--ep 2. Each is loaded into a fresh engine and saved again at once: every master, exp_avg and exp_avg_sq, by global
name, and the step equal the checkpoint's bit for bit (both assembled here from whole shards); the resumed run's 2
steps equal the uninterrupted run's losses within 1e-6 relative. Each rank reads its new shards' values once (within
1.25x; its dense share and its block of experts) beside its share of the verification's hashing. Planted in the load's
path and caught: every expert read from its neighbour (homes.expert_home), the expert moments shifted by one expert
(ZeroEngine.load_shard_state_dict), the old shards' tensors read whole (load.py's _read_ranges).

The plans (training/memory_plan.py, io_plan.py) of those runs give each rank's expert bytes (summary.json's
expert_bytes) exactly at --ep 1, 2 and 4, the rows each MoE layer's all-to-all sends exactly (and those received
within the plan's most; the runs are strict), each rank's values drawn at start-up and bytes written at its saves
exactly, the resume's reads exactly, and the export's size within 1%. Planted and caught: the plans without the
EP split (every expert on each rank), and the all-to-all's rows planned without top-k (the run stops at step 1).

The final checkpoints of --ep 2 and 4 export what --ep 1's does (each expert read from the shards of the EP rank that
holds it; read from EP rank 0's instead, planted in checkpoint/homes.py's expert_home, is caught), and transformers
reads the export with zerotrain's logits.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import shutil
from unittest import mock

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_checkpoint import spawn

from zerotrain import checkpoint
from zerotrain.checkpoint import homes
from zerotrain.checkpoint import load as load_module
from zerotrain.checkpoint.format import STATE_KEYS, ep_of
from zerotrain.checkpoint.homes import shard_parts
from zerotrain.checkpoint.stream import bytes_counted, count_read
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.parallel import ShardLayout, ZeroEngine, experts
from zerotrain.runtime.run_folder import resolve_paths
from zerotrain.training import io_plan as io_plan_module
from zerotrain.training import memory_plan
from zerotrain.training.io_plan import differences, io_plan
from zerotrain.training.loop import build_engine, train

from conftest import zerotrain_here

pytestmark = pytest.mark.timeout(300)

STEPS, SAVED = 4, 2  # the runs' steps; the step each run that is resumed saved at


def config(out, *flags):
    args = build_parser().parse_args(["train", "--preset", "qwen3-moe-tiny", "--n-experts", "8", "--data", "synthetic",
                                      "--no-progress", "--steps", str(STEPS), "--nproc", "4", "--micro-batch", "2",
                                      "--lr", "1e-2", "--out", str(out),
                                      "--peak-flops", "1e12", *flags])  # MFU untimed: conftest's tiny_config
    return resolve_paths(config_from_args(args))


def run(comm, out, *flags) -> dict:
    before = bytes_counted()  # this process's, over the job's runs
    result = train(config(out, *flags), comm, announce=False)
    params = {n: p.detach().float().clone().tolist() for n, p in result.engine.model.named_parameters()}
    sent, received = experts.all_to_all_bytes_most(result.engine.model)
    return {"losses": [r["loss"] for r in result.records], "params": params,
            "expert_bytes": result.per_rank.get("expert_bytes"), "drawn": result.per_rank["init_values_drawn"],
            "flags": flags, "saves": len(result.checkpoints), "sent": sent, "received": received,
            "written": result.per_rank["checkpoint_bytes_written"][comm.rank] - before["checkpoint_bytes_written"],
            "read": result.per_rank["checkpoint_bytes_read"][comm.rank] - before["checkpoint_bytes_read"]}


def saved_step(tmp_path, key) -> str:
    return str(tmp_path / key / "checkpoints" / checkpoint.step_name(SAVED))


def two_rank_job(rank, comm, tmp_path):
    """--ep 2 on 2 ranks (micro-batch 4: the 4-rank runs' global batch), saved at step SAVED: the W 2 -> W 4 reshard's."""
    return {"w2": run(comm, tmp_path / "w2", "--nproc", "2", "--micro-batch", "4", "--ep", "2", "--ckpt-every", str(SAVED))}


def loaded_job(comm, path, out, *flags, planted=None) -> dict:
    """Load checkpoint `path` into a fresh engine of this run's settings and save it at once into `out`: what the
    load restored, every rank's bytes read in all and verifying. `planted`: (object, name, replacement) patched in the
    load's path meanwhile."""
    cfg = config(out, *flags)
    engine = build_engine(cfg, comm)
    verified, real_verify = [], load_module.verify_together

    def counting_verify(folder, comm_):
        start = bytes_counted()["checkpoint_bytes_read"]
        checks = real_verify(folder, comm_)
        verified.append(bytes_counted()["checkpoint_bytes_read"] - start)
        return checks

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(load_module, "verify_together", counting_verify))
        if planted is not None:
            patches.enter_context(mock.patch.object(*planted))
        start = bytes_counted()["checkpoint_bytes_read"]
        checkpoint.load_checkpoint(path, engine, comm)
        total = bytes_counted()["checkpoint_bytes_read"] - start
    saved, _, _ = checkpoint.save_checkpoint(str(out / "checkpoints"), SAVED, engine, comm, cfg.to_dict())
    share = sum(12 * owned_values(part.layout, part.dp.rank) + 8 for _, part in shard_parts(engine))
    mine = {"total": total, "verify": sum(verified), "share": share}
    return {"saved": saved, "bytes": comm.io.all_gather_json(mine, "test_load_bytes")}


def owned_values(layout, dp_rank) -> int:
    """The parameter values (not padding) DP rank `dp_rank` owns of `layout`."""
    return sum(p.numel for s in layout.slots for p in layout.owned_pieces(dp_rank, s.offset, s.offset + s.numel))


def whole_tensor_reads(file, reads, sd):
    """Planted in place of load.py's _read_ranges: each old shard's state tensors read whole, then the ranges taken."""
    with safe_open(file, framework="pt") as f:
        for key in STATE_KEYS:
            for prefix in {r.prefix for r in reads}:
                values = f.get_tensor(prefix + key)
                count_read(values.numel() * values.element_size())
                for r in (r for r in reads if r.prefix == prefix):
                    sd[key][r.dst : r.dst + r.numel] = values[r.src : r.src + r.numel]


def neighbour_expert_home(name, per_rank):
    """Planted in place of homes.expert_home: every expert read from the next expert of its EP rank's block."""
    ep_rank, local = REAL_EXPERT_HOME(name, per_rank)
    head, index, tail = re.fullmatch(r"(.*\.experts\.)(\d+)(\..*)", local).groups()
    return ep_rank, f"{head}{(int(index) + 1) % per_rank}{tail}"


def neighbour_moments(self, sd):
    """Planted in place of ZeroEngine.load_shard_state_dict: the expert group's moments shifted by one
    expert's parameter (each value's moments the neighbouring expert's), the masters right."""
    n = self.experts.layout.slots[0].numel
    sd = {**sd, **{k: sd[k].roll(n) for k in ("expert_exp_avg", "expert_exp_avg_sq")}}
    return REAL_LOAD_EP(self, sd)


REAL_EXPERT_HOME, REAL_LOAD_EP = homes.expert_home, ZeroEngine.load_shard_state_dict

# A resume onto another EP layout: case -> (checkpoint saved at step SAVED, the uninterrupted run it continues, flags)
RESHARDS = {
    "EP 2 -> EP 4": ("ep2z2", "ep2_zero2", ("--ep", "4", "--zero", "2")),
    "EP 1 -> EP 2": ("ep1", "ep1", ("--ep", "2")),
    "EP 2 -> EP 1": ("ep2", "ep2", ("--ep", "1")),
    "W 2 -> W 4 at EP 2": ("two/w2", "ep2", ("--ep", "2")),
}
PLANTED = {
    "neighbour expert": ("EP 2 -> EP 4", (homes, "expert_home", neighbour_expert_home)),
    "neighbour moments": ("EP 2 -> EP 4", (ZeroEngine, "load_shard_state_dict", neighbour_moments)),
    "whole tensors read": ("W 2 -> W 4 at EP 2", (load_module, "_read_ranges", whole_tensor_reads)),
}


real_rows = memory_plan.all_to_all_row_bytes


def failed(comm, out, *flags) -> str | None:
    """What a run expected to raise said (None: it did not)."""
    try:
        train(config(out, *flags), comm, announce=False)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return None


def four_rank_job(rank, comm, tmp_path):
    # each saved at step SAVED (resumed onto other EP layouts by a test) and at the end (exported by a test)
    out = {f"ep{e}": run(comm, tmp_path / f"ep{e}", "--ep", str(e), "--ckpt-every", str(SAVED if e < 4 else STEPS))
           for e in (1, 2, 4)}
    # ZeRO-2, saved at step SAVED; then resumed from there on the same EP layout
    out["ep2_zero2"] = run(comm, tmp_path / "ep2z2", "--ep", "2", "--zero", "2", "--ckpt-every", str(SAVED))
    out["resumed"] = run(comm, tmp_path / "resumed", "--ep", "2", "--zero", "2", "--resume", saved_step(tmp_path, "ep2z2"))
    for i, (case, (saved, _, flags)) in enumerate(RESHARDS.items()):  # the state right after the load, then the rest
        out[f"loaded {case}"] = loaded_job(comm, saved_step(tmp_path, saved), tmp_path / f"loaded{i}", *flags)
        out[f"resumed {case}"] = run(comm, tmp_path / f"resumed{i}", *flags, "--resume", saved_step(tmp_path, saved))
    for i, (bug, (case, patch)) in enumerate(PLANTED.items()):
        saved, _, flags = RESHARDS[case]
        out[f"planted {bug}"] = loaded_job(comm, saved_step(tmp_path, saved), tmp_path / f"planted{i}", *flags,
                                           planted=patch)
    # planted: the plan's all-to-all rows without top-k (a token's one row, not its k): strict, the run stops
    with mock.patch.object(memory_plan, "all_to_all_row_bytes", lambda cfg, sequences: real_rows(
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, experts_per_token=1)), sequences)):
        out["planted all-to-all"] = failed(comm, tmp_path / "planted_a2a", "--ep", "2", "--steps", "1")
    real = experts.expert_major_order
    # planted: the received rows reversed
    experts.expert_major_order = lambda per_source, *a: real(per_source, *a).flip(0)
    out["planted"] = run(comm, tmp_path / "planted", "--ep", "2")
    experts.expert_major_order = real
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep")
    (tmp / "two").mkdir()
    codes, two = spawn(two_rank_job, 2, tmp / "two", timeout=120)
    assert codes == [0, 0], codes
    codes, results = spawn(four_rank_job, 4, tmp, timeout=280)
    assert codes == [0, 0, 0, 0], codes
    results[0]["folder"], results[0]["w2"] = str(tmp), two[0]["w2"]
    return results


def merged(results, key) -> dict:
    """Every rank's parameters (each its block of experts), by name."""
    out = {}
    for r in results:
        out.update(r[key]["params"])
    return out


def close(a: list[float], b: list[float], rel: float) -> bool:
    return all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def weight_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((torch.tensor(a[n]) - torch.tensor(b[n])).abs().max()) for n in a)


@pytest.mark.parametrize("key", ["ep2", "ep4", "ep2_zero2"])
def test_expert_parallel_training_equals_ep1_and_a_wrong_row_order_is_caught(four_ranks, key):
    base = four_ranks[0]["ep1"]
    assert close(four_ranks[0][key]["losses"], base["losses"], 1e-6), (four_ranks[0][key]["losses"], base["losses"])
    assert weight_gap(merged(four_ranks, key), merged(four_ranks, "ep1")) < 1e-5
    planted = four_ranks[0]["planted"]["losses"]
    assert not close(planted, base["losses"], 1e-3)
    assert weight_gap(merged(four_ranks, "planted"), merged(four_ranks, "ep1")) > 1e-3


def test_each_rank_holds_its_block_of_experts(four_ranks):
    for e in (2, 4):
        names = [{n for n in r[f"ep{e}"]["params"] if ".experts." in n} for r in four_ranks]
        for rank, held in enumerate(names):
            blocks = {int(n.split(".experts.")[1].split(".")[0]) for n in held}
            first = (rank % e) * (8 // e)
            assert blocks == set(range(first, first + 8 // e)), (e, rank, blocks)


def test_expert_bytes_per_rank_at_ep4(four_ranks):
    ep1 = four_ranks[0]["ep1"]["expert_bytes"]
    ep4 = four_ranks[0]["ep4"]["expert_bytes"]
    assert ep1 and ep4 and len(set(ep4)) == 1
    # parameters 1/4 (2 of 8 experts) and the optimizer state of those experts whole on their one rank: the same
    # 1/4 of the experts' state that ZeRO-1 over 4 DP ranks gives each rank at EP 1: (P + 2P) / (4P + 2P)
    assert max(ep4) <= 0.51 * sum(ep1) / len(ep1), (ep4, ep1)


def plan_config(got: dict, tmp_path):
    return config(tmp_path / "plan", *got["flags"])


@pytest.mark.parametrize("key", ["ep1", "ep2", "ep4", "ep2_zero2"])
def test_the_memory_plans_expert_rows_are_each_ranks_expert_bytes_and_a_plan_without_the_ep_split_is_caught(
        four_ranks, tmp_path, monkeypatch, key):
    plan = memory_plan.memory_plan(plan_config(four_ranks[0][key], tmp_path))
    measured = four_ranks[0][key]["expert_bytes"]
    assert plan.expert_bytes_by_rank == measured, (plan.expert_bytes_by_rank, measured)  # exactly, rank by rank
    assert plan.experts["parameters"] + plan.experts["optimizer_state"] == measured[0]
    if key == "ep4":  # planted: the plan keeps every expert on each rank (no EP split), as it did before
        monkeypatch.setattr(memory_plan, "keep_expert_block", lambda model, ep, ep_rank=0: None)
        wrong = memory_plan.memory_plan(plan_config(four_ranks[0][key], tmp_path)).expert_bytes_by_rank
        assert all(w > m for w, m in zip(wrong, measured)), (wrong, measured)


def test_the_plans_expert_bytes_at_ep4_are_half_of_ep1s_on_4_ranks_and_under_0_3x_on_64(four_ranks, tmp_path):
    # ZeRO-1 over W ranks: a rank's experts at EP E hold P_e / E parameters and 8 P_e / W of state (its block's
    # state sharded over W / E replicas); at EP 1, P_e and 8 P_e / W (fp32, bytes in units of 4 P_e: 1 + 2 / W
    # against 1 / E + 2 / W). On 4 ranks (3/4 against 3/2) that is 0.5x; on 64, 0.28x
    ratio = {}
    for world in (4, 64):
        per = {e: memory_plan.memory_plan(config(tmp_path / "p", "--ep", str(e)), world_size=world).expert_bytes_by_rank
               for e in (1, 4)}
        ratio[world] = max(per[4]) / (sum(per[1]) / len(per[1]))
    measured = four_ranks[0]["ep4"]["expert_bytes"][0] / (sum(four_ranks[0]["ep1"]["expert_bytes"]) / 4)
    assert ratio[4] == measured == 0.5 and ratio[64] <= 0.3, (ratio, measured)


@pytest.mark.parametrize("key", ["ep2", "ep4", "ep2_zero2"])
def test_the_all_to_all_rows_are_the_plans_and_a_plan_without_top_k_stops_the_run(four_ranks, tmp_path, key):
    plan = memory_plan.memory_plan(plan_config(four_ranks[0][key], tmp_path))
    sent = plan.rows["all_to_all"] // 2  # N k rows of C values, whatever the routing
    assert sent == 2 * 16 * 2 * 32 * 4 and [r[key]["sent"] for r in four_ranks] == [sent] * 4
    received = [r[key]["received"] for r in four_ranks]  # the most one call received: the routing's imbalance
    assert sum(received) >= 4 * sent and max(received) <= plan.all_to_all_most - sent, (received, sent)
    # every run above ran under the strict plan (tests/conftest.py); the planted plan stopped its run at step 1
    said = four_ranks[0]["planted all-to-all"]
    assert said and "memory plan failed at step 1" in said and "all-to-all" in said, said


@pytest.mark.parametrize("key", ["ep1", "ep2", "ep4", "ep2_zero2"])
def test_the_io_plan_gives_each_ranks_draws_and_saves_with_ep_and_a_plan_without_the_split_is_caught(
        four_ranks, tmp_path, monkeypatch, key):
    got = four_ranks[0][key]
    plan = io_plan(plan_config(got, tmp_path))
    measured = {"init_values_drawn": got["drawn"], "checkpoint_bytes_written": [r[key]["written"] for r in four_ranks]}
    assert got["saves"] and differences(plan, measured, saves=got["saves"]) == []
    assert measured["init_values_drawn"] == [r.startup_drawn for r in plan.ranks]  # exactly
    assert measured["checkpoint_bytes_written"] == [r.save_written * got["saves"] for r in plan.ranks]
    if key == "ep4":  # planted: every expert drawn and saved on each rank (the plan without the EP split)
        monkeypatch.setattr(memory_plan, "keep_expert_block", lambda model, ep, ep_rank=0: None)  # planned_layouts
        said = differences(io_plan(plan_config(got, tmp_path)), measured, saves=got["saves"])
        assert sum("init_values_drawn" in line for line in said) == 4, said
        assert sum("checkpoint_bytes_written" in line for line in said) == 4, said


def test_the_io_plan_gives_each_ranks_resume_reads_with_ep(four_ranks, tmp_path):
    got = four_ranks[0]["resumed"]
    plan = io_plan(plan_config(got, tmp_path))
    measured = {"checkpoint_bytes_read": [r["resumed"]["read"] for r in four_ranks]}
    assert differences(plan, measured, phases=("resume",)) == []
    assert measured["checkpoint_bytes_read"] == [r.resume_read for r in plan.ranks]


def test_resume_on_the_same_ep_layout_is_bitwise(four_ranks):
    for r in four_ranks:
        assert r["resumed"]["params"] == r["ep2_zero2"]["params"]
    assert four_ranks[0]["resumed"]["losses"] == four_ranks[0]["ep2_zero2"]["losses"][SAVED:]


def named_state(folder: str) -> dict[str, torch.Tensor]:
    """Every state key of every parameter of the checkpoint `folder` ("key name"), by its global name, read whole from
    every shard and assembled through its layouts here (TP 1): with --ep, EP rank e's experts from the expert_ keys of
    its replicas' shards (world ranks k E + e), named as EP rank 0's shifted by e x experts_per_rank."""
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    W, ep = manifest["world_size"], ep_of(manifest)
    shards = [load_file(os.path.join(folder, checkpoint.shard_name(r, W))) for r in range(W)]
    out = {"step": shards[0]["step"]}
    layout = ShardLayout.from_dict(manifest["layout"])
    for key in STATE_KEYS:
        flat = layout.assemble([shards[r][key] for r in range(W)])
        out.update({f"{key} {s.name}": flat[s.offset : s.offset + s.numel] for s in layout.slots})
    if ep == 1:
        return out
    assert all(int(s["expert_step"]) == int(out["step"]) for s in shards)
    experts_layout, per_rank = ShardLayout.from_dict(manifest["expert_layout"]), manifest["experts_per_rank"]
    for e in range(ep):
        for key in STATE_KEYS:
            flat = experts_layout.assemble([shards[k * ep + e]["expert_" + key] for k in range(W // ep)])
            for s in experts_layout.slots:
                head, index, tail = re.fullmatch(r"(.*\.experts\.)(\d+)(\..*)", s.name).groups()
                out[f"{key} {head}{int(index) + e * per_rank}{tail}"] = flat[s.offset : s.offset + s.numel]
    return out


def differing(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys() and len(a) > 1
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("case", list(RESHARDS))
def test_a_resume_onto_another_ep_or_world_size_restores_every_value_and_moment_bitwise_and_trains_on(four_ranks,
                                                                                                      case):
    saved, uninterrupted, _ = RESHARDS[case]
    tmp = four_ranks[0]["folder"]
    before = named_state(saved_step(pathlib.Path(tmp), saved))
    after = named_state(four_ranks[0][f"loaded {case}"]["saved"])
    assert any(".experts." in k for k in before) and any(k.startswith("exp_avg_sq ") for k in before)
    assert differing(after, before) == []  # every master, exp_avg, exp_avg_sq and the step, bit for bit
    losses, base = four_ranks[0][f"resumed {case}"]["losses"], four_ranks[0][uninterrupted]["losses"][SAVED:]
    assert len(losses) == STEPS - SAVED and close(losses, base, 1e-6), (losses, base)
    if case == "W 2 -> W 4 at EP 2":  # and the 2 ranks' own run, which the 4 ranks' --ep 2 run equals in turn
        assert close(losses, four_ranks[0]["w2"]["losses"][SAVED:], 1e-6), (losses, four_ranks[0]["w2"]["losses"])


@pytest.mark.parametrize("bug", ["neighbour expert", "neighbour moments"])
def test_a_reshard_that_misplaces_an_experts_values_or_moments_is_caught(four_ranks, bug):
    case = PLANTED[bug][0]
    before = named_state(saved_step(pathlib.Path(four_ranks[0]["folder"]), RESHARDS[case][0]))
    wrong = differing(named_state(four_ranks[0][f"planted {bug}"]["saved"]), before)
    assert wrong and all(".experts." in k for k in wrong), wrong
    if bug == "neighbour moments":
        assert all(k.startswith("exp_avg") for k in wrong), wrong


@pytest.mark.parametrize("case", list(RESHARDS))
def test_a_reshard_reads_each_ranks_dense_share_and_its_experts_and_a_reader_of_whole_tensors_is_caught(four_ranks,
                                                                                                        case):
    ranks = four_ranks[0][f"loaded {case}"]["bytes"]
    # summary.json's checkpoint_bytes_read of the resumed run counts the same load
    assert [r[f"resumed {case}"]["read"] for r in four_ranks] == [r["total"] for r in ranks]
    folder = saved_step(pathlib.Path(four_ranks[0]["folder"]), RESHARDS[case][0])
    sizes = [os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".safetensors")]
    for r in ranks:  # the ranged reads: its new shards' values and steps, nothing more than 1.25x of it
        assert r["share"] <= r["total"] - r["verify"] <= 1.25 * r["share"], (case, r)
        # verifying: each file hashed by one rank (its share and at most one file more), every shard's header
        assert r["verify"] <= sum(sizes) / len(ranks) + max(sizes) + 4096 * len(sizes), (case, r)
    if case == PLANTED["whole tensors read"][0]:
        planted = four_ranks[0]["planted whole tensors read"]["bytes"]
        assert any(p["total"] - p["verify"] > 1.25 * p["share"] for p in planted), planted


def test_verify_checks_the_expert_layouts_partition_and_an_overlap_planted_in_it_is_caught(four_ranks, tmp_path):
    from zerotrain.checkpoint.verify import first_failure

    saved = saved_step(pathlib.Path(four_ranks[0]["folder"]), "ep2")
    assert first_failure(checkpoint.verify_checkpoint(saved)) is None
    folder = tmp_path / "overlap"
    shutil.copytree(saved, folder)
    with open(folder / "manifest.json") as f:
        manifest = json.load(f)
    owned = manifest["expert_layout"]["owned_ranges"]  # 2 replicas: replica 1's first range starts inside replica 0's
    owned[1][0][0] -= 1
    (folder / "manifest.json").write_text(json.dumps(manifest))
    bad = first_failure(checkpoint.verify_checkpoint(str(folder)))
    assert bad is not None and bad.name == "partition" and "overlap" in bad.detail, bad


def export_tensors(capfd, ckpt: str, out) -> dict[str, torch.Tensor]:
    """`zerotrain export --format hf` of checkpoint `ckpt` into `out`, its tensors by name."""
    from safetensors.torch import load_file

    got = zerotrain_here(capfd, "export", "--format", "hf", ckpt, str(out))
    assert got.returncode == 0, got
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def export_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and any(".experts." in n for n in a)
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)


@pytest.mark.parametrize("ep", [2, 4])
def test_an_expert_parallel_checkpoint_exports_what_ep1_exports_and_a_misplaced_expert_block_is_caught(
        four_ranks, capfd, tmp_path, monkeypatch, ep):
    import transformers  # the [test] extra installs it: a missing one fails, never skips

    import zerotrain

    ckpt = lambda key: f"{four_ranks[0]['folder']}/{key}/checkpoints/step_{STEPS:08d}"  # noqa: E731
    base = export_tensors(capfd, ckpt("ep1"), tmp_path / "ep1")
    ours = export_tensors(capfd, ckpt(f"ep{ep}"), tmp_path / f"ep{ep}")
    assert export_gap(ours, base) < 1e-5
    # the io plan's export: every parameter once, fp32 (its header in zerotrain's names, Hugging Face's differ)
    planned = io_plan(config(tmp_path / "plan", "--ep", str(ep))).export_written
    written = sum(f.stat().st_size for f in (tmp_path / f"ep{ep}").glob("*.safetensors"))
    assert abs(written - planned) <= io_plan_module.TOLERANCE * planned + io_plan_module.SLACK, (written, planned)
    # transformers reads the export with the logits zerotrain's reader of the checkpoint gives
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / f"ep{ep}")).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, mine = hf(ids).logits, zerotrain.load_model(ckpt(f"ep{ep}"))(ids)
    assert float((theirs - mine).abs().max()) < 1e-5
    # planted: every expert read from EP rank 0's shards (the expert block of EP rank 1 and on is EP rank 0's)
    monkeypatch.setattr(homes, "expert_home", lambda name, per_rank: (0, REAL_EXPERT_HOME(name, per_rank)[1]))
    planted = export_tensors(capfd, ckpt(f"ep{ep}"), tmp_path / "planted")
    assert export_gap(planted, base) > 1e-3


@pytest.mark.parametrize("flags, said", [
    (("--nproc", "4", "--ep", "3"), "--ep 3 does not divide the data-parallel size 4"),
    (("--nproc", "2", "--ep", "2", "--n-experts", "3", "--experts-per-token", "1"), "--ep 2 does not divide --n-experts 3"),
])
def test_ep_settings_are_refused_in_one_line(capfd, tmp_path, flags, said):
    got = zerotrain_here(capfd, "train", "--preset", "qwen3-moe-tiny", "--data", "synthetic", "--steps", "1",
                         "--out", str(tmp_path / "x"), *flags)
    assert got.returncode == 2, got
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], got.stderr
