"""TP wider than the KV heads: each KV head on tp / KV heads ranks computes TP 1's math, its replicas stay bitwise
equal (invariant (b)), and checkpoints hold each head once, resuming on other meshes exactly.

One start of 4 ranks serves every test (module fixture): the tiny Llama (4 heads, 2 KV heads) at TP 4 x DP 1 (each
KV head on 2 ranks) beside TP 1 x DP 4 on the same global batch of 8 sequences, two planted bugs, resumes of the TP 4
run's step-2 checkpoint on TP 2 x DP 2, and multi-query attention (1 KV head) at TP 2 x DP 2. The resume on one
rank (TP 1) and the checks of files and formulas run in this process.
"""

import functools
import json
import hashlib
import os
import shutil
from unittest import mock

import dist_jobs
import pytest
import torch
import tp_kv_jobs
from conftest import tiny_config
from safetensors.torch import load_file, save_file

from zerotrain import checkpoint
from zerotrain.checkpoint import homes as homes_module
from zerotrain.checkpoint import verify as verify_module
from zerotrain.cli.main import main
from zerotrain.config import PRESETS, ModelConfig
from zerotrain.hub.init_from import load_local, weight_source
from zerotrain.model import build_model, llama, parallelize, plan, tensor_parallel
from zerotrain.model.activation_memory import activation_bytes
from zerotrain.parallel import ShardLayout, layout_of
from zerotrain.runtime.launch import run_job
from zerotrain.training.loop import build_engine

LIMIT = 120  # seconds: a deadlocked job fails the test instead of hanging CI
pytestmark = pytest.mark.timeout(300)
GQA = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64)  # head_dim 8
MQA = {**GQA, "n_kv_head": 1}
# The other members, each with what sets it apart: Qwen2's k/v biases are replicated with their heads' rows
FAMILIES = {"qwen2": dict(arch="qwen2"), "qwen3": dict(arch="qwen3", head_width=12),
            "mistral": dict(arch="mistral", sliding_window=6), "phi3": dict(arch="phi3", sliding_window=6)}
STEPS, SAVED_AT = 4, 2
STATE = ("master", "exp_avg", "exp_avg_sq")


def config(tmp, name, tp, micro, accum, model=GQA, **run):
    """4 ranks, global batch 4 / tp x micro x accum = 8 sequences, every step clipped, (b) checked every step."""
    cfg = tiny_config(tmp / name, nproc=4, tp=tp, micro=micro, accum=accum, steps=STEPS, check_every=1, **model, **run)
    cfg.optim.grad_clip = 0.5  # below the tiny model's gradient norms: the norm decides every update
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each job's rank-0 result by name, all on one start of 4 ranks, in turn."""
    tmp = tmp_path_factory.mktemp("kv")
    cfgs = {"logits": (tp_kv_jobs.logits_job, config(tmp, "logits", 4, 1, 1)),
            "mqa logits": (tp_kv_jobs.logits_job, config(tmp, "mqa-logits", 2, 1, 1, MQA)),
            "tp1": (tp_kv_jobs.train_job, config(tmp, "tp1", 1, 2, 1)),
            "tp4": (tp_kv_jobs.saved_state_job, config(tmp, "tp4", 4, 4, 2, ckpt_every=SAVED_AT)),
            "unsummed": (tp_kv_jobs.unsummed_replicas_job, config(tmp, "unsummed", 4, 4, 2)),
            "averaged": (tp_kv_jobs.averaged_replicas_job, config(tmp, "averaged", 4, 4, 2)),
            "double-counted": (tp_kv_jobs.double_counted_norm_job, config(tmp, "double-counted", 4, 4, 2)),
            "mqa tp1": (tp_kv_jobs.train_job, config(tmp, "mqa-tp1", 1, 2, 1, MQA)),
            "mqa tp2": (tp_kv_jobs.train_job, config(tmp, "mqa-tp2", 2, 2, 2, MQA)),
            **{f"{arch} logits": (tp_kv_jobs.logits_job, config(tmp, f"{arch}-logits", 4, 1, 1, {**GQA, **family}))
               for arch, family in FAMILIES.items()},
            "lora tp1": (tp_kv_jobs.lora_job, config(tmp, "lora-tp1", 1, 2, 1)),
            "lora tp4": (tp_kv_jobs.lora_job, config(tmp, "lora-tp4", 4, 4, 2)),
            "lora unsummed B": (tp_kv_jobs.lora_unsummed_b_job, config(tmp, "lora-unsummed", 4, 4, 2))}
    saved = os.path.join(cfgs["tp4"][1].checkpoint.dir, checkpoint.step_name(SAVED_AT))
    cfgs["tp4->tp2"] = (tp_kv_jobs.resume_job, config(tmp, "tp4-tp2", 2, 2, 2, resume=saved))
    jobs = [(job, cfg) for job, cfg in cfgs.values()]
    results = run_job(functools.partial(dist_jobs.in_turn_job, jobs=jobs), jobs[0][1], time_limit=LIMIT)
    out = dict(zip(cfgs, results))
    out["saved folder"], out["configs"] = saved, {name: cfg for name, (_, cfg) in cfgs.items()}
    return out


