"""Tensor parallelism composed with ZeRO-1: the same math on every mesh, replicas that stay equal, counted norms."""

import functools
import json

import dist_jobs
import pytest
import torch
from conftest import child_pids, tiny_config, zerotrain_here

from zerotrain.cli.main import main
from zerotrain.config import ModelConfig
from zerotrain.model import build_model, plan
from zerotrain.runtime.launch import JobFailed, run_job

LIMIT = 120  # seconds: a deadlocked job fails the test instead of hanging CI
pytestmark = pytest.mark.timeout(300)

# The same global batch of 8 sequences on every mesh: DP replicas x micro-batch x accumulation.
MESHES = {"TP1xDP2": dict(nproc=2, tp=1, micro=2, accum=2),
          "TP2xDP2": dict(nproc=4, tp=2, micro=2, accum=2),
          "TP2xDP1": dict(nproc=2, tp=2, micro=2, accum=4),
          # reduce-scatters in backward and all-gathers behind the next forward, beside the TP all-reduces
          "TP2xDP2 overlapped": dict(nproc=4, tp=2, micro=2, accum=2, overlap="on")}
# Planted bugs that still train to the end, run on TP2xDP1 beside the meshes (a bug that stops the run has its own job).
PLANTED = {"averaged TP all-reduce": dist_jobs.tp_averaged_grad_all_reduce_job,
           "double-counted norm": dist_jobs.tp_double_counted_norm_job}


def mesh_config(tmp_path, name, mesh="", **overrides):
    mesh = {**MESHES[mesh or name], **overrides}
    cfg = tiny_config(tmp_path / name.replace(" ", "-"), micro=mesh.pop("micro"), accum=mesh.pop("accum"), steps=5,
                      **mesh)
    cfg.optim.grad_clip = 0.5  # below the tiny model's gradient norms: every step is clipped
    return cfg


def run(job, tmp_path, name, **overrides):
    return run_job(job, mesh_config(tmp_path, name, **overrides), time_limit=LIMIT)


