"""A mixture of experts' balancing loss does not depend on the split, and ZeRO-3 trains experts that get no token.

One step of the tiny Qwen3-MoE (qwen3-moe-tiny, --moe-aux-coef 0.5, so that the balancing term is a large part of the
loss and its gradient) on the same global batch of 4 sequences: 1 rank x micro-batch 4, 2 ranks x 2, 1 rank x
accumulation 4 x 1. The balancing loss, the loss and the gradient norm agree within 1e-6; a balancing term averaged
per micro-batch instead of over the global batch (planted in training/balancing.py's Balancing.term) is caught.
ZeRO-3 on 2 ranks, with 16 experts, top-1, 4-token micro-batches (most experts get no token in a micro-batch),
trains what ZeRO-1 does.
"""

from __future__ import annotations


import pytest
import torch
from test_checkpoint import spawn

from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.model import moe
from zerotrain.runtime.run_folder import resolve_paths
from zerotrain.training import balancing
from zerotrain.training.loop import train

pytestmark = pytest.mark.timeout(300)

SPLITS = {"1 rank x 4": ("--nproc", "1", "--micro-batch", "4"), "2 ranks x 2": ("--nproc", "2", "--micro-batch", "2"),
          "accumulation 4 x 1": ("--nproc", "1", "--micro-batch", "1", "--accum", "4")}
SPARSE = ("--n-experts", "16", "--experts-per-token", "1", "--seq-len", "4", "--micro-batch", "1", "--accum", "2")


def config(out, *flags):
    args = build_parser().parse_args(["train", "--preset", "qwen3-moe-tiny", "--data", "synthetic", "--no-progress",
                                      "--steps", "1", "--moe-aux-coef", "0.5", "--lr", "1e-2", "--out", str(out),
                                      *flags])
    return resolve_paths(config_from_args(args))


def figures(result) -> dict:
    first = result.records[0]
    return {"aux_loss": first["aux_loss"], "loss": first["loss"], "grad_norm": first["grad_norm"],
            "expert_load": first["expert_load"]}


def two_rank_job(rank, comm, tmp_path, split, sparse):
    """2 ranks: the split's step; then ZeRO-1 and ZeRO-3 of the sparse model, with how many experts went without a
    token in this rank's micro-batches."""
    out = {"split": figures(train(config(tmp_path / "split", *split), comm, announce=False))}
    idle = []
    real = moe.expert_loop
    moe.expert_loop = lambda experts, tokens, counts, sizes=None: idle.append(int((counts == 0).sum())) or \
        real(experts, tokens, counts, sizes)
    for zero in ("1", "3"):
        result = train(config(tmp_path / f"zero{zero}", *sparse, "--nproc", "2", "--zero", zero, "--steps", "3"),
                       comm, announce=False)
        out[f"zero{zero}"] = [r["loss"] for r in result.records]
    out["idle"] = idle
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe2")
    codes, results = spawn(two_rank_job, 2, tmp, SPLITS["2 ranks x 2"], SPARSE, timeout=200)
    assert codes == [0, 0], results
    return results[0]


def per_micro_batch(real):
    """Planted: each micro-batch's balancing term averaged over its own rows, not the global batch's."""
    def term(self, model, *args):
        sequences = self.sequences
        self.sequences = moe.moe_layers(model)[0].routing.counts.shape[0]
        try:
            return real(self, model, *args)
        finally:
            self.sequences = sequences
    return term


def test_the_balancing_loss_is_the_same_for_every_split_and_a_per_micro_batch_mean_is_caught(
        two_ranks, one_rank, tmp_path, monkeypatch):
    runs = {"2 ranks x 2": two_ranks["split"]}
    for name in ("1 rank x 4", "accumulation 4 x 1"):
        runs[name] = figures(train(config(tmp_path / name.replace(" ", "_"), *SPLITS[name]), one_rank,
                                   announce=False))
    reference = runs["1 rank x 4"]
    assert reference["aux_loss"] * 0.5 > 0.1 * reference["loss"]  # the term weighs in the loss
    for name, got in runs.items():
        for key in ("aux_loss", "loss", "grad_norm"):
            assert abs(got[key] - reference[key]) <= 1e-6 * reference[key], (name, key, got, reference)
        assert got["expert_load"] == reference["expert_load"], name
    monkeypatch.setattr(balancing.Balancing, "term", per_micro_batch(balancing.Balancing.term))
    planted = figures(train(config(tmp_path / "planted", *SPLITS["accumulation 4 x 1"]), one_rank, announce=False))
    assert abs(planted["loss"] - reference["loss"]) > 1e-2 * reference["loss"]
    assert abs(planted["grad_norm"] - reference["grad_norm"]) > 1e-3 * reference["grad_norm"]


def test_zero3_trains_experts_that_get_no_token_in_a_micro_batch_as_zero1_does(two_ranks):
    assert max(two_ranks["idle"]) >= 8  # most of the 16 experts got no token in some micro-batch
    assert len(two_ranks["zero3"]) == 3
    for a, b in zip(two_ranks["zero1"], two_ranks["zero3"]):
        assert abs(a - b) <= 1e-6 * a, (two_ranks["zero1"], two_ranks["zero3"])


def test_moe_aux_coef_is_validated_in_one_line(capfd, tmp_path):
    from conftest import zerotrain_here
    from test_user_errors import one_line_error

    r = zerotrain_here(capfd, "train", "--preset", "qwen3-moe-tiny", "--moe-aux-coef", "-0.5", "--steps", "1",
                       "--out", str(tmp_path / "bad"))
    line = one_line_error(r)
    assert "--moe-aux-coef" in line and "-0.5" in line, line
    r = zerotrain_here(capfd, "train", "--preset", "llama-tiny", "--moe-aux-coef", "0.1", "--steps", "1",
                       "--out", str(tmp_path / "dense"))
    assert "no experts" in one_line_error(r)




@pytest.mark.parametrize("flags, said", [
    (("--arch", "qwen3_moe"), "give --n-experts"),
    (("--n-experts", "4"), "--n-experts 4 is for --arch qwen3_moe or"),
    (("--arch", "qwen3_moe", "--n-experts", "4", "--experts-per-token", "5"), "--experts-per-token 5 is more than"),
    (("--arch", "mixtral", "--n-experts", "4", "--shared-expert-width", "8"), "--shared-expert-width 8 is for"),
    (("--arch", "qwen3_moe", "--n-experts", "4", "--mlp-only-layers", "0,7"), "'7' is not a layer 0-1"),
    (("--arch", "qwen3_moe", "--n-experts", "4", "--expert-width", "30", "--nproc", "4", "--tp", "4"),
     "--tp 4 does not divide the experts' width"),
    (("--arch", "qwen2_moe", "--n-experts", "4", "--shared-expert-width", "30", "--nproc", "4", "--tp", "4"),
     "--tp 4 does not divide --shared-expert-width 30"),
    (("--arch", "qwen3_moe", "--n-experts", "4", "--nproc", "2", "--tp", "2", "--lora-rank", "4"),
     "--tp 2: LoRA on the experts' projections"),
    (("--mlp-only-layers", "1"), "--mlp-only-layers 1 is for a mixture of experts"),
])
def test_what_a_mixture_of_experts_cannot_be_is_refused_naming_the_flag(flags, said):
    from zerotrain.errors import ConfigError

    with pytest.raises(ConfigError, match=said.replace("(", r"\(")):
        config_from_args(build_parser().parse_args(["train", "--preset", "llama-tiny", "--data", "synthetic",
                                                    *flags]))
