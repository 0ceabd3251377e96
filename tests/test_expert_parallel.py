"""Expert parallelism (--ep) trains what EP 1 trains, holds a rank's share of the experts, and resumes bitwise.

One 4-rank job of the tiny Qwen3-MoE with 8 experts (top-2): 6 steps at --ep 1, 2 and 4 (ZeRO-1) and --ep 2 at ZeRO-2,
on the same global batch. Losses agree within 1e-6 (relative) and the final weights within 1e-5; the received rows
put in another order (planted in parallel/experts.py's expert_major_order, which the dispatch runs) are caught. An
--ep 2 run saved at step 3 and resumed ends bitwise where the uninterrupted run does; resuming it at --ep 4 is refused.
The final checkpoints of --ep 2 and 4 export what --ep 1's does (each expert read from the shards of the EP rank that
holds it; read from EP rank 0's instead, planted in checkpoint/model.py's expert_home, is caught), and transformers
reads the export with zerotrain's logits.
"""

from __future__ import annotations

import pytest
import torch
from test_checkpoint import spawn

from zerotrain.cli.flags import config_from_args
from zerotrain.errors import ConfigError
from zerotrain.cli.main import build_parser
from zerotrain.parallel import experts
from zerotrain.runtime.run_folder import resolve_paths
from zerotrain.training.loop import train

from conftest import zerotrain_here

pytestmark = pytest.mark.timeout(300)

STEPS = 6


def config(out, *flags):
    args = build_parser().parse_args(["train", "--preset", "qwen3-moe-tiny", "--n-experts", "8", "--data", "synthetic",
                                      "--no-progress", "--steps", str(STEPS), "--nproc", "4", "--micro-batch", "2",
                                      "--lr", "1e-2", "--out", str(out), *flags])
    return resolve_paths(config_from_args(args))


def run(comm, out, *flags) -> dict:
    result = train(config(out, *flags), comm, announce=False)
    params = {n: p.detach().float().clone().tolist() for n, p in result.engine.model.named_parameters()}
    return {"losses": [r["loss"] for r in result.records], "params": params,
            "expert_bytes": result.per_rank.get("expert_bytes")}


def four_rank_job(rank, comm, tmp_path):
    # each saved at the end (exported by a test)
    out = {f"ep{e}": run(comm, tmp_path / f"ep{e}", "--ep", str(e), "--ckpt-every", str(STEPS))
           for e in (1, 2, 4)}
    # ZeRO-2, saved at step 3; then resumed from there on the same EP layout
    out["ep2_zero2"] = run(comm, tmp_path / "ep2z2", "--ep", "2", "--zero", "2", "--ckpt-every", "3")
    out["resumed"] = run(comm, tmp_path / "resumed", "--ep", "2", "--zero", "2", "--resume",
                         str(tmp_path / "ep2z2" / "checkpoints" / "step_00000003"))
    try:  # onto another --ep: refused, naming both
        run(comm, tmp_path / "other", "--ep", "4", "--resume", str(tmp_path / "ep2z2" / "checkpoints" / "step_00000003"))
        out["other_ep"] = None
    except ConfigError as e:
        out["other_ep"] = str(e)
    real = experts.expert_major_order
    experts.expert_major_order = lambda per_source: real(per_source).flip(0)  # planted: the received rows reversed
    out["planted"] = run(comm, tmp_path / "planted", "--ep", "2")
    experts.expert_major_order = real
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep")
    codes, results = spawn(four_rank_job, 4, tmp, timeout=280)
    assert codes == [0, 0, 0, 0], codes
    results[0]["folder"] = str(tmp)
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


def test_a_resume_onto_another_ep_is_refused_in_one_line_naming_both(four_ranks):
    said = four_ranks[0]["other_ep"]
    assert said and "--ep 2" in said and "--ep 4" in said and "\n" not in said, said


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
    from zerotrain.checkpoint import model as checkpoint_model

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
    real = checkpoint_model.expert_home
    monkeypatch.setattr(checkpoint_model, "expert_home", lambda name, per_rank: (0, real(name, per_rank)[1]))
    planted = export_tensors(capfd, ckpt(f"ep{ep}"), tmp_path / "planted")
    assert export_gap(planted, base) > 1e-3


@pytest.mark.parametrize("flags, said", [
    (("--nproc", "4", "--ep", "3"), "--ep 3 does not divide the data-parallel size 4"),
    (("--nproc", "2", "--ep", "2", "--n-experts", "3", "--experts-per-token", "1"), "--ep 2 does not divide --n-experts 3"),
    (("--nproc", "2", "--ep", "2", "--tp", "2"), "--tp 2"),
])
def test_ep_settings_are_refused_in_one_line(capfd, tmp_path, flags, said):
    got = zerotrain_here(capfd, "train", "--preset", "qwen3-moe-tiny", "--data", "synthetic", "--steps", "1",
                         "--out", str(tmp_path / "x"), *flags)
    assert got.returncode == 2, got
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], got.stderr
