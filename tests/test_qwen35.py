"""Qwen3.5 (dense and MoE) against transformers' Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM, on its torch path
(torch_chunk_gated_delta_rule, conv1d): tiny models built by transformers with both layer types (linear attention,
full attention, twice), norms, dt_bias and A_log moved off their starts, sequences of 150 tokens (three chunks of
the delta rule, the last padded), read by `load_model` and --init-from.

Logits within 1e-4 of transformers' (measured: dense 6.9e-6, MoE 1.4e-5); packed records equal each record alone
within 1e-6 at every linear-attention layer (records crossing the chunks' edges), and through the whole model;
decoding through the cache (the linear layers' state and convolution kept beside it) equals the full forward.
Planted in the functions zerotrain runs and caught: the decay without its A, beta at 1, the attention's output gate
or the gated norm's gate dropped, the convolution or the delta rule not restarted at a record's first token, the
linear layers' state not carried through the cache.

Tensor parallelism: --init-from at TP 2 (each rank reading its slices) computes transformers' logits within 1e-4
(measured: dense 2.5e-5, MoE 2.2e-5); planted in qwen35.plan and caught (logits off by 2.9-5.5): the value heads'
in_proj_z/a/b rows dealt to the other rank, the convolution's channels not split with their heads, the attention's
query-and-gate rows on the other rank.

Training: 8 AdamW steps of --init-from at 1 rank (in this process), at ZeRO-3, at --tp 2 and (the MoE) at --ep 2 on 2
ranks (one start of 2 ranks for all) equal a plain transformers + AdamW loop: losses and gradient norms within 1e-5
relative (measured on the dense model: 1.4e-7 and 1.8e-7 at 1 rank, 1.4e-7 and 3.7e-7 at TP 2), the final weights
within 1e-5 relative (dense TP 2: 1.7e-6; the MoE's within 5e-5: WEIGHTS_BOUND, measured 1.8e-5 at 1 rank, ZeRO-3
and EP 2, 2.1e-5 at TP 2, fp32's noise grown by the steps, as its comment measures; gaps()'s docstring says why the
whole model's); in fp64 throughout, 8 steps of zerotrain's model equal transformers' within 1e-12 (measured 2.6e-15;
a gated norm's eps at 10 x caught); the MoE's loss with its balancing loss, per row as zerotrain takes it; the
trained models (the TP 2 and EP 2 runs' through `zerotrain export`, their slices stitched back, each expert from its
EP rank) export with --format hf to the same transformers class computing the run's logits, config.json both ways.

The multi-token-prediction head: the training folders hold one (mtp.*, counted by mtp_num_hidden_layers), which
import sets aside at every split the runs take and every export (1 rank, ZeRO-3, TP 2, EP 2, and a LoRA run's merged
model from its --init-from folder) writes back bitwise; an export without it (mtp_layers_of planted away in
hub/export.py) is caught, and a folder that counts it without holding it fails the export in one line.

LoRA on every linear of the blocks (the linear layers' in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj among
them): 3 steps at TP 2 give 1 rank's losses, and both runs' peft exports give 1 rank's logits on transformers' model
(measured 3.6e-7); B split as a plain column-parallel linear's (planted in model/lora.py) trains alike but exports
rows where they were not trained (0.24 off) and is caught. The MoE's adapters on its attention and linear layers
export to peft with the run's logits. A --tp that does not divide the linear layers' heads is refused in one line,
exit 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import types

import pytest
import torch
import torch.nn as nn
import transformers
from conftest import world_of_one
from dist_jobs import in_turn_job
from safetensors.torch import load_file, save_file
from test_gemma import one_thread

import zerotrain
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.data import IGNORE, BatchSchedule, make_source
from zerotrain.hub import export, init_from, mapping
from zerotrain.hub.export import export_model
from zerotrain.model import build_model, is_decayed, qwen35
from zerotrain.model.kv_cache import KVCache
from zerotrain.model.moe import balancing_loss
from zerotrain.runtime.launch import run_job
from zerotrain.runtime.run_folder import resolve_paths

pytestmark = pytest.mark.timeout(600)

VOCAB, SEQ = 300, 150
SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
             linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
             initializer_range=0.1, layer_types=["linear_attention", "full_attention"] * 2)
CONFIGS = {
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**SIZES, intermediate_size=96),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**SIZES, num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=32,
                                                             shared_expert_intermediate_size=40),
}
HF_CLASSES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
EXACT, CAUGHT = 1e-4, 1e-3
RECORDS = (50, 40, 60)  # one row of SEQ: the second record starts in the first chunk, the third in the second
LIMIT = 300  # seconds: a deadlocked job fails the test instead of hanging CI


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def hf_model(folder, family: str, initializer_range: float = 0.1):
    """A tiny random `family` model saved by transformers in `folder`; the model in eval mode, eager attention."""
    torch.manual_seed(0)
    config = CONFIGS[family]()
    config.initializer_range = initializer_range
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # (1 + w) norms start at w = 0, the gated norm at 1, dt_bias at 1: moved off them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(folder))
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35")
    with one_thread():
        return {family: (root / family, hf_model(root / family, family)) for family in CONFIGS}


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
        return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("family", list(CONFIGS))
def test_load_model_computes_the_logits_transformers_does(folders, family):
    folder, hf = folders[family]
    model = zerotrain.load_model(str(folder))
    cfg = model.cfg
    assert [cfg.linear_attention(layer) for layer in range(4)] == [True, False, True, False]
    assert (cfg.arch, cfg.rotary_dim, cfg.n_experts) == (family, 4, 4 if family.endswith("moe") else 0)
    assert (logits(model) - logits(hf)).abs().max() < EXACT


def no_decay_rate(a, b, A_log, dt_bias):
    """Planted: the decay without exp(A_log)."""
    return -nn.functional.softplus(a.float() + dt_bias), b.sigmoid()


PLANTED = {
    "decay without A": lambda mp: mp.setattr(qwen35, "decay_and_beta", no_decay_rate),
    "beta at 1": lambda mp: mp.setattr(qwen35, "decay_and_beta", lambda a, b, A_log, dt_bias: (
        -A_log.float().exp() * nn.functional.softplus(a.float() + dt_bias), torch.ones_like(b))),
    "attention output ungated": lambda mp: mp.setattr(qwen35, "output_gate", lambda y, gate: y),
    "linear output ungated": lambda mp: mp.setattr(qwen35, "gated_rms_norm", lambda x, gate, weight, eps: (
        weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)))),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_changes_the_logits(folders, monkeypatch, bug):
    folder, hf = folders["qwen3_5"]
    PLANTED[bug](monkeypatch)
    assert (logits(zerotrain.load_model(str(folder))) - logits(hf)).abs().max() > CAUGHT


# Packed records: the convolution and the state restart at each record's first token.

def segments() -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(RECORDS)]).expand(2, SEQ).contiguous()


def spans() -> list[tuple[int, int]]:
    edges = [0]
    for n in RECORDS:
        edges.append(edges[-1] + n)
    return list(zip(edges, edges[1:]))


def linear_layer_gap(model) -> float:
    """max over the linear-attention layers of |the layer's output on the packed row - its output on each record
    alone|, the same inputs (random, of the width the layer takes), in the model's dtype."""
    dtype = model.lm_head.weight.dtype
    x = torch.randn(2, SEQ, model.cfg.n_embd, generator=torch.Generator().manual_seed(5)).to(dtype)
    starts = qwen35.record_starts(segments())
    gap = 0.0
    with torch.no_grad():
        for block in model.model.layers:
            if not block.linear:
                continue
            packed = block.linear_attn(x, None, 0, starts)
            alone = torch.cat([block.linear_attn(x[:, a:b], None, 0, None) for a, b in spans()], dim=1)
            gap = max(gap, (packed - alone).abs().max().item())
    return gap


