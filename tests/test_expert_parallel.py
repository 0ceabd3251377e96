"""Expert parallelism (--ep) trains what EP 1 trains, holds a rank's share of the experts, resumes bitwise, and
reshards onto another --ep or world size exactly.

One 4-rank job of the tiny Qwen3-MoE with 8 experts (top-2): 6 steps at --ep 1, 2 and 4 (ZeRO-1) and --ep 2 at ZeRO-2,
on the same global batch. Losses agree within 1e-6 (relative) and the final weights within 1e-5; the received rows
put in another order (planted in parallel/experts.py's expert_major_order, which the dispatch runs) are caught. An
--ep 2 run saved at step 3 and resumed ends bitwise where the uninterrupted run does.

Reshards (the step-3 checkpoints): --ep 2 (ZeRO-2) -> --ep 4, --ep 1 (the experts in the one flat layout) -> --ep 2,
--ep 2 -> --ep 1, and a 2-rank --ep 2 run (a job of its own first, micro-batch 4: the same global batch) -> 4 ranks at
--ep 2. Each is loaded into a fresh engine and saved again at once: every master, exp_avg and exp_avg_sq, by global
name, and the step equal the checkpoint's bit for bit (both assembled here from whole shards); the resumed run's 3
steps equal the uninterrupted run's losses within 1e-6 relative. Each rank reads its new shards' values once (within
1.25x; its dense share and its block of experts) beside its share of the verification's hashing. Planted in the load's
path and caught: every expert read from its neighbour (homes.expert_home), the expert moments shifted by one expert
(ExpertParallelEngine.load_shard_state_dict), the old shards' tensors read whole (load.py's _read_ranges).

The final checkpoints of --ep 2 and 4 export what --ep 1's does (each expert read from the shards of the EP rank that
holds it; read from EP rank 0's instead, planted in checkpoint/homes.py's expert_home, is caught), and transformers
reads the export with zerotrain's logits.
"""
from __future__ import annotations

import contextlib
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
from zerotrain.checkpoint.format import STATE_KEYS
from zerotrain.checkpoint.homes import shard_parts
from zerotrain.checkpoint.stream import bytes_counted, count_read
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.parallel import ShardLayout, experts
from zerotrain.runtime.run_folder import resolve_paths
from zerotrain.training.loop import build_engine, train

from conftest import zerotrain_here

pytestmark = pytest.mark.timeout(300)

STEPS = 6


def config(out, *flags):
    args = build_parser().parse_args(["train", "--preset", "qwen3-moe-tiny", "--n-experts", "8", "--data", "synthetic",
                                      "--no-progress", "--steps", str(STEPS), "--nproc", "4", "--micro-batch", "2",
                                      "--lr", "1e-2", "--out", str(out), *flags])
    return resolve_paths(config_from_args(args))


def run(comm, out, *flags) -> dict:
    before = bytes_counted()["checkpoint_bytes_read"]  # this process's, over the job's runs
    result = train(config(out, *flags), comm, announce=False)
    params = {n: p.detach().float().clone().tolist() for n, p in result.engine.model.named_parameters()}
    return {"losses": [r["loss"] for r in result.records], "params": params,
            "expert_bytes": result.per_rank.get("expert_bytes"),
            "read": result.per_rank["checkpoint_bytes_read"][comm.rank] - before}  # as summary.json counts it


def step3(tmp_path, key) -> str:
    return str(tmp_path / key / "checkpoints" / "step_00000003")


def two_rank_job(rank, comm, tmp_path):
    """--ep 2 on 2 ranks (micro-batch 4: the 4-rank runs' global batch), saved at step 3: the W 2 -> W 4 reshard's."""
    return {"w2": run(comm, tmp_path / "w2", "--nproc", "2", "--micro-batch", "4", "--ep", "2", "--ckpt-every", "3")}


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
    saved, _, _ = checkpoint.save_checkpoint(str(out / "checkpoints"), 3, engine, comm, cfg.to_dict())
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
    """Planted in place of ExpertParallelEngine.load_shard_state_dict: the expert engine's moments shifted by one
    expert's parameter (each value's moments the neighbouring expert's), the masters right."""
    n = self.experts.layout.slots[0].numel
    sd = {**sd, **{k: sd[k].roll(n) for k in ("expert_exp_avg", "expert_exp_avg_sq")}}
    return REAL_LOAD_EP(self, sd)


REAL_EXPERT_HOME, REAL_LOAD_EP = homes.expert_home, experts.ExpertParallelEngine.load_shard_state_dict