def max_rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def max_abs_params(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """tp_params_job's result on every mesh and for every PLANTED bug, by name. The runs of one world size take
    turns on one start of its ranks (TP1xDP2 first, so that its collective counts are its own)."""
    tmp = tmp_path_factory.mktemp("meshes")
    jobs = [(name, dist_jobs.tp_params_job, mesh_config(tmp, name)) for name in MESHES]
    jobs += [(bug, job, mesh_config(tmp, bug, mesh="TP2xDP1")) for bug, job in PLANTED.items()]
    out = {}
    for nproc in sorted({cfg.launch.nproc for _, _, cfg in jobs}):
        mine = [(name, job, cfg) for name, job, cfg in jobs if cfg.launch.nproc == nproc]
        in_turn = functools.partial(dist_jobs.in_turn_job, jobs=[(job, cfg) for _, job, cfg in mine])
        out.update(zip([name for name, _, _ in mine], run_job(in_turn, mine[0][2], time_limit=LIMIT)))
    return out


@pytest.fixture(scope="module")
def meshes(runs):
    return {name: runs[name] for name in MESHES}


@pytest.fixture(scope="module")
def planted(runs):
    return {bug: runs[bug] for bug in PLANTED}


def agrees(run, base) -> bool:
    """The equivalence check: losses and norms within 1e-5 relative, parameters within 1e-4."""
    return (max_rel(run["losses"], base["losses"]) <= 1e-5 and max_rel(run["grad_norms"], base["grad_norms"]) <= 1e-5
            and max_abs_params(run["params"], base["params"]) <= 1e-4)


def test_every_mesh_computes_the_same_steps_and_a_wrong_backward_all_reduce_is_caught(meshes, planted, tmp_path):
    base = meshes["TP1xDP2"]
    for name, r in meshes.items():
        assert len(r["losses"]) == 5
        assert max_rel(r["losses"], base["losses"]) <= 1e-5, name
        assert max_rel(r["grad_norms"], base["grad_norms"]) <= 1e-5, name
        assert max_abs_params(r["params"], base["params"]) <= 1e-4, name
        assert r["params"]["transformer.h.0.attn.c_attn.weight"].shape == (96, 32)  # full tensors, gathered
    # the activations really are all-reduced within a TP group, and only there
    assert meshes["TP2xDP2"]["calls"]["all_reduce_tp_activations"] > 0
    assert "all_reduce_tp_activations" not in base["calls"]
    # planted bug: each rank keeps its partial input gradient of c_attn / c_fc; the TP ranks' replicated
    # gradients then differ, and so do their updates: invariant (b) stops the run
    with pytest.raises(JobFailed, match=r"invariant \(b\) failed: replicated parameters of rank\(s\) \[1\]"):
        run(dist_jobs.tp_no_grad_all_reduce_job, tmp_path, "TP2xDP1")
    # planted bug: the all-reduce averages instead of summing; the ranks stay equal, the math is wrong
    averaged = planted["averaged TP all-reduce"]
    assert not agrees(averaged, base)
    assert max_rel(averaged["grad_norms"], base["grad_norms"]) > 1e-3


def test_replicated_parameters_stay_bitwise_equal_on_every_rank(meshes):
    for name in ("TP2xDP2", "TP2xDP1"):
        rows = meshes[name]["replicated"]
        # the position embedding (512), norms and row-parallel biases: the token embedding is split by vocabulary
        assert rows.shape[0] == MESHES[name]["nproc"] and rows.shape[1] == 960
        for r in range(1, rows.shape[0]):
            assert torch.equal(rows[r], rows[0]), (name, r)
    digests = [d.split("-") for d in meshes["TP2xDP2"]["digests"]]  # per rank: replicated (2), sliced (2)
    assert len({tuple(d[:2]) for d in digests}) == 1
    assert digests[0][2:] == digests[2][2:] and digests[1][2:] == digests[3][2:]  # TP slice t across its DP group
    assert digests[0][2:] != digests[1][2:]  # the two TP ranks hold different slices


def test_one_ulp_drift_on_one_tp_rank_trips_invariant_b_naming_the_rank(tmp_path):
    cfg = tiny_config(tmp_path / "rep", nproc=4, tp=2, micro=2, steps=4, check_every=2)
    with pytest.raises(JobFailed, match=r"invariant \(b\) failed: replicated parameters of rank\(s\) \[1\] differ "
                                        r"from rank 0 at step 2"):
        run_job(dist_jobs.tp_drift_replicated_job, cfg, time_limit=LIMIT)
    cfg = tiny_config(tmp_path / "sliced", nproc=4, tp=2, micro=2, steps=4, check_every=2)
    with pytest.raises(JobFailed, match=r"invariant \(b\) failed: the TP slices of rank\(s\) \[3\] differ from "
                                        r"their DP group's first rank \(\[1\]\) at step 2"):
        run_job(dist_jobs.tp_drift_sliced_job, cfg, time_limit=LIMIT)
    assert child_pids() == []


def test_the_gradient_norm_counts_replicated_values_once_and_a_double_count_is_caught(meshes, planted):
    base = meshes["TP1xDP2"]
    assert max_rel(meshes["TP2xDP1"]["grad_norms"], base["grad_norms"]) <= 1e-5
    # planted bug: both TP ranks add the replicated gradients; with clipping on, the update changes
    doubled = planted["double-counted norm"]
    assert min(n / b for n, b in zip(doubled["grad_norms"], base["grad_norms"])) > 1 + 1e-3
    assert not agrees(doubled, base)


def test_tp_slices_tile_every_split_tensor_exactly_once():
    cfg = ModelConfig(n_layer=1, n_head=4, n_embd=8)
    model = build_model(cfg, seed=0)
    full = dict(model.named_parameters())
    for tp in (2, 4):
        for name, cut in plan(cfg, tp).items():
            assert cut.full_shape == tuple(full[name].shape)
            rebuilt = torch.full(cut.full_shape, float("nan"))
            for r in range(tp):
                assert cut.take(full[name], r).shape == cut.local_shape()
                cut.place(rebuilt, cut.take(full[name], r), r)
            assert torch.equal(rebuilt, full[name].detach()), (name, tp)
    # c_attn: rank 0 holds the first head block of each of q, k and v
    assert plan(cfg, 2)["transformer.h.0.attn.c_attn.weight"].parts[0] == ((0, 4), (8, 12), (16, 20))


@pytest.mark.parametrize("argv, message", [
    (["train", "--nproc", "4", "--tp", "3"], "--tp 3 does not divide the world size 4 (--nproc)"),
    (["train", "--nproc", "2", "--tp", "2", "--n-head", "3", "--n-embd", "48"], "--tp 2 does not divide --n-head 3"),
    (["train", "--nproc", "2", "--tp", "0"], "--tp must be positive, got 0"),
    (["equivalence", "--nproc", "2", "--tp", "2", "--accum", "1"], "1 DP replica(s) x --accum 1 gives one micro-batch"),
    (["bench", "compare", "--nproc", "2", "--tp", "2"], "--tp 2: bench compare compares data-parallel strategies"),
    (["bench", "accum", "--tp", "2"], "--tp 2: bench accum measures data parallelism"),
])
def test_bad_tp_settings_are_one_line_errors_with_exit_code_2(tmp_path, argv, message, capsys):
    assert main([*argv, "--data", "synthetic", "--out", str(tmp_path)]) == 2  # the command line's own entry point
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"zerotrain: error: {message}"), err
    assert "Traceback" not in err