def packed_vs_alone(model) -> float:
    """max |the logits of the packed row - each record's alone|, both zerotrain's, in the model's dtype."""
    with torch.no_grad():
        packed = model(IDS, segments=segments())
        alone = torch.cat([model(IDS[:, a:b]) for a, b in spans()], dim=1)
    return (packed - alone).abs().max().item()


PACKING_PLANTED = {
    "convolution not restarted": lambda mp: mp.setattr(
        qwen35, "causal_conv", functools.partial(lambda real, x, w, starts=None, past=None: real(x, w, None, past),
                                                 qwen35.causal_conv)),
    "state not restarted": lambda mp: mp.setattr(
        qwen35, "chunk_gated_delta_rule", functools.partial(
            lambda real, q, k, v, g, beta, starts=None, state=None: real(q, k, v, g, beta, None, state),
            qwen35.chunk_gated_delta_rule)),
}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_packed_records_equal_each_record_alone_at_every_linear_layer(folders, family):
    """In fp64 (the delta rule computes in the inputs' dtype, at least fp32) within 1e-6: measured 0 at the layers'
    outputs (their gated norm rounds to fp32), and at the logits. In fp32 within the chunked rule's own rounding: a
    record that starts inside a chunk is chunked on another grid than alone (measured 6.8e-6 at a layer's output of
    2.7; transformers' own output of one sequence moves 2.9e-6 when its chunk size goes from 64 to 32)."""
    model = zerotrain.load_model(str(folders[family][0]))
    assert linear_layer_gap(model) < EXACT and packed_vs_alone(model) < EXACT
    precise = zerotrain.load_model(str(folders[family][0])).double()
    assert linear_layer_gap(precise) < 1e-6 and packed_vs_alone(precise) < 1e-6
    # transformers' logits of each record alone, too
    theirs = torch.cat([logits(folders[family][1], IDS[:, a:b]) for a, b in spans()], dim=1)
    with torch.no_grad():
        assert (model(IDS, segments=segments()) - theirs).abs().max() < EXACT


@pytest.mark.parametrize("bug", list(PACKING_PLANTED))
def test_a_record_reading_the_one_before_it_is_caught(folders, monkeypatch, bug):
    model = zerotrain.load_model(str(folders["qwen3_5"][0])).double()
    PACKING_PLANTED[bug](monkeypatch)
    assert linear_layer_gap(model) > CAUGHT
    assert packed_vs_alone(model) > CAUGHT


def cached_logits(model, prompt: int = 70) -> torch.Tensor:
    """Logits of IDS through the cache: the prompt in one forward (two chunks), then one token per forward."""
    ids = IDS[:, :80]
    cache = KVCache(model.cfg, ids.shape[0])
    with torch.no_grad():
        steps = [model(ids[:, :prompt], cache)] + [model(ids[:, t : t + 1], cache) for t in range(prompt, 80)]
    return torch.cat(steps, dim=1)


