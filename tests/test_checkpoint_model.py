"""The model a checkpoint holds is the same whether it is read from its model file or from its shards' masters.

One start of 2 ranks trains and saves five tiny runs (fp32 over DP 2, bf16, ZeRO-3, TP 2 of a Llama with its one KV
head on both TP ranks, LoRA adapters at TP 2), each returning the parameters it trained (the engine's own gather, not
the checkpoint's). Here, in this process: the shards assemble bitwise to them, whole (checkpoint_model) and one tensor
at a time (ShardedModel), and a planted misassembly is caught; then every reader of a checkpoint's model (load_model,
export hf and peft, --init-from, a LoRA base) gives the same model from a copy of the checkpoint whose manifest lists
no model file (format 2) as from one that lists it (format 1).
"""

import functools
import hashlib
import json
import math
import os
import shutil

import dist_jobs
import pytest
import torch
from conftest import tiny_config
from safetensors.torch import load_file, save_file

from zerotrain import checkpoint, load_model
from zerotrain.checkpoint import MODEL_FILE, ShardedModel, checkpoint_model, has_model_file
from zerotrain.checkpoint import consolidate
from zerotrain.checkpoint import verify as verify_module
from zerotrain.checkpoint.stream import bytes_counted
from zerotrain.cli.main import main
from zerotrain.errors import CheckpointError
from zerotrain.hub import base_digest
from zerotrain.hub.init_from import adopt, load_local, weight_source
from zerotrain.model import build_model, parallelize
from zerotrain.runtime.launch import run_job
from zerotrain.training.loop import train

