"""Mixtures of experts under tensor parallelism: TP 2 trains what 1 rank trains, and exports what transformers reads;
each family at EP 2 and ZeRO-3 too.

Tiny Qwen3-MoE, Qwen2-MoE (its shared expert), gpt-oss (biased experts: the down biases added once), OLMoE (q/k
norms over the whole projections, of which each TP rank holds its heads' slice) and Mixtral (a window, the top-k
always renormalised) from the qwen3-moe-tiny preset, 3 steps on synthetic data: each at TP 2, EP 2 and ZeRO-3 on 2
ranks (Qwen3-MoE's EP in test_expert_parallel.py, and here at TP 2 x DP 2, ZeRO-1 and ZeRO-3; OLMoE at TP 4, each of
its 2 KV heads on 2 ranks) against 1 rank on the same global batch: the losses (balancing term included) within 1e-6
relative, the final weights (reassembled from the TP slices of the checkpoint) within 1e-5. AdamW's eps is 1e-3: at 1e-8 its first steps
divide each gradient value by its own magnitude, so float noise in a near-zero value (an expert's row few tokens
reached) becomes a step of up to lr (measured: 5.6e-5 on one expert's down_proj at lr 1e-2, 1e-7 elsewhere).
Planted in the product's MoE code: its partial outputs never summed over the TP group (the all-reduce left out) is
stopped by the replica invariant; each rank's down_proj slices taken as the other rank's half, and OLMoE's norms
over each rank's own units (their sum of squares not all-reduced), trip the losses. The
TP 2 runs' exports load in transformers with the runs' logits; --init-from a Qwen2-MoE folder at TP 2 computes
transformers' logits, and a TP 2 checkpoint resumed on 1 rank takes 1 rank's next step. DPO on a tiny OLMoE folder
at TP 2 gives 1 rank's losses (its norms left rank-local, planted, are caught). One TP 2 rank saves the
activation bytes the memory plan counts, to the byte.
"""

from __future__ import annotations

import dataclasses
import functools

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
    "olmoe": ["--arch", "olmoe"],  # its q/k norms over the whole projections, of which each TP rank holds a slice
    "mixtral": ["--arch", "mixtral", "--sliding-window", "8"],  # Mistral's window, the top-k always renormalised
}


def config(out, *flags, preset=("--preset", "qwen3-moe-tiny")):
    from zerotrain.cli.flags import config_from_args
    from zerotrain.cli.main import build_parser
    from zerotrain.runtime.run_folder import resolve_paths

    args = build_parser().parse_args(["train", *preset, "--data", "synthetic", "--no-progress",
                                      "--steps", str(STEPS), "--ckpt-every", str(STEPS), "--lr", "1e-2",
                                      "--eps", "1e-3", "--seed", "3", "--out", str(out), *flags])
    return resolve_paths(config_from_args(args))


def train_job(rank, comm, tmp_path, runs, planted=None):
    """Each of `runs` ({name: flags}) trained on these ranks: {name: its losses}. `planted`, in the product's MoE
    code: "unsummed" (the layer's partial outputs never summed over the TP group), "swapped" (each TP rank's
    experts' down_proj slice taken as the other rank's half) or "local norm" (OLMoE's q/k norms' sums of squares
    left as each rank's own)."""
    from zerotrain.model import TPSlice, llama, moe
    from zerotrain.training.loop import train

    if planted == "local norm":
        llama.ReduceFromTP = type("NotReduced", (), {"apply": staticmethod(lambda x, comm, purpose: x)})

    if planted == "unsummed":
        moe.reduce_from_tp = lambda x, comm: x
    if planted == "swapped":
        real = moe.plan
        moe.plan = lambda cfg, tp, prefix: {n: TPSlice(s.dim, s.full_shape, s.parts[::-1]) if "down_proj" in n else s
                                            for n, s in real(cfg, tp, prefix).items()}
    return {name: [r["loss"] for r in train(config(tmp_path / name, *flags), comm, announce=False).records]
            for name, flags in runs.items()}


# Each family on 2 ranks, against 1 rank at micro-batch 4 (the same global batch): TP 2; and where no other test runs
# the family so, EP 2 and ZeRO-3 over 2 DP ranks (Qwen3-MoE's: test_expert_parallel.py, test_ep_tp.py and the
# TP 2 x DP 2 test below). One start of 2 ranks trains them all in turn.
SPLITS = {"tp2": ["--tp", "2", "--micro-batch", "4"], "ep2": ["--ep", "2", "--micro-batch", "2"],
          "zero3": ["--zero", "3", "--micro-batch", "2"]}
SPLIT_RUNS = [f"{family}-{split}" for split in SPLITS for family in FAMILIES
              if split == "tp2" or family != "qwen3_moe"]


