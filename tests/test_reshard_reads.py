"""A reshard reads only what each rank will own, exactly what reading every shard whole gave; every rank counts its
checkpoint bytes.

One start of 3 ranks saves the tiny GPT's 3-rank checkpoint; one start of 2 ranks saves a 2-rank one and a TP 2 one
(a Llama with one KV head, on both TP ranks), then loads them on other meshes: 3 -> 2 ranks, another bucket size on
2 ranks, TP 2 -> TP 1, ZeRO-1 on 3 ranks -> ZeRO-3 on 2, and 3 -> 2 with the planted reshard that reads every old
shard whole (the one zerotrain had before). Each loaded state is compared bitwise with that whole-shard reshard,
computed here from the files (reshard_jobs.whole_shards_state). Other meshes (2 -> 3 ranks, TP 1 -> 2, TP 2 -> 4
with KV heads on several TP ranks) are resharded in this process, every new rank in turn.

The bound on the bytes a rank reads at a reshard, and why:
    ranged reads  <= 3 state keys x 4 bytes x its new shard's values + 8 (the step): it reads each value it will own
                     once, and not its padding
    verification  <= the old checkpoint's files / ranks + its largest file (each file is hashed by one rank, files
                     dealt largest first to the least loaded: no rank gets more than the mean plus one file)
                     + every old shard's header (each rank checks every shard's dtypes and shapes)
Reading every old shard whole costs each rank the whole optimizer state, the new DP size times the first bound (2x
with 3 -> 2 ranks). The loads run on 2 ranks: verification_bound is the bound of one of two.
"""

import functools
import os
import struct

import dist_jobs
import numpy as np
import pytest
import reshard_jobs
import torch
from conftest import tiny_config
from safetensors.torch import load_file

from zerotrain import checkpoint
from zerotrain.checkpoint import load as load_module
from zerotrain.checkpoint.format import STATE_KEYS, mesh_of, tp_slices_of
from zerotrain.checkpoint.homes import CheckpointHomes
from zerotrain.checkpoint.stream import bytes_counted
from zerotrain.checkpoint.verify import layout_of
from zerotrain.config import Config
from zerotrain.model import meta_model, parallelize
from zerotrain.model.tensor_parallel import TPSlice
from zerotrain.parallel import ShardLayout
from zerotrain.parallel.engine import layout_of as engine_layout
from zerotrain.runtime.launch import run_job

LIMIT = 120  # seconds: a deadlocked job fails the test instead of hanging CI
MQA = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=1, n_embd=32, intermediate_size=64)  # one KV head
pytestmark = pytest.mark.timeout(300)


def run_in_turn(*jobs):
    """The (job, config) pairs, all of one world size, run one after another on one start of the ranks."""
    return run_job(functools.partial(dist_jobs.in_turn_job, jobs=list(jobs)), jobs[0][1], time_limit=LIMIT)


def saving(tmp, name, nproc, **run):
    cfg = tiny_config(tmp / name, nproc=nproc, micro=2, steps=2, **run)
    cfg.checkpoint.every = 2
    return cfg


def folder(cfg) -> str:
    return os.path.join(cfg.checkpoint.dir, checkpoint.step_name(2))