def test_decoding_through_the_cache_carries_the_linear_layers_state(folders, monkeypatch):
    model = zerotrain.load_model(str(folders["qwen3_5"][0]))
    full = logits(model, IDS[:, :80])
    assert (cached_logits(model) - full).abs().max() < EXACT
    monkeypatch.setattr(qwen35, "recurrent_state", lambda cache, layer: (None, None))  # planted: state dropped
    assert (cached_logits(model) - full).abs().max() > CAUGHT


# Tensor parallelism: --init-from at TP 2 (each rank reads its slices) computes transformers' logits; a slice dealt
# wrong is caught.

def swapped(names: tuple[str, ...]):
    """Planted in qwen35.plan: the slices of the parameters whose names end with one of `names` dealt to the other
    rank (rank 0 takes rank 1's heads and rank 1 rank 0's), the rest of the layer as it was."""
    from zerotrain.model import TPSlice

    real = qwen35.plan

    def plan(cfg, tp):
        return {n: TPSlice(s.dim, s.full_shape, s.parts[::-1]) if n.endswith(names) else s
                for n, s in real(cfg, tp).items()}
    return plan


TP_PLANTED = {
    "value heads on the other rank": ("in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight"),
    "convolution channels not with their heads": ("conv1d.weight",),
    "attention gate rows on the other rank": ("self_attn.q_proj.weight",),
}


def tp_logits_job(rank, comm, tmp_path, folders):
    """Each family's folder as --init-from reads it at TP 2, and the dense one under each of TP_PLANTED: their logits
    on IDS, by name."""
    from unittest import mock

    from zerotrain.training.loop import build_engine

    runs = {family: None for family in folders} | {bug: TP_PLANTED[bug] for bug in TP_PLANTED}
    out = {}
    with one_thread():
        for name, planted in runs.items():
            folder = folders.get(name, folders["qwen3_5"])
            cfg = config_for(folder, tmp_path / name.replace(" ", "-"), "--nproc", "2", "--tp", "2",
                             "--seq-len", str(SEQ))
            with mock.patch.object(qwen35, "plan", swapped(planted)) if planted else contextlib.nullcontext():
                engine = build_engine(cfg, comm)
                with torch.no_grad():
                    out[name] = engine.model(IDS).tolist()
    return out


@pytest.fixture(scope="module")
def tp_logits(folders, tmp_path_factory):
    from test_checkpoint import spawn

    tmp = tmp_path_factory.mktemp("qwen35-tp")
    codes, results = spawn(tp_logits_job, 2, tmp, {family: folders[family][0] for family in CONFIGS}, timeout=LIMIT)
    assert codes == [0, 0], results
    return results


@pytest.mark.parametrize("family", list(CONFIGS))
def test_init_from_at_tp2_reads_each_ranks_slices_and_computes_transformers_logits(folders, tp_logits, family):
    theirs = logits(folders[family][1])
    for result in tp_logits:  # every rank's logits, whole (the head gathers the vocabulary)
        assert (torch.tensor(result[family]) - theirs).abs().max() < EXACT


@pytest.mark.parametrize("bug", list(TP_PLANTED))
def test_a_tp_slice_dealt_to_the_wrong_rank_is_caught(folders, tp_logits, bug):
    assert (torch.tensor(tp_logits[0][bug]) - logits(folders["qwen3_5"][1])).abs().max() > CAUGHT


# Training: 8 AdamW steps against a plain transformers + AdamW loop.

STEPS, ROWS, TRAIN_SEQ, COEF, LR = 8, 2, 80, 0.5, 1e-3


# The final weights' bound (gaps()): the MoE's whole model is 1.8e-5 from transformers' after 8 steps (1 rank, ZeRO-3
# and EP 2; TP 2 2.1e-5): float noise grown by the steps, not a difference of the computation. Measured on this model
# and batch: with both models in fp64 throughout (their fp32 casts made fp64: the delta rule, the norms, the router's
# softmax, rotary) zerotrain's 8 steps equal transformers' within 1.8e-14; transformers' own fp32 loop is 1.44e-4 from
# that fp64 run (zerotrain's 1.44e-4), most of it in the linear layers' in_proj_a, A_log and dt_bias, and its own
# fp32 variants differ by the same order as zerotrain from it: its grouped_mm experts against its eager ones 4.6e-6,
# foreach AdamW against fused 3.1e-6; zerotrain's model in that same plain loop 1.35e-5, its engine against its model
# in the loop 5.2e-6. Step 1's gradients, tensor by tensor, are as far from the fp64 ones in zerotrain as in
# transformers (the ratio of the two errors: median 1.00, at most 1.42; the router, the experts, the shared expert's
# gate, A_log and dt_bias among them): no operation of zerotrain's rounds worse. The fp64 test below holds the
# computation itself to 1e-12. The bound: the measured 2.1e-5 with room for another machine's BLAS.
WEIGHTS_BOUND = {"qwen3_5": 1e-5, "qwen3_5_moe": 5e-5}


def config_for(folder, out, *flags):
    args = build_parser().parse_args(["train", "--init-from", str(folder), "--data", "synthetic", "--no-progress",
                                      "--seq-len", str(TRAIN_SEQ), "--steps", str(STEPS), "--micro-batch", str(ROWS),
                                      "--lr", str(LR), "--weight-decay", "0.1", "--ckpt-every", str(STEPS),
                                      "--seed", "1", "--threads", "1", "--out", str(out), *flags])
    return resolve_paths(config_from_args(args))