def tp_runs(nproc: int) -> dict:
    if nproc == 2:
        return {name: [*FAMILIES[name.split("-")[0]], "--nproc", "2", *SPLITS[name.split("-")[1]]]
                for name in SPLIT_RUNS}
    return {**{f"qwen3_moe-tp2-dp2-zero{z}": ["--nproc", "4", "--tp", "2", "--micro-batch", "2", "--zero", str(z)]
               for z in (1, 3)},
            "olmoe-tp4": [*FAMILIES["olmoe"], "--nproc", "4", "--tp", "4", "--micro-batch", "4"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run name: (losses, run folder)}: 1 rank, and the SPLIT_RUNS of 2 ranks, per family."""
    from conftest import world_of_one

    tmp = tmp_path_factory.mktemp("moe_tp")
    out = {}
    codes, results = spawn(train_job, 2, tmp, tp_runs(2), timeout=560)
    assert codes == [0, 0], results
    out.update({name: (losses, tmp / name) for name, losses in results[0].items()})
    with world_of_one() as comm:
        out.update({name: (losses, tmp / name) for name, losses in train_job(
            0, comm, tmp, {f"{family}-1": [*flags, "--micro-batch", "4"] for family, flags in FAMILIES.items()}
        ).items()})
    return out


def final_weights(run) -> dict[str, torch.Tensor]:
    return zerotrain.load_model(str(run)).state_dict()


@pytest.mark.parametrize("split", SPLIT_RUNS)
def test_each_family_at_tp2_ep2_and_zero3_equals_one_rank_losses_and_final_weights(runs, split):
    family = split.split("-")[0]
    (theirs, one), (ours, run) = runs[f"{family}-1"], runs[split]
    assert len(ours) == STEPS and all(abs(a - b) <= 1e-6 * b for a, b in zip(ours, theirs)), (ours, theirs)
    full, split_w = final_weights(one), final_weights(run)
    assert full.keys() == split_w.keys()
    gaps = {n: (full[n] - split_w[n]).abs().max().item() for n in full}
    # OLMoE's TP 2 within 1e-6 (measured 1.8e-7, its q/k norms' gains 1.2e-7)
    assert max(gaps.values()) < (1e-6 if split == "olmoe-tp2" else 1e-5), max(gaps.items(), key=lambda kv: kv[1])


def test_an_unsummed_moe_output_swapped_expert_slices_and_rank_local_olmoe_norms_under_tp_are_caught(runs, tmp_path):
    flags = ["--nproc", "2", "--tp", "2", "--micro-batch", "4"]
    for planted in ("unsummed", "swapped", "local norm"):
        (tmp_path / planted).mkdir()
    # the layer's output left as each rank's partial sum: the ranks' replicated parameters part, which the run's
    # invariants stop
    codes, results = spawn(train_job, 2, tmp_path / "unsummed", {"planted": flags}, "unsummed", timeout=120)
    assert "replicated parameters of rank(s) [1] differ from rank 0" in results[0].get("error", ""), results
    # each rank's experts computing their gate/up half with the other half of down_proj: not the model's function
    codes, results = spawn(train_job, 2, tmp_path / "swapped", {"planted": flags}, "swapped", timeout=120)
    assert codes == [0, 0], results
    planted, honest = results[0]["planted"], runs["qwen3_moe-1"][0]
    # 10x the bound (measured 75x: the tiny model's experts add little to its output at initialisation)
    assert max(abs(a - b) / b for a, b in zip(planted, honest)) > 10 * 1e-6, (planted, honest)
    # OLMoE's q and k normalised by each rank's own units' mean of squares: not the model's function
    codes, results = spawn(train_job, 2, tmp_path / "local norm", {"planted": [*FAMILIES["olmoe"], *flags]},
                           "local norm", timeout=120)
    assert codes == [0, 0], results
    planted, honest = results[0]["planted"], runs["olmoe-1"][0]
    assert max(abs(a - b) / b for a, b in zip(planted, honest)) > 10 * 1e-6, (planted, honest)


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


def test_tp2_by_dp2_at_zero_1_and_3_and_olmoe_at_tp4_over_replicated_kv_heads_equal_one_rank(runs, tmp_path):
    codes, results = spawn(train_job, 4, tmp_path, tp_runs(4), timeout=300)
    assert codes == [0] * 4, results
    for name, ours in results[0].items():
        theirs, one = runs[f"{name.split('-')[0]}-1"]
        full = final_weights(one)
        assert len(ours) == STEPS and all(abs(a - b) <= 1e-6 * b for a, b in zip(ours, theirs)), (name, ours, theirs)
        split_w = final_weights(tmp_path / name)
        assert max((full[n] - split_w[n]).abs().max().item() for n in full) < 1e-5, name


class _OneRankOfTwo:
    """A TP group's collectives as one rank sees their shapes: the sums are left as they are (bytes, not values)."""

    def all_reduce(self, tensor, *args, **kwargs):
        return tensor


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss"])
def test_a_tp2_rank_saves_the_activations_the_plan_counts_and_full_width_experts_are_caught(family, monkeypatch):
    """One TP rank's saved bytes for a micro-batch, to the byte: its 1/T of every expert's (and the shared expert's)
    hidden width. Planted: the plan counting each expert's full width on every rank (TP 1's experts) is caught."""

    from test_activation_bytes import measured_bytes, predicted_bytes

    from zerotrain.config import PRESETS, ModelConfig
    from zerotrain.model import activation_memory, build_model, llama

    cfg = ModelConfig(**PRESETS["qwen3-moe-tiny"])
    if family == "qwen2_moe":
        cfg = dataclasses.replace(cfg, arch="qwen2_moe", norm_topk_prob=False, shared_expert_width=24,
                                  mlp_only_layers="1")
    if family == "olmoe":  # its q/k norms over each rank's slice of the projections
        cfg = dataclasses.replace(cfg, arch="olmoe", norm_topk_prob=False)
    if family == "gpt_oss":  # its sinks, biased experts and down biases added after the all-reduce
        cfg = dataclasses.replace(cfg, arch="gpt_oss")
    for precision in ("fp32", "bf16"):
        model = build_model(cfg, seed=0)
        llama.parallelize(model, 2, 0, _OneRankOfTwo())
        measured = measured_bytes(model, 2, 16, precision, "none")
        assert predicted_bytes(cfg, 2, 16, precision=precision, tp=2) == measured, precision
        real = activation_memory.experts
        with monkeypatch.context() as m:  # planted: every rank counted as holding whole experts
            m.setattr(activation_memory, "experts", lambda s, cfg, tp=1: real(s, cfg))
            assert predicted_bytes(cfg, 2, 16, precision=precision, tp=2) != measured


def test_gpt_oss_on_the_qwen3_moe_shape_keeps_its_softmax_weights_as_they_are_and_the_plan_holds_in_bf16(
        monkeypatch, tmp_path):
    """The qwen3-moe preset's norm_topk_prob under --arch gpt_oss does nothing: gpt-oss's top-k weights are a softmax
    over the top-k logits, summing to 1 (transformers' GptOssTopKRouter divides nothing), so the plan counts no
    quotient and a rank saves none, fp32 and bf16 (273,792 and 168,064 bytes at 2 x 16 tokens). Planted: the weights
    divided by their sum again, as before: in bf16 the quotient and the sum are bf16 (the softmax's dtype), 384 bytes
    under the plan's fp32 count (168,448 saved, 168,832 planned). --norm-topk-prob given with it is refused."""
    from test_activation_bytes import measured_bytes, predicted_bytes

    from zerotrain.cli.flags import config_from_args
    from zerotrain.cli.main import build_parser
    from zerotrain.config import PRESETS, ModelConfig
    from zerotrain.errors import ConfigError
    from zerotrain.model import build_model

    cfg = dataclasses.replace(ModelConfig(**PRESETS["qwen3-moe-tiny"]), arch="gpt_oss")
    assert cfg.norm_topk_prob and not cfg.renormalizes
    for precision in ("fp32", "bf16"):
        measured = measured_bytes(build_model(cfg, seed=0), 2, 16, precision, "none")
        assert predicted_bytes(cfg, 2, 16, precision=precision) == measured, precision
    monkeypatch.setattr(ModelConfig, "renormalizes", property(
        lambda self: self.norm_topk_prob or self.arch in ("mixtral", "qwen3_5_moe")))
    measured = measured_bytes(build_model(cfg, seed=0), 2, 16, "bf16", "none")
    assert predicted_bytes(cfg, 2, 16, precision="bf16") - measured == 384
    monkeypatch.undo()
    args = build_parser().parse_args(["train", "--preset", "qwen3-moe-tiny", "--arch", "gpt_oss", "--norm-topk-prob",
                                      "--data", "synthetic", "--out", str(tmp_path)])
    with pytest.raises(ConfigError, match="--norm-topk-prob applies to mixture-of-experts models but gpt_oss; "
                                          "qwen3-moe-tiny is --arch gpt_oss"):
        config_from_args(args, environment=False)


def init_from_job(rank, comm, tmp_path, folder):
    """The folder's model as --init-from reads it at TP 2 (each rank its slices): its logits on IDS."""
    from zerotrain.training.loop import build_engine

    cfg = config(tmp_path / "init", "--init-from", str(folder), "--nproc", "2", "--tp", "2", "--micro-batch", "4",
                 "--seq-len", "16", preset=())
    engine = build_engine(cfg, comm)
    with torch.no_grad():
        return engine.model(IDS).tolist()


IDS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))