def test_demo_tp2_passes_the_four_invariants_and_the_bitwise_resume_on_tp2_x_dp2(tmp_path, capfd):
    r = zerotrain_here(capfd, "demo", "--tp", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "TP 2 x DP 2 = 4 ranks" in r.stdout
    for line in ("(a) finite loss", "(b) replicas bitwise equal", "(c) AdamW's state = ZeRO-1 formula", "(d) checkpoints"):
        assert any(line in l and l.endswith("PASS") for l in r.stdout.splitlines()), line
    assert "RESUME VERIFIED" in r.stdout
    report = json.load(open(tmp_path / "report.json"))
    assert report["world_size"] == 4 and report["tp"] == 2 and report["param_count"] == 28_032
    assert report["losses"][-1] < report["losses"][0] - 0.5 and report["resumed_losses"] == report["losses"][10:]
    words = [h.split("-") for h in report["param_hashes"]]
    assert len({tuple(w[:2]) for w in words}) == 1 and words[0][2:] == words[2][2:] != words[1][2:] == words[3][2:]
    assert report["optimizer_bytes"] == [report["expected_bytes"]] * 4
    # each rank holds its TP slices and the replicated parameters: 62,080 bytes against the full 112,128
    assert max(report["param_bytes"]) < 0.6 * 4 * report["param_count"]
    assert report["comm_calls_per_step"]["all_reduce_tp_activations"] == 2 * 2 * 2  # 2 per block, 2 blocks, accum 2


def test_equivalence_tp2_adds_mesh_rows_that_pass_and_still_catches_the_wrong_weightings(tmp_path, capsys):
    code = main(["equivalence", "--tp", "2", "--nproc", "4", "--accum", "2", "--json", str(tmp_path / "eq.json")])
    assert code == 0, capsys.readouterr()
    report = json.load(open(tmp_path / "eq.json"))
    splits = [row["split"] for row in report["checked"]]
    assert splits == ["1 x 8 x 1", "1 x 2 x 4", "4 x 2 x 2 (TP 2 x DP 2)", "4 x 2 x 1"]
    for row in report["checked"]:
        assert row["passed"] and row["initial_params_match"], row["split"]
        assert max(row["grad_max_abs_diff"], row["adamw_param_max_abs_diff"]) <= 1e-4
    assert report["wrong_variants_caught"] and all(row["tp"] == 2 for row in report["wrong_variants"])
