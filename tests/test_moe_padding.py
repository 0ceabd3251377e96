"""Padding trains nothing in a mixture of experts: empty rows leave the balancing loss, the pad token's row its lookups.

The oracle is a plain transformers + AdamW loop. A tiny Qwen3-MoE saved by transformers with pad_token_id 0 (its
embedding's padding row, nn.Embedding's padding_idx, starts at zero and its lookups give it no gradient), trained
8 steps with --init-from on 10 records, one per row (--no-pack: each row padded with id 0 after its record), 4 rows a
step: every epoch's last step holds 2 records and 2 empty rows (no trained token). The loop feeds transformers each
step's rows with a trained token, one forward per row (its aux_loss is that row's balancing loss, every position
counted, as zerotrain's), the loss the summed token losses / the step's target tokens + coef x the rows' mean
aux_loss, clipped at 1, AdamW with zerotrain's decay groups and learning rates. Losses, balancing losses and gradient
norms agree within 1e-5 at every step, the final weights within 1e-5, and the padding row stays exactly zero.
Planted in the product's code and caught: the empty rows counted in the balancing loss and the global batch's rows
dividing it (training/balancing.py's old behaviour, through its own names), and the embedding built without its
padding row (model/vocab.token_embedding, which the model builds it with).

At ZeRO-1, 2 and 3 and under TP 2 (the embedding split by vocabulary rows), a random-init model with --pad-token-id 0
starts that row at zero and, with weight decay, keeps it at zero over 3 steps of padded rows; a TP rank holding the
padding row in the upper half of the vocabulary gives it no gradient either. Every Llama family member's config.json
gives its pad_token_id (its class's default where absent) as the padding row transformers builds, and the export
writes it back; a reading that drops it is caught.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import transformers
from model_folders import moe_folder, read_weights
from reference_adamw import reference_adamw, reference_step
from test_checkpoint import spawn
from test_packing import make_records, write_records

from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.data import IGNORE, BatchSchedule, make_source
from zerotrain.model import build_model, decoder as decoder_module, vocab
from zerotrain.runtime.run_folder import resolve_paths
from zerotrain.training import balancing
from zerotrain.training.loop import train

pytestmark = pytest.mark.timeout(300)

STEPS, ROWS, RECORDS, SEQ, COEF = 8, 4, 10, 24, 0.5
EMBEDDING = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the Qwen3-MoE folder with pad 0, the records' data folder)."""
    root = tmp_path_factory.mktemp("padding")
    moe_folder(root / "model", "qwen3_moe", vocab_size=256, pad_token_id=0)
    return root / "model", write_records(root / "data", make_records(RECORDS))


def config(out, model, data, *flags):
    args = build_parser().parse_args(["train", "--init-from", str(model), "--data", str(data), "--no-pack",
                                      "--seq-len", str(SEQ), "--micro-batch", str(ROWS), "--steps", str(STEPS),
                                      "--moe-aux-coef", str(COEF), "--lr", "1e-3", "--weight-decay", "0.1",
                                      "--threads", "1", "--no-progress", "--out", str(out), *flags,
                                      # 10 records learnt by heart: the loss of a step of other records jumps back,
                                      # which the guard's spike tests would take for a divergence
                                      "--spike-window", "4", "--spike-factor", "100"])
    return resolve_paths(config_from_args(args))


def zerotrain_run(cfg, comm) -> dict:
    result = train(cfg, comm, announce=False)
    weights = {n: p.detach().clone() for n, p in result.engine.model.named_parameters()}
    return {key: [r[key] for r in result.records] for key in ("loss", "aux_loss", "grad_norm", "lr")} | {
        "weights": weights}