def test_init_from_a_qwen2_moe_folder_at_tp2_and_a_tp2_resume_on_one_rank_continue_the_same_run(runs, tmp_path):
    from conftest import world_of_one
    from model_folders import moe_folder

    from zerotrain.training.loop import train

    hf = moe_folder(tmp_path / "qwen2_moe", "qwen2_moe")
    codes, results = spawn(init_from_job, 2, tmp_path, tmp_path / "qwen2_moe", timeout=120)
    assert codes == [0, 0], results
    with torch.no_grad():
        theirs = hf(IDS).logits
    assert "error" not in results[0] and "error" not in results[1], results
    assert all((torch.tensor(r) - theirs).abs().max() < 1e-5 for r in results)
    # a TP 2 checkpoint resumed on 1 rank (its slices and optimizer state put together) takes 1 rank's 4th step
    fourth = {}
    with world_of_one() as comm:
        for name in ("qwen3_moe-1", "qwen3_moe-tp2"):
            cfg = config(tmp_path / f"from-{name}", "--micro-batch", "4", "--steps", str(STEPS + 1), "--resume",
                         str(runs[name][1] / "checkpoints" / f"step_{STEPS:08d}"))
            fourth[name] = [r["loss"] for r in train(cfg, comm, announce=False).records]
    assert len(fourth["qwen3_moe-1"]) == 1
    assert abs(fourth["qwen3_moe-tp2"][0] - fourth["qwen3_moe-1"][0]) <= 1e-6 * fourth["qwen3_moe-1"][0], fourth


