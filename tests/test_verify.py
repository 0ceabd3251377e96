"""`zerotrain verify` and resume fallback: a good checkpoint verifies; each planted corruption is named and skipped."""

import argparse
import hashlib
import json
import os
import shutil

import pytest
import torch
from conftest import as_version_1, tiny_config
from safetensors.torch import load_file, save_file
from test_engine import run_steps

from zerotrain import checkpoint
from zerotrain.checkpoint.verify import model_problem
from zerotrain.cli.commands.verify_checkpoint import cmd_verify
from zerotrain.errors import ConfigError
from zerotrain.parallel import ShardLayout
from zerotrain.training.loop import build_engine

SHARD = "optim-rank00000-of-00001.safetensors"


def two_checkpoints(tmp_path, one_rank, **run):
    """A root with committed steps 1 and 2 (different states); latest names step 2."""
    cfg = tiny_config(tmp_path, **run)
    engine = build_engine(cfg, one_rank)
    root = str(tmp_path / "ck")
    for step in (1, 2):
        run_steps(engine, cfg, 1)
        checkpoint.save_checkpoint(root, step, engine, one_rank, cfg.to_dict())
    return root, os.path.join(root, "step_00000001"), os.path.join(root, "step_00000002")


def verify_command(path, capsys):
    code = cmd_verify(argparse.Namespace(path=path))
    return code, capsys.readouterr().out.strip().splitlines()


def rewrite_manifest(folder, change):
    file = os.path.join(folder, "manifest.json")
    manifest = json.load(open(file))
    change(manifest)
    json.dump(manifest, open(file, "w"))


def flip_a_byte(folder, tmp_path):
    path = os.path.join(folder, SHARD)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(path, "wb").write(bytes(data))


def truncate(folder, tmp_path):
    path = os.path.join(folder, SHARD)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) - 4])


def delete_manifest(folder, tmp_path):
    os.remove(os.path.join(folder, "manifest.json"))


def traversal_name(folder, tmp_path):
    shutil.copy(os.path.join(folder, SHARD), os.path.join(folder, "..", "x"))  # a real file out there

    def rename(manifest):
        next(f for f in manifest["files"] if f["name"] == SHARD)["name"] = "../x"

    rewrite_manifest(folder, rename)


def symlink_out(folder, tmp_path):
    outside = str(tmp_path / "elsewhere.safetensors")
    shutil.move(os.path.join(folder, SHARD), outside)  # same bytes: only the link is wrong
    os.symlink(outside, os.path.join(folder, SHARD))


def overlapping_ranges(folder, tmp_path):
    def overlap(manifest):
        manifest["layout"]["owned_ranges"][0][1][0] -= 10  # bucket 1's range reaches into bucket 0's

    rewrite_manifest(folder, overlap)


def model_differs(folder, tmp_path):
    as_version_1(folder)  # a checkpoint written before format 2: its model file beside the masters
    path = os.path.join(folder, "model.safetensors")
    model = load_file(path)
    model["transformer.wpe.weight"][0, 0] += 1e-3
    save_file(model, path)
    size, digest = os.path.getsize(path), hashlib.sha256(open(path, "rb").read()).hexdigest()

    def record(manifest):  # the manifest agrees with the new file: only the content check can tell
        entry = next(f for f in manifest["files"] if f["name"] == "model.safetensors")
        entry["bytes"], entry["sha256"] = size, digest

    rewrite_manifest(folder, record)


CORRUPTIONS = {  # planted corruption -> (the check that catches it, the file it names, why)
    "flipped byte": (flip_a_byte, "sha256", SHARD, "corrupt"),
    "truncated shard": (truncate, "size", SHARD, "truncated"),
    "deleted manifest": (delete_manifest, "manifest", "manifest.json", "is missing"),
    "traversal name": (traversal_name, "name", "../x", "not a plain name"),
    "symlink out": (symlink_out, "name", SHARD, "outside the checkpoint folder"),
    "overlapping ranges": (overlapping_ranges, "partition", "manifest.json", "owned ranges overlap"),
    "model differs": (model_differs, "model", "model.safetensors", "differs from the assembled master shards"),
}