def transformers_run(cfg, folder, lrs: list[float], saved) -> dict:
    """The same steps in a plain loop over transformers' model: each step's rows with a trained token. Its final
    weights are saved in `saved` and read back as zerotrain's parameters (transformers 5 stacks the experts)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa").train()
    optimizer = reference_adamw(hf, lrs[0])
    schedule = BatchSchedule(make_source(cfg), micro_batch=ROWS, accum=1, rank=0, world_size=1)
    out = {"loss": [], "aux_loss": [], "grad_norm": [], "empty_rows": []}
    for step, lr in enumerate(lrs):
        micro = schedule.batch(step).micro_batches[0]
        trained = (micro.labels != IGNORE).any(-1)
        tokens = int((micro.labels != IGNORE).sum())
        token_loss, aux = 0.0, 0.0
        for x, y in zip(micro.inputs[trained], micro.labels[trained]):
            result = hf(x[None], output_router_logits=True)
            token_loss = token_loss + nn.functional.cross_entropy(result.logits[0], y, ignore_index=IGNORE,
                                                                  reduction="sum")
            aux = aux + result.aux_loss
        aux = aux / int(trained.sum())
        loss = token_loss / tokens + COEF * aux
        out["grad_norm"].append(reference_step(optimizer, hf, loss, lr))
        out["loss"].append(float(loss.detach()))
        out["aux_loss"].append(float(aux.detach()))
        out["empty_rows"].append(int((~trained).sum()))
    hf.save_pretrained(str(saved))
    out["weights"] = read_weights(saved)
    return out


def gaps(ours: dict, theirs: dict) -> dict:
    """The largest relative gap of each figure over the steps, and the largest absolute gap of the final weights."""
    out = {key: max(abs(a - b) / abs(b) for a, b in zip(ours[key], theirs[key]))
           for key in ("loss", "aux_loss", "grad_norm")}
    out["weights"] = max((ours["weights"][n] - theirs["weights"][n]).abs().max().item() for n in theirs["weights"])
    return out


@pytest.fixture(scope="module")
def runs(folders, tmp_path_factory):
    """{name: zerotrain's run}, honest and planted, and transformers' loop."""
    from conftest import world_of_one

    model, data = folders
    tmp = tmp_path_factory.mktemp("runs")
    out = {}
    with world_of_one() as comm, pytest.MonkeyPatch.context() as mp:
        out["honest"] = zerotrain_run(config(tmp / "honest", model, data), comm)
        # planted, the old balancing: every row's loss counted, the global batch's rows dividing it
        real = balancing.balancing_loss
        mp.setattr(balancing, "balancing_loss", lambda model, take=True, rows=None, whole_rows=None: real(model, take))
        mp.setattr(balancing.Balancing, "rows", lambda self, global_rows: self.sequences)
        out["empty rows counted"] = zerotrain_run(config(tmp / "counted", model, data), comm)
        mp.undo()
        # planted: the embedding built without its padding row
        mp.setattr(decoder_module, "token_embedding", lambda rows, width, padding_idx: nn.Embedding(rows, width))
        out["no padding row"] = zerotrain_run(config(tmp / "unpadded", model, data), comm)
    out["transformers"] = transformers_run(config(tmp / "oracle", model, data), model, out["honest"]["lr"],
                                           tmp / "oracle_weights")
    return out


def test_a_pad_id_0_moe_with_empty_rows_trains_as_transformers_over_the_real_rows(runs, folders):
    theirs, ours = runs["transformers"], runs["honest"]
    assert theirs["empty_rows"] == [0, 0, 2, 0, 0, 2, 0, 0]  # each epoch's last step: 2 records, 2 empty rows
    assert COEF * min(theirs["aux_loss"]) > 1000 * 1e-5 * max(theirs["loss"])  # the term well above the bound
    gap = gaps(ours, theirs)
    assert all(g <= 1e-5 for g in gap.values()), gap
    start = transformers.AutoModelForCausalLM.from_pretrained(str(folders[0])).model.embed_tokens.weight
    assert not start[0].any() and not ours["weights"][EMBEDDING][0].any()  # the padding row: zero, and kept so
    assert (ours["weights"][EMBEDDING][1:] - start[1:]).abs().max() > 1e-3  # the other rows trained


def test_empty_rows_counted_in_the_balancing_loss_are_caught(runs):
    theirs, planted = runs["transformers"], runs["empty rows counted"]
    assert planted["aux_loss"][:2] == pytest.approx(theirs["aux_loss"][:2], rel=1e-5)  # no empty row yet
    assert abs(planted["aux_loss"][2] - theirs["aux_loss"][2]) > 1e-2 * theirs["aux_loss"][2]
    assert gaps(planted, theirs)["loss"] > 100 * 1e-5


def test_an_embedding_without_its_padding_row_is_caught(runs):
    theirs, planted = runs["transformers"], runs["no padding row"]
    assert gaps(planted, theirs)["grad_norm"] > 100 * 1e-5
    assert planted["weights"][EMBEDDING][0].abs().max() > 1e-3  # the padding row trained


# ZeRO stages and TP: a random-init model's padding row starts at zero and stays there.

def padding_row_job(rank, comm, tmp_path, data, planted):
    """Qwen3-MoE from the seed with --pad-token-id 0, 3 steps at ZeRO-1, 2, 3 and TP 2: each run's padding row and
    the largest change of the other rows of the embedding, after the last step."""
    from zerotrain import load_model

    if planted:
        decoder_module.token_embedding = lambda rows, width, padding_idx: nn.Embedding(rows, width)
    runs = {"zero1": ["--zero", "1"], "zero2": ["--zero", "2"], "zero3": ["--zero", "3"],
            "tp2": ["--tp", "2", "--micro-batch", "4"]} if not planted else {"tp2": ["--tp", "2", "--micro-batch", "4"]}
    out = {}
    for name, flags in runs.items():
        args = build_parser().parse_args(["train", "--preset", "qwen3-moe-tiny", "--data", str(data), "--no-pack",
                                          "--vocab-size", "256", "--pad-token-id", "0", "--seq-len", str(SEQ),
                                          "--micro-batch", "2", "--nproc", "2", "--steps", "3", "--ckpt-every", "3",
                                          "--lr", "1e-2", "--weight-decay", "0.1", "--no-progress",
                                          "--out", str(tmp_path / name), *flags])
        train(resolve_paths(config_from_args(args)), comm, announce=False)
        trained = load_model(str(tmp_path / name)).model.embed_tokens.weight
        out[name] = (trained[0].abs().max().item(), trained[1:].abs().max().item())
    return out


def test_the_padding_row_starts_at_zero_and_stays_there_at_every_zero_stage_and_under_tp(folders, tmp_path):
    for run in ("honest", "planted"):
        (tmp_path / run).mkdir()
    codes, results = spawn(padding_row_job, 2, tmp_path / "honest", folders[1], False, timeout=250)
    assert codes == [0, 0], results
    assert set(results[0]) == {"zero1", "zero2", "zero3", "tp2"}
    for name, (pad_row, others) in results[0].items():
        assert pad_row == 0.0 and others > 1e-2, (name, pad_row, others)
    # planted: the embedding without its padding row (under TP, each rank's rows built from it)
    codes, results = spawn(padding_row_job, 2, tmp_path / "planted", folders[1], True, timeout=120)
    assert codes == [0, 0], results
    assert results[0]["tp2"][0] > 1e-3, results[0]


class _OneRankOfTwo:
    """A TP group's all-reduce as one rank sees it: the rank's own part, left as it is."""

    def all_reduce(self, tensor, *args, **kwargs):
        return tensor


def test_a_tp_rank_holding_the_padding_row_gives_it_no_gradient_and_a_planted_full_index_is_caught(monkeypatch):
    full = vocab.token_embedding(16, 4, padding_idx=11)  # rank 1 of 2 holds rows 8..15: the padding row is its 3
    split = vocab.VocabParallelEmbedding(full, vocab.vocab_slice(16, 4, 2), 1, _OneRankOfTwo())
    ids = torch.tensor([[11, 9, 11, 3, 15]])
    split(ids).sum().backward()
    assert not split.weight.grad[3].any() and split.weight.grad[1].any() and split.weight.grad[7].any()
    # planted: the rank's slice built without the padding row (only the rank whose rows start at 0 would find it)
    real = vocab.VocabParallelEmbedding.__init__

    def without_padding(self, *args):
        real(self, *args)
        self.padding_idx = None

    monkeypatch.setattr(vocab.VocabParallelEmbedding, "__init__", without_padding)
    again = vocab.VocabParallelEmbedding(full, vocab.vocab_slice(16, 4, 2), 1, _OneRankOfTwo())
    again(ids).sum().backward()
    assert again.weight.grad[3].any()



# Every family's config.json: pad_token_id read as the padding row, the family's default where absent, written back.

def family_configs() -> dict:
    """{model_type: a transformers config of that family, as its class fills it in} for every Llama family member."""
    from model_folders import FAMILY_SIZES, MOE_FAMILIES, family_config, moe_config

    sizes = dict(head_dim=16, max_position_embeddings=32)
    configs = {family: family_config(family, **sizes) for family in ("llama", "qwen2", "qwen3", "mistral", "phi3")}
    configs.update({family: moe_config(family) for family in MOE_FAMILIES})
    gemma = {**FAMILY_SIZES, **sizes, "sliding_window": 4, "query_pre_attn_scalar": 16}
    configs["gemma2"] = transformers.Gemma2Config(**gemma)
    configs["gemma3_text"] = transformers.Gemma3TextConfig(**gemma, sliding_window_pattern=2)
    configs["gpt_oss"] = transformers.GptOssConfig(**{**FAMILY_SIZES, **sizes, "num_local_experts": 4,
                                                      "num_experts_per_tok": 2, "sliding_window": 4})
    linear = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                  linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"])
    qwen35 = {**FAMILY_SIZES, **sizes, **linear, "num_hidden_layers": 2}
    configs["qwen3_5_text"] = transformers.Qwen3_5TextConfig(**qwen35)
    configs["qwen3_5_moe_text"] = transformers.Qwen3_5MoeTextConfig(
        **qwen35, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    from test_deepseek import SIZES as DEEPSEEK_SIZES
    from test_gemma4 import hf_config as gemma4_config
    from test_glm45 import SIZES as GLM_SIZES
    from test_llama4 import hf_config as llama4_config
    from test_mistral4 import SIZES as MISTRAL4_SIZES

    configs["deepseek_v3"] = transformers.DeepseekV3Config(**DEEPSEEK_SIZES)
    configs["mistral4"] = transformers.Mistral4Config(**MISTRAL4_SIZES)
    configs["glm4_moe"] = transformers.Glm4MoeConfig(**GLM_SIZES)
    configs["llama4_text"] = llama4_config()
    configs["gemma4_text"] = gemma4_config(moe=True)  # with the MoE block, without per-layer inputs, whose table's
    configs["gemma4_text"].hidden_size_per_layer_input = 0  # vocabulary is the model's (the survey reads 40000)
    return configs


def test_every_family_reads_its_pad_token_id_writes_it_back_and_a_dropped_one_is_caught(monkeypatch):
    from zerotrain.errors import CheckpointError
    from zerotrain.hub import mapping

    for kind, config in family_configs().items():
        default = type(config)().pad_token_id  # the class's own, where config.json leaves it out
        # a vocabulary Phi-3's default (32000) fits
        absent = {**{k: v for k, v in config.to_dict().items() if k != "pad_token_id"}, "vocab_size": 40000}
        assert mapping.model_config_from_hf(absent, kind).padding_idx == default, kind
        for pad in (7, None):
            cfg = mapping.model_config_from_hf({**config.to_dict(), "pad_token_id": pad}, kind)
            assert cfg.padding_idx == pad and mapping.hf_config(cfg, None)["pad_token_id"] == pad, (kind, pad)
        ours = build_model(cfg.__class__(**{**cfg.__dict__, "pad_token_id": 7}), 0)
        written = mapping.hf_config(ours.cfg, None)  # the class it names: AutoModelForCausalLM lacks Mistral 4's
        theirs = getattr(transformers, written["architectures"][0])(transformers.AutoConfig.for_model(**written))
        assert ours.embedding.padding_idx == theirs.get_input_embeddings().padding_idx == 7, kind
    assert set(family_configs()) == {m.model_type for m in mapping.MAPPINGS.values()} - {"gpt2"}
    with pytest.raises(CheckpointError, match="^config.json: pad_token_id 96 is not an id of the vocabulary of 96"):
        mapping.model_config_from_hf({**family_configs()["llama"].to_dict(), "pad_token_id": 96}, "config.json")
    # planted: the reading drops pad_token_id
    monkeypatch.setattr(mapping, "_padding_id", lambda *a: -1)
    assert mapping.model_config_from_hf({**family_configs()["qwen3_moe"].to_dict(), "pad_token_id": 7},
                                        "config.json").padding_idx is None
