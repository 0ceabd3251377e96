"""Expert parallelism under tensor parallelism (--ep 2 --tp 2) trains what --ep 1 does, at --tp 2 and at --tp 1.

One 4-rank job of the tiny Qwen3-MoE with 8 experts (top-2), 3 steps on the same global batch: --ep 2 --tp 2 (DP 2)
at ZeRO-1, 2 and 3, --ep 1 --tp 2 (DP 2) and --ep 1 --tp 1 (DP 4); gpt-oss (biased experts: the down biases
gathered from the EP group) at --ep 2 --tp 2 and --ep 1 --tp 1. Losses agree within 1e-6 (relative), the final
weights (the checkpoints' models, the exports for Qwen3-MoE) within 1e-5. AdamW's eps is 1e-3, as in
test_moe_tp.py: at 1e-8 its first steps turn float noise in a near-zero gradient value into a step of up to lr
(measured here: 1.8e-5 on the final weights at eps 1e-8, 4 steps). Planted in the product's path: the MoE layer's
partial outputs never summed over the TP group (stopped by invariant (b)); the all-to-all run over the TP group
instead of the EP group (the losses part). The --ep 2 --tp 2 run saved at step 2 and resumed ends bitwise where it
ends uninterrupted; resumed at --ep 1 --tp 2 (resharded: each expert's TP slice t from TP index t's shards) its last
steps are the uninterrupted run's within 1e-6. Its export loads in transformers with zerotrain's logits. Each
expert's TP slices read from TP index 0's shards (planted in checkpoint/homes.py's expert_shard_rank) are caught, in
the export and in the reshard. Invariant (b)'s rule for E x T is
checked on the digests alone: which ranks must agree, and a drift in each expert row caught, naming the ranks. On
8 ranks (--tp 2, DP 4), --ep 4 (replica groups of one rank) and --ep 2 (of two) train what --ep 1 does.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from test_checkpoint import spawn
from test_expert_parallel import export_tensors

import zerotrain
from zerotrain.errors import InvariantError

from conftest import zerotrain_here

pytestmark = [pytest.mark.timeout(400), pytest.mark.xdist_group("ep_tp")]

STEPS = 3
QWEN3, GPT_OSS = [], ["--arch", "gpt_oss"]
EP2_TP2 = ["--ep", "2", "--tp", "2", "--micro-batch", "4"]
EP1_TP2 = ["--tp", "2", "--micro-batch", "4"]
EP1_TP1 = ["--micro-batch", "2"]


def config(out, *flags):
    from zerotrain.cli.flags import config_from_args
    from zerotrain.cli.main import build_parser
    from zerotrain.runtime.run_folder import resolve_paths

    args = build_parser().parse_args(["train", "--preset", "qwen3-moe-tiny", "--n-experts", "8", "--data", "synthetic",
                                      "--no-progress", "--steps", str(STEPS), "--nproc", "4", "--lr", "1e-2",
                                      "--eps", "1e-3", "--ckpt-every", "2", "--out", str(out),
                                      "--peak-flops", "1e12", *flags])  # MFU untimed: conftest's tiny_config
    return resolve_paths(config_from_args(args))


def run(comm, out, *flags) -> dict:
    from zerotrain.training.loop import train

    try:
        result = train(config(out, *flags), comm, announce=False)
    except InvariantError as e:
        return {"error": str(e)}
    return {"losses": [r["loss"] for r in result.records], "digests": result.digests}


def four_rank_job(rank, comm, tmp_path):
    from zerotrain.checkpoint import homes
    from zerotrain.model import moe
    from zerotrain.training import loop, memory_plan

    runs = {"ep2tp2": [*QWEN3, *EP2_TP2], "ep2tp2_zero2": [*QWEN3, *EP2_TP2, "--zero", "2"],
            "ep2tp2_zero3": [*QWEN3, *EP2_TP2, "--zero", "3"],
            "ep1tp2": [*QWEN3, *EP1_TP2], "ep1tp1": [*QWEN3, *EP1_TP1],
            "gpt_oss_ep2tp2": [*GPT_OSS, *EP2_TP2], "gpt_oss_ep1tp1": [*GPT_OSS, *EP1_TP1]}
    out = {name: run(comm, tmp_path / name, *flags) for name, flags in runs.items()}
    out["resumed"] = run(comm, tmp_path / "resumed", *EP2_TP2, "--resume",
                         str(tmp_path / "ep2tp2" / "checkpoints" / "step_00000002"))
    # the --ep 2 --tp 2 checkpoint resharded to --ep 1 at the same --tp (each expert's TP slice t from TP index t's
    # shards), then with every expert slice read from TP index 0's (planted in checkpoint/homes.py's expert_shard_rank)
    at_ep1 = ["--resume", str(tmp_path / "ep2tp2" / "checkpoints" / "step_00000002")]
    out["resharded_ep1"] = run(comm, tmp_path / "resharded_ep1", *QWEN3, *EP1_TP2, *at_ep1)
    real_rank = homes.expert_shard_rank
    homes.expert_shard_rank = lambda replica, ep_rank, tp_rank, ep, tp: real_rank(replica, ep_rank, 0, ep, tp)
    try:
        out["resharded_tp0"] = run(comm, tmp_path / "resharded_tp0", *QWEN3, *EP1_TP2, *at_ep1)
    finally:
        homes.expert_shard_rank = real_rank
    # planted: the all-to-all over the TP group (each TP rank sends its rows to its TP peers' experts)
    real_shard = loop.shard_experts
    loop.shard_experts = lambda model, mesh: real_shard(model, dataclasses.replace(mesh, ep=mesh.tp))
    try:
        out["wrong_group"] = run(comm, tmp_path / "wrong_group", *EP2_TP2)
    finally:
        loop.shard_experts = real_shard
    # planted: each TP rank's partial expert outputs never summed over the TP group
    real_reduce = moe.reduce_from_tp
    moe.reduce_from_tp = lambda x, comm: x
    try:
        out["unsummed"] = run(comm, tmp_path / "unsummed", *EP2_TP2)
    finally:
        moe.reduce_from_tp = real_reduce
    # planted: the memory plan (strict under the tests) holding every expert on every rank, TP-sliced
    real_block = memory_plan.keep_expert_block
    memory_plan.keep_expert_block = lambda model, ep, ep_rank=0: None
    try:
        out["plan_every_expert"] = run(comm, tmp_path / "plan_every_expert", *EP2_TP2)
    finally:
        memory_plan.keep_expert_block = real_block
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_tp")
    codes, results = spawn(four_rank_job, 4, tmp, timeout=360)
    assert codes == [0, 0, 0, 0], results
    return tmp, results


EIGHT = ["--nproc", "8", "--micro-batch", "2"]  # DP 4 at --tp 2: the four-rank runs' global batch


def eight_rank_job(rank, comm, tmp_path):
    """--ep 4 at --tp 2 (DP 4: each EP group 4 ranks of one TP index, replica groups of 1) and --ep 2 (replica
    groups of 2) against --ep 1 at --tp 2, ZeRO-1."""
    runs = {"ep4tp2": [*QWEN3, *EIGHT, "--tp", "2", "--ep", "4"], "ep2tp2_8": [*QWEN3, *EIGHT, "--tp", "2", "--ep", "2"],
            "ep1tp2_8": [*QWEN3, *EIGHT, "--tp", "2"]}
    return {name: run(comm, tmp_path / name, *flags) for name, flags in runs.items()}


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_tp_8")
    codes, results = spawn(eight_rank_job, 8, tmp, timeout=360)
    assert codes == [0] * 8, results
    return tmp, results


@pytest.mark.parametrize("key", ["ep4tp2", "ep2tp2_8"])
def test_ep4_and_ep2_at_tp2_on_eight_ranks_train_what_ep1_trains(eight_ranks, key):
    tmp, results = eight_ranks
    assert close(results[0][key]["losses"], results[0]["ep1tp2_8"]["losses"], 1e-6), (results[0][key],
                                                                                     results[0]["ep1tp2_8"])
    assert weight_gap(final_weights(tmp / key), final_weights(tmp / "ep1tp2_8")) < 1e-5, key


def close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def final_weights(folder) -> dict[str, torch.Tensor]:
    return zerotrain.load_model(str(folder / "checkpoints" / f"step_{STEPS:08d}")).state_dict()


def weight_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and any(".experts." in n for n in a)
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)


@pytest.mark.parametrize("key, baselines", [("ep2tp2", ["ep1tp2", "ep1tp1"]), ("ep2tp2_zero2", ["ep1tp1"]),
                                            ("ep2tp2_zero3", ["ep1tp2"]),
                                            ("gpt_oss_ep2tp2", ["gpt_oss_ep1tp1"])])
def test_ep2_tp2_trains_what_ep1_trains_at_tp2_and_tp1(four_ranks, key, baselines):
    tmp, results = four_ranks
    for base in baselines:
        assert close(results[0][key]["losses"], results[0][base]["losses"], 1e-6), (key, base, results[0][key],
                                                                                    results[0][base])
        assert weight_gap(final_weights(tmp / key), final_weights(tmp / base)) < 1e-5, (key, base)


def test_an_unsummed_expert_output_and_the_all_to_all_over_the_wrong_group_are_caught(four_ranks):
    tmp, results = four_ranks
    said = results[0]["unsummed"].get("error", "")
    assert "invariant (b) failed" in said, results[0]["unsummed"]
    # the rows computed by other experts (or other slices): the losses part by 100x the bound (measured 370x at step 1:
    # the tiny model's experts add little to its output at initialisation), the weights by far more than noise
    wrong, honest = results[0]["wrong_group"]["losses"], results[0]["ep2tp2"]["losses"]
    assert max(abs(a - b) / b for a, b in zip(wrong, honest)) > 100 * 1e-6, (wrong, honest)
    assert weight_gap(final_weights(tmp / "wrong_group"), final_weights(tmp / "ep2tp2")) > 1e-3


def test_the_memory_plan_holds_at_ep2_tp2_and_one_counting_every_expert_is_caught(four_ranks):
    """Every run of the job checked its plan after its first step (ZEROTRAIN_STRICT_PLAN=1: a difference stops it):
    those that ended held what it planned. Planted in the plan: every expert on every rank."""
    _, results = four_ranks
    assert all("losses" in results[0][key] for key in ("ep2tp2", "ep2tp2_zero2", "gpt_oss_ep2tp2"))
    said = results[0]["plan_every_expert"].get("error", "")
    assert "memory plan" in said and "parameters" in said, said


def test_an_ep2_tp2_resume_on_the_same_layout_is_bitwise(four_ranks):
    _, results = four_ranks
    assert results[0]["resumed"]["losses"] == results[0]["ep2tp2"]["losses"][2:]
    assert results[0]["resumed"]["digests"] == results[0]["ep2tp2"]["digests"]  # every rank's, bitwise


def test_an_ep2_tp2_checkpoint_reshards_to_ep1_at_tp2_and_expert_slices_read_from_one_tp_index_are_caught(
        four_ranks):
    """4 ranks, --ep 2 --tp 2 saved at step 2, resumed at --ep 1 --tp 2 (DP 2): the experts move from the expert
    layouts into the flat one, each TP slice from its own TP index's shards. Its last 2 steps are the uninterrupted
    run's within 1e-6 (relative) and its final weights within 1e-5; every expert slice read from TP index 0 is
    caught."""
    tmp, results = four_ranks
    assert close(results[0]["resharded_ep1"]["losses"], results[0]["ep2tp2"]["losses"][2:], 1e-6), results[0]
    assert weight_gap(final_weights(tmp / "resharded_ep1"), final_weights(tmp / "ep2tp2")) < 1e-5
    assert weight_gap(final_weights(tmp / "resharded_tp0"), final_weights(tmp / "ep2tp2")) > 1e-3


def test_an_ep2_tp2_export_is_ep1s_loads_in_transformers_and_experts_read_from_one_tp_index_are_caught(
        four_ranks, capfd, tmp_path, monkeypatch):
    import transformers  # the [test] extra installs it: a missing one fails, never skips

    from zerotrain.checkpoint import homes

    tmp, _ = four_ranks
    ckpt = lambda key: str(tmp / key / "checkpoints" / f"step_{STEPS:08d}")  # noqa: E731
    base = export_tensors(capfd, ckpt("ep1tp1"), tmp_path / "ep1tp1")
    ours = export_tensors(capfd, ckpt("ep2tp2"), tmp_path / "ep2tp2")
    assert weight_gap(ours, base) < 1e-5
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "ep2tp2")).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, mine = hf(ids).logits, zerotrain.load_model(ckpt("ep2tp2"))(ids)
    assert float((theirs - mine).abs().max()) < 1e-5
    # planted: every expert slice read from TP index 0's shards (TP rank 1's slices are TP rank 0's)
    real = homes.expert_shard_rank
    monkeypatch.setattr(homes, "expert_shard_rank",
                        lambda replica, ep_rank, tp_rank, ep, tp: real(replica, ep_rank, 0, ep, tp))
    planted = export_tensors(capfd, ckpt("ep2tp2"), tmp_path / "planted")
    assert weight_gap(planted, base) > 1e-3


class _Gathered:
    """A world communicator whose all_gather_rows gives every rank's digests (invariants.check_no_drift's one
    collective), for the rule alone."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def all_gather_rows(self, row, purpose):
        return self.rows


