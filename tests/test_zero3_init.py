"""ZeRO-3's start-up costs a rank its share of the model: with --init-from it reads the rows of its owned ranges only,
from a seed it draws its owned values only, each counted where it is read or drawn and reported per rank in
summary.json (init_bytes_read, init_values_drawn); and the seeded model is the same at every world size and TP degree.

One start of 4 ranks runs, in turn: GPT-2 from a Hugging Face folder (its Conv1D weights transposed in the file,
width 48 so that owned ranges cut rows) and from the seed, each parameter its own bucket, one step each, and each
again with the planted whole-tensor read; the initial model at TP 2 x DP 2 from the seed, with a planted TP slice
drawn at its own positions, and from the folder (and with a planted read that drops the TP slices). The 1, 2 and 3
rank models at every stage and TP 2 at stage 1 are test_zero3.py's.
"""

import functools

import dist_jobs
import pytest
import torch
import transformers
import zero3_init_jobs as jobs
from conftest import tiny_config
from safetensors.torch import load_file

from zerotrain import load_model
from zerotrain.hub.init_from import adopt, weight_source
from zerotrain.model import build_model
from zerotrain.runtime.launch import run_job

pytestmark = pytest.mark.timeout(300)
W = 4
BUCKET_MB = 1e-4  # 26 values: every parameter is its own bucket, cut into 4 chunks


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3-init")
    hf = str(tmp / "gpt2")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=200, n_embd=48, n_layer=2, n_head=4, n_positions=16,
                                                         bos_token_id=0, eos_token_id=0)).save_pretrained(hf)

    def cfg(name, init_from="", **run):
        c = tiny_config(tmp / name, nproc=W, micro=2, steps=1, zero=3, bucket_mb=BUCKET_MB, seq_len=16, **run)
        if init_from:  # the folder's model, as `zerotrain train --init-from` adopts it
            c.checkpoint.init_from = init_from
            c.model = adopt(c.model, weight_source(init_from), {"seq_len"})
        return c

    runs = {"init-from": (jobs.summary_job, cfg("init-from", hf)),
            "init-from whole": (jobs.whole_tensor_job, cfg("init-from-whole", hf)),
            "seeded": (jobs.summary_job, cfg("seeded")),
            "seeded whole": (jobs.whole_tensor_job, cfg("seeded-whole")),
            "tp2": (jobs.initial_model_job, cfg("tp2", tp=2)),
            "init-from tp2": (jobs.initial_model_job, cfg("init-from-tp2", hf, tp=2)),
            "init-from tp2 unsliced": (jobs.unsliced_reads_job, cfg("init-from-tp2-unsliced", hf, tp=2)),
            "tp2 local positions": (jobs.local_positions_job, cfg("tp2-local", tp=2))}
    pairs = list(runs.values())
    results = run_job(functools.partial(dist_jobs.in_turn_job, jobs=pairs), pairs[0][1], time_limit=180)
    return {"hf": hf, "configs": {k: c for k, (_, c) in runs.items()}, **dict(zip(runs, results))}


def test_init_from_at_stage3_reads_each_rank_its_share_and_a_whole_tensor_read_is_caught(four_ranks):
    stored = load_file(f"{four_ranks['hf']}/model.safetensors")
    share = sum(t.numel() * t.element_size() for n, t in stored.items() if not n.endswith(".attn.bias")) / W
    read = four_ranks["init-from"]["per_rank"]["init_bytes_read"]
    assert len(read) == W and all(0.75 * share <= r <= 1.25 * share for r in read), (read, share)
    # Each rank took every parameter's whole tensor where it owns part of it: about W times its share
    whole = four_ranks["init-from whole"]["per_rank"]["init_bytes_read"]
    assert all(r > 3 * share for r in whole), (whole, share)
    assert four_ranks["init-from"]["per_rank"]["init_values_drawn"] == [0] * W


def test_a_seeded_init_at_stage3_draws_each_rank_its_share_and_a_whole_tensor_draw_is_caught(four_ranks):
    cfg = four_ranks["configs"]["seeded"]
    share = sum(p.numel() for p in build_model(cfg.model, cfg.loop.seed).parameters()) / W
    drawn = four_ranks["seeded"]["per_rank"]["init_values_drawn"]
    assert all(0.75 * share <= n <= 1.25 * share for n in drawn), (drawn, share)
    assert all(n > 2.5 * share for n in four_ranks["seeded whole"]["per_rank"]["init_values_drawn"])
    assert four_ranks["seeded"]["per_rank"]["init_bytes_read"] == [0] * W


def test_the_seeded_model_at_tp2_stage3_is_the_whole_model_and_a_slice_drawn_at_its_own_positions_is_caught(
        four_ranks):
    cfg = four_ranks["configs"]["tp2"]
    whole = build_model(cfg.model, cfg.loop.seed).state_dict()
    whole.pop("lm_head.weight")  # the tied head: the embedding's tensor, once in the engine's state
    got, planted = four_ranks["tp2"], four_ranks["tp2 local positions"]
    assert got.keys() == whole.keys() and all(torch.equal(got[k], whole[k]) for k in whole)
    split = [k for k in whole if not torch.equal(planted[k], whole[k])]
    assert split and all(".attn." in k or ".mlp." in k or k == "transformer.wte.weight" for k in split)  # TP-sliced


def test_init_from_at_tp2_stage3_reads_the_folders_model_and_reads_that_drop_the_slices_are_caught(four_ranks):
    # Each rank's rows of its TP slices (Conv1D's transposed columns, row-parallel weights' column parts) in its owned
    # ranges: together the model the folder holds, as one process loads it whole.
    whole = load_model(four_ranks["hf"]).state_dict()
    whole.pop("lm_head.weight")
    got, planted = four_ranks["init-from tp2"], four_ranks["init-from tp2 unsliced"]
    assert got.keys() == whole.keys() and all(torch.equal(got[k], whole[k]) for k in whole)
    split = [k for k in whole if not torch.equal(planted[k], whole[k])]  # read as if not TP-split: only those differ
    assert split and all(".attn." in k or ".mlp." in k or k == "transformer.wte.weight" for k in split)