LIMIT = 120  # seconds: a deadlocked job fails the test instead of hanging CI
pytestmark = pytest.mark.timeout(300)
STEPS = 2
GQA = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64)
MQA = {**GQA, "n_kv_head": 1}  # at TP 2 its one KV head is on both TP ranks
RUNS = {"fp32 DP 2": {}, "bf16 DP 2": {"precision": "bf16"}, "ZeRO-3 DP 2": {"zero": 3},
        "TP 2, the KV head on both": {"tp": 2, **MQA}, "LoRA TP 2": {"tp": 2, "lora_rank": 4, "lora_alpha": 8.0, **GQA}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (the step-2 checkpoint folder, the run's trained parameters by name)}, all on one start of 2 ranks."""
    tmp = tmp_path_factory.mktemp("ckpt-model")
    cfgs = {}
    for name, settings in RUNS.items():
        cfg = tiny_config(tmp / name.replace(" ", "_").replace(",", ""), nproc=2, micro=2, steps=STEPS, **settings)
        cfg.checkpoint.every = STEPS
        cfgs[name] = cfg
    jobs = [(dist_jobs.params_job, cfg) for cfg in cfgs.values()]
    results = run_job(functools.partial(dist_jobs.in_turn_job, jobs=jobs), jobs[0][1], time_limit=LIMIT)
    return {name: (os.path.join(cfg.checkpoint.dir, checkpoint.step_name(STEPS)), result["params"])
            for (name, cfg), result in zip(cfgs.items(), results)}


def bits_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype == torch.float32 and a[n].shape == b[n].shape
        and torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


def write_manifest(folder: str, manifest: dict) -> None:
    with open(os.path.join(folder, checkpoint.MANIFEST), "w") as f:
        json.dump(manifest, f)


def without_model_file(src: str, dst) -> str:
    """A copy of checkpoint `src` whose manifest lists no model file: format 2, the parameters only in the shards."""
    shutil.copytree(src, dst)
    manifest = checkpoint.read_manifest(dst)
    if has_model_file(manifest):
        os.remove(os.path.join(dst, MODEL_FILE))
        manifest["files"] = [f for f in manifest["files"] if f["name"] != MODEL_FILE]
    write_manifest(dst, {**manifest, "version": 2})  # verify's "files" check wants the model file at version 1
    return str(dst)


def with_model_file(src: str, dst, params: dict) -> str:
    """A copy of checkpoint `src` that lists a model file (format 1): the writer's own if it wrote one, else the run's
    trained parameters, as a format-1 writer's rank 0 gathered and wrote them."""
    shutil.copytree(src, dst)
    manifest = checkpoint.read_manifest(dst)
    if not has_model_file(manifest):
        path = os.path.join(dst, MODEL_FILE)
        save_file({n: t.contiguous() for n, t in params.items()}, path)
        with open(path, "rb") as f:
            data = f.read()
        manifest["files"].append({"name": MODEL_FILE, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    write_manifest(dst, {**manifest, "version": 1})
    return str(dst)


def both(runs, name: str, tmp_path) -> tuple[str, str]:
    """The run's checkpoint with a model file and without one."""
    folder, params = runs[name]
    return with_model_file(folder, tmp_path / "v1", params), without_model_file(folder, tmp_path / "v2")


def one_at_a_time(folder: str, manifest: dict | None = None) -> dict:
    with ShardedModel(folder, manifest) as shards:
        return {name: shards.tensor(name) for name in shards.shapes}


def reversed_tp_parts(manifest: dict) -> dict:
    return {**manifest, "tp_slices": {n: {**d, "parts": d["parts"][::-1]} for n, d in manifest["tp_slices"].items()}}


def chunk_from_rank_0(monkeypatch) -> None:
    """Planted: DP rank 1's chunks read from DP rank 0's shard (in both assemblies' shard lookup)."""
    real = checkpoint.shard_name
    wrong = lambda rank, world_size: real(0 if rank == 1 else rank, world_size)  # noqa: E731
    monkeypatch.setattr(verify_module, "shard_name", wrong)  # the verifier reads shards by name too
    monkeypatch.setattr(consolidate, "shard_name", wrong)


# run -> how its planted misassembly is made: (a manifest the assembly misreads, or a patch)
PLANTED = {"fp32 DP 2": chunk_from_rank_0, "ZeRO-3 DP 2": chunk_from_rank_0,
           "bf16 DP 2": lambda manifest: {**manifest, "precision": "fp32"},  # the masters left unrounded
           "TP 2, the KV head on both": reversed_tp_parts, "LoRA TP 2": reversed_tp_parts}


@pytest.mark.parametrize("name", RUNS)
def test_the_shards_assemble_bitwise_to_the_trained_model_and_a_planted_misassembly_is_caught(runs, name,
                                                                                             monkeypatch):
    folder, params = runs[name]
    manifest = checkpoint.read_manifest(folder)
    assert all(c.ok for c in checkpoint.verify_checkpoint(folder))
    whole = checkpoint_model(folder, from_shards=True)
    assert bits_equal(whole, params)
    assert bits_equal(one_at_a_time(folder), params)
    assert len({t.untyped_storage().data_ptr() for t in whole.values()}) == len(whole)  # no views of one buffer
    if has_model_file(manifest):  # a format-1 writer's model file: the one rank 0 gathered
        assert bits_equal(checkpoint_model(folder, from_shards=False), params)
    if name == "LoRA TP 2":
        assert params and all(".lora_A." in n or ".lora_B." in n for n in params)
    planted = PLANTED[name]
    if planted is chunk_from_rank_0:
        planted(monkeypatch)
    else:
        manifest = planted(manifest)
    assert not bits_equal(checkpoint_model(folder, manifest, from_shards=True), params)
    assert not bits_equal(one_at_a_time(folder, manifest), params)


def test_one_tensor_at_a_time_reads_only_its_own_values_and_a_replicated_kv_head_once(runs):
    folder, params = runs["TP 2, the KV head on both"]
    with ShardedModel(folder) as shards:
        for name, shape in shards.shapes.items():
            before = bytes_counted()["checkpoint_bytes_read"]
            shards.tensor(name)
            assert bytes_counted()["checkpoint_bytes_read"] - before == 4 * math.prod(shape), name


@pytest.mark.parametrize("name", ["fp32 DP 2", "TP 2, the KV head on both"])
def test_load_model_and_hf_export_give_the_same_model_from_a_checkpoint_without_a_model_file(runs, name, tmp_path):
    v1, v2 = both(runs, name, tmp_path)
    assert not has_model_file(checkpoint.read_manifest(v2))
    models = [load_model(v).state_dict() for v in (v1, v2)]
    assert models[0].keys() == models[1].keys()
    assert all(torch.equal(models[0][n], models[1][n]) for n in models[0])
    assert all(torch.equal(models[1][n], t) for n, t in runs[name][1].items())
    exported = []
    for v, out in ((v1, tmp_path / "hf1"), (v2, tmp_path / "hf2")):
        assert main(["export", v, str(out), "--format", "hf"]) == 0
        exported.append(load_file(os.path.join(out, "model.safetensors")))
    assert exported[0].keys() == exported[1].keys()
    assert all(torch.equal(exported[0][n], exported[1][n]) for n in exported[0])


def test_a_lora_checkpoint_without_a_model_file_loads_and_exports_its_adapters_alike(runs, tmp_path):
    v1, v2 = both(runs, "LoRA TP 2", tmp_path)
    models = [load_model(v).state_dict() for v in (v1, v2)]  # the seed's random base, the adapters merged in
    assert all(torch.equal(models[0][n], models[1][n]) for n in models[0])
    adapters = []
    for v, out in ((v1, tmp_path / "peft1"), (v2, tmp_path / "peft2")):
        assert main(["export", v, str(out), "--format", "peft"]) == 0
        adapters.append(load_file(os.path.join(out, "adapter_model.safetensors")))
    assert adapters[0].keys() == adapters[1].keys() and len(adapters[0]) == len(runs["LoRA TP 2"][1])
    assert all(torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])


def initial_tensors(source, cfg, tp: int, rank: int) -> dict:
    """What --init-from gives TP rank `rank` of `tp` (load_local into the sliced model)."""
    with torch.device("meta"):
        model = build_model(cfg, 0)
        slices = parallelize(model, tp, rank, None) if tp > 1 else {}
    model.to_empty(device="cpu")
    model.tie_weights()
    load_local(model, source, slices, rank)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["TP 2, the KV head on both", "bf16 DP 2"])
def test_init_from_a_checkpoint_without_a_model_file_gives_every_tp_rank_the_same_values(runs, name, tmp_path,
                                                                                        monkeypatch):
    v1, v2 = both(runs, name, tmp_path)
    sources = [weight_source(v) for v in (v1, v2)]  # verified, shapes checked (v2: against the manifest's layout)
    cfg = sources[0].model
    for tp in (1, 2):
        for rank in range(tp):
            from_file, from_shards = (initial_tensors(s, cfg, tp, rank) for s in sources)
            assert from_file.keys() == from_shards.keys()
            assert all(torch.equal(from_file[n], from_shards[n]) for n in from_file), (tp, rank)
    # the record of a source without a model file: its shards, with the sha256 its manifest holds, not hashed again
    monkeypatch.setattr(base_digest, "sha256_range", lambda path, *_: pytest.fail(f"hashed {path}"))
    listed = {f["name"]: f["sha256"] for f in checkpoint.read_manifest(v2)["files"]}
    assert sources[1].record()["files"] == [{"name": checkpoint.shard_name(r, 2), "sha256": listed[
        checkpoint.shard_name(r, 2)]} for r in range(2)]


def test_a_lora_run_on_a_base_without_a_model_file_loads_on_it_and_a_changed_base_is_refused(runs, one_rank,
                                                                                            tmp_path):
    base = without_model_file(runs["fp32 DP 2"][0], tmp_path / "base")
    cfg = tiny_config(tmp_path / "lora", steps=1, micro=2, lora_rank=4, lora_alpha=8.0, ckpt_every=1)
    cfg.optim.lr = 1e-2
    cfg.checkpoint.init_from = base
    cfg.model = adopt(cfg.model, weight_source(base), set())
    result = train(cfg, one_rank, announce=False)
    step = result.checkpoints[-1]
    recorded = checkpoint.read_manifest(step)["init_from"]["files"]
    assert [f["name"] for f in recorded] == [checkpoint.shard_name(r, 2) for r in range(2)]
    idx = torch.randint(0, cfg.model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (load_model(step)(idx) - result.engine.model.eval()(idx)).abs().max() <= 1e-5
    # planted: the base's shard 1 replaced (and its manifest rewritten to match, so the base still verifies)
    shard = os.path.join(base, checkpoint.shard_name(1, 2))
    tensors = load_file(shard)
    tensors["master"][0] += 1.0
    save_file(tensors, shard)
    with open(shard, "rb") as f:
        data = f.read()
    manifest = checkpoint.read_manifest(base)
    for entry in manifest["files"]:
        if entry["name"] == checkpoint.shard_name(1, 2):
            entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    write_manifest(base, manifest)
    with pytest.raises(CheckpointError, match=f"its base {shard} has changed"):
        load_model(step)


def test_an_export_holds_one_tensor_at_a_time_and_a_whole_model_assembly_is_caught(runs, tmp_path, monkeypatch):
    from zerotrain.checkpoint import held_bytes

    _, v2 = both(runs, "TP 2, the KV head on both", tmp_path)
    with ShardedModel(v2) as shards:
        sizes = {name: 4 * math.prod(shape) for name, shape in shards.shapes.items()}

    def export(out) -> int:
        """The most bytes of checkpoint tensors alive at once in this process while `export` runs."""
        held_bytes(reset_peak=True)
        start = held_bytes()["now"]
        assert main(["export", v2, str(tmp_path / out), "--format", "hf"]) == 0
        return held_bytes()["peak"] - start

    assert export("one") == max(sizes.values())  # each tensor written and let go before the next is read
    real = ShardedModel.tensor

    def whole(self, name):
        if not hasattr(self, "everything"):
            self.everything = {n: real(self, n) for n in self.shapes}
        return self.everything[name]

    # planted: the whole model assembled before it is written (what building the model first did)
    monkeypatch.setattr(ShardedModel, "tensor", whole)
    assert export("whole") == sum(sizes.values())


class MappedReader:
    """Planted (_FlatReader's place): the shard's tensor read through safetensors' safe_open, which maps the file."""

    def __init__(self, path: str, key: str):
        from safetensors import safe_open

        self._file, self._key = safe_open(path, framework="pt"), key

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        out.copy_(self._file.get_slice(self._key)[offset : offset + out.numel()])

    def close(self) -> None:
        self._file = None


def mapped_shards(folder: str) -> set[str]:
    """The files of checkpoint `folder` this process maps now (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        paths = {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}
    return {p for p in paths if os.path.dirname(p) == os.path.realpath(folder)}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_reading_a_model_from_the_shards_maps_none_of_them_and_a_mapping_reader_is_caught(runs, tmp_path,
                                                                                         monkeypatch):
    # A mapped shard's pages stay resident while it is open: an export of a 229M-parameter model held 1,068 MB
    # beyond the model it wrote, the masters' pages it had touched (docs/benchmarks.md)
    folder = without_model_file(runs["fp32 DP 2"][0], tmp_path / "v2")

    def mapped_while_reading(folder) -> set[str]:
        with ShardedModel(folder) as shards:
            for name in shards.shapes:
                shards.tensor(name)
            return mapped_shards(folder)

    assert mapped_while_reading(folder) == set()
    monkeypatch.setattr(consolidate, "_FlatReader", MappedReader)
    assert {os.path.basename(p) for p in mapped_while_reading(folder)} == {checkpoint.shard_name(r, 2) for r in
                                                                          range(2)}