def test_invariant_b_under_ep_and_tp_compares_the_ranks_holding_the_same_experts_and_names_a_drift():
    """8 ranks, TP 2 x DP 4, EP 2: world rank r = d T + t holds EP rank d mod 2's experts, TP slice t. Honest digests
    differ across EP ranks and TP slices and pass; one rank's experts' TP slices or replicated values changed is
    caught, naming it and the rank it should equal."""
    from zerotrain.parallel import Mesh
    from zerotrain.training.invariants import check_no_drift

    T, D, E = 2, 4, 2

    def digests() -> torch.Tensor:
        rows = []
        for r in range(T * D):
            d, t = divmod(r, T)
            # dense replicated, dense TP slice t, experts' replicated (EP rank), experts' TP slice (EP rank, t)
            rows.append(torch.tensor([[1, 1], [10 + t, 0], [20 + d % E, 0], [30 + 10 * (d % E) + t, 0]]))
        return torch.stack(rows)

    def mesh(rows):
        return Mesh(world=_Gathered(rows), dp_shard=None, tp=None, tp_size=T, tp_rank=0, ep_size=E)

    assert len(check_no_drift(1, digests()[0], mesh(digests()))) == T * D
    for row, rank, first, what in ((-1, 6, 2, "TP slices"), (-2, 5, 0, "replicated values")):
        rows = digests()
        rows[rank, row, 0] += 1  # rank 6: DP 3, TP 0, EP rank 1 (as rank 2); rank 5: DP 2, TP 1, EP rank 0 (as rank 0)
        with pytest.raises(InvariantError, match=rf"experts' {what} of rank\(s\) \[{rank}\] differ from those of "
                                                 rf"rank\(s\) \[{first}\]"):
            check_no_drift(1, rows[0], mesh(rows))