def transformers_run(cfg, folder, lrs: list[float], saved, moe: bool, attention: str = "eager") -> dict:
    """The same steps in a plain loop over transformers' model (adamw_steps; `attention`: its attn_implementation);
    its final weights saved in `saved` and read back as zerotrain's parameters."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation=attention).train()
    out = adamw_steps(hf, transformers_forward(hf, moe), cfg, lrs)
    hf.save_pretrained(str(saved))
    source = init_from.weight_source(str(saved))
    model = build_model(source.model, 0)
    init_from.load_local(model, source, {}, 0)
    out["weights"] = {n: p.detach() for n, p in model.named_parameters()}
    return out


def transformers_forward(hf, moe: bool):
    """One row's (logits, balancing loss) from transformers' model: its aux_loss, over that row's forward."""
    def forward(row):
        result = hf(row[None], output_router_logits=True) if moe else hf(row[None])
        return result.logits[0], result.aux_loss if moe else 0.0
    return forward


def zerotrain_forward(model):
    """One row's (logits, balancing loss) from zerotrain's model (moe.balancing_loss: 0 without experts)."""
    def forward(row):
        logits = model(row[None])[0]
        taken = balancing_loss(model)
        return logits, 0.0 if taken is None else taken[0][0]
    return forward


def adamw_steps(model, forward, cfg, lrs: list[float]) -> dict:
    """A plain loop of AdamW steps (zerotrain's: betas (0.9, 0.95), weight decay 0.1 on matrices, the gradient
    clipped at 1) at learning rates `lrs` on the run's batches. The MoE's loss: the summed token losses / the step's
    tokens + coef x the mean over the rows of each row's balancing loss (one forward per row: transformers' aux_loss
    pools its batch). {"loss", "grad_norm"}: each step's."""
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [p for n, p in named if is_decayed(n, p)], "weight_decay": 0.1},
                                   {"params": [p for n, p in named if not is_decayed(n, p)], "weight_decay": 0.0}],
                                  lr=lrs[0], betas=(0.9, 0.95), eps=1e-8)
    schedule = BatchSchedule(make_source(cfg), micro_batch=ROWS, accum=1, rank=0, world_size=1)
    out = {"loss": [], "grad_norm": []}
    for step, lr in enumerate(lrs):
        micro = schedule.batch(step).micro_batches[0]
        tokens = int((micro.labels != IGNORE).sum())
        token_loss, aux = 0.0, 0.0
        for x, y in zip(micro.inputs, micro.labels):
            logits, row_aux = forward(x)
            token_loss = token_loss + nn.functional.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")
            aux = aux + row_aux
        loss = token_loss / tokens + COEF * aux / ROWS
        optimizer.zero_grad()
        loss.backward()
        out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        out["loss"].append(float(loss.detach()))
    return out


def weights_of(folder) -> dict:
    return {n: p.detach() for n, p in zerotrain.load_model(str(folder)).named_parameters()}


def gaps(ours: dict, theirs: dict) -> dict:
    """The largest relative gap of the losses and gradient norms over the steps, and of the final weights: the whole
    model's |ours - theirs| / |theirs| (all tensors as one vector).

    Not each tensor's: the decay's input projections (in_proj_a) carry fp32's rounding of the chunked rule's
    exp(cumulative decay) (AdamW divides each gradient by its own size, so a gradient's relative noise becomes its
    step's): after 8 steps the dense model's layer-2 in_proj_a is 6.7e-5 from an fp64 run of transformers' loop,
    transformers' own fp32 loop 4.4e-5 from it (measured)."""
    out = {key: max(abs(a - b) / abs(b) for a, b in zip(ours[key], theirs[key])) for key in ("loss", "grad_norm")}
    names = list(theirs["weights"])
    gap = torch.cat([(ours["weights"][n] - theirs["weights"][n]).flatten() for n in names])
    out["weights"] = (gap.norm() / torch.cat([theirs["weights"][n].flatten() for n in names]).norm()).item()
    return out


@pytest.fixture(scope="module")
def training_folders(tmp_path_factory):
    """The models at transformers' own initialisation scale (0.02): at the logits tests' 0.1 the tiny dense model's
    gradient norm is 13 (1.3 at 0.02) and swings 10-22 from step to step, and float noise (its step-1 gradient norm
    equal to transformers' within 6e-7) grows about tenfold a step, to 1.3e-2 at step 8; at 0.02 it stays within 2e-7
    (measured over the 8 steps of lr 1e-3)."""
    root = tmp_path_factory.mktemp("qwen35-training")
    with one_thread():
        out = {family: (root / family, hf_model(root / family, family, 0.02)) for family in CONFIGS}
    for folder, _ in out.values():
        with_mtp_head(folder)
    return out


def with_mtp_head(folder) -> dict[str, torch.Tensor]:
    """Qwen3.5's multi-token-prediction head put into a folder transformers saved, as its releases hold it (a block
    under mtp.layers.0., named as the decoder's attention layer 1, and mtp.fc, mtp.pre_fc_norm_embedding,
    mtp.pre_fc_norm_hidden, mtp.norm), counted in config.json (mtp_num_hidden_layers); its tensors, random."""
    tensors = load_file(str(folder / "model.safetensors"))
    width = tensors["model.norm.weight"].shape[0]
    draw = torch.Generator().manual_seed(5)
    mtp = {n.replace("model.layers.1.", "mtp.layers.0."): torch.randn(t.shape, generator=draw)
           for n, t in tensors.items() if n.startswith("model.layers.1.")}
    mtp |= {"mtp.fc.weight": torch.randn(width, 2 * width, generator=draw),
            **{f"mtp.{norm}.weight": torch.randn(width, generator=draw)
               for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    save_file(tensors | mtp, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1,
                                                             "mtp_use_dedicated_embeddings": False}))
    return mtp


