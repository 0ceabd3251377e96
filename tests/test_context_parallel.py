"""Context parallelism (--cp C): each row split along its length over C ranks (zig-zag chunks, ring attention, ZeRO
over dp_shard x cp) trains as one rank holding the whole row does, and its checkpoints resume at --cp 1."""

from __future__ import annotations

import functools
import json
import os

import cp_jobs
import dist_jobs
import pytest
from conftest import tiny_config, zerotrain_here
from test_hsdp import worst_gap
from test_packing import make_records, write_records

from zerotrain import checkpoint
from zerotrain.config import apply_preset, resolve, validate
from zerotrain.errors import ConfigError
from zerotrain.parallel import parts
from zerotrain.runtime.launch import run_job
from zerotrain.training import memory_plan

STEPS, SAVED_AT, SEQ = 6, 3, 64
LIMIT = 900
pytestmark = pytest.mark.timeout(3 * LIMIT)


def config(tmp, name, data, nproc, zero=1, cp=1, tp=1, **run):
    """A tiny Llama (4 heads over 2 KV heads) on packed records of several lengths in rows of 64; a global batch of
    4 rows (2 micro-batches of 2); every step clipped (the norm decides every update), invariant (b) every step."""
    cfg = tiny_config(tmp / name, nproc=nproc, zero=zero, micro=2, accum=2, tp=tp,
                      **{"steps": STEPS, "threads": 1, "check_every": 1, **run})
    apply_preset(cfg, "llama-tiny")
    cfg.data.source, cfg.model.vocab_size, cfg.model.seq_len = str(data), 256, SEQ
    cfg.parallel.cp = cp
    cfg.optim.grad_clip = 0.5
    return resolve(validate(cfg))


