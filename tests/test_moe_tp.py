"""Mixtures of experts under tensor parallelism: TP 2 trains what 1 rank trains, and exports what transformers reads.

Tiny Qwen3-MoE, Qwen2-MoE (its shared expert) and gpt-oss (biased experts: the down biases added once) from the
qwen3-moe-tiny preset, 3 steps on synthetic data: each at TP 2 against 1 rank on the same global batch: the losses (balancing term included) within 1e-6 relative, the final
weights (reassembled from the TP slices of the checkpoint) within 1e-5. Planted in the product's MoE layer: its
partial outputs never summed over the TP group (the all-reduce left out) trips the losses. The TP 2 run's export
loads in transformers with the run's logits.
"""

from __future__ import annotations

import pytest
import torch
from test_checkpoint import spawn

import zerotrain

pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("moe_tp")]

STEPS = 3
FAMILIES = {  # flags beside the preset's
    "qwen3_moe": [],
    "qwen2_moe": ["--arch", "qwen2_moe", "--shared-expert-width", "32"],
    "gpt_oss": ["--arch", "gpt_oss"],
}


def config(out, *flags):
    from zerotrain.cli.flags import config_from_args
    from zerotrain.cli.main import build_parser
    from zerotrain.runtime.run_folder import resolve_paths

    args = build_parser().parse_args(["train", "--preset", "qwen3-moe-tiny", "--data", "synthetic", "--no-progress",
                                      "--steps", str(STEPS), "--ckpt-every", str(STEPS), "--lr", "1e-2",
                                      "--seed", "3", "--out", str(out), *flags])
    return resolve_paths(config_from_args(args))


def train_job(rank, comm, tmp_path, runs, planted=False):
    """Each of `runs` ({name: flags}) trained on these ranks: {name: its losses}."""
    from zerotrain.model import moe
    from zerotrain.training.loop import train

    if planted:  # the MoE layer's partial outputs left unsummed over the TP group
        moe.reduce_from_tp = lambda x, comm: x
    return {name: [r["loss"] for r in train(config(tmp_path / name, *flags), comm, announce=False).records]
            for name, flags in runs.items()}


def tp_runs(nproc: int) -> dict:
    if nproc == 2:
        return {f"{family}-tp2": [*flags, "--nproc", "2", "--tp", "2", "--micro-batch", "4"]
                for family, flags in FAMILIES.items()}
    return {f"qwen3_moe-tp2-dp2-zero{z}": ["--nproc", "4", "--tp", "2", "--micro-batch", "2", "--zero", str(z)]
            for z in (1, 3)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run name: (losses, run folder)}: 1 rank and TP 2 per family (tp_runs(4): TP 2 x DP 2, ZeRO-1 and ZeRO-3,
    kept out of CI for its cost on 2 cores)."""
    from conftest import world_of_one

    tmp = tmp_path_factory.mktemp("moe_tp")
    out = {}
    codes, results = spawn(train_job, 2, tmp, tp_runs(2), timeout=400)
    assert codes == [0, 0], results
    out.update({name: (losses, tmp / name) for name, losses in results[0].items()})
    with world_of_one() as comm:
        out.update({name: (losses, tmp / name) for name, losses in train_job(
            0, comm, tmp, {f"{family}-1": [*flags, "--micro-batch", "4"] for family, flags in FAMILIES.items()}
        ).items()})
    return out


def final_weights(run) -> dict[str, torch.Tensor]:
    return zerotrain.load_model(str(run)).state_dict()


@pytest.mark.parametrize("split", [f"{f}-tp2" for f in FAMILIES])
def test_a_tp2_moe_run_equals_one_rank_losses_and_final_weights(runs, split):
    family = split.split("-")[0]
    (theirs, one), (ours, run) = runs[f"{family}-1"], runs[split]
    assert len(ours) == STEPS and all(abs(a - b) <= 1e-6 * b for a, b in zip(ours, theirs)), (ours, theirs)
    full, split_w = final_weights(one), final_weights(run)
    assert full.keys() == split_w.keys()
    gaps = {n: (full[n] - split_w[n]).abs().max().item() for n in full}
    assert max(gaps.values()) < 1e-5, max(gaps.items(), key=lambda kv: kv[1])


def test_the_moe_layer_output_left_unsummed_over_tp_is_caught(runs, tmp_path):
    codes, results = spawn(train_job, 2, tmp_path, {"planted": ["--nproc", "2", "--tp", "2", "--micro-batch", "4"]},
                           True, timeout=300)
    assert codes == [0, 0], results
    planted, honest = results[0]["planted"], runs["qwen3_moe-1"][0]
    assert abs(planted[0] - honest[0]) > 1e-3 * honest[0]


def test_a_tp2_moe_export_loads_in_transformers_with_the_runs_logits(runs, tmp_path, capfd):
    import transformers
    from conftest import zerotrain_here

    for family in FAMILIES:
        run = runs[f"{family}-tp2"][1]
        r = zerotrain_here(capfd, "export", str(run), str(tmp_path / family), "--format", "hf")
        assert r.returncode == 0, r.stderr[-2000:]
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / family)).eval()
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ours, theirs = zerotrain.load_model(str(run))(ids), loaded(ids).logits
        assert (ours - theirs).abs().max() < 1e-5, family
