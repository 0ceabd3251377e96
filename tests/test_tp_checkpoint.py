"""Tensor-parallel checkpoints: a full-model file whatever the mesh, exact resharding across meshes, verify.

Two saved runs serve every test (spawned once per module): TP 2 x DP 2 and TP 1 x DP 4 of the tiny model,
6 steps of the same global batch (8 sequences), checkpoints at steps 3 and 6; the resumes on other meshes
from their step-3 checkpoints run in the same module fixture.
"""

import argparse
import functools
import hashlib
import json
import os
import shutil

import dist_jobs
import pytest
import torch
import tp_ckpt_jobs
from conftest import as_version_1, tiny_config
from safetensors.torch import load_file, save_file

from zerotrain import checkpoint
from zerotrain.cli.commands.verify_checkpoint import cmd_verify
from zerotrain.model.tensor_parallel import TPSlice
from zerotrain.parallel import ShardLayout
from zerotrain.runtime.launch import run_job
from zerotrain.training.loop import build_engine

LIMIT = 120  # seconds: a deadlocked job fails the test instead of hanging CI
STATE = ("master", "exp_avg", "exp_avg_sq")
pytestmark = pytest.mark.timeout(300)


def run(job, cfg):
    return run_job(job, cfg, time_limit=LIMIT)


def config(tmp, nproc, tp, micro, accum=2, **run_fields):
    """The tiny model, 6 steps, global batch nproc / tp x micro x accum = 8 sequences on every mesh."""
    return tiny_config(tmp, nproc=nproc, tp=tp, micro=micro, accum=accum, steps=6, **run_fields)


def step_folder(cfg, step):
    return os.path.join(cfg.checkpoint.dir, checkpoint.step_name(step))