def mtp_changed(out, folder) -> list[str]:
    """The MTP head's tensors of `folder` that the export in `out` lacks or holds changed (not bitwise)."""
    kept = {n: t for n, t in load_file(str(folder / "model.safetensors")).items() if n.startswith("mtp.")}
    exported = {}
    for path in out.glob("*.safetensors"):
        exported |= load_file(str(path))
    return sorted(n for n, t in kept.items() if n not in exported or not torch.equal(exported[n], t))


# The runs on 2 ranks (one start of 2 ranks for all), each on the 1-rank run's global batch of ROWS rows.
# --ep 2: the MoE's only (each rank a block of 2 of its 4 experts).
TWO_RANKS = {"zero3": ("--zero", "3", "--micro-batch", "1"), "tp2": ("--tp", "2", "--micro-batch", str(ROWS)),
             "ep2": ("--ep", "2", "--micro-batch", "1")}
# The 2-rank runs of the families tested from one folder (test_llama4, test_gemma4*: one_folder_runs).
ZERO3 = {"zero3": ("--zero", "3", "--micro-batch", "1")}
ZERO3_EP2 = ZERO3 | {"ep2": ("--ep", "2", "--micro-batch", "1")}
FAMILY_RUNS = [(family, run) for family in CONFIGS for run in ["1 rank", *TWO_RANKS]
               if run != "ep2" or family.endswith("moe")]


def one_folder_runs(path, tmp, two_ranks: dict[str, tuple[str, ...]], limit: float, *flags: str,
                    attention: str = "eager") -> dict:
    """The runs a family's 8-step test compares, from one folder: each of `two_ranks` (name: its flags) on 2 ranks in
    one job, 1 rank, and transformers + AdamW at the 1-rank run's learning rates. {run: {"loss", "grad_norm",
    "weights"; the 2-rank runs' "read", their ranks' init_bytes_read}, "folder": the 1-rank run's}."""
    from zerotrain.training.loop import train, train_job

    with one_thread():
        two = {run: config_for(path, tmp / run, *flags, "--nproc", "2", *split) for run, split in two_ranks.items()}
        reports = run_job(functools.partial(in_turn_job, jobs=[(train_job, cfg) for cfg in two.values()]),
                          next(iter(two.values())), time_limit=limit)
        out = {}
        for run, report in zip(two, reports):
            out[run] = {key: [r[key] for r in report["records"]] for key in ("loss", "grad_norm")} | {
                "weights": weights_of(tmp / run), "read": report["summary"]["per_rank"]["init_bytes_read"]}
        with world_of_one() as comm:
            result = train(config_for(path, tmp / "1", *flags), comm, announce=False)
        out["1 rank"] = {key: [r[key] for r in result.records] for key in ("loss", "grad_norm")} | {
            "weights": {n: p.detach().clone() for n, p in result.engine.model.named_parameters()}}
        out["folder"] = tmp / "1"
        out["transformers"] = transformers_run(config_for(path, tmp / "oracle"), path,
                                               [r["lr"] for r in result.records], tmp / "oracle-weights", False,
                                               attention)
    return out


@pytest.fixture(scope="module")
def runs(training_folders, tmp_path_factory):
    """{(family, "1 rank" | "zero3" | "tp2" | "transformers"): {"loss", "grad_norm", "weights", and but for
    transformers' the run's "folder"}}."""
    from zerotrain.training.loop import train, train_job

    folders = training_folders
    tmp = tmp_path_factory.mktemp("qwen35-runs")
    stack = contextlib.ExitStack()
    stack.enter_context(one_thread())
    flags = {family: ("--moe-aux-coef", str(COEF)) if family.endswith("moe") else () for family in CONFIGS}
    two = {(family, run): config_for(folders[family][0], tmp / f"{family}-{run}", *flags[family], "--nproc", "2",
                                     *split) for family in CONFIGS for run, split in TWO_RANKS.items()
           if run != "ep2" or family.endswith("moe")}
    reports = run_job(functools.partial(in_turn_job, jobs=[(train_job, cfg) for cfg in two.values()]),
                      next(iter(two.values())), time_limit=LIMIT)
    out = {}
    for (family, run), report in zip(two, reports):
        out[family, run] = {key: [r[key] for r in report["records"]] for key in ("loss", "grad_norm")} | {
            "weights": weights_of(tmp / f"{family}-{run}"), "folder": tmp / f"{family}-{run}"}
    with world_of_one() as comm:
        for family in CONFIGS:
            result = train(config_for(folders[family][0], tmp / f"{family}-1", *flags[family]), comm, announce=False)
            out[family, "1 rank"] = {key: [r[key] for r in result.records] for key in ("loss", "grad_norm")} | {
                "weights": {n: p.detach().clone() for n, p in result.engine.model.named_parameters()},
                "folder": tmp / f"{family}-1"}
            lrs = [r["lr"] for r in result.records]
            out[family, "transformers"] = transformers_run(
                config_for(folders[family][0], tmp / f"{family}-oracle", *flags[family]), folders[family][0], lrs,
                tmp / f"{family}-oracle-weights", family.endswith("moe"))
    stack.close()
    return out