def test_ep_with_tp_is_accepted(tmp_path):
    cfg = config(tmp_path / "run", *EP2_TP2)  # validated as it is built
    assert (cfg.parallel.ep, cfg.parallel.tp, cfg.dp) == (2, 2, 2)


def test_an_ep2_tp2_checkpoint_verifies_and_a_drifted_expert_bias_and_swapped_expert_slices_are_caught(
        four_ranks, tmp_path):
    """gpt-oss's experts' down biases are replicated over TP: each TP rank's expert masters of them are compared
    (replica digests); the experts' TP slices are those the model config gives at TP 2."""
    import shutil

    from safetensors.torch import load_file, save_file
    from test_tp_checkpoint import _record_file, rewrite

    from zerotrain import checkpoint
    from zerotrain.checkpoint import verify as verify_module
    from zerotrain.parallel import ShardLayout

    tmp, _ = four_ranks
    good = str(tmp / "gpt_oss_ep2tp2" / "checkpoints" / f"step_{STEPS:08d}")
    with mock.patch.object(verify_module, "expert_layout_of", wraps=verify_module.expert_layout_of) as parsed:
        checks = checkpoint.verify_checkpoint(good)
    assert all(c.ok for c in checks) and [c.name for c in checks][-1] == "replicas", checks
    assert parsed.call_count == 1  # the expert layout parsed once for the 4 shards' replica digests

    def copy(name):
        shutil.copytree(good, tmp_path / name)
        return str(tmp_path / name)

    # world rank 1 (DP 0, TP 1): its expert master of a down bias moved off TP rank 0's, the manifest entry rewritten
    drifted, shard = copy("drifted"), checkpoint.shard_name(1, 4)
    manifest = checkpoint.read_manifest(good)
    experts = ShardLayout.from_dict(manifest["expert_layout"])
    slot = next(s for s in experts.slots if s.name.endswith("down_proj.bias"))
    piece = experts.owned_pieces(0, slot.offset, slot.offset + slot.numel)[0]
    tensors = load_file(f"{drifted}/{shard}")
    tensors["expert_master"][piece.shard_offset] += 1.0
    save_file(tensors, f"{drifted}/{shard}")
    rewrite(drifted, lambda m: _record_file(m, drifted, shard))
    bad = next(c for c in checkpoint.verify_checkpoint(drifted) if not c.ok)
    assert (bad.name, bad.file) == ("replicas", shard) and f"expert:{slot.name} differs" in bad.detail, bad

    # the experts' TP slices swapped between the TP ranks: not what TP 2 gives them
    swapped = copy("swapped")
    rewrite(swapped, lambda m: m["expert_tp_slices"].update(
        {n: {**d, "parts": d["parts"][::-1]} for n, d in m["expert_tp_slices"].items()}))
    bad = next(c for c in checkpoint.verify_checkpoint(swapped) if not c.ok)
    assert (bad.name, bad.file) == ("partition", "manifest.json") and "not the slice TP 2 gives it" in bad.detail, bad


