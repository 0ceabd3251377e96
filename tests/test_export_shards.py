"""`zerotrain export --format hf` writes the model's dtype, cut as save_pretrained cuts it, by one or several processes.

The dtype: a bf16 run exports bf16 (transformers loads it in bf16, and in fp32 bitwise as the fp32 export), a run from
--init-from its model's dtype. The shards: huggingface_hub's split of the same tensors, each file the bytes
safetensors.save_file writes, the index transformers reads (its logits equal the one-file export's). The processes:
two write the files one writes, byte for byte; a shard that no process wrote leaves no export.
"""

import functools
import json
import os

import pytest
import torch
import transformers  # the [test] extra installs it: a missing one fails, never skips
from conftest import tiny_config
from test_api import IDX, run_cli, train_checkpoint

import zerotrain
from zerotrain import checkpoint
from zerotrain.checkpoint.stream import read_header
from zerotrain.cli.commands import export_model as export_command
from zerotrain.hub import export, weight_shards
from zerotrain.hub.pretrained import ModelSource

pytestmark = pytest.mark.timeout(300)
LLAMA = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny GPT trained in fp32 (test_api.train_checkpoint): its run folder."""
    return train_checkpoint(str(tmp_path_factory.mktemp("run")))


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """A tiny Llama trained 2 steps at --precision bf16 on one rank in this process: its run folder."""
    import torch.distributed as dist

    from test_engine import run_steps

    from zerotrain.parallel import Comm
    from zerotrain.training.loop import build_engine

    root = str(tmp_path_factory.mktemp("bf16"))
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        cfg = tiny_config(root, steps=2, micro=4, seed=1, precision="bf16", **LLAMA)
        engine = build_engine(cfg, Comm())
        run_steps(engine, cfg, 2)
        checkpoint.save_checkpoint(cfg.checkpoint.dir, 2, engine, Comm(), cfg.to_dict())
    finally:
        dist.destroy_process_group()
    return root


def dtypes(folder: str) -> set[str]:
    """The dtypes of every tensor in the folder's weight files."""
    return {dtype for path in set(export.tensor_files(folder).values()) for dtype, _ in read_header(path).values()}


def read_json(folder: str, name: str) -> dict:
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def logits(folder: str, **kwargs) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    with torch.no_grad():
        return model(IDX % model.config.vocab_size).logits.float()


def test_a_bf16_run_exports_bf16_which_transformers_loads_as_the_fp32_export_and_a_dropped_cast_is_caught(
        bf16_run, tmp_path, monkeypatch):
    out, fp32 = str(tmp_path / "hf"), str(tmp_path / "fp32")
    assert run_cli(["export", bf16_run, out, "--format", "hf"]) == 0
    assert dtypes(out) == {"BF16"}
    config = read_json(out, "config.json")
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"  # transformers 5's field, and 4's
    assert run_cli(["export", bf16_run, fp32, "--format", "hf", "--dtype", "fp32"]) == 0
    assert dtypes(fp32) == {"F32"} and read_json(fp32, "config.json")["dtype"] == "float32"
    assert os.path.getsize(os.path.join(out, "model.safetensors")) < 0.55 * os.path.getsize(
        os.path.join(fp32, "model.safetensors"))
    # transformers takes the dtype from config.json; the run's parameters were bf16: nothing is lost in bf16
    assert transformers.AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    assert torch.equal(logits(out, dtype=torch.float32), logits(fp32))
    model = zerotrain.load_model(bf16_run)
    with torch.no_grad():
        ours = model(IDX % model.cfg.vocab_size)
    assert (logits(fp32) - ours).abs().max() < 1e-4
    # planted: the run's dtype ignored, fp32 written as before
    monkeypatch.setattr(export_command, "model_dtype", lambda source, choice: (torch.float32, "fp32"))
    assert run_cli(["export", bf16_run, str(tmp_path / "ignored"), "--format", "hf"]) == 0
    assert dtypes(str(tmp_path / "ignored")) == {"F32"}
    monkeypatch.undo()
    # planted: the cast left out of the writer: the file does not come out at its planned size and no export is left
    monkeypatch.setattr(weight_shards, "stored_tensor", lambda t, dtype: t.detach().contiguous())
    assert run_cli(["export", bf16_run, str(tmp_path / "uncast"), "--format", "hf"]) == 1
    assert not os.path.exists(tmp_path / "uncast") and not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def source(manifest: dict | None, folder: str = "") -> ModelSource:
    return ModelSource(folder, "checkpoint" if manifest else "hf", manifest)