@pytest.mark.parametrize("family, run", FAMILY_RUNS)
def test_eight_steps_train_as_transformers_and_adamw_do(runs, family, run):
    theirs, ours = runs[family, "transformers"], runs[family, run]
    assert len(ours["loss"]) == STEPS
    gap = gaps(ours, theirs)
    assert gap["loss"] <= 1e-5 and gap["grad_norm"] <= 1e-5 and gap["weights"] <= WEIGHTS_BOUND[family], gap
    assert max(theirs["loss"]) != min(theirs["loss"])  # it trained


# The computation apart from fp32's rounding: both models in fp64 throughout (what each computes in fp32 on purpose,
# the delta rule, the decay, the norms, the router's softmax, rotary, made fp64 too: fp64_throughout), 8 steps of the
# same plain AdamW loop. Measured: the final weights 1.0e-15 (dense) and 2.6e-15 (MoE) of the model's norm apart, the
# losses within 2.7e-16, gradient norms 3.7e-16; in fp32 the same loops end 1.3e-6 apart, dense and MoE alike (the
# MoE's 1.35e-5 at the 1-rank run's learning rates: the growth of fp32's noise depends on the steps taken).

FP64_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                "transformers.modeling_rope_utils", *(f"zerotrain.model.{name}" for name in
                                                      ("moe", "rotary", "delta_rule", "attention", "vocab")))


class Fp64Torch(types.ModuleType):
    """torch as FP64_MODULES see it in fp64_throughout: torch.float32 (and torch.float) is fp64."""

    def __getattr__(self, name):
        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


@contextlib.contextmanager
def fp64_throughout():
    """Tensor.float() gives fp64, FP64_MODULES' torch.float32 is fp64, new float tensors are fp64."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "float", lambda self, *args, **kwargs: self.to(torch.float64))
        for name in FP64_MODULES:
            patch.setattr(importlib.import_module(name), "torch", Fp64Torch("torch"))
        torch.set_default_dtype(torch.float64)
        try:
            yield
        finally:
            torch.set_default_dtype(torch.float32)


def fp64_gaps(folder, family: str, tmp) -> dict:
    """gaps() of zerotrain's model against transformers' over 8 steps of adamw_steps, both in fp64 throughout."""
    moe = family.endswith("moe")
    cfg = config_for(folder, tmp, *(("--moe-aux-coef", str(COEF)) if moe else ()))
    lrs = [LR * (step + 1) / STEPS for step in range(STEPS)]
    with fp64_throughout():
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager",
                                                               experts_implementation="eager").double().train()
        theirs = adamw_steps(hf, transformers_forward(hf, moe), cfg, lrs)
        model = zerotrain.load_model(str(folder)).double().train().requires_grad_(True)
        ours = adamw_steps(model, zerotrain_forward(model), cfg, lrs)
    theirs["weights"] = ours_named(hf.state_dict())
    ours["weights"] = {n: p.detach() for n, p in model.named_parameters()}
    return gaps(ours, theirs)


def ours_named(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' Qwen3.5 tensors in memory by zerotrain's names: its stacked experts (gate_up_proj, down_proj)
    one linear each, as its files store them."""
    out = {}
    for name, t in state.items():
        base, _, kind = name.rpartition(".")
        if base.endswith("mlp.experts") and kind in ("gate_up_proj", "down_proj"):
            for e in range(len(t)):
                parts = zip(("gate_proj", "up_proj"), t[e].chunk(2)) if kind == "gate_up_proj" else [(kind, t[e])]
                out.update({f"{base}.{e}.{part}.weight": w for part, w in parts})
        else:
            out[name] = t.detach()
    return out


def eps_tenfold(real):
    """Planted in qwen35.gated_rms_norm: the linear layers' gated norm at 10 x rms_norm_eps."""
    return lambda x, gate, weight, eps: real(x, gate, weight, 10 * eps)


@pytest.mark.parametrize("family", CONFIGS)
def test_in_fp64_eight_steps_equal_transformers_within_1e_12_and_a_norm_eps_off_is_caught(training_folders, tmp_path,
                                                                                        monkeypatch, family):
    """The fp32 runs' weights gap (WEIGHTS_BOUND) is float noise: in fp64 the 8 steps are transformers' within
    1e-12. Planted in the function zerotrain runs, the linear layers' gated norm at 10 x rms_norm_eps is caught (the
    weights 1.5e-2 off, dense and MoE)."""
    folder = training_folders[family][0]
    gap = fp64_gaps(folder, family, tmp_path / "run")
    assert max(gap.values()) < 1e-12, gap
    monkeypatch.setattr(qwen35, "gated_rms_norm", eps_tenfold(qwen35.gated_rms_norm))
    planted = fp64_gaps(folder, family, tmp_path / "planted")
    assert planted["weights"] > 1e-3, planted