def test_a_good_checkpoint_and_root_verify(tmp_path, one_rank, capsys):
    root, step1, step2 = two_checkpoints(tmp_path, one_rank)
    checks = checkpoint.verify_checkpoint(step2)
    assert checkpoint.read_manifest(step2)["version"] == 2  # the parameters stored once: in the shard
    assert [c.name for c in checks] == ["manifest", "json", "schema", "name", "files", "size", "sha256", "partition",
                                        "shard"]
    assert all(c.ok for c in checks)
    as_version_1(step1)  # a checkpoint written before format 2 verifies, its model file against the masters
    checks = checkpoint.verify_checkpoint(step1)
    assert [c.name for c in checks] == ["manifest", "json", "schema", "name", "name", "files", "size", "size",
                                        "sha256", "sha256", "partition", "shard", "model"]
    assert all(c.ok for c in checks)
    checkpoint.verify_or_raise(step2)
    code, lines = verify_command(step2, capsys)
    assert code == 0 and f"ok   sha256 {SHARD}" in lines and lines[-1].startswith("verified: 1 checkpoint,")
    code, lines = verify_command(root, capsys)
    assert code == 0 and lines[0] == f"== {step2} (latest)" and lines[-1].startswith("verified: 2 checkpoints")
    assert checkpoint.find_resumable(root) == (step2, [])


def test_a_bf16_checkpoint_verifies_against_its_masters_rounded_to_bf16(tmp_path, one_rank):
    _, _, step2 = two_checkpoints(tmp_path, one_rank, precision="bf16")
    checkpoint.verify_or_raise(step2)
    as_version_1(step2)  # format 1's model file: the masters rounded to bf16
    checkpoint.verify_or_raise(step2)
    # planted: a model file of the unrounded fp32 masters is not what a bf16 run trains with
    shard = load_file(os.path.join(step2, SHARD))
    L = ShardLayout.from_dict(checkpoint.read_manifest(step2)["layout"])
    flat = L.assemble([shard["master"]])
    assert not torch.equal(flat, flat.bfloat16().float())
    model_file = os.path.join(step2, "model.safetensors")
    save_file({s.name: flat[s.offset : s.offset + s.numel].view(s.shape).clone() for s in L.slots}, model_file)
    assert "differs from the assembled master shards" in model_problem(step2, checkpoint.read_manifest(step2))


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_planted_corruption_fails_verify_naming_the_file_and_resume_falls_back(tmp_path, one_rank, capsys, corruption):
    corrupt, check, file, why = CORRUPTIONS[corruption]
    root, step1, step2 = two_checkpoints(tmp_path, one_rank)
    corrupt(step2, tmp_path)
    bad = [c for c in checkpoint.verify_checkpoint(step2) if not c.ok]
    assert (bad[0].name, bad[0].file) == (check, file) and why in bad[0].detail
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.verify_or_raise(step2)
    assert str(raised.value).startswith(os.path.join(step2, file) + ": ") and why in str(raised.value)

    code, lines = verify_command(step2, capsys)
    assert code == 1 and f"FAIL {check} {file}: " in "\n".join(lines)
    assert lines[-1].startswith(f"FAILED: {os.path.join(step2, file)}: ") and why in lines[-1]
    code, lines = verify_command(root, capsys)  # the root: step 2 fails, step 1 still verifies
    assert code == 1 and lines[-1].startswith(f"FAILED: {os.path.join(step2, file)}: ")

    path, skipped = checkpoint.find_resumable(root)
    assert path == step1
    assert [name for name, _ in skipped] == ["step_00000002"] and os.path.join(step2, file) in skipped[0][1]
    assert checkpoint.resolve_resume("auto", root) == step1


