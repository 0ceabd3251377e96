"""DeepSeek-V3's and GLM-4.5's multi-token-prediction layer trained (--mtp train) against a reference built from
transformers' own modules: DeepseekV3ForCausalLM (Glm4MoeForCausalLM) for the main model, and for the MTP layer a
DeepseekV3DecoderLayer (Glm4MoeDecoderLayer), two of its RMSNorms (enorm, hnorm), an nn.Linear (eh_proj) and
shared_head.norm, loaded with the folder's MTP tensors
and composed as DeepSeek-V3's report (section 2.2) and vLLM's deepseek_mtp.py / Megatron-LM's
multi_token_prediction.py compose them (model/mtp.py): h^0 the main model's final-norm output, [enorm(Emb(t_{i+1})) ;
hnorm(h^0)] through eh_proj and the block, the main head after shared_head.norm predicting t_{i+2}; the loss the main
one + lambda x the MTP one, both summed over their targets and divided by the main loss's token count.

The summed loss equals the reference's at step 0 (fp32, within 1e-6 relative); packed records' loss equals each
record's alone; 8 AdamW steps at 1 rank, at ZeRO-3 on 2 ranks, at --ep 2, at --tp 2 and at ZeRO-3 with --ep 2 (the
MTP depth's unit a MoE block whose experts are split over the ranks) equal the reference loop within 1e-5 relative
(losses, gradient norms, the final weights, the MTP layer's among them); resumed from step 6 at 1 rank and at ZeRO-3
with --ep 2 the runs end bitwise where the uninterrupted ones do, and a resume that loses AdamW's moments is caught;
`zerotrain export --format hf` writes the trained MTP tensors under the folder's names (its copies of the embedding
and the head the trained ones) and transformers loads it. Planted in the functions the model runs and caught: the
concatenation's order swapped, the target one place too near, a packed record's MTP target taken from the next record.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import transformers
from conftest import world_of_one
from model_folders import read_weights
from reference_adamw import reference_adamw, reference_step
from safetensors.torch import load_file, save_file
from test_deepseek import SIZES, hf_model
from test_glm45 import hf_model as glm_model
from test_deepseek_training import in_turn_runs, one_rank_run, routing_bias_updates
from test_gemma import one_thread
from test_qwen35 import ROWS, config_for, gaps, weights_of
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm

from zerotrain.checkpoint import step_name
from zerotrain.config import ModelConfig
from zerotrain.data import IGNORE, BatchSchedule, make_source
from zerotrain.hub.mtp_layers import trained_name
from zerotrain.model import build_model, mtp

pytestmark = pytest.mark.timeout(900)
N_LAYER, C = SIZES["num_hidden_layers"], SIZES["hidden_size"]
MTP = f"model.layers.{N_LAYER}."  # the folder's MTP layer
WEIGHT = 0.3  # --mtp-loss-weight of the runs (not the default, so that a weight taken wrong shows)
FLAGS = ("--mtp", "train", "--mtp-loss-weight", str(WEIGHT))
RESUMED_AT = 6  # the step the resumed runs start from: two steps of their own, the moments carried through both
LIMIT = 700
# each family's tiny folder (test_deepseek's, test_glm45's: 3 layers, the last two MoE, hidden 64) and transformers'
# decoder layer and RMSNorm, which its MTP layer is built of
FAMILIES = {"deepseek_v3": (hf_model, DeepseekV3DecoderLayer, DeepseekV3RMSNorm),
            "glm4_moe": (glm_model, Glm4MoeDecoderLayer, Glm4MoeRMSNorm)}


class ReferenceMTP(nn.Module):
    """transformers' modules composed as DeepSeek-V3's MTP depth 1, loaded with the folder's MTP tensors."""

    def __init__(self, config, tensors: dict):
        super().__init__()
        _, layer, norm = FAMILIES[config.model_type]
        self.enorm = norm(C, config.rms_norm_eps)
        self.hnorm = norm(C, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * C, C, bias=False)
        self.block = layer(config, N_LAYER)
        self.head_norm = norm(C, config.rms_norm_eps)
        state = {n[len(MTP):]: t for n, t in tensors.items() if n.startswith(MTP)}
        own = {"enorm.weight": state.pop("enorm.weight"), "hnorm.weight": state.pop("hnorm.weight"),
               "eh_proj.weight": state.pop("eh_proj.weight"), "head_norm.weight": state.pop("shared_head.norm.weight")}
        state.pop("embed_tokens.weight"), state.pop("shared_head.head.weight")
        experts = len([n for n in state if n.endswith(".down_proj.weight") and ".experts." in n])
        for part in ("gate_proj", "up_proj", "down_proj"):  # one linear per expert in the files, stacked here
            stacked = torch.stack([state.pop(f"mlp.experts.{e}.{part}.weight") for e in range(experts)])
            state[f"mlp.experts.{part}"] = stacked
        state["mlp.experts.gate_up_proj"] = torch.cat([state.pop("mlp.experts.gate_proj"),
                                                       state.pop("mlp.experts.up_proj")], 1)
        self.load_state_dict({**own, **{"block." + n: t for n, t in state.items()}}, strict=True)
        self.block.mlp.gate.e_score_correction_bias.copy_(state["mlp.gate.e_score_correction_bias"])

    def ours(self) -> dict:
        """Its parameters under zerotrain's names (model.mtp_layers.{n}.*)."""
        names = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                 "head_norm.weight": "shared_head.norm.weight"}
        out = {}
        for n, p in self.named_parameters():
            n = names.get(n, n.removeprefix("block."))
            if n == "mlp.experts.gate_up_proj":
                F = p.shape[1] // 2
                out.update({f"mlp.experts.{e}.{part}.weight": w for e in range(len(p))
                            for part, w in (("gate_proj", p[e, :F]), ("up_proj", p[e, F:]))})
            elif n == "mlp.experts.down_proj":
                out.update({f"mlp.experts.{e}.down_proj.weight": p[e] for e in range(len(p))})
            else:
                out[n] = p
        return {f"model.mtp_layers.{N_LAYER}.{n}": p.detach().clone() for n, p in out.items()}