# A load on another mesh: case -> (saved checkpoint, settings of the loading run)
LOADS = {
    "3 -> 2 ranks": ("3 ranks", {}),
    "another bucket size on 2 ranks": ("2 ranks", {"bucket_mb": 0.004}),
    "TP 2 -> TP 1": ("TP 2", {"tp": 1, **MQA}),
    "ZeRO-1 on 3 ranks -> ZeRO-3 on 2": ("3 ranks", {"zero": 3}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"saved": {name: (cfg, save_job's result)}, "loaded": {case: (cfg, load_job's result)}}: the 3-rank save on
    3 ranks; on one start of 2 ranks the 2-rank and TP 2 saves, then every LOADS case and the planted 3 -> 2."""
    tmp = tmp_path_factory.mktemp("reshard")
    saved = {"3 ranks": saving(tmp, "3ranks", 3), "2 ranks": saving(tmp, "2ranks", 2),
             "TP 2": saving(tmp, "tp2", 2, tp=2, **MQA)}
    loads = {}
    for case, (source, settings) in {**LOADS, "planted 3 -> 2 ranks": ("3 ranks", {})}.items():
        cfg = tiny_config(tmp / case.replace(" ", "_"), nproc=2, micro=2, steps=2, **settings)
        cfg.checkpoint.resume = folder(saved[source])
        loads[case] = (reshard_jobs.planted_load_job if case.startswith("planted") else reshard_jobs.load_job, cfg)
    out = {"saved": {"3 ranks": (saved["3 ranks"], run_in_turn((reshard_jobs.save_job, saved["3 ranks"]))[0])}}
    results = run_in_turn(*[(reshard_jobs.save_job, saved[n]) for n in ("2 ranks", "TP 2")], *loads.values())
    out["saved"].update({n: (saved[n], r) for n, r in zip(("2 ranks", "TP 2"), results)})
    out["loaded"] = {case: (cfg, r) for (case, (_, cfg)), r in zip(loads.items(), results[2:])}
    return out


def old_shards(path) -> list[dict]:
    manifest = checkpoint.read_manifest(path)
    return [load_file(os.path.join(path, checkpoint.shard_name(r, manifest["world_size"])))
            for r in range(manifest["world_size"])]


def whole_shard_states(path, new: ShardLayout, new_slices: dict, tp: int) -> list[dict]:
    """Every new world rank's state (rank = dp x tp + t) as reading every old shard whole builds it."""
    manifest = checkpoint.read_manifest(path)
    shards, old, old_slices = old_shards(path), layout_of(manifest, path), tp_slices_of(manifest)
    return [reshard_jobs.whole_shards_state(shards, old, old_slices, mesh_of(manifest)[0], new, new_slices, r % tp,
                                            r // tp) for r in range(tp * new.world_size)]


def bits_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32) if a[k].is_floating_point() else a[k],
                                                    b[k].view(torch.int32) if b[k].is_floating_point() else b[k])
                                        for k in a)


def ranged_bytes(values: int) -> int:
    """What reading `values` values of every state key (float32) and the step (one int64) reads."""
    return len(STATE_KEYS) * 4 * values + 8


def owned_values(layout: ShardLayout, dp_rank: int) -> int:
    """The parameter values in DP rank `dp_rank`'s shard of `layout`: its owned chunks without their padding."""
    owned = 0
    for s in layout.slots:
        lo, hi = layout.buckets[s.bucket].chunk(dp_rank, layout.world_size)
        owned += max(0, min(hi, s.offset + s.numel) - max(lo, s.offset))
    return owned


def verification_bound(path) -> int:
    """The most bytes one of two ranks reads verifying `path`: its share of the files, and every shard's header."""
    manifest = checkpoint.read_manifest(path)
    sizes = [f["bytes"] for f in manifest["files"]]
    headers = 0
    for r in range(manifest["world_size"]):
        with open(os.path.join(path, checkpoint.shard_name(r, manifest["world_size"])), "rb") as f:
            headers += 8 + struct.unpack("<Q", f.read(8))[0]
    return sum(sizes) // 2 + max(sizes) + headers


def own_files(cfg, rank: int) -> int:
    """The bytes of the safetensors file rank `rank` wrote into the run's step-2 checkpoint: its shard (format 2: no
    rank writes the model, which is the shards' masters)."""
    return os.path.getsize(os.path.join(folder(cfg), checkpoint.shard_name(rank, cfg.launch.nproc)))


# ---------------------------------------------------------------- counting
def test_a_save_counts_the_bytes_of_each_ranks_own_files_and_reads_nothing(runs):
    for name, (cfg, out) in runs["saved"].items():
        world = cfg.launch.nproc
        files = [own_files(cfg, r) for r in range(world)]
        # counted around the run: written = its files; read: nothing (each file's sha256 is taken as it is written)
        assert [c[reshard_jobs.WRITTEN] for c in out["counted"]] == files, name
        assert [c[reshard_jobs.READ] for c in out["counted"]] == [0] * world, name
    # a run is its ranks' first in their processes: summary.json's per-rank figures are the same bytes
    for name in ("3 ranks", "2 ranks"):
        cfg, out = runs["saved"][name]
        assert out["per_rank"][reshard_jobs.WRITTEN] == [own_files(cfg, r) for r in range(cfg.launch.nproc)]
        assert out["per_rank"][reshard_jobs.READ] == [0] * cfg.launch.nproc