def test_nothing_to_resume_and_nothing_that_verifies_are_told_apart(tmp_path, one_rank):
    assert checkpoint.find_resumable(str(tmp_path / "empty")) == (None, [])
    assert checkpoint.resolve_resume("auto", str(tmp_path / "empty")) is None
    root, step1, step2 = two_checkpoints(tmp_path, one_rank)
    flip_a_byte(step1, tmp_path)
    truncate(step2, tmp_path)
    path, skipped = checkpoint.find_resumable(root)
    assert path is None and [name for name, _ in skipped] == ["step_00000002", "step_00000001"]
    with pytest.raises(checkpoint.CheckpointError, match=f"no checkpoint under {root} verifies: .*{SHARD}"):
        checkpoint.resolve_resume("auto", root)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step_00000009\n")  # latest naming a folder that is not there
    assert checkpoint.find_resumable(root)[1][0] == ("step_00000009", f"{root}/latest names step_00000009, which does not exist")


def test_verify_of_a_missing_path_is_a_user_error(tmp_path):
    with pytest.raises(ConfigError, match="no such checkpoint folder or checkpoint root"):
        cmd_verify(argparse.Namespace(path=str(tmp_path / "nope")))


class Readers:
    """W readers of one checkpoint in this process, seen from reader `rank`: a W-rank group's all-gather."""

    def __init__(self, path: str, world_size: int, rank: int = 0):
        self.path, self.rank, self.world_size, self.io = path, rank, world_size, self

    def all_gather_json(self, mine, purpose):
        from zerotrain.checkpoint.verify import _listed, _verify_share
        every = []
        for r in range(self.world_size):
            checks, digests, _ = _verify_share(self.path, r, self.world_size)
            every.append({"checks": [[c.name, c.ok, c.detail, c.file] for c in checks], "digests": _listed(digests)})
        assert every[self.rank] == mine
        return every


def together(path, readers=3, rank=0):
    from zerotrain.checkpoint.verify import verify_together
    return verify_together(path, Readers(path, readers, rank))


def test_readers_share_the_reading_checks_each_file_header_and_tensor_once(tmp_path, one_rank):
    _, _, step2 = two_checkpoints(tmp_path, one_rank)
    as_version_1(step2)  # two files, and the model file's tensors
    parts = [checkpoint.verify_checkpoint(step2, part=(r, 2)) for r in range(2)]
    hashed = [[c.file for c in p if c.name == "sha256"] for p in parts]
    assert sorted(hashed[0] + hashed[1]) == sorted(["model.safetensors", SHARD]) and all(hashed)
    headers = [[c.file for c in p if c.name == "shard"] for p in parts]
    assert sorted(headers[0] + headers[1]) == [SHARD]  # each shard's header read by one reader
    cheap = [[(c.name, c.file) for c in p if c.name not in ("sha256", "model", "shard")] for p in parts]
    assert cheap[0] == cheap[1]  # every reader runs every cheap check
    assert all(c.ok for c in together(step2)) and [c.name for c in together(step2)] == \
        [c.name for c in checkpoint.verify_checkpoint(step2)]


@pytest.mark.parametrize("corruption", ["flipped byte", "model differs", "truncated shard"])
def test_a_corruption_fails_verification_together_whichever_reader_reads_it(tmp_path, one_rank, corruption,
                                                                             monkeypatch):
    corrupt, check, file, why = CORRUPTIONS[corruption]
    root, step1, step2 = two_checkpoints(tmp_path, one_rank)
    corrupt(step2, tmp_path)
    for readers in (1, 2, 3):
        for rank in range(readers):  # every rank sees the same verdict, whoever read the bad bytes
            bad = [c for c in together(step2, readers, rank) if not c.ok]
            assert (bad[0].name, bad[0].file) == (check, file) and why in bad[0].detail
    if check == "size":
        return  # a cheap check: every reader runs it
    # planted: each rank keeps only its own share's verdicts, so what another reader found is lost on it
    from zerotrain.checkpoint import verify
    missed = []
    for rank in range(2):
        monkeypatch.setattr(verify, "merge_checks", lambda every, r=rank: every[r])
        missed.append(all(c.ok for c in together(step2, 2, rank)))
    assert any(missed)
