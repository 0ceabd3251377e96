"""The record of an --init-from folder (hub/base_digest.py, WeightSource.record) costs each rank its share: 4 ranks
hashing a Hugging Face folder of two files each read within 1.25x of a quarter of its bytes (counted where they
are read), their record equal to the one a single process computes; a planted record that hashes whole files, one
rank each, is caught by the same bound. A base with one block changed is still refused (a LoRA checkpoint's base,
pretrained.base_problem; a resume's, first_difference), by a record of either format (block digests, or an older
manifest's whole-file sha256); a planted digest that skips every block after a file's first lets the change
through.
"""

import functools
import hashlib
import os
import shutil

import dist_jobs
import io_plan_jobs as jobs
import pytest
import torch
import transformers
from conftest import tiny_config

from zerotrain.hub import base_digest
from zerotrain.hub.base_digest import first_difference, tagged_digests
from zerotrain.hub.init_from import weight_source
from zerotrain.hub.pretrained import base_problem
from zerotrain.runtime.launch import run_job

pytestmark = pytest.mark.timeout(240)
W = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama saved by transformers in bf16, in two files (about 300 KB: 4 KiB blocks, ~75 of them)."""
    path = str(tmp_path_factory.mktemp("base") / "llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="200KB")
    return path


def weight_files(folder):
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


@pytest.fixture(scope="module")
def hashed(folder, tmp_path_factory):
    cfg = tiny_config(tmp_path_factory.mktemp("hash-run"), nproc=W)
    pairs = [(functools.partial(jobs.hash_job, folder=folder), cfg),
             (functools.partial(jobs.hash_job, folder=folder, plants=("whole files",)), cfg)]
    real, planted = run_job(functools.partial(dist_jobs.in_turn_job, jobs=pairs), cfg, time_limit=150)
    return real, planted


def test_each_rank_hashes_its_share_of_the_folder_and_a_whole_file_hash_is_caught(folder, hashed):
    real, planted = hashed
    files = weight_files(folder)
    total = sum(os.path.getsize(f) for f in files)
    assert len(files) == 2 and real["record"]["block_bytes"] == 4096
    share = total / W
    assert sum(real["hashed"]) == total and max(real["hashed"]) <= 1.25 * share, (real["hashed"], share)
    # the planted record: the larger file's rank reads it all, the bound names it
    assert sum(planted["hashed"]) == total and max(planted["hashed"]) > 1.25 * share, (planted["hashed"], share)
    # one process (export, sample, a resume's check) computes the ranks' record
    assert weight_source(folder).record() == real["record"]
    # and the I/O plan's figure is the bytes the ranks read
    assert base_digest.hashed_bytes([(f, os.path.getsize(f)) for f in files], W) == real["hashed"]


def changed_copy(folder, dest, at: float = 0.6) -> str:
    """A copy of `folder` whose second weight file has one byte changed, `at` of the way in (past its first block)."""
    shutil.copytree(folder, dest)
    second = weight_files(str(dest))[1]
    with open(second, "r+b") as f:
        f.seek(int(os.path.getsize(second) * at))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return second


def test_a_base_with_one_block_changed_is_refused_by_either_records_format_and_a_digest_of_first_blocks_is_caught(
        folder, tmp_path, monkeypatch):
    same, changed = tmp_path / "same", tmp_path / "changed"
    shutil.copytree(folder, same)
    changed_file = changed_copy(folder, changed)
    name = os.path.basename(changed_file)
    record = weight_source(folder).record()
    old = {"path": folder, "kind": "hf", "files": [  # a manifest's record before block digests: whole-file sha256s
        {"name": os.path.basename(f), "sha256": hashlib.sha256(open(f, "rb").read()).hexdigest()}
        for f in weight_files(folder)]}
    for kept in (record, old):
        assert base_problem({**kept, "path": str(same)}) is None
        assert f"its base {changed_file} has changed" in base_problem({**kept, "path": str(changed)})
        # a resume: this run's record of its base against the one the checkpoint keeps
        assert first_difference(tagged_digests(kept), weight_source(str(same)).record()) is None
        differs = first_difference(tagged_digests(kept), weight_source(str(changed)).record())
        assert differs is not None and differs[0] == name and differs[1] != differs[2]
    # planted: a digest of each file's first block alone; the change, past it, goes through
    real = base_digest.blocks
    monkeypatch.setattr(base_digest, "blocks", lambda sizes, block_bytes: [
        b for b in real(sizes, block_bytes) if b[1] == 0])
    assert base_problem({**weight_source(folder).record(), "path": str(changed)}) is None