def saved(cfg, step=SAVED_AT) -> str:
    return os.path.join(cfg.checkpoint.dir, checkpoint.step_name(step))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each job's rank-0 result by name: one start of 2 ranks (the --cp 2 runs, the planted ones, --tp 2), one of 4
    (--cp 2 --tp 2), then one of 1 (the references, the resume at --cp 1)."""
    tmp = tmp_path_factory.mktemp("cp")
    data = write_records(tmp / "data", make_records(400))  # 4 records a row on average, of 5 to 18 tokens
    job = cp_jobs.trained_job
    out, configs = {}, {}

    def start(cfgs: dict) -> None:
        jobs = list(cfgs.values())
        results = run_job(functools.partial(dist_jobs.in_turn_job, jobs=jobs), jobs[0][1], time_limit=LIMIT)
        out.update(zip(cfgs, results))
        configs.update({name: cfg for name, (_, cfg) in cfgs.items()})

    start({"cp2": (job, config(tmp, "cp2", data, 2, cp=2, ckpt_every=SAVED_AT)),
           "cp2 z3": (job, config(tmp, "cp2-z3", data, 2, zero=3, cp=2)),
           "missing hop": (cp_jobs.missing_hop_job, config(tmp, "missing-hop", data, 2, cp=2)),
           "local positions": (cp_jobs.local_positions_job, config(tmp, "local-positions", data, 2, cp=2)),
           "tp2 z3": (job, config(tmp, "tp2-z3", data, 2, zero=3, tp=2))})
    start({"cp2 tp2 z3": (job, config(tmp, "cp2-tp2-z3", data, 4, zero=3, cp=2, tp=2))})
    start({"cp1": (job, config(tmp, "cp1", data, 1)),
           "cp1 z3": (job, config(tmp, "cp1-z3", data, 1, zero=3)),
           "cp2 -> cp1": (job, config(tmp, "cp2-cp1", data, 1, resume=saved(configs["cp2"])))})
    out["configs"] = configs
    return out


def test_two_context_parallel_ranks_train_as_one_rank_with_the_whole_rows_and_planted_bugs_are_caught(runs):
    # The same global batch of packed rows, each row split over 2 ranks: losses, gradient norms and final weights
    # within float noise of one rank holding every row whole, at --zero 1 and 3, over 6 clipped steps.
    gaps = {"cp2": worst_gap(runs["cp2"], runs["cp1"]), "cp2 z3": worst_gap(runs["cp2 z3"], runs["cp1 z3"])}
    assert all(gap < 1e-6 for gap in gaps.values()), gaps
    # the CP ranks hold the same parameters after every step (invariant (b), checked at every step)
    assert len(set(runs["cp2"]["digests"])) == 1
    # planted: the keys and values that travel the ring are never attended to (each rank sees its own chunks only);
    # planted: each rank's rotary positions count from its own chunks' start, not the whole row's
    for planted in ("missing hop", "local positions"):
        assert worst_gap(runs[planted], runs["cp1"]) > 1e-3, planted


def test_context_parallelism_composes_with_tensor_parallelism_at_zero3(runs):
    # 4 ranks: 2 CP ranks x 2 TP ranks (each TP rank's heads around its own ring) equal TP 2 alone on 2 ranks
    assert worst_gap(runs["cp2 tp2 z3"], runs["tp2 z3"]) < 1e-6


def test_the_memory_plan_counts_a_context_parallel_rank_s_activations_and_a_plan_without_them_is_caught(runs,
                                                                                                         monkeypatch):
    # A rank of --cp C saves the activations of T / C tokens a row, every rank's segment ids and its rows' rotary
    # tables (no T x T records' mask): planned to the byte, as the run measured them (saved-tensor hooks)
    for name, whole_row in (("cp2", "cp1"), ("cp2 z3", "cp1 z3"), ("cp2 tp2 z3", "tp2 z3")):
        plan = runs[name]["plan"]
        assert plan["rows"]["activations"] == plan["activations_measured"], name
        assert plan["activations_measured"] < 0.6 * runs[whole_row]["plan"]["activations_measured"], name
    # planted: the plan without context parallelism's part (RunParts.more) counts the whole row's
    cfg = runs["configs"]["cp2"]
    assert memory_plan.memory_plan(cfg, documents=True).rows["activations"] == runs["cp2"]["plan"]["rows"]["activations"]
    monkeypatch.setattr(parts, "context_parallel_rows", lambda cp: [])
    wrong = memory_plan.memory_plan(cfg, documents=True).rows["activations"]
    assert wrong == runs["cp1"]["plan"]["activations_measured"] != runs["cp2"]["plan"]["activations_measured"]


def test_a_checkpoint_written_at_cp2_resumes_at_cp1(runs):
    # ZeRO shards over dp_shard x cp: the checkpoint is the one 2 DP ranks write, "cp" recorded beside
    manifest = json.load(open(os.path.join(saved(runs["configs"]["cp2"]), "manifest.json")))
    assert manifest["world_size"] == 2 and manifest["mesh"] == {"tp": 1, "dp": 2, "cp": 2}
    resumed, whole = runs["cp2 -> cp1"], runs["cp1"]
    assert resumed["start"] == SAVED_AT
    gaps = [abs(a - b) / b for a, b in zip(resumed["losses"], whole["losses"][SAVED_AT:], strict=True)]
    assert max(gaps) < 1e-6, gaps
    assert worst_gap({**resumed, "losses": [], "grad_norms": []}, {**whole, "losses": [], "grad_norms": []}) < 1e-6


@pytest.mark.parametrize("change, says", [
    (dict(cp=3), "--cp 3 x --tp 1 does not divide the world size 4"),
    (dict(cp=2, seq_len=30), "--seq-len 30 is not divisible by 2 x --cp 2"),
    (dict(cp=2, arch="gpt2"), "--cp 2 with --arch gpt2 (learned positions)"),
    (dict(cp=2, arch="gemma2", attn_softcap=50.0), "--cp 2 with --attn-softcap 50.0"),
    (dict(cp=2, arch="gpt_oss"), "--cp 2 with --arch gpt_oss"),
    (dict(cp=2, arch="qwen3_5", seq_len=4), "--seq-len 4 at --cp 2 leaves chunks of 1 tokens, fewer than the 3"),
])
def test_what_context_parallelism_cannot_split_is_refused_naming_the_value(tmp_path, change, says):
    cfg = tiny_config(tmp_path, nproc=4, micro=2)
    apply_preset(cfg, "llama-tiny")
    cfg.model.seq_len = 32
    for key, value in change.items():
        section = "parallel" if key in ("cp", "dp_replicate") else "model"
        setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert says in str(e.value)


def test_cp_refusals_reach_the_user_as_one_line_with_exit_2(tmp_path, capfd):
    r = zerotrain_here(capfd, "train", "--preset", "llama-tiny", "--nproc", "2", "--cp", "2", "--seq-len", "30",
                       "--steps", "1", "--out", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("zerotrain: error: ")]
    assert errors == ["zerotrain: error: --seq-len 30 is not divisible by 2 x --cp 2: each CP rank holds 2 equal "
                      "chunks of every row"], r.stderr[-2000:]