# A resume onto another EP layout: case -> (checkpoint saved at step 3, the uninterrupted run it continues, flags)
RESHARDS = {
    "EP 2 -> EP 4": ("ep2z2", "ep2_zero2", ("--ep", "4", "--zero", "2")),
    "EP 1 -> EP 2": ("ep1", "ep1", ("--ep", "2")),
    "EP 2 -> EP 1": ("ep2", "ep2", ("--ep", "1")),
    "W 2 -> W 4 at EP 2": ("two/w2", "ep2", ("--ep", "2")),
}
PLANTED = {
    "neighbour expert": ("EP 2 -> EP 4", (homes, "expert_home", neighbour_expert_home)),
    "neighbour moments": ("EP 2 -> EP 4", (experts.ExpertParallelEngine, "load_shard_state_dict", neighbour_moments)),
    "whole tensors read": ("W 2 -> W 4 at EP 2", (load_module, "_read_ranges", whole_tensor_reads)),
}


def four_rank_job(rank, comm, tmp_path):
    # each saved at step 3 (resumed onto other EP layouts by a test) and at the end (exported by a test)
    out = {f"ep{e}": run(comm, tmp_path / f"ep{e}", "--ep", str(e), "--ckpt-every", "3" if e < 4 else str(STEPS))
           for e in (1, 2, 4)}
    # ZeRO-2, saved at step 3; then resumed from there on the same EP layout
    out["ep2_zero2"] = run(comm, tmp_path / "ep2z2", "--ep", "2", "--zero", "2", "--ckpt-every", "3")
    out["resumed"] = run(comm, tmp_path / "resumed", "--ep", "2", "--zero", "2", "--resume", step3(tmp_path, "ep2z2"))
    for i, (case, (saved, _, flags)) in enumerate(RESHARDS.items()):  # the state right after the load, then 3 steps
        out[f"loaded {case}"] = loaded_job(comm, step3(tmp_path, saved), tmp_path / f"loaded{i}", *flags)
        out[f"resumed {case}"] = run(comm, tmp_path / f"resumed{i}", *flags, "--resume", step3(tmp_path, saved))
    for i, (bug, (case, patch)) in enumerate(PLANTED.items()):
        saved, _, flags = RESHARDS[case]
        out[f"planted {bug}"] = loaded_job(comm, step3(tmp_path, saved), tmp_path / f"planted{i}", *flags,
                                           planted=patch)
    real = experts.expert_major_order
    experts.expert_major_order = lambda per_source: real(per_source).flip(0)  # planted: the received rows reversed
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


def test_resume_on_the_same_ep_layout_is_bitwise(four_ranks):
    for r in four_ranks:
        assert r["resumed"]["params"] == r["ep2_zero2"]["params"]
    assert four_ranks[0]["resumed"]["losses"] == four_ranks[0]["ep2_zero2"]["losses"][3:]


def named_state(folder: str) -> dict[str, torch.Tensor]:
    """Every state key of every parameter of the checkpoint `folder` ("key name"), by its global name, read whole from
    every shard and assembled through its layouts here (TP 1): with --ep, EP rank e's experts from the expert_ keys of
    its replicas' shards (world ranks k E + e), named as EP rank 0's shifted by e x experts_per_rank."""
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    W, ep = manifest["world_size"], manifest["mesh"].get("ep", 1)
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
    before = named_state(step3(pathlib.Path(tmp), saved))
    after = named_state(four_ranks[0][f"loaded {case}"]["saved"])
    assert any(".experts." in k for k in before) and any(k.startswith("exp_avg_sq ") for k in before)
    assert differing(after, before) == []  # every master, exp_avg, exp_avg_sq and the step, bit for bit
    losses, base = four_ranks[0][f"resumed {case}"]["losses"], four_ranks[0][uninterrupted]["losses"][3:]
    assert len(losses) == 3 and close(losses, base, 1e-6), (losses, base)
    if case == "W 2 -> W 4 at EP 2":  # and the 2 ranks' own run, which the 4 ranks' --ep 2 run equals in turn
        assert close(losses, four_ranks[0]["w2"]["losses"][3:], 1e-6), (losses, four_ranks[0]["w2"]["losses"])


@pytest.mark.parametrize("bug", ["neighbour expert", "neighbour moments"])
def test_a_reshard_that_misplaces_an_experts_values_or_moments_is_caught(four_ranks, bug):
    case = PLANTED[bug][0]
    before = named_state(step3(pathlib.Path(four_ranks[0]["folder"]), RESHARDS[case][0]))
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
    folder = step3(pathlib.Path(four_ranks[0]["folder"]), RESHARDS[case][0])
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

    saved = step3(pathlib.Path(four_ranks[0]["folder"]), "ep2")
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