def max_rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def max_abs(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def agrees(run, base, steps=slice(None)) -> bool:
    """TP 1's training within 1e-5: losses and gradient norms relative, parameters absolute."""
    return (max_rel(run["losses"], base["losses"][steps]) <= 1e-5
            and max_rel(run["grad_norms"], base["grad_norms"][steps]) <= 1e-5
            and max_abs(run["params"], base["params"]) <= 1e-5)


def test_tp4_over_2_kv_heads_gives_tp1_logits_and_kv_heads_dealt_to_the_wrong_ranks_are_caught(runs):
    assert runs["logits"]["max_diff"] <= 1e-5 and runs["mqa logits"]["max_diff"] <= 1e-5
    # planted: rank r holds KV head r % KV instead of the one its query heads attend with
    assert runs["logits"]["round_robin_max_diff"] > 1e-2


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_every_family_at_tp4_over_2_kv_heads_gives_tp1_logits_and_heads_dealt_to_the_wrong_ranks_are_caught(runs, arch):
    assert runs[f"{arch} logits"]["max_diff"] <= 1e-5
    assert runs[f"{arch} logits"]["round_robin_max_diff"] > 1e-2


def test_tp4_over_2_kv_heads_trains_as_tp1_and_averaged_replica_gradients_are_caught(runs):
    base, tp4 = runs["tp1"], runs["tp4"]
    assert len(tp4["losses"]) == STEPS and agrees(tp4, base)
    assert tp4["params"]["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)  # each head once, gathered
    # every micro-batch sums each KV head's gradient over its 2 ranks: 2 layers x (k, v) x 2 micro-batches a step
    assert tp4["calls"]["all_reduce_kv_replica_grads"] == STEPS * 2 * 2 * 2
    assert "all_reduce_kv_replica_grads" not in base["calls"]
    # planted: the replicas average their parts; they stay equal (no invariant fails), the math is wrong
    averaged = runs["averaged"]
    assert len(averaged["losses"]) == STEPS and not agrees(averaged, base)
    assert max_abs(averaged["params"], base["params"]) > 1e-4


def test_the_gradient_norm_counts_a_replicated_kv_head_once_and_a_count_per_replica_is_caught(runs):
    base = runs["tp1"]
    assert max_rel(runs["tp4"]["grad_norms"], base["grad_norms"]) <= 1e-5
    # planted: each replica adds its copy of the head's gradient; with clipping on, the updates change too
    doubled = runs["double-counted"]
    assert min(n / b for n, b in zip(doubled["grad_norms"], base["grad_norms"])) > 1 + 1e-3
    assert not agrees(doubled, base)


def test_mqa_at_tp2_trains_as_tp1_with_its_one_kv_head_on_both_tp_ranks(runs):
    assert agrees(runs["mqa tp2"], runs["mqa tp1"])
    rows = runs["mqa tp2"]["kv_slices"]
    assert all(torch.equal(rows[r], rows[0]) for r in range(4))  # one head: every rank holds it


def test_kv_replicas_stay_bitwise_equal_and_a_skipped_replica_sum_trips_invariant_b(runs):
    rows = runs["tp4"]["kv_slices"]  # k_proj and v_proj values of each rank, gathered by the test
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[2], rows[3])
    assert not torch.equal(rows[0], rows[2])  # the two KV groups hold the two different heads
    words = [d.split("-") for d in runs["tp4"]["digests"]]  # per rank: replicated, sliced, KV heads (2 words each)
    assert words[0][4:] == words[1][4:] != words[2][4:] == words[3][4:]
    # planted: each replica keeps its own query heads' part of the gradient; the drift shows after the first step
    assert runs["unsummed"] == ("invariant (b) failed: the KV heads of rank(s) [1, 3] differ from their KV group's "
                                "first rank ([0, 2]) at step 1")


def test_a_tp4_checkpoint_holds_each_kv_head_once_and_verifies(runs, tmp_path):
    folder = runs["saved folder"]
    manifest = checkpoint.read_manifest(folder)
    assert manifest["mesh"] == {"tp": 4, "dp": 1}
    assert manifest["tp_slices"]["model.layers.0.self_attn.k_proj.weight"]["parts"] == [[[0, 8]], [[0, 8]],
                                                                                        [[8, 16]], [[8, 16]]]
    on_disk = checkpoint.checkpoint_model(folder)
    assert on_disk["model.layers.1.self_attn.v_proj.weight"].shape == (16, 32)
    assert all(torch.equal(on_disk[n], t) for n, t in runs["tp4"]["saved"]["master"].items())
    assert all(c.ok for c in checkpoint.verify_checkpoint(folder))
    # planted: TP rank 1's master of its k_proj (a replica of rank 0's head) moved, its manifest entry rewritten
    drifted = str(tmp_path / checkpoint.step_name(SAVED_AT))
    shutil.copytree(folder, drifted)
    shard = checkpoint.shard_name(1, 4)
    L = ShardLayout.from_dict(manifest["layout"])
    k_proj = next(s for s in L.slots if s.name == "model.layers.0.self_attn.k_proj.weight")
    tensors = load_file(os.path.join(drifted, shard))
    tensors["master"][k_proj.offset] += 1.0  # one DP rank: the shard is the flat buffer
    save_file(tensors, os.path.join(drifted, shard))
    data = open(os.path.join(drifted, shard), "rb").read()
    manifest["files"] = [{**f, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} if f["name"] == shard
                         else f for f in manifest["files"]]
    json.dump(manifest, open(os.path.join(drifted, "manifest.json"), "w"))
    bad = next(c for c in checkpoint.verify_checkpoint(drifted) if not c.ok)
    assert (bad.name, bad.file) == ("replicas", shard)
    assert "tensor model.layers.0.self_attn.k_proj.weight differs from TP rank 0's" in bad.detail


def test_a_tp4_checkpoint_resumes_on_tp2_exactly(runs):
    saved, resumed, whole = runs["tp4"]["saved"], runs["tp4->tp2"], runs["tp4"]
    # the state right after loading is bitwise the state the TP 4 ranks held at the save
    for key in STATE:
        assert all(torch.equal(resumed["loaded"][key][n], t) for n, t in saved[key].items()), key
    assert resumed["start"] == SAVED_AT and len(resumed["losses"]) == STEPS - SAVED_AT
    assert agrees(resumed, whole, slice(SAVED_AT, None))


def test_a_tp4_checkpoint_loads_on_one_rank_exactly_and_swapped_kv_groups_are_caught(runs, one_rank, tmp_path):
    cfg = tiny_config(tmp_path, tp=1, **GQA)
    saved = runs["tp4"]["saved"]

    def loaded() -> dict:
        engine = build_engine(cfg, one_rank)
        checkpoint.load_checkpoint(runs["saved folder"], engine, one_rank)
        return tp_kv_jobs.full_shard_state(engine)

    state = loaded()
    for key in STATE:
        assert all(torch.equal(state[key][n], t) for n, t in saved[key].items()), key
    # planted: the old slices read with their parts reversed (the KV groups' heads exchanged, and the q heads')
    real = homes_module.tp_slices_of  # what the load's CheckpointHomes reads the old slices with
    swapped = {n: tensor_parallel.TPSlice(s.dim, s.full_shape, s.parts[::-1]) for n, s in real(
        checkpoint.read_manifest(runs["saved folder"])).items()}
    with mock.patch.object(homes_module, "tp_slices_of", lambda manifest, *key: swapped):
        state = loaded()
    k = "model.layers.0.self_attn.k_proj.weight"
    assert not torch.equal(state["master"][k], saved["master"][k])


def test_init_from_a_tp4_checkpoint_gives_each_rank_the_kv_head_of_its_query_heads(runs, monkeypatch):
    source = weight_source(runs["saved folder"], verify=False)
    full = checkpoint.checkpoint_model(runs["saved folder"])
    cfg = runs["configs"]["tp4"].model
    D = cfg.head_dim

    def k_heads_read(tp):
        heads = []
        for rank in range(tp):
            with torch.device("meta"):
                model = build_model(cfg, 0)
                slices = parallelize(model, tp, rank, None)
            model.to_empty(device="cpu")
            model.tie_weights()
            load_local(model, source, slices, rank)
            heads.append(model.model.layers[0].self_attn.k_proj.weight.detach().clone())
        return heads

    k_proj = full["model.layers.0.self_attn.k_proj.weight"]
    # rank r of TP 4 serves query head r, which attends with KV head r // 2; at TP 2 rank r holds KV head r
    assert [torch.equal(h, k_proj[r // 2 * D:(r // 2 + 1) * D]) for r, h in enumerate(k_heads_read(4))] == [True] * 4
    assert [torch.equal(h, k_proj[r * D:(r + 1) * D]) for r, h in enumerate(k_heads_read(2))] == [True] * 2
    # planted: KV heads dealt round-robin (rank r: head r % 2)
    monkeypatch.setattr(llama, "kv_head_blocks", lambda kv, d, tp: tuple(((r % kv * d, (r % kv + 1) * d),)
                                                                         for r in range(tp)))
    assert [torch.equal(h, k_proj[r // 2 * D:(r // 2 + 1) * D]) for r, h in enumerate(k_heads_read(4))] != [True] * 4


def test_kv_slices_tile_each_tensor_once_counting_replicas_as_one_and_verify_refuses_a_missing_head():
    cfg = ModelConfig(**GQA)
    full = dict(build_model(cfg, seed=0).named_parameters())
    for tp in (1, 2, 4):
        for name, cut in plan(cfg, tp).items():
            rebuilt = torch.full(cut.full_shape, float("nan"))
            for r in range(tp):
                assert cut.take(full[name], r).shape == cut.local_shape()
                cut.place(rebuilt, cut.take(full[name], r), r)
            assert torch.equal(rebuilt, full[name].detach()), (name, tp)
    k = plan(cfg, 4)["model.layers.0.self_attn.k_proj.weight"]
    assert [k.first_holder(r) for r in range(4)] == [0, 0, 2, 2] and [k.holders(r) for r in range(4)] == [2] * 4

    def manifest(parts):
        return {"mesh": {"tp": 4, "dp": 1}, "world_size": 4,
                "layout": {"params": [{"name": "k", "shape": [8, 32]}]},
                "tp_slices": {"k": {"dim": 0, "full_shape": [16, 32], "parts": parts}}}

    assert verify_module.tp_slices_problem(manifest([[[0, 8]], [[0, 8]], [[8, 16]], [[8, 16]]])) is None
    # planted: every rank holds head 0, head 1 is in no slice
    assert "covering 8, not 4 equal parts" in verify_module.tp_slices_problem(manifest([[[0, 8]]] * 4))
    # planted: overlapping parts that are not the same rows
    assert "TP rank 1's part [4, 12) leaves a gap or overlaps at 8" in verify_module.tp_slices_problem(
        manifest([[[0, 8]], [[4, 12]], [[8, 16]], [[8, 16]]]))
    # SmolLM's 3 KV heads keep their TP 3: one head per rank, none replicated
    smol = plan(ModelConfig(**PRESETS["smollm-135m"]), 3)["model.layers.0.self_attn.k_proj.weight"]
    assert smol.parts == (((0, 64),), ((64, 128),), ((128, 192),)) and {smol.holders(r) for r in range(3)} == {1}


def test_the_plan_counts_each_ranks_replicated_kv_head_and_the_activation_formula_matches_the_run(runs,
                                                                                                  monkeypatch):
    cfg = runs["configs"]["tp4"]
    C, D, F_ = cfg.model.n_embd, cfg.model.head_dim, cfg.model.ffn_width
    # per TP 4 rank: 1 query head, 1 whole KV head (a replica), a quarter of the MLP and of the (tied) embedding's
    # vocabulary; norms whole
    per_block = D * C * 4 + 3 * F_ // 4 * C + 2 * C
    with torch.device("meta"):
        model = build_model(cfg.model, 0)
        parallelize(model, 4, 0, None)
    assert layout_of(model, 1, cfg.parallel.bucket_numel).numel == \
        cfg.model.vocab_size // 4 * C + C + cfg.model.n_layer * per_block
    # the run checked its plan's state exactly after the first step (else InvariantError); its activations match
    measured = runs["tp4"]["plan"]["activations_measured"]
    assert measured == runs["tp4"]["plan"]["rows"]["activations"]
    assert activation_bytes(cfg.model, 4, cfg.model.seq_len, tp=4)["total"] == measured
    # planted: the formula at kv_heads // tp KV heads per rank (0 under replication)
    monkeypatch.setattr(tensor_parallel, "kv_heads_per_rank", lambda kv, tp: kv // tp)
    assert activation_bytes(cfg.model, 4, cfg.model.seq_len, tp=4)["total"] != measured


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "4", "--tp", "4", "--n-head", "12", "--n-kv-head", "3", "--n-embd", "48"],
     "--tp 4 neither divides the KV heads (--n-kv-head 3) nor is a multiple of them"),
    (["--nproc", "9", "--tp", "9", "--preset", "smollm-135m"],
     "--tp 9 does not divide the MLP width (--intermediate-size 1536)"),
])
def test_a_tp_that_no_kv_head_split_fits_is_a_one_line_error_with_exit_code_2(tmp_path, argv, message, capsys):
    assert main(["train", "--arch", "llama", *argv, "--data", "synthetic", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"zerotrain: error: {message}"), err


def test_lora_at_tp4_over_2_kv_heads_trains_as_tp1_and_an_unsummed_replicated_b_trips_invariant_b(runs):
    base, tp4 = runs["lora tp1"], runs["lora tp4"]
    assert set(tp4["params"]) == set(base["params"]) and all(".lora_" in n for n in tp4["params"])
    assert len(tp4["losses"]) == STEPS and agrees(tp4, base)
    # the adapters moved: B left zero, and the k/v adapters' replicas are among what agrees with TP 1
    assert tp4["params"]["model.layers.0.self_attn.k_proj.lora_B.weight"].abs().max() > 1e-4
    # planted: a replicated KV head's B keeps its rank's part of the gradient; the replicas drift apart
    assert "invariant (b)" in runs["lora unsummed B"]["invariant"]
    assert "KV heads" in runs["lora unsummed B"]["invariant"]