def test_auto_is_the_init_from_models_dtype_then_the_runs_precision_and_a_torch_dtype_left_unread_is_caught(
        tmp_path, monkeypatch):
    base = tmp_path / "base"
    base.mkdir()
    run = {"precision": "fp32", "init_from": {"path": str(base)}}
    for config, expected in (({"dtype": "bfloat16"}, torch.bfloat16),  # transformers 5's field
                             ({"torch_dtype": "float16"}, torch.float16),  # transformers 4's
                             ({}, torch.float32)):  # neither: the run's --precision
        (base / "config.json").write_text(json.dumps(config))
        assert export.model_dtype(source(run))[0] == expected, config
    assert export.model_dtype(source({"precision": "bf16"}))[0] == torch.bfloat16  # no --init-from: the run's
    assert export.model_dtype(source({"precision": "bf16"}), "fp32")[0] == torch.float32  # --dtype decides
    (base / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert export.model_dtype(source(run, str(base)))[0] == torch.bfloat16
    assert export.model_dtype(source(None, str(base)))[0] == torch.bfloat16  # an exported folder: its config's
    # planted: only transformers 5's "dtype" read: a folder transformers 4 saved comes back in the run's fp32
    monkeypatch.setattr(export, "DTYPE_NAMES", {})
    assert export.model_dtype(source(run))[0] == torch.float32


def test_shards_are_what_save_pretrained_writes_transformers_loads_them_with_the_one_files_logits_and_a_wrong_weight_map_is_caught(
        run, bf16_run, tmp_path, monkeypatch):
    # GPT-2: the files transformers writes of the same model, byte for byte (its order, sizes, headers, index)
    gpt2, theirs = str(tmp_path / "gpt2"), str(tmp_path / "theirs")
    assert run_cli(["export", run, gpt2, "--format", "hf", "--max-shard-size", "30KB"]) == 0
    transformers.AutoModelForCausalLM.from_pretrained(gpt2).save_pretrained(theirs, max_shard_size="30KB")
    index = read_json(gpt2, "model.safetensors.index.json")
    assert index == read_json(theirs, "model.safetensors.index.json") and len(set(index["weight_map"].values())) >= 4
    for file in set(index["weight_map"].values()):
        with open(os.path.join(gpt2, file), "rb") as ours, open(os.path.join(theirs, file), "rb") as reference:
            assert ours.read() == reference.read(), file
    # a Llama in bf16: transformers loads the shards with the one file's logits, and so does zerotrain
    one, sharded = str(tmp_path / "one"), str(tmp_path / "sharded")
    assert run_cli(["export", bf16_run, one, "--format", "hf"]) == 0
    assert "model.safetensors.index.json" not in os.listdir(one)  # one file when it fits, as save_pretrained
    limit = os.path.getsize(os.path.join(one, "model.safetensors")) // 4
    assert run_cli(["export", bf16_run, sharded, "--format", "hf", "--max-shard-size", str(limit)]) == 0
    assert len(set(read_json(sharded, "model.safetensors.index.json")["weight_map"].values())) >= 4
    assert torch.equal(logits(sharded), logits(one))
    model = zerotrain.load_model(sharded)
    with torch.no_grad():
        assert torch.equal(model(IDX % model.cfg.vocab_size), zerotrain.load_model(one)(IDX % model.cfg.vocab_size))
    # --overwrite with one file removes the shards and the index of the export before
    assert run_cli(["export", bf16_run, sharded, "--format", "hf", "--overwrite"]) == 0
    assert sorted(n for n in os.listdir(sharded) if n.startswith("model")) == ["model.safetensors"]
    # planted: the index names the wrong shard for two tensors. transformers 5 reads every file the index lists and
    # takes each tensor where it finds it; zerotrain (as transformers 4) reads each where the index says: refused
    plan_index = weight_shards.ShardPlan.index

    def swapped(plan):
        index = plan_index(plan)
        first = [n for n, f in index["weight_map"].items() if f == plan.files[0]][0]
        other = [n for n, f in index["weight_map"].items() if f != plan.files[0]][0]
        index["weight_map"].update({first: index["weight_map"][other], other: plan.files[0]})
        return index

    monkeypatch.setattr(weight_shards.ShardPlan, "index", swapped)
    wrong = str(tmp_path / "wrong")
    assert run_cli(["export", bf16_run, wrong, "--format", "hf", "--max-shard-size", str(limit)]) == 0
    with pytest.raises(checkpoint.CheckpointError, match="does not fit the model its config describes: Missing"):
        zerotrain.load_model(wrong)
    # planted: the index numbers its files from 0: transformers refuses the folder
    monkeypatch.setattr(weight_shards.ShardPlan, "index", lambda plan: {**plan_index(plan), "weight_map": {
        n: f.replace(f"model-{k:05d}", f"model-{k - 1:05d}") for n, f in plan_index(plan)["weight_map"].items()
        for k in [int(f[6:11])]}})
    numbered = str(tmp_path / "numbered")
    assert run_cli(["export", bf16_run, numbered, "--format", "hf", "--max-shard-size", str(limit)]) == 0
    with pytest.raises(OSError):
        logits(numbered)


def test_two_processes_write_the_one_process_files_byte_for_byte_and_a_shard_none_wrote_leaves_no_export(
        run, tmp_path, monkeypatch):
    limit = "20KB"  # several shards of the tiny GPT in bf16
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert run_cli(["export", run, one, "--format", "hf", "--dtype", "bf16", "--max-shard-size", limit]) == 0
    assert run_cli(["export", run, two, "--format", "hf", "--dtype", "bf16", "--max-shard-size", limit,
                    "--nproc", "2"]) == 0
    files = sorted(os.listdir(one))
    assert files == sorted(os.listdir(two)) and sum(n.startswith("model-") for n in files) >= 3
    for name in files:
        with open(os.path.join(one, name), "rb") as a, open(os.path.join(two, name), "rb") as b:
            assert a.read() == b.read(), name
    # planted: fp32 rounded to bf16 by truncation in this process's writer: the comparison sees it
    truncated = str(tmp_path / "truncated")
    with monkeypatch.context() as m:
        m.setattr(weight_shards, "stored_tensor", lambda t, dtype: (t.detach().float().contiguous().view(torch.int32)
                                                                    >> 16).to(torch.int16).view(torch.bfloat16))
        assert run_cli(["export", run, truncated, "--format", "hf", "--dtype", "bf16", "--max-shard-size",
                        limit]) == 0
    assert any(open(os.path.join(truncated, n), "rb").read() != open(os.path.join(two, n), "rb").read()
               for n in files if n.startswith("model-"))
    # planted: the last shard given to no process: the export stops before anything is moved into place
    owners = weight_shards.ShardPlan.owners
    monkeypatch.setattr(weight_shards.ShardPlan, "owners", lambda plan, nproc: owners(plan, nproc)[:-1] + [nproc])
    assert run_cli(["export", run, str(tmp_path / "lost"), "--format", "hf", "--max-shard-size", limit,
                    "--nproc", "2"]) == 1
    assert not os.path.exists(tmp_path / "lost") and not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


@pytest.mark.parametrize("flags, message", [
    (["--max-shard-size", "5XB"], "--max-shard-size must be a positive size such as 5GB, 500MB or a count of "
                                  "bytes, got '5XB'"),
    (["--max-shard-size", "0"], "--max-shard-size must be a positive size"),
    (["--nproc", "0"], "--nproc must be at least 1, got 0"),
])
def test_a_bad_shard_size_or_process_count_is_refused_in_one_line(run, tmp_path, capsys, flags, message):
    assert run_cli(["export", run, str(tmp_path / "out"), "--format", "hf", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not os.path.exists(tmp_path / "out")


def test_owners_give_each_process_consecutive_shards_of_about_its_share_of_the_bytes():
    meta = functools.partial(torch.empty, device="meta")
    plan = weight_shards.plan_shards({f"t{i}": meta(25) for i in range(10)}, 400)  # 4 of 100 bytes a shard: 4, 4, 2
    assert [len(s) for s in plan.shards] == [4, 4, 2] and plan.files[0] == "model-00001-of-00003.safetensors"
    assert plan.owners(1) == [0, 0, 0] and plan.owners(2) == [0, 1, 1] and plan.owners(3) == [0, 1, 2]
    big = weight_shards.plan_shards({"a": meta(10), "big": meta(1000), "b": meta(10)}, 400)
    assert big.shards == (("big",), ("a", "b"))  # a larger tensor alone, before the shard being filled (huggingface_hub)