def reference_loss(hf, ref: ReferenceMTP, ids: torch.Tensor, labels: torch.Tensor, weight: float) -> torch.Tensor:
    """(the main loss summed + weight x depth 1's summed) / the main loss's tokens."""
    main, depth, tokens = reference_sums(hf, ref, ids, labels)
    return (main + weight * depth) / tokens


def reference_sums(hf, ref: ReferenceMTP, ids: torch.Tensor, labels: torch.Tensor):
    """(the main loss summed, depth 1's summed, the main loss's tokens)."""
    h = hf.model(ids).last_hidden_state  # after the final norm: the head's input
    ce = lambda logits, y: nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE,
                                                       reduction="sum")
    main = ce(hf.lm_head(h), labels)
    embedded = hf.model.embed_tokens(ids)
    next_embedded = torch.cat([embedded[:, 1:], torch.zeros_like(embedded[:, :1])], 1)  # Emb(t_{i+1})
    x = ref.eh_proj(torch.cat([ref.enorm(next_embedded), ref.hnorm(h)], -1))
    T = ids.shape[1]
    positions = torch.arange(T)[None]
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    x = ref.block(x, attention_mask=causal, position_ids=positions,
                  position_embeddings=hf.model.rotary_emb(x, positions))
    depth = ce(hf.lm_head(ref.head_norm(x)), torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], 1))
    return main, depth, (labels != IGNORE).sum()