# DPO on a mixture of experts: a tiny OLMoE folder (transformers' own, with a tokenizer) tuned on 8 pairs, 2 steps at
# TP 2 and on 1 rank (AdamW eps 1e-3, as above). Its log-probs are vocab-parallel and its q/k norms all-reduced.
PAIRS = [{"prompt": f"Question {i}: what is {i} plus {i}?", "chosen": f" Answer: {2 * i}.",
          "rejected": f" Answer: {2 * i + 1}."} for i in range(8)]


def dpo_job(rank, comm, tmp_path, folder, pairs, name, *flags, planted=None):
    """The losses of 2 DPO steps from `folder` on `pairs`; `planted` as train_job's ("local norm")."""
    from zerotrain.cli.flags import config_from_args
    from zerotrain.cli.main import build_parser
    from zerotrain.model import llama
    from zerotrain.runtime.run_folder import resolve_paths
    from zerotrain.training.loop import train

    if planted == "local norm":
        llama.ReduceFromTP = type("NotReduced", (), {"apply": staticmethod(lambda x, comm, purpose: x)})
    args = build_parser().parse_args(["train", "--method", "dpo", "--init-from", str(folder), "--data", str(pairs),
                                      "--seq-len", "32", "--micro-batch", "4", "--steps", "2", "--lr", "1e-2", "--eps", "1e-3",
                                      "--no-progress", "--out", str(tmp_path / name), *flags])
    return [r["loss"] for r in train(resolve_paths(config_from_args(args)), comm, announce=False).records]


def test_dpo_on_olmoe_at_tp2_equals_one_rank_and_rank_local_norms_are_caught(tmp_path):
    from conftest import world_of_one
    from model_folders import VOCAB, moe_folder, tokenizer_folder, write_jsonl

    folder = tmp_path / "olmoe"
    moe_folder(folder, "olmoe", vocab_size=VOCAB, max_position_embeddings=64)
    tokenizer_folder(folder)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    with world_of_one() as comm:
        one = dpo_job(0, comm, tmp_path, folder, pairs, "one")
    tp2 = ("--nproc", "2", "--tp", "2")
    for name in ("tp2", "planted"):
        (tmp_path / name).mkdir()
    codes, results = spawn(dpo_job, 2, tmp_path / "tp2", folder, pairs, "tp2", *tp2, timeout=120)
    assert codes == [0, 0], results
    assert len(one) == 2 and one[1] != one[0] and all(abs(a - b) <= 1e-6 * b for a, b in zip(results[0], one)), \
        (results[0], one)
    codes, results = spawn(functools.partial(dpo_job, planted="local norm"), 2, tmp_path / "planted", folder, pairs,
                           "planted", *tp2, timeout=120)
    assert codes == [0, 0], results
    assert max(abs(a - b) / b for a, b in zip(results[0], one)) > 10 * 1e-6, (results[0], one)