def test_a_rank_that_writes_the_whole_model_at_a_save_is_caught_by_its_byte_count(tmp_path, one_rank, monkeypatch):
    from zerotrain.checkpoint import save as save_module
    from zerotrain.training.loop import build_engine

    cfg = tiny_config(tmp_path)
    engine = build_engine(cfg, one_rank)
    real = save_module._live_files

    def with_the_model(engine, rank, world_size):  # planted: rank 0 writes the whole model too, as before format 2
        files = real(engine, rank, world_size)
        files[checkpoint.MODEL_FILE] = engine.full_state_dict()
        return files

    written_beyond_the_shard = []
    for step, planted in ((1, False), (2, True)):
        if planted:
            monkeypatch.setattr(save_module, "_live_files", with_the_model)
        before = bytes_counted()[reshard_jobs.WRITTEN]
        path, _, _ = checkpoint.save_checkpoint(str(tmp_path / "ck"), step, engine, one_rank, cfg.to_dict())
        shard = os.path.getsize(os.path.join(path, checkpoint.shard_name(0, 1)))
        written_beyond_the_shard.append(bytes_counted()[reshard_jobs.WRITTEN] - before - shard)
    assert written_beyond_the_shard[0] == 0 and written_beyond_the_shard[1] > 4 * 28_032  # the planted fp32 model


# ---------------------------------------------------------------- resharding across processes
@pytest.mark.parametrize("case", list(LOADS))
def test_a_reshard_loads_bitwise_what_whole_shards_gave_reading_only_each_ranks_share(runs, case):
    cfg, out = runs["loaded"][case]
    tp = cfg.parallel.tp
    new = ShardLayout.from_dict(out["layout"])
    new_slices = {n: TPSlice.from_dict(d) for n, d in out["tp_slices"].items()}
    want = whole_shard_states(cfg.checkpoint.resume, new, new_slices, tp)
    for r, mine in enumerate(out["ranks"]):
        got = load_file(os.path.join(cfg.logging.out, f"state-rank{r}.safetensors"))
        assert bits_equal(got, want[mine["dp_rank"] * tp + mine["tp_rank"]]), (case, r)
        assert mine["verified"], (case, r)  # the checkpoint was verified together before anything was read
        assert mine["homes_built"] == 1, (case, r, mine)  # its layouts parsed once, for the check and every part
        # the ranged reads: each value it owns once, counted (within the bound, which a padded shard is below)
        assert mine["total"] - mine["verify"] == ranged_bytes(owned_values(new, mine["dp_rank"])), (case, r, mine)
        assert mine["total"] - mine["verify"] <= ranged_bytes(new.shard_numel), (case, r, mine)
        assert 0 < mine["verify"] <= verification_bound(cfg.checkpoint.resume), (case, r, mine)
    assert not bits_equal(load_file(os.path.join(cfg.logging.out, "state-rank0.safetensors")),
                          load_file(os.path.join(cfg.logging.out, "state-rank1.safetensors")))


def test_every_rank_reading_every_old_shard_whole_is_caught_by_the_byte_bound(runs):
    real, planted = runs["loaded"]["3 -> 2 ranks"][1], runs["loaded"]["planted 3 -> 2 ranks"][1]
    new = ShardLayout.from_dict(real["layout"])
    for r, (mine, theirs) in enumerate(zip(real["ranks"], planted["ranks"])):
        assert mine["total"] - mine["verify"] <= ranged_bytes(new.shard_numel)
        assert theirs["total"] - theirs["verify"] > ranged_bytes(new.shard_numel), (r, theirs)
    cfg = runs["loaded"]["planted 3 -> 2 ranks"][0]
    same = runs["loaded"]["3 -> 2 ranks"][0]
    for r in range(2):  # and it loaded the same state: only the bytes read tell the two apart
        assert bits_equal(load_file(os.path.join(cfg.logging.out, f"state-rank{r}.safetensors")),
                          load_file(os.path.join(same.logging.out, f"state-rank{r}.safetensors")))


