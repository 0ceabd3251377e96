"""Checkpoints on one rank: manifest, atomic commit, latest, retention, integrity and round trip (d)."""

import importlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_config
from test_engine import run_steps
from zerotrain import checkpoint
from zerotrain.invariants import InvariantError, check_roundtrip
from zerotrain.train import build_engine


def test_manifest_describes_the_checkpoint(tmp_path, one_rank):
    cfg = tiny_config(tmp_path)
    engine = build_engine(cfg, one_rank)
    run_steps(engine, cfg, 2)
    path, written, manifest = checkpoint.save(str(tmp_path / "ck"), 2, engine, one_rank, cfg.to_dict())
    assert os.path.basename(path) == "step_00000002"
    on_disk = json.load(open(os.path.join(path, "manifest.json")))
    assert on_disk["format"] == "zerotrain-checkpoint" and on_disk["step"] == 2 and on_disk["world_size"] == 1
    assert on_disk["param_count"] == 28_032 and on_disk["config"]["model"]["n_embd"] == 32
    names = {f["name"] for f in on_disk["files"]}
    assert names == {"model.safetensors", "optim-rank00000-of-00001.safetensors"} == set(os.listdir(path)) - {"manifest.json"}
    assert on_disk["layout"]["owned_ranges"][0] == [[b["start"], b["end"]] for b in on_disk["layout"]["buckets"]]
    model = load_file(os.path.join(path, "model.safetensors"))  # plain safetensors, no torch.distributed
    assert torch.equal(model["transformer.wte.weight"], engine.model.transformer.wte.weight.detach())
    assert open(tmp_path / "ck" / "latest").read().strip() == "step_00000002"
    check_roundtrip(path, written, manifest)


def test_round_trip_check_catches_a_corrupted_file_and_a_changed_tensor(tmp_path, one_rank):
    cfg = tiny_config(tmp_path)
    engine = build_engine(cfg, one_rank)
    path, written, manifest = checkpoint.save(str(tmp_path / "ck"), 1, engine, one_rank, cfg.to_dict())
    changed = {name: {k: v.clone() for k, v in t.items()} for name, t in written.items()}
    changed["model.safetensors"]["transformer.wpe.weight"][0, 0] += 1.0
    with pytest.raises(InvariantError, match=r"invariant \(d\).*transformer.wpe.weight"):
        check_roundtrip(path, changed, manifest)
    shard = os.path.join(path, "optim-rank00000-of-00001.safetensors")
    data = bytearray(open(shard, "rb").read())
    data[-1] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(InvariantError, match=r"invariant \(d\).*sha256"):
        check_roundtrip(path, written, manifest)
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        checkpoint.load(path, engine, one_rank)


def test_save_is_atomic_and_retention_keeps_the_newest(tmp_path, one_rank, monkeypatch):
    cfg = tiny_config(tmp_path)
    engine = build_engine(cfg, one_rank)
    root = str(tmp_path / "ck")
    for step in (1, 2, 3):
        checkpoint.save(root, step, engine, one_rank, cfg.to_dict(), keep=2)
    assert checkpoint.committed_steps(root) == ["step_00000002", "step_00000003"]

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(importlib.import_module("zerotrain.checkpoint.save"), "save_file", crash)  # a crash in the middle of writing step 4
    with pytest.raises(OSError):
        checkpoint.save(root, 4, engine, one_rank, cfg.to_dict(), keep=2)
    assert checkpoint.committed_steps(root) == ["step_00000002", "step_00000003"]
    assert not os.path.exists(os.path.join(root, "step_00000004"))
    assert checkpoint.resolve_resume("auto", root).endswith("step_00000003")


def test_resume_restores_the_exact_state(tmp_path, one_rank):
    cfg = tiny_config(tmp_path)
    engine = build_engine(cfg, one_rank)
    run_steps(engine, cfg, 2)
    path, _, _ = checkpoint.save(str(tmp_path / "ck"), 2, engine, one_rank, cfg.to_dict())
    fresh = build_engine(cfg, one_rank)
    assert not torch.equal(fresh.flat_params, engine.flat_params)
    assert checkpoint.load(path, fresh, one_rank) == 2
    assert torch.equal(fresh.flat_params, engine.flat_params)
    assert torch.equal(fresh.exp_avg, engine.exp_avg) and torch.equal(fresh.exp_avg_sq, engine.exp_avg_sq)
    assert fresh.step_count == engine.step_count == 2


def test_incompatible_or_foreign_folders_are_refused(tmp_path, one_rank):
    cfg = tiny_config(tmp_path)
    engine = build_engine(cfg, one_rank)
    path, _, manifest = checkpoint.save(str(tmp_path / "ck"), 1, engine, one_rank, cfg.to_dict())
    assert checkpoint.incompatibility(manifest, {**vars(cfg.model), "n_embd": 64}) == \
        "checkpoint has model.n_embd=32, this run has 64"
    with pytest.raises(checkpoint.CheckpointError, match="manifest.json is missing"):
        checkpoint.read_manifest(str(tmp_path))