def test_an_ep_checkpoint_resumed_at_another_tp_is_refused_in_one_line_naming_both_and_another_ep_is_not():
    from types import SimpleNamespace

    from zerotrain.checkpoint.load import refuse_ep_at_other_tp
    from zerotrain.errors import ConfigError

    manifest = {"mesh": {"tp": 2, "dp": 2, "ep": 2}, "world_size": 4}
    mesh = SimpleNamespace(ep_size=2, dp_size=2, tp_size=1, world=SimpleNamespace(world_size=2))
    with pytest.raises(ConfigError, match=r"--ep 2 with --tp 2; this run has --tp 1") as said:
        refuse_ep_at_other_tp("ckpt", manifest, SimpleNamespace(mesh=mesh))
    assert "\n" not in str(said.value)
    mesh.tp_size, mesh.world.world_size = 2, 4
    refuse_ep_at_other_tp("ckpt", manifest, SimpleNamespace(mesh=mesh))  # its own mesh: resumed
    mesh.ep_size, mesh.dp_size, mesh.world.world_size = 1, 4, 8
    refuse_ep_at_other_tp("ckpt", manifest, SimpleNamespace(mesh=mesh))  # another --ep and world size: resharded
    with pytest.raises(ConfigError, match=r"--ep 1 with --tp 1; this run has --tp 2 \(--ep 2\)"):
        refuse_ep_at_other_tp("ckpt", {"mesh": {"tp": 1, "dp": 4}, "world_size": 4},
                              SimpleNamespace(mesh=SimpleNamespace(ep_size=2, tp_size=2)))