def mtp_folder(folder, family: str = "deepseek_v3", **changes):
    """The family's tiny folder (3 layers, the last two MoE) with one MTP layer added as DeepSeek-V3's and GLM-4.5's
    files hold it: model.layers.3.* a MoE block drawn by transformers, enorm, hnorm, eh_proj, shared_head.norm (norms
    moved off 1) and the copies of the embedding and the head; config.json's num_nextn_predict_layers 1."""
    build, layer, _ = FAMILIES[family]
    hf = build(folder, **changes)
    torch.manual_seed(1)
    block = layer(hf.config, N_LAYER)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else
                    torch.randn_like(p) * hf.config.initializer_range)
        block.mlp.gate.e_score_correction_bias.copy_(torch.randn(hf.config.n_routed_experts) * 0.2)
    tensors = load_file(str(folder / "model.safetensors"))
    state = {n: t.detach().clone() for n, t in block.state_dict().items()}
    gate_up, down = state.pop("mlp.experts.gate_up_proj"), state.pop("mlp.experts.down_proj")
    F = down.shape[2]
    for e in range(len(down)):  # the files' layout: one linear per expert (transformers 5 stacks them in memory)
        state.update({f"mlp.experts.{e}.gate_proj.weight": gate_up[e, :F], f"mlp.experts.{e}.up_proj.weight":
                      gate_up[e, F:], f"mlp.experts.{e}.down_proj.weight": down[e]})
    tensors.update({MTP + n: t.contiguous() for n, t in state.items()})
    tensors.update({MTP + "enorm.weight": 1 + 0.3 * torch.randn(C), MTP + "hnorm.weight": 1 + 0.3 * torch.randn(C),
                    MTP + "shared_head.norm.weight": 1 + 0.3 * torch.randn(C),
                    MTP + "eh_proj.weight": torch.randn(C, 2 * C) * 3 * hf.config.initializer_range,
                    MTP + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    MTP + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return tensors


def loaded(folder, **changes):
    """(transformers' model of `folder`, the reference MTP layer, zerotrain's --mtp train model of it, fp32)."""
    tensors = load_file(str(folder / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager")
    ref = ReferenceMTP(hf.config, tensors)
    from zerotrain.hub.init_from import weight_source

    cfg = ModelConfig(**{**weight_source(str(folder)).model.__dict__, "mtp": "train", **changes})
    ours = build_model(cfg, 0)
    state = {}
    for n, t in tensors.items():
        name = trained_name(n) if n.startswith(MTP) else n
        if name is not None:
            state[name] = t
    ours.load_state_dict(state, strict=True)
    return hf.train(), ref.train(), ours.train()


@pytest.fixture(scope="module", params=list(FAMILIES))
def models(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("mtp") / "model"
    with one_thread():
        mtp_folder(folder, request.param)
        return loaded(folder, mtp_loss_weight=1.0)


IDS = torch.randint(0, SIZES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(5))
LABELS = torch.cat([IDS[:, 1:], torch.randint(0, SIZES["vocab_size"], (2, 1))], 1)


def our_loss(model, ids=IDS, labels=LABELS, segments=None) -> torch.Tensor:
    return model(ids, segments=segments, targets=labels) / (labels != IGNORE).sum()


def test_the_loss_at_step_0_is_the_references(models):
    hf, ref, ours = models
    with one_thread():
        theirs, mine = reference_loss(hf, ref, IDS, LABELS, 1.0), our_loss(ours)
    assert abs(float(mine) - float(theirs)) <= 1e-6 * abs(float(theirs)), (float(mine), float(theirs))


def swapped(embedded, hidden):
    return torch.cat([hidden, embedded], -1)


def one_too_near(targets, segments, k, depth_targets=mtp.depth_targets):
    return depth_targets(targets, segments, k - 1)


@pytest.mark.parametrize("bug", ["concatenation swapped", "target one place too near"])
def test_a_planted_bug_changes_the_loss(models, monkeypatch, bug):
    hf, ref, ours = models
    if bug == "concatenation swapped":
        monkeypatch.setattr(mtp, "joined", swapped)
    else:
        monkeypatch.setattr(mtp, "depth_targets", one_too_near)
    with one_thread():
        theirs, mine = reference_loss(hf, ref, IDS, LABELS, 1.0), our_loss(ours)
    # 10x the bound the unplanted loss keeps (measured 0.0); planted, 7.5e-5 to 1.8e-2 was measured
    assert abs(float(mine) - float(theirs)) > 1e-5 * abs(float(theirs))


def packed_gap(model) -> float:
    """|the loss of two records packed in one row - the two records' losses alone| / the latter (summed losses)."""
    a, b = 10, 14
    segments = torch.tensor([[0] * a + [1] * b])
    with one_thread():
        packed = model(IDS[:1], segments=segments, targets=LABELS[:1].clone().index_fill_(1, torch.tensor([a - 1]),
                                                                                          IGNORE))
        alone = model(IDS[:1, :a], targets=LABELS[:1, :a].clone().index_fill_(1, torch.tensor([a - 1]), IGNORE)) + \
            model(IDS[:1, a:], targets=LABELS[:1, a:])
    return abs(float(packed) - float(alone)) / abs(float(alone))


def test_packed_records_equal_each_record_alone_and_a_target_from_the_next_record_is_caught(models, monkeypatch):
    _, _, ours = models
    assert packed_gap(ours) <= 1e-6
    monkeypatch.setattr(mtp, "depth_targets", lambda targets, segments, k, f=mtp.depth_targets: f(targets, None, k))
    assert packed_gap(ours) > 1e-4


def reference_run(folder, lrs: list[float], scratch) -> dict:
    """The runs' steps (config_for's batches) in a plain loop: transformers' model and the reference MTP layer, one
    AdamW over both (reference_adamw); the final weights under zerotrain's names."""
    cfg = config_for(folder, scratch / "run", *FLAGS)
    torch.manual_seed(0)
    hf, ref, _ = loaded(folder)
    both = nn.ModuleDict(dict(hf=hf, ref=ref))
    optimizer = reference_adamw(both, lrs[0])
    move_biases = routing_bias_updates(hf.model.layers.modules())  # the decoder's routers alone
    schedule = BatchSchedule(make_source(cfg), micro_batch=ROWS, accum=1, rank=0, world_size=1)
    out = {"loss": [], "grad_norm": []}
    for step, lr in enumerate(lrs):
        micro = schedule.batch(step).micro_batches[0]
        loss = reference_loss(hf, ref, micro.inputs, micro.labels, WEIGHT)
        out["grad_norm"].append(reference_step(optimizer, both, loss, lr))
        move_biases()
        out["loss"].append(float(loss.detach()))
    hf.save_pretrained(str(scratch / "weights"))  # read back as zerotrain's names (its experts one linear each)
    out["weights"] = {**read_weights(scratch / "weights"), **ref.ours()}
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def runs(tmp_path_factory, request):
    """{"1 rank" | "zero3" | "ep2" | "tp2" | "zero3-ep2" | "reference": {"loss", "grad_norm", "weights"}, "resumed" |
    "zero3-ep2-resumed": steps 7-8 of "1 rank" | "zero3-ep2" from its step-6 checkpoint, "zero3-ep2-forgetful": the
    latter with a resume that loses AdamW's moments (planted), "folder": the 1-rank run's} of each family."""
    from dist_jobs import forgetful_train_job
    from zerotrain.training.loop import train_job

    tmp = tmp_path_factory.mktemp("mtp-runs")
    folder = tmp / "model"
    with one_thread():
        mtp_folder(folder, request.param, initializer_range=0.02)
    # at --zero 3 --ep 2 the MTP depth's unit is a MoE block whose experts --ep splits: 8 steps saving at step 6, then
    # steps 7-8 again from that checkpoint (and with the planted resume), in the same start
    zero3_ep2 = ("--zero", "3", "--ep", "2", "--micro-batch", "1")
    saved = ("--resume", str(tmp / "zero3-ep2" / "checkpoints" / step_name(RESUMED_AT)))
    jobs = {"zero3": (train_job, ("--zero", "3", "--micro-batch", "1")),
            "ep2": (train_job, ("--ep", "2", "--micro-batch", "1")), "tp2": (train_job, ("--tp", "2")),
            "zero3-ep2": (train_job, (*zero3_ep2, "--ckpt-every", str(RESUMED_AT))),
            "zero3-ep2-resumed": (train_job, (*zero3_ep2, *saved)),
            "zero3-ep2-forgetful": (forgetful_train_job, (*zero3_ep2, *saved))}
    out = in_turn_runs({name: (job, config_for(folder, tmp / name, *FLAGS, "--nproc", "2", *flags))
                        for name, (job, flags) in jobs.items()}, LIMIT)
    for name in jobs:
        out[name]["weights"] = weights_of(tmp / name)
    with one_thread(), world_of_one() as comm:
        out["1 rank"] = one_rank_run(config_for(folder, tmp / "1-rank", *FLAGS, "--ckpt-every", str(RESUMED_AT)), comm)
        saved = next((tmp / "1-rank").rglob(step_name(RESUMED_AT)))  # steps 7-8 again, the MTP layer from the checkpoint
        out["resumed"] = one_rank_run(config_for(folder, tmp / "resumed", *FLAGS, "--resume", str(saved)), comm)
        out["reference"] = reference_run(folder, out["1 rank"]["lr"], tmp / "reference")
    out["folder"], out["file bytes"] = tmp / "1-rank", (folder / "model.safetensors").stat().st_size
    out["mtp bytes"] = sum(t.numel() * 4 for n, t in load_file(str(folder / "model.safetensors")).items()
                           if trained_name(n) is not None and n.startswith(MTP))
    return out


def test_a_resume_continues_the_mtp_layer_bitwise_and_zero3_reads_each_ranks_slice(runs):
    """Resumed from step 6, step 8's weights (the MTP layer's among them) are the uninterrupted run's bitwise; at
    ZeRO-3 (and at ZeRO-3 with --ep 2) each rank read its owned ranges' rows of the folder (less than 3/4 of its file),
    the MTP layer's among them (the two ranks together at least its bytes)."""
    ours, resumed = runs["1 rank"]["weights"], runs["resumed"]["weights"]
    assert any(n.startswith("model.mtp_layers.") for n in ours)
    assert all(torch.equal(resumed[n], ours[n]) for n in ours)
    for run in ("zero3", "zero3-ep2"):
        reads = runs[run]["read"]
        assert len(reads) == 2 and all(0 < r < 0.75 * runs["file bytes"] for r in reads), (run, reads)
        assert sum(reads) >= runs["mtp bytes"], (run, reads, runs["mtp bytes"])


def test_a_resume_at_zero3_with_ep2_continues_the_mtp_layer_bitwise_and_a_resume_losing_the_moments_is_caught(runs):
    """At ZeRO-3 with the MTP depth's experts split over --ep 2, resumed from step 6: steps 7-8's losses and step 8's
    weights (the MTP layer's among them) are the uninterrupted run's bitwise; resumed without AdamW's moments
    (planted in checkpoint.resume, which the loop calls), the MTP layer's are not."""
    ours, resumed, forgetful = runs["zero3-ep2"], runs["zero3-ep2-resumed"], runs["zero3-ep2-forgetful"]
    assert "error" not in resumed and "error" not in forgetful, (resumed, forgetful)
    assert resumed["loss"] == ours["loss"][RESUMED_AT:] and resumed["grad_norm"] == ours["grad_norm"][RESUMED_AT:]
    mtp_names = [n for n in ours["weights"] if n.startswith("model.mtp_layers.")]
    assert any(".experts." in n for n in mtp_names)
    assert set(resumed["weights"]) == set(ours["weights"])
    assert all(torch.equal(resumed["weights"][n], ours["weights"][n]) for n in ours["weights"])
    # planted: a resume that loses AdamW's moments ends elsewhere, the MTP layer's weights among them
    assert not all(torch.equal(forgetful["weights"][n], ours["weights"][n]) for n in mtp_names)


@pytest.mark.parametrize("run", ["1 rank", "zero3", "ep2", "tp2", "zero3-ep2"])
def test_eight_steps_train_as_the_reference_loop_does(runs, run):
    ours, theirs = runs[run], runs["reference"]
    assert "error" not in ours, ours
    assert set(theirs["weights"]) <= set(ours["weights"])
    gap = gaps(ours, theirs)
    assert gap["loss"] <= 1e-5 and gap["grad_norm"] <= 1e-5 and gap["weights"] <= 1e-5, gap
    mtp_names = [n for n in theirs["weights"] if n.startswith("model.mtp_layers.")]
    assert mtp_names
    moved = gaps({**ours, "weights": {n: ours["weights"][n] for n in mtp_names}},
                 {**theirs, "weights": {n: theirs["weights"][n] for n in mtp_names}})["weights"]
    assert moved <= 1e-5, moved


def test_the_export_writes_the_trained_mtp_layer_under_the_folders_names(runs, tmp_path):
    from zerotrain.cli.main import main

    assert main(["export", str(runs["folder"]), str(tmp_path / "out"), "--format", "hf", "--dtype", "fp32"]) == 0
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    ours = runs["1 rank"]["weights"]
    trained = {n for n in written if n.startswith(MTP)}
    assert MTP + "eh_proj.weight" in trained and MTP + "self_attn.o_proj.weight" in trained
    for n in trained:
        name = trained_name(n) or {"embed_tokens.weight": "model.embed_tokens.weight",
                                   "shared_head.head.weight": "lm_head.weight"}[n[len(MTP):]]
        assert torch.equal(written[n], ours[name]), n
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert type(theirs).__name__ in ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
    back = read_weights(tmp_path / "out")  # --init-from of the export reads its main model as the run's
    assert all(torch.equal(back[n], ours[n]) for n in back)


@pytest.fixture(scope="module")
def mtp_model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-mtp-refused") / "model"
    with one_thread():
        mtp_folder(folder)
    return folder


def test_the_guard_takes_a_uniform_guess_at_every_depth_as_the_chance_loss():
    from zerotrain.config import Config
    from zerotrain.training.objectives import TokenObjective

    cfg = Config()
    cfg.model = ModelConfig(arch="deepseek_v3", vocab_size=300, mtp_layers=1, mtp="train", mtp_loss_weight=0.3)
    assert abs(TokenObjective(cfg).loss_rule().chance_loss - 1.3 * math.log(300)) < 1e-12
    cfg.model.mtp = "frozen"
    assert abs(TokenObjective(cfg).loss_rule().chance_loss - math.log(300)) < 1e-12


@pytest.mark.parametrize("flags, said", [
    (("--lora-rank", "4"), "--lora-rank 4 does not train with --mtp train yet: give --mtp frozen"),
    (("--nproc", "2", "--cp", "2"), "--cp 2 does not train with --mtp train yet: give --mtp frozen"),
    (("--activation-checkpointing", "full"),
     "--activation-checkpointing full does not train with --mtp train yet: give --mtp frozen"),
    (("--mtp-layers", "0"), "--mtp train: the model has no multi-token-prediction layers (--mtp-layers 0)"),
])
def test_what_mtp_training_does_not_have_is_refused_in_one_line(mtp_model_folder, flags, said, capsys):
    from test_deepseek import assert_refused_in_one_line

    folder = mtp_model_folder
    if flags[0] == "--mtp-layers":  # a folder without MTP layers
        config = json.loads((folder / "config.json").read_text())
        (folder.parent / "plain").mkdir(exist_ok=True)
        for f in folder.iterdir():
            (folder.parent / "plain" / f.name).write_bytes(f.read_bytes())
        (folder.parent / "plain" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
        folder, flags = folder.parent / "plain", ()
    assert_refused_in_one_line(capsys, ["train", "--init-from", str(folder), "--data", "synthetic", "--mtp", "train",
                                        *flags], said)


# Qwen3.5's head (mtp.*): test_qwen35's tiny dense and MoE folders at 0.02 with its MTP head (with_mtp_head), against
# transformers' Qwen3_5DecoderLayer (Qwen3_5MoeDecoderLayer) of full attention, its (1 + w) RMSNorms and an nn.Linear
# (fc), composed as vLLM's qwen3_next_mtp.py runs them: fc([pre_fc_norm_embedding(Emb(t_{i+1})) ;
# pre_fc_norm_hidden(h^0)]), the block, mtp.norm, the main head. The runs without the MoE's balancing loss
# (--moe-aux-coef 0): the reference's loss is the token losses' (test_qwen35's runs test the balancing loss).
QWEN_FLAGS = {"qwen3_5": FLAGS, "qwen3_5_moe": (*FLAGS, "--moe-aux-coef", "0")}


class QwenReferenceMTP(nn.Module):
    """transformers' modules composed as Qwen3.5's MTP depth 1, loaded with the folder's mtp.* tensors: the block
    is transformers' own layer n of a model of n + 1 layers (the last of full attention) read from the folder's
    tensors and the block's (so that transformers stacks its experts as it reads them), under `scratch`."""

    def __init__(self, folder, scratch):
        super().__init__()
        tensors = load_file(str(folder / "model.safetensors"))
        config = json.loads((folder / "config.json").read_text())
        self.n, self.scratch = config["num_hidden_layers"], scratch
        scratch.mkdir(parents=True, exist_ok=True)
        (scratch / "config.json").write_text(json.dumps({**config, "num_hidden_layers": self.n + 1,
                                                         "layer_types": config["layer_types"] + ["full_attention"],
                                                         "mtp_num_hidden_layers": 0}))
        block = {n.replace("mtp.layers.0.", f"model.layers.{self.n}."): t for n, t in tensors.items()
                 if n.startswith("mtp.layers.0.")}
        save_file({**{n: t for n, t in tensors.items() if not n.startswith("mtp.")}, **block},
                  str(scratch / "model.safetensors"), metadata={"format": "pt"})
        self.big = [transformers.AutoModelForCausalLM.from_pretrained(str(scratch), attn_implementation="eager")]
        self.block = self.big[0].model.layers[self.n]
        norm = type(self.big[0].model.norm)
        C = tensors["mtp.fc.weight"].shape[0]
        self.fc = nn.Linear(2 * C, C, bias=False)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = (norm(C, config["rms_norm_eps"])
                                                                          for _ in range(3))
        with torch.no_grad():
            for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
                getattr(self, name).weight.copy_(tensors[f"mtp.{name}.weight"])

    def forward(self, hf, ids, labels, weight: float) -> torch.Tensor:
        """(the main loss summed + weight x depth 1's summed) / the main loss's tokens."""
        h = hf.model(ids).last_hidden_state
        ce = lambda logits, y: nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE,
                                                           reduction="sum")
        embedded = hf.model.embed_tokens(ids)
        next_embedded = torch.cat([embedded[:, 1:], torch.zeros_like(embedded[:, :1])], 1)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embedded), self.pre_fc_norm_hidden(h)], -1))
        B, T = ids.shape
        positions = torch.arange(T)[None]
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        rotary = hf.model.rotary_emb(x, positions[None].expand(3, B, T))
        x = self.block(x, position_embeddings=rotary, attention_mask=causal, position_ids=positions)
        depth = ce(hf.lm_head(self.norm(x)), torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], 1))
        return (ce(hf.lm_head(h), labels) + weight * depth) / (labels != IGNORE).sum()

    def ours(self) -> dict:
        """Its parameters under zerotrain's (and the folder's) names, the block's read back through transformers'
        save (its experts one linear each)."""
        self.big[0].save_pretrained(str(self.scratch / "saved"))
        saved = load_file(str(self.scratch / "saved" / "model.safetensors"))
        prefix = f"model.layers.{self.n}."
        out = {"mtp.layers.0." + n[len(prefix):]: t for n, t in saved.items() if n.startswith(prefix)}
        out.update({f"mtp.{name}.weight": getattr(self, name).weight.detach().clone()
                    for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
        return out


def qwen_folder(folder, family: str, initializer_range: float):
    from test_qwen35 import hf_model as qwen_model, with_mtp_head

    qwen_model(folder, family, initializer_range)
    head = with_mtp_head(folder)  # drawn at std 1: brought to the model's scale (matrices), norms' w off 0 by 0.3
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update({n: t * (initializer_range if t.dim() >= 2 else 0.3) for n, t in head.items()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def qwen_loaded(folder, scratch, **changes):
    """(transformers' model of `folder`, the reference MTP head, zerotrain's --mtp train model of it, fp32)."""
    from zerotrain.hub.init_from import weight_source

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager")
    ref = QwenReferenceMTP(folder, scratch)
    cfg = ModelConfig(**{**weight_source(str(folder)).model.__dict__, "mtp": "train", **changes})
    ours = build_model(cfg, 0)
    ours.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return hf.train(), ref.train(), ours.train()


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def qwen_models(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("qwen-mtp")
    with one_thread():
        qwen_folder(tmp / "model", request.param, 0.1)
        return qwen_loaded(tmp / "model", tmp / "reference", mtp_loss_weight=1.0)


QWEN_IDS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(5))
QWEN_LABELS = torch.cat([QWEN_IDS[:, 1:], torch.randint(0, 300, (2, 1))], 1)


@pytest.mark.parametrize("bug", [None, "concatenation swapped", "target one place too near"])
def test_qwen35s_loss_at_step_0_is_the_references_and_a_planted_bug_changes_it(qwen_models, monkeypatch, bug):
    hf, ref, ours = qwen_models
    if bug == "concatenation swapped":
        monkeypatch.setattr(mtp, "joined", swapped)
    elif bug == "target one place too near":
        monkeypatch.setattr(mtp, "depth_targets", one_too_near)
    with one_thread():
        theirs = float(ref(hf, QWEN_IDS, QWEN_LABELS, 1.0))
        mine = float(our_loss(ours, QWEN_IDS, QWEN_LABELS))
    if bug is None:
        assert abs(mine - theirs) <= 1e-6 * abs(theirs), (mine, theirs)
    else:
        assert abs(mine - theirs) > 1e-5 * abs(theirs), (mine, theirs)


def test_qwen35s_packed_records_equal_each_record_alone_and_a_target_from_the_next_record_is_caught(qwen_models,
                                                                                                   monkeypatch):
    _, _, ours = qwen_models
    assert packed_gap(ours) <= 1e-6
    monkeypatch.setattr(mtp, "depth_targets", lambda targets, segments, k, f=mtp.depth_targets: f(targets, None, k))
    assert packed_gap(ours) > 1e-4


def qwen_reference_run(folder, family: str, lrs: list[float], scratch) -> dict:
    """The runs' steps in a plain loop over transformers' model and the reference head, one AdamW over both; the
    final weights under zerotrain's names."""
    cfg = config_for(folder, scratch / "run", *QWEN_FLAGS[family])
    torch.manual_seed(0)
    hf, ref, _ = qwen_loaded(folder, scratch / "reference")
    both = nn.ModuleDict(dict(hf=hf, ref=ref))
    optimizer = reference_adamw(both, lrs[0])
    schedule = BatchSchedule(make_source(cfg), micro_batch=ROWS, accum=1, rank=0, world_size=1)
    out = {"loss": [], "grad_norm": []}
    for step, lr in enumerate(lrs):
        micro = schedule.batch(step).micro_batches[0]
        loss = ref(hf, micro.inputs, micro.labels, WEIGHT)
        out["grad_norm"].append(reference_step(optimizer, both, loss, lr))
        out["loss"].append(float(loss.detach()))
    hf.save_pretrained(str(scratch / "weights"))
    out["weights"] = {**read_weights(scratch / "weights"), **ref.ours()}
    return out


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def qwen_runs(tmp_path_factory, request):
    """{"family", "1 rank" | "zero3" | "tp2" | "ep2" (the MoE's) | "reference": {"loss", "grad_norm", "weights"},
    "folder": the 1-rank run's}."""
    from zerotrain.training.loop import train_job

    tmp = tmp_path_factory.mktemp("qwen-mtp-runs")
    folder = tmp / "model"
    with one_thread():
        qwen_folder(folder, request.param, 0.02)
    jobs = {"zero3": ("--zero", "3", "--micro-batch", "1"), "tp2": ("--tp", "2"),
            **({"ep2": ("--ep", "2", "--micro-batch", "1")} if request.param.endswith("moe") else {})}
    flags_of = QWEN_FLAGS[request.param]
    out = in_turn_runs({name: (train_job, config_for(folder, tmp / name, *flags_of, "--nproc", "2", *flags))
                        for name, flags in jobs.items()}, LIMIT)
    for name in jobs:
        out[name]["weights"] = weights_of(tmp / name)
    with one_thread(), world_of_one() as comm:
        out["1 rank"] = one_rank_run(config_for(folder, tmp / "1-rank", *flags_of), comm)
        out["reference"] = qwen_reference_run(folder, request.param, out["1 rank"]["lr"], tmp / "reference")
    out["folder"], out["family"] = tmp / "1-rank", request.param
    return out


def test_qwen35s_eight_steps_train_as_the_reference_loop_does(qwen_runs):
    """At 1 rank, ZeRO-3, TP 2 and (the MoE's) EP 2."""
    from test_qwen35 import WEIGHTS_BOUND

    theirs, bound = qwen_runs["reference"], WEIGHTS_BOUND[qwen_runs["family"]]
    runs = [run for run in ("1 rank", "zero3", "tp2", "ep2") if run in qwen_runs]
    assert len(runs) == (4 if qwen_runs["family"].endswith("moe") else 3), runs
    for run in runs:
        ours = qwen_runs[run]
        assert "error" not in ours, (run, ours)
        assert set(theirs["weights"]) <= set(ours["weights"])
        gap = gaps(ours, theirs)
        assert gap["loss"] <= 1e-5 and gap["grad_norm"] <= 1e-5 and gap["weights"] <= bound, (run, gap)
        heads = [n for n in theirs["weights"] if n.startswith("mtp.")]
        assert heads
        moved = gaps({**ours, "weights": {n: ours["weights"][n] for n in heads}},
                     {**theirs, "weights": {n: theirs["weights"][n] for n in heads}})["weights"]
        assert moved <= bound, (run, moved)


def test_qwen35s_export_writes_the_trained_head(qwen_runs, tmp_path):
    from zerotrain.cli.main import main

    assert main(["export", str(qwen_runs["folder"]), str(tmp_path / "out"), "--format", "hf", "--dtype", "fp32"]) == 0
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    ours = qwen_runs["1 rank"]["weights"]
    heads = [n for n in ours if n.startswith("mtp.")]
    assert heads and all(torch.equal(written[n], ours[n]) for n in heads)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert type(theirs).__name__.startswith("Qwen3_5")