# tp2: its checkpoint's slices stitched back; ep2: each expert read from the EP rank that holds it
@pytest.mark.parametrize("family, run", [(family, run) for family, run in FAMILY_RUNS if run != "zero3"])
def test_a_trained_export_is_loaded_by_transformers_as_the_same_class_with_the_same_logits(training_folders, runs,
                                                                                        tmp_path, capfd, family,
                                                                                        run):
    from conftest import zerotrain_here

    folder = runs[family, run]["folder"]
    trained = zerotrain.load_model(str(folder))
    ours = logits(trained)
    assert (ours - logits(training_folders[family][1])).abs().max() > CAUGHT  # it moved from where it started
    out = tmp_path / "hf"
    if run != "1 rank":  # `zerotrain export` of the run folder: each TP rank's slices, each EP rank's experts
        result = zerotrain_here(capfd, "export", str(folder), str(out), "--format", "hf")
        assert result.returncode == 0, result.stderr[-2000:]
    else:  # a model in memory: its MTP head from the folder it came from
        export_model(trained, str(out), "hf", tokenizer_folder=None, eot_id=None,
                     config_folder=str(training_folders[family][0]))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(loaded).__name__ == HF_CLASSES[family]
    assert (logits(loaded) - ours).abs().max() < EXACT
    assert mtp_changed(out, training_folders[family][0]) == []  # the head, frozen, comes back bitwise
    config = json.loads((out / "config.json").read_text())
    cfg = trained.cfg  # its context is the file's max_position_embeddings, which reads back as the window
    assert mapping.model_config_from_hf(config, "config.json") == dataclasses.replace(cfg, seq_len=cfg.positions,
                                                                                      context=0)