# ---------------------------------------------------------------- resharding in this process, every new rank
# new mesh -> (saved checkpoint, TP, DP, bucket MiB or None for the saved run's)
MESHES = {
    "2 -> 3 ranks": ("2 ranks", 1, 3, None),
    "TP 1 -> TP 2 x DP 2": ("2 ranks", 2, 2, None),
    "TP 2 -> TP 4, a KV head on 4 TP ranks, other buckets": ("TP 2", 4, 1, 0.003),
    "TP 2 -> TP 1 x DP 3": ("TP 2", 1, 3, None),
    "TP 2 x DP 1 -> TP 2 x DP 2, the same TP slices": ("TP 2", 2, 2, None),
}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_rank_of_another_mesh_reads_its_share_and_gets_what_whole_shards_gave(runs, mesh):
    source, tp, dp, bucket_mb = MESHES[mesh]
    path = folder(runs["saved"][source][0])
    manifest = checkpoint.read_manifest(path)
    cfg = Config.from_dict(manifest["config"])
    bucket_numel = int(bucket_mb * 2**20) // 4 if bucket_mb else cfg.parallel.bucket_numel
    homes = CheckpointHomes.of(manifest, path)
    layouts = []
    for t in range(tp):  # what build_engine gives TP rank t, without process groups
        model = meta_model(cfg.model)
        slices = parallelize(model, tp, t, None) if tp > 1 else {}
        layouts.append((engine_layout(model, dp, bucket_numel), slices))
    new, new_slices = layouts[0]
    assert all(layout.to_dict() == new.to_dict() and s == new_slices for layout, s in layouts)
    want = whole_shard_states(path, new, new_slices, tp)
    for r in range(tp * dp):
        start = bytes_counted()[reshard_jobs.READ]
        got = load_module._reshard(path, manifest, homes, new, new_slices, r % tp, r // tp)
        assert bits_equal(got, want[r]), (mesh, r)
        read = bytes_counted()[reshard_jobs.READ] - start
        assert read == ranged_bytes(owned_values(new, r // tp)) <= ranged_bytes(new.shard_numel), (mesh, r)


# ---------------------------------------------------------------- a resume on the mesh that saved
def state_buffers(engine) -> list[tuple[int, int]]:
    """(first byte, end) of each buffer `engine` keeps its shard state in: the parameters (at stages 1 and 2 in fp32
    the masters are their owned runs), the fp32 masters where kept apart, the moments."""
    tensors = [engine.flat_params, engine.exp_avg, engine.exp_avg_sq, *([engine.master] if engine.master is not None
                                                                        else [])]
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
            for t in tensors]


def whole_shard_read(path, manifest, rank, places=None):
    """Planted in place of load.py's read_shard: the resume before it read in place, its shard read whole into
    tensors of its own (the places ignored), which the engine then copied from."""
    return REAL_READ_SHARD(path, manifest, rank)


REAL_READ_SHARD = load_module.read_shard


@pytest.mark.parametrize("run", [{"zero": 1}, {"zero": 3, "precision": "bf16"}], ids=["ZeRO-1 fp32", "ZeRO-3 bf16"])
def test_a_resume_reads_its_shard_into_the_engine_and_a_whole_shard_copy_is_caught(tmp_path, one_rank, monkeypatch,
                                                                                    run):
    """The bytes a same-mesh resume reads land in the engine's own state; beside it only the header and the step (not
    RSS: pages on a shared machine; the bytes the reader puts in memory of its own, counted at stream.read_at, which
    every read of the shard goes through). Planted: the whole shard read into tensors of its own, one more copy of
    the rank's optimizer state while it is read (the 1.29x peak resident memory of a TP 2 x DP 2 resume), caught by
    the count while the state it loads is the same, bitwise."""
    from test_engine import run_steps

    from zerotrain.checkpoint import stream
    from zerotrain.training.loop import build_engine

    cfg = tiny_config(tmp_path, **run)
    trained = build_engine(cfg, one_rank)
    run_steps(trained, cfg, 2)
    path, _, _ = checkpoint.save_checkpoint(str(tmp_path / "ck"), 2, trained, one_rank, cfg.to_dict())
    with open(os.path.join(path, checkpoint.shard_name(0, 1)), "rb") as f:
        header = 8 + struct.unpack("<Q", f.read(8))[0]
    state_bytes, real_read_at = len(STATE_KEYS) * 4 * trained.layout.shard_numel, stream.read_at
    read = {}
    for planted in (False, True):
        engine, counted = build_engine(cfg, one_rank), {"in place": 0, "beside": 0}
        buffers = state_buffers(engine)

        def counting(f, pos, view, buffers=buffers, counted=counted):
            at = np.frombuffer(view, dtype=np.uint8).ctypes.data
            counted["in place" if any(a <= at and at + view.nbytes <= z for a, z in buffers) else "beside"] += \
                view.nbytes
            real_read_at(f, pos, view)

        with monkeypatch.context() as m:
            m.setattr(stream, "read_at", counting)
            if planted:
                m.setattr(load_module, "read_shard", whole_shard_read)
            assert checkpoint.load_checkpoint(path, engine, one_rank)["step"] == 2
        assert bits_equal(engine.shard_state_dict(), trained.shard_state_dict()), planted
        assert torch.equal(engine.flat_params, trained.flat_params), planted
        read[planted] = counted
    assert read[False] == {"in place": state_bytes, "beside": header + 8}  # its header, and the step
    assert read[True] == {"in place": 0, "beside": header + 8 + state_bytes}  # planted: a second copy of the state