# A resume on another mesh: new mesh -> (saved run, nproc, tp, micro, planted bug the exactness check must catch)
RESHARDS = {
    "tp2dp2->tp1dp2": ("tp2dp2", 2, 1, 2, "swapped slices"),
    "tp2dp2->tp2dp1": ("tp2dp2", 2, 2, 4, "swapped slices"),
    "tp1dp4->tp2dp2": ("tp1dp4", 4, 2, 2, "no moments"),
}
RESHARD_JOBS = {"swapped slices": tp_ckpt_jobs.resume_swapped_slices_job,
                "no moments": tp_ckpt_jobs.resume_without_moments_job}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"saved": {name: (cfg, result)}, "resharded": {case: (cfg, result)}}: the TP 2 x DP 2 run (also resumed
    from step 3 on its own mesh, and saved sync and async at the end) and the TP 1 x DP 4 run, each saving at
    steps 3 and 6, then every RESHARDS resume from their step-3 checkpoints.

    The runs of one world size take turns on one start of its ranks: starting ranks costs more than the tiny
    model's steps. 4 ranks go first: they write the checkpoints the 2-rank resumes read.
    """
    saved = {}
    for name, job, (nproc, tp, micro) in (("tp2dp2", tp_ckpt_jobs.run_then_resume_on_the_same_mesh_job, (4, 2, 2)),
                                          ("tp1dp4", tp_ckpt_jobs.train_and_save_job, (4, 1, 1))):
        cfg = config(tmp_path_factory.mktemp(name), nproc, tp, micro)
        cfg.checkpoint.every = 3
        saved[name] = (job, cfg)
    resharded = {}
    for case, (source, nproc, tp, micro, planted) in RESHARDS.items():
        cfg = config(tmp_path_factory.mktemp(case.replace("->", "-to-")), nproc, tp, micro)
        cfg.checkpoint.resume = step_folder(saved[source][1], 3)
        resharded[case] = (RESHARD_JOBS[planted], cfg)
    jobs = {("saved", name): job_cfg for name, job_cfg in saved.items()}
    jobs.update({("resharded", case): job_cfg for case, job_cfg in resharded.items()})
    out = {"saved": {}, "resharded": {}}
    for nproc in (4, 2):
        mine = {key: job_cfg for key, job_cfg in jobs.items() if job_cfg[1].launch.nproc == nproc}
        results = run(functools.partial(dist_jobs.in_turn_job, jobs=list(mine.values())), next(iter(mine.values()))[1])
        for ((kind, name), (_, cfg)), result in zip(mine.items(), results):
            out[kind][name] = (cfg, result)
    return out


@pytest.fixture(scope="module")
def saved(runs):
    return runs["saved"]


def max_rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def max_abs(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def full_state(shards, layout: ShardLayout, slices: dict, tp: int, dp: int) -> dict:
    """{key: {name: full tensor}} and the step, by hand from every world rank's shard (shards[r]).

    TP rank t's flat buffer from the shards of world ranks d x tp + t; split tensors placed by their
    TP slices; replicated ones are TP rank 0's, also kept per TP rank under "replicas" for comparison.
    """
    out = {"step": [s["step"] for s in shards], "replicas": {}}
    for key in STATE:
        flats = [layout.assemble([shards[d * tp + t][key] for d in range(dp)]) for t in range(tp)]
        out[key] = {}
        for s in layout.slots:
            pieces = [flat[s.offset : s.offset + s.numel].view(s.shape) for flat in flats]
            if s.name in slices:
                out[key][s.name] = torch.empty(slices[s.name].full_shape)
                for t, piece in enumerate(pieces):
                    slices[s.name].place(out[key][s.name], piece, t)
            else:
                out[key][s.name] = pieces[0]
                out["replicas"][key, s.name] = pieces
    return out


def checkpoint_state(folder) -> dict:
    manifest = checkpoint.read_manifest(folder)
    T, D = manifest["mesh"]["tp"], manifest["mesh"]["dp"]
    shards = [load_file(os.path.join(folder, checkpoint.shard_name(r, T * D))) for r in range(T * D)]
    slices = {n: TPSlice.from_dict(d) for n, d in manifest["tp_slices"].items()}
    return full_state(shards, ShardLayout.from_dict(manifest["layout"]), slices, T, D)


def loaded_state(out_dir, tag, loaded: dict) -> dict:
    """The state the resumed ranks held right after loading, from the files each rank wrote."""
    T, D = loaded["mesh"]["tp"], loaded["mesh"]["dp"]
    shards = [load_file(os.path.join(out_dir, f"state-{tag}-rank{r:02d}.safetensors")) for r in range(T * D)]
    slices = {n: TPSlice.from_dict(d) for n, d in loaded["tp_slices"].items()}
    return full_state(shards, ShardLayout.from_dict(loaded["layout"]), slices, T, D)


def bits(t):
    return t.view(torch.int32)  # bitwise: NaN equals NaN, -0.0 differs from 0.0


def differences(got: dict, want: dict) -> list[str]:
    """What differs bitwise between two full states (every key of every tensor, the step on every rank),
    and any replicated tensor whose TP ranks disagree."""
    bad = [f"{key} {name}" for key in STATE for name in want[key]
           if name not in got[key] or not torch.equal(bits(got[key][name]), bits(want[key][name]))]
    bad += [f"{key} {name} differs across TP ranks" for (key, name), pieces in got["replicas"].items()
            if any(not torch.equal(p, pieces[0]) for p in pieces)]
    steps = {int(s.item()) for s in got["step"] + want["step"]}
    return bad + ([f"steps {sorted(steps)}"] if len(steps) > 1 else [])


# ---------------------------------------------------------------- saving
def test_a_tp_checkpoint_holds_the_full_model_in_its_shards_with_the_names_and_shapes_of_a_tp1_one(saved):
    (cfg2, out2), (cfg1, _) = saved["tp2dp2"], saved["tp1dp4"]
    tp2, tp1 = step_folder(cfg2, 3), step_folder(cfg1, 3)
    manifest = checkpoint.read_manifest(tp2)
    assert manifest["world_size"] == 4 and manifest["mesh"] == {"tp": 2, "dp": 2}
    assert manifest["layout"]["world_size"] == 2 and manifest["param_count"] == 28_032
    assert len(manifest["tp_slices"]) == 6 * 2 + 1  # 6 split tensors per block, 2 blocks; the tied embedding
    assert sorted(f["name"] for f in manifest["files"]) == [checkpoint.shard_name(r, 4) for r in range(4)]
    tp1_manifest = checkpoint.read_manifest(tp1)
    assert tp1_manifest["mesh"] == {"tp": 1, "dp": 4} and tp1_manifest["tp_slices"] == {}

    # the same names, dtypes and shapes as a TP 1 checkpoint's model
    model2, model1 = checkpoint.checkpoint_model(tp2), checkpoint.checkpoint_model(tp1)
    assert {n: (t.dtype, t.shape) for n, t in model2.items()} == {n: (t.dtype, t.shape) for n, t in model1.items()}
    # ... holding the same model: the two runs differ only by float order (the bound of test_distributed's
    # split invariance; AdamW's first steps amplify last-bit gradient differences to a few 1e-5)
    assert max_abs(model2, model1) <= 1e-4
    # bitwise the masters of the shards, assembled by hand through the layout and the TP slices
    masters = checkpoint_state(tp2)["master"]
    on_disk = model2
    assert all(torch.equal(on_disk[n], masters[n]) for n in masters)
    # and, at the end, bitwise the parameters the ranks hold
    final = checkpoint.checkpoint_model(step_folder(cfg2, 6))
    assert all(torch.equal(final[n], p) for n, p in out2["first"]["params"].items())
    # planted: the TP ranks' slices placed the other way round are not the model
    manifest["tp_slices"] = {n: {**d, "parts": d["parts"][::-1]} for n, d in manifest["tp_slices"].items()}
    shards = [load_file(os.path.join(tp2, checkpoint.shard_name(r, 4))) for r in range(4)]
    swapped = full_state(shards, ShardLayout.from_dict(manifest["layout"]),
                         {n: TPSlice.from_dict(d) for n, d in manifest["tp_slices"].items()}, 2, 2)["master"]
    assert not all(torch.equal(on_disk[n], swapped[n]) for n in swapped)


def test_an_async_tp_save_writes_bitwise_the_files_of_a_sync_one(saved):
    folders = saved["tp2dp2"][1]["folders"]
    contents = {way: {n: open(os.path.join(f, n), "rb").read() for n in sorted(os.listdir(f))}
                for way, f in folders.items()}
    shards = [checkpoint.shard_name(r, 4) for r in range(4)]
    assert sorted(contents["sync"]) == ["manifest.json"] + shards
    assert contents["async"] == contents["sync"]  # manifest.json included


def test_a_tp_resume_on_the_same_mesh_is_bitwise_identical(saved):
    out = saved["tp2dp2"][1]
    first, resumed = out["first"], out["resumed"]
    assert resumed["start"] == 3 and resumed["mesh"] == {"tp": 2, "dp": 2}
    assert resumed["losses"] == first["losses"][3:]  # exact float equality, every step
    assert resumed["digests"] == first["digests"]
    assert all(torch.equal(first["params"][k], resumed["params"][k]) for k in first["params"])


# ---------------------------------------------------------------- resharding across meshes
@pytest.mark.parametrize("case", list(RESHARDS))
def test_a_resume_on_another_mesh_restores_the_exact_state_and_a_misplaced_or_lossy_load_is_caught(runs, case):
    source, nproc, tp, micro, planted = RESHARDS[case]
    src_cfg, src_out = runs["saved"][source]
    uninterrupted = src_out.get("first", src_out)
    cfg, out = runs["resharded"][case]  # resumed from step_folder(src_cfg, 3) by RESHARD_JOBS[planted]
    assert cfg.checkpoint.resume == step_folder(src_cfg, 3)
    assert out["loaded"]["mesh"] == {"tp": tp, "dp": nproc // tp}
    # (i) right after loading, the new ranks' shards hold bitwise the checkpoint's full master, moments and step
    want = checkpoint_state(cfg.checkpoint.resume)
    assert differences(loaded_state(cfg.logging.out, "real", out["loaded"]), want) == []
    # planted: the same check catches a load that places the old TP slices wrongly or loses the moments
    bad = differences(loaded_state(cfg.logging.out, "planted", out["loaded"]), want)
    assert {"swapped slices": "master transformer.h.0.attn.c_attn.weight",
            "no moments": "exp_avg transformer.wte.weight"}[planted] in bad
    # (ii) and the run continues as the uninterrupted one did, up to float order
    resumed = out["resumed"]
    assert resumed["start"] == 3 and len(resumed["losses"]) == 3
    assert max_rel(resumed["losses"], uninterrupted["losses"][3:]) <= 1e-5
    assert max_abs(resumed["params"], uninterrupted["params"]) <= 1e-4


# ---------------------------------------------------------------- verify
def test_verify_passes_a_tp_checkpoint_and_names_the_corrupt_file(saved, tmp_path, capsys):
    cfg, _ = saved["tp2dp2"]
    good = step_folder(cfg, 3)
    checks = checkpoint.verify_checkpoint(good)
    assert all(c.ok for c in checks) and [c.name for c in checks][-1] == "replicas"
    assert sum(c.name == "shard" for c in checks) == 4
    assert cmd_verify(argparse.Namespace(path=cfg.checkpoint.dir)) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("verified: 2 checkpoints")

    def copy(name):
        folder = str(tmp_path / name / "step_00000003")
        shutil.copytree(good, folder)
        return folder

    version_1 = copy("version-1")  # written before format 2: its model file checked against the TP masters
    as_version_1(version_1)
    checks = checkpoint.verify_checkpoint(version_1)
    assert all(c.ok for c in checks) and [c.name for c in checks][-2:] == ["replicas", "model"]

    shard = checkpoint.shard_name(3, 4)  # world rank 3: DP rank 1, TP rank 1
    flipped = copy("flipped")
    path = os.path.join(flipped, shard)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    assert cmd_verify(argparse.Namespace(path=flipped)) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert f"FAIL sha256 {shard}: " in "\n".join(lines) and "(corrupt)" in lines[-1]
    assert lines[-1].startswith(f"FAILED: {path}: ")

    # a replicated master that differs between TP ranks, its manifest entry rewritten to match: named by its file
    drifted = copy("drifted")
    path = os.path.join(drifted, shard)
    name, at = replicated_value_of(checkpoint.read_manifest(good), dp_rank=1)
    tensors = load_file(path)
    tensors["master"][at] += 1.0
    save_file(tensors, path)
    rewrite(drifted, lambda m: _record_file(m, drifted, shard))
    bad = next(c for c in checkpoint.verify_checkpoint(drifted) if not c.ok)
    assert (bad.name, bad.file) == ("replicas", shard) and f"replicated tensor {name} differs" in bad.detail

    # the manifest's TP slices swapped between the ranks: not the slices its model config gives at TP 2, through
    # which the model is assembled from the shards
    swapped = copy("swapped")
    rewrite(swapped, lambda m: m["tp_slices"].update(
        {n: {**d, "parts": d["parts"][::-1]} for n, d in m["tp_slices"].items()}))
    bad = next(c for c in checkpoint.verify_checkpoint(swapped) if not c.ok)
    assert (bad.name, bad.file) == ("partition", "manifest.json") and "not the slice TP 2 gives it" in bad.detail

    # a mesh that does not make the world size is refused by the schema check
    wrong = copy("wrong-mesh")
    rewrite(wrong, lambda m: m["mesh"].update(dp=4))
    bad = next(c for c in checkpoint.verify_checkpoint(wrong) if not c.ok)
    assert (bad.name, bad.detail) == ("schema", "mesh TP 2 x DP 4 does not make world_size 4")


def replicated_value_of(manifest, dp_rank):
    """(name, index in the shard) of the first value of a replicated parameter that DP rank `dp_rank` owns."""
    L = ShardLayout.from_dict(manifest["layout"])
    for s in L.slots:
        if s.name not in manifest["tp_slices"]:
            for b in L.buckets:
                lo, hi = b.chunk(dp_rank, L.world_size)
                if max(lo, s.offset) < min(hi, s.offset + s.numel):
                    return s.name, b.shard_offset + max(lo, s.offset) - lo
    raise AssertionError("no replicated value owned by that rank")


def rewrite(folder, change):
    file = os.path.join(folder, "manifest.json")
    manifest = json.load(open(file))
    change(manifest)
    json.dump(manifest, open(file, "w"))


def _record_file(manifest, folder, name):
    data = open(os.path.join(folder, name), "rb").read()
    entry = next(f for f in manifest["files"] if f["name"] == name)
    entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()


def test_a_manifest_from_before_tp_reads_and_loads_as_tp1(tmp_path, one_rank):
    cfg = tiny_config(tmp_path)
    engine = build_engine(cfg, one_rank)
    path, _, _ = checkpoint.save_checkpoint(str(tmp_path / "ck"), 1, engine, one_rank, cfg.to_dict())
    rewrite(path, lambda m: [m.pop("mesh"), m.pop("tp_slices")])
    assert all(c.ok for c in checkpoint.verify_checkpoint(path))
    fresh = build_engine(cfg, one_rank)
    assert checkpoint.load_checkpoint(path, fresh, one_rank)["step"] == 1
    assert torch.equal(fresh.flat_params, engine.flat_params)
    rewrite(path, lambda m: m.update(mesh={"tp": 1, "dp": 1}))  # one of the two new keys alone is refused
    with pytest.raises(checkpoint.CheckpointError, match="has 'mesh' but no 'tp_slices'"):
        checkpoint.load_checkpoint(path, fresh, one_rank)


# ---------------------------------------------------------------- bf16
def test_a_bf16_tp_checkpoint_verifies_and_async_and_sync_saves_agree(tmp_path):
    cfg = tiny_config(tmp_path, nproc=2, tp=2, micro=4, accum=1, steps=2, precision="bf16")
    cfg.checkpoint.every = 2
    out = run(tp_ckpt_jobs.bf16_saves_job, cfg)
    for folder in (out["sync"], out["async"]):
        assert all(c.ok for c in checkpoint.verify_checkpoint(folder)), [c.line() for c in checkpoint.verify_checkpoint(folder)]
    files = [n for n in os.listdir(out["sync"]) if n != "manifest.json"]
    assert all(open(os.path.join(out["sync"], n), "rb").read() == open(os.path.join(out["async"], n), "rb").read()
               for n in files)
    model = checkpoint.checkpoint_model(out["sync"])
    assert all(torch.equal(model[n], p) for n, p in out["params"].items())  # the bf16 parameters, upcast exactly