@pytest.mark.parametrize("family", CONFIGS)
def test_the_mtp_head_is_kept_frozen_through_import_and_export_and_an_export_dropping_it_is_caught(
        training_folders, runs, tmp_path, capfd, monkeypatch, family):
    """The training folders hold Qwen3.5's MTP head (with_mtp_head): import counts it and sets it aside (every run
    of `runs`, at 1 rank, ZeRO-3's slices, --tp 2 and --ep 2, trained from that folder; the exports of the others in
    the test above keep it bitwise), and the ZeRO-3 run's export keeps it bitwise; planted in hub/export.py, an export
    that drops it is caught; a folder counting it without holding it fails the export in one line."""
    from conftest import zerotrain_here

    folder = training_folders[family][0]
    model = zerotrain.load_model(str(folder))
    assert model.cfg.mtp_layers == 1 and not any(n.startswith("mtp.") for n, _ in model.named_parameters())
    run = runs[family, "zero3"]["folder"]
    result = zerotrain_here(capfd, "export", str(run), str(tmp_path / "hf"), "--format", "hf")
    assert result.returncode == 0, result.stderr[-2000:]
    assert mtp_changed(tmp_path / "hf", folder) == []
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["mtp_num_hidden_layers"] == 1

    monkeypatch.setattr(export, "mtp_layers_of", lambda cfg, folder, files_of: None)
    result = zerotrain_here(capfd, "export", str(run), str(tmp_path / "dropped"), "--format", "hf")
    assert result.returncode == 0, result.stderr[-2000:]
    assert mtp_changed(tmp_path / "dropped", folder) == sorted(
        n for n in load_file(str(folder / "model.safetensors")) if n.startswith("mtp."))  # every one of them
    monkeypatch.undo()

    stripped = tmp_path / "stripped"
    stripped.mkdir()
    (stripped / "config.json").write_text((folder / "config.json").read_text())
    save_file({n: t for n, t in load_file(str(folder / "model.safetensors")).items() if not n.startswith("mtp.")},
              str(stripped / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(zerotrain.errors.CheckpointError, match="counts 1 multi-token-prediction layers "
                       r"\(mtp_num_hidden_layers\) but its files hold no mtp.layers.0.\*"):
        export_model(model, str(tmp_path / "again"), "hf", tokenizer_folder=None, eot_id=None,
                     config_folder=str(stripped))
    assert not (tmp_path / "again").exists()


# LoRA: adapters on every linear of the blocks (--lora-targets all: the attention's q, k, v, o; the linear layers'
# in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj; the MLP's), 3 steps at 1 rank and at --tp 2 from the dense
# training folder, exported to peft. AdamW's eps 1e-3 (test_moe_tp's reason): at 1e-8 the first step divides each
# zero-started B's gradient by its own size, and TP 2's float noise in it became 2e-4 of the logits (measured; 3.6e-7
# at 1e-3).

LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--lr", "2e-2", "--eps", "1e-3", "--steps", "3", "--ckpt-every", "3")


# The MoE's adapters on its attention and linear layers (peft cannot hold a mixture of experts' MLP adapters:
# hub/adapter.py)
MOE_LORA = ("--lora-targets", "q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,out_proj", "--moe-aux-coef", str(COEF))


def stacked_blocks(real):
    """Planted in model/lora.py: an adapter's B split as a plain column-parallel linear's (a contiguous block of rows
    per rank) where its base's slice is several ranges (in_proj_qkv's q, k and v rows)."""
    from zerotrain.model import TPSlice
    from zerotrain.model.tensor_parallel import blocks

    def make(dim, full_shape, parts):
        if dim == 0 and len(parts[0]) > 1:
            parts = blocks(full_shape[0] // len(parts), len(parts))
        return real(dim, full_shape, parts)
    return make


def lora_tp_job(rank, comm, tmp_path, folder):
    """The LoRA run at --tp 2 and, planted, with B's rows dealt as stacked_blocks: their losses by name."""
    from unittest import mock

    from zerotrain.model import lora
    from zerotrain.training.loop import train

    out = {}
    with one_thread():
        for name in ("tp2", "planted"):
            cfg = config_for(folder, tmp_path / name, *LORA, "--nproc", "2", "--tp", "2")
            with mock.patch.object(lora, "TPSlice", stacked_blocks(lora.TPSlice)) if name == "planted" else \
                    contextlib.nullcontext():
                out[name] = [r["loss"] for r in train(cfg, comm, announce=False).records]
    return out


@pytest.fixture(scope="module")
def lora_runs(training_folders, tmp_path_factory):
    """{"1 rank" | "tp2" | "planted" | "moe": (losses, the last checkpoint)}."""
    from test_checkpoint import spawn

    from zerotrain.training.loop import train

    tmp = tmp_path_factory.mktemp("qwen35-lora")
    folder = training_folders["qwen3_5"][0]
    codes, results = spawn(lora_tp_job, 2, tmp, folder, timeout=LIMIT)
    assert codes == [0, 0], results
    out = {name: (losses, tmp / name) for name, losses in results[0].items()}
    with one_thread(), world_of_one() as comm:
        for name, flags in {"1 rank": LORA, "moe": (*LORA, *MOE_LORA)}.items():
            moe = name == "moe"
            run = train(config_for(training_folders["qwen3_5_moe" if moe else "qwen3_5"][0], tmp / name, *flags),
                        comm, announce=False)
            out[name] = ([r["loss"] for r in run.records], tmp / name)
    return {name: (losses, run / "checkpoints" / "step_00000003") for name, (losses, run) in out.items()}


def test_lora_at_tp2_trains_as_one_rank_and_its_peft_export_gives_the_runs_logits_and_a_wrong_b_split_is_caught(
        training_folders, lora_runs, tmp_path):
    import peft

    from zerotrain.cli.main import main
    from zerotrain.hub.adapter import ADAPTER_CONFIG

    folder = training_folders["qwen3_5"][0]
    losses, step = lora_runs["1 rank"]
    ours = logits(zerotrain.load_model(str(step)))
    assert (ours - logits(training_folders["qwen3_5"][1])).abs().max() > CAUGHT  # the adapters moved the logits

    def peft_logits(name):
        assert main(["export", str(lora_runs[name][1]), str(tmp_path / name), "--format", "peft"]) == 0
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager")
        return logits(peft.PeftModel.from_pretrained(hf, str(tmp_path / name)).eval())

    assert (peft_logits("1 rank") - ours).abs().max() < EXACT
    targets = json.loads((tmp_path / "1 rank" / ADAPTER_CONFIG).read_text())["target_modules"]
    assert targets == ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b",
                       "out_proj", "gate_proj", "up_proj", "down_proj"]
    for name in ("tp2", "planted"):  # the same training: B's rows are trained alike wherever a rank holds them
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(lora_runs[name][0], losses)), (name, losses)
    assert (peft_logits("tp2") - ours).abs().max() < EXACT
    # planted: the checkpoint stitches the planted split's rows back where they were not trained
    assert (peft_logits("planted") - ours).abs().max() > CAUGHT


def test_a_lora_runs_merged_hf_export_keeps_the_mtp_head_of_its_init_from_folder_bitwise(training_folders, lora_runs,
                                                                                        tmp_path, capfd):
    """A LoRA run's hf export merges the adapters into a model built in memory: its MTP head comes from the run's
    --init-from folder (export_model's init_from), bitwise, beside the run's logits (before: the export looked for it
    in the checkpoint and failed)."""
    from conftest import zerotrain_here

    step = lora_runs["1 rank"][1]
    result = zerotrain_here(capfd, "export", str(step), str(tmp_path / "hf"), "--format", "hf")
    assert result.returncode == 0, result.stderr[-2000:]
    assert mtp_changed(tmp_path / "hf", training_folders["qwen3_5"][0]) == []
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    assert (logits(loaded.eval()) - logits(zerotrain.load_model(str(step)))).abs().max() < EXACT


def test_a_moe_lora_run_on_its_attention_and_linear_layers_exports_to_peft_with_the_runs_logits(
        training_folders, lora_runs, tmp_path):
    import peft

    from zerotrain.cli.main import main

    step = lora_runs["moe"][1]
    ours = logits(zerotrain.load_model(str(step)))
    base = training_folders["qwen3_5_moe"]
    assert (ours - logits(base[1])).abs().max() > CAUGHT
    assert main(["export", str(step), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base[0]), attn_implementation="eager")
    assert (logits(peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()) - ours).abs().max() < EXACT


# A TP degree that splits the linear layers' heads: refused in one line, exit 2.

@pytest.mark.parametrize("flags, said", [
    (["--nproc", "4", "--tp", "4"], "--tp 4 does not divide the linear-attention layers' key heads (2) and value "
                                    "heads (4): each TP rank keeps whole heads of both"),
])
def test_what_zerotrain_does_not_have_for_qwen35_is_refused_in_one_line(folders, flags, said, capsys):
    from zerotrain.cli.main import main

    assert main(["train", "--init-from", str(folders["qwen3_5"][0]), "--data", "synthetic", *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"zerotrain: error: {said}"]


@pytest.mark.parametrize("field, value, said", [
    ("layer_types", ["full_attention", "linear_attention", "linear_attention", "full_attention"],
     "are not every N-th layer"),
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "rope_type 'yarn'"),
    ("mtp_num_hidden_layers", -1, "mtp_num_hidden_layers must be a whole number, got -1"),
    ("mtp_use_dedicated_embeddings", True, "mtp_use_dedicated_embeddings = True"),
])
def test_a_config_zerotrain_does_not_compute_is_refused_naming_the_field(field, value, said):
    from zerotrain.errors import CheckpointError

    config = CONFIGS["qwen3_5"]().to_dict()
    config[field] = value
    with pytest.raises(CheckpointError, match="^config.json: .*" + said.replace("(", r"\(").replace("'", "'")):
        mapping.model_config_from_hf(config, "config.json")
