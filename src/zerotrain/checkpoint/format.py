"""The checkpoint format: folder and file names, the manifest and its schema, what `latest` names.

A checkpoint is a folder `step_{step:08d}/` holding `manifest.json`, one `optim-rank{r}-of-{W}.safetensors` per
rank of the world (its ZeRO shard of its local flat buffer: master values, exp_avg, exp_avg_sq and the optimizer
step; the masters are the model: checkpoint/consolidate.py assembles it, whatever the mesh, without torch.distributed)
and, when the data has a BPE, its
`tokenizer.json` (the manifest's "tokenizer" records kind, vocab_size, eot_id and the file); a run started
--init-from a model keeps that model's tokenizer.json and the files configuring it, which the record lists
under "files" (tokenizer_config.json ...: data.tokenizer_config), with its context length and special ids.
`latest` in the checkpoint root names the newest committed folder. Safetensors and JSON only:
nothing is unpickled. A re-save of a step moves its committed folder aside to `step_{step:08d}.old/` for a moment
(checkpoint/commit.py); when a crash leaves it there with no `step_{step:08d}/`, it is that checkpoint
(committed_folder), and the next run in the folder puts it back.

Versions: 2 stores the parameters once, in the shards. 1 (written before) also held `model.safetensors`, the full
fp32 model (in bf16 runs the masters rounded to bf16) in zerotrain's names, written by rank 0 alone; it is still
read, verified (the model file against the masters) and resumed.

With tensor parallelism the manifest records the mesh ({"tp": T, "dp": D}, T x D = world_size,
world rank = dp_index x T + tp_index) and each split parameter's TP slice ("tp_slices": how a TP
rank's local tensor maps to the full one). "layout" is the local flat layout, the same on every TP
rank, sharded over the D ranks of a DP group; "param_count" counts the full model. A manifest
without "mesh" (written before TP) reads as TP 1 x DP world_size. A run with hybrid sharding (--dp-replicate R: R
replica groups, each sharding the state over D ranks, parallel/mesh.py) writes the checkpoint its replica group 0
writes, the one a run of T x D ranks would: world_size T x D, "mesh" {"tp": T, "dp": D, "dp_replicate": R}; its other
groups hold the same shards and write nothing. So every reader (resume at any world size or R, the model, verify)
reads it as it reads any other. With expert parallelism ("mesh" has "ep") the
experts' own layout and TP slices are "expert_layout" and "expert_tp_slices" (checkpoint/consolidate.py).
"""

from __future__ import annotations

import json
import os
import re

from zerotrain.config import ModelConfig
from zerotrain.errors import CheckpointError
from zerotrain.model.tensor_parallel import TPSlice
from zerotrain.parallel import ShardLayout

# 2: no model file, the parameters stored once (the shards' masters). (TP's keys came within version 1: additions, and
# a reader from before TP refuses a TP checkpoint anyway, since its layout.world_size (D) differs from its world_size.)
FORMAT, VERSION = "zerotrain-checkpoint", 2
READABLE_VERSIONS = (1, 2)
MODEL_FILE, MANIFEST, LATEST = "model.safetensors", "manifest.json", "latest"
TOKENIZER_FILE = "tokenizer.json"  # the data's BPE, copied by rank 0 when there is one (manifest["tokenizer"]["file"])
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
STEP_FOLDER = re.compile(r"step_(\d{8})")
ASIDE = ".old"  # step_N.old/: the committed step_N/ while a re-save of step N renames its own folder into place

# The keys the writer records, with their JSON types; callers add their own keys beside these.
MANIFEST_SCHEMA = {"format": str, "version": int, "step": int, "world_size": int, "param_count": int,
                   "precision": str, "torch_version": str, "layout": dict, "files": list}
LAYOUT_SCHEMA = {"world_size": int, "numel": int, "padded_numel": int, "shard_numel": int, "params": list,
                 "buckets": list, "owned_ranges": list}
PARAM_SCHEMA = {"name": str, "shape": list, "numel": int, "offset": int, "flat_offset": int, "bucket": int,
                "decay": bool}
BUCKET_SCHEMA = {"index": int, "start": int, "end": int, "decay_end": int, "shard_offset": int}
FILE_SCHEMA = {"name": str, "bytes": int, "sha256": str}
# Written by every writer since TP; optional to read (absent: TP 1 x DP world_size).
MESH_KEYS = ("mesh", "tp_slices")
MESH_SCHEMA = {"tp": int, "dp": int}
TP_SLICE_SCHEMA = {"dim": int, "full_shape": list, "parts": list}
PRECISIONS = ("fp32", "bf16")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a committed folder's name (`step_00000012` -> 12), or None for any other name."""
    match = STEP_FOLDER.fullmatch(name)
    return int(match.group(1)) if match else None


def shard_name(rank: int, world_size: int) -> str:
    return f"optim-rank{rank:05d}-of-{world_size:05d}.safetensors"


def expected_files(world_size: int, tokenizer: dict | None = None, version: int = VERSION) -> list[str]:
    """The model file (version 1 only), one shard per rank, and the tokenizer files the manifest's tokenizer record
    names: its "file" (tokenizer.json) and, from an --init-from model, the "files" that configure it
    (tokenizer_config.json ...)."""
    tokenizer = tokenizer if isinstance(tokenizer, dict) else {}
    extra = [TOKENIZER_FILE] if tokenizer.get("file") == TOKENIZER_FILE else []
    listed = tokenizer.get("files")
    extra += [n for n in listed if isinstance(n, str)] if isinstance(listed, list) else []
    model = [MODEL_FILE] if version == 1 else []
    return model + [shard_name(r, world_size) for r in range(world_size)] + extra


def step_folders(root: str) -> list[str]:
    """Every committed step folder's name under `root` (manifest or not), newest first."""
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if step_of(n) is not None and os.path.isdir(os.path.join(root, n))]
    return sorted(names, key=step_of, reverse=True)


def committed_steps(root: str) -> list[str]:
    """Committed step folders that hold a manifest, oldest first."""
    return sorted(n for n in step_folders(root) if os.path.isfile(os.path.join(root, n, MANIFEST)))


def committed_step_numbers(root: str) -> list[int]:
    """The steps of the committed checkpoints under `root`, oldest first."""
    return [step_of(n) for n in committed_steps(root)]


def committed_folder(root: str, name: str) -> str:
    """The folder of the committed checkpoint `name` (a step folder's name) under `root`: `root/name`, or
    `root/name.old` when a re-save of that step crashed between its two renames, which left the committed folder
    there (manifest and all) and no `root/name`. Readers resolve `latest` through this and change nothing."""
    path = os.path.join(root, name)
    if not os.path.isdir(path) and os.path.isfile(os.path.join(path + ASIDE, MANIFEST)):
        return path + ASIDE
    return path


def read_latest(root: str) -> str | None:
    """The folder name `latest` holds, or None if there is no `latest`."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def schema_problem(manifest) -> str | None:
    """Why `manifest` does not have the writer's keys with their types, format and version, or None."""
    if not isinstance(manifest, dict):
        return f"is a JSON {type(manifest).__name__}, not an object"
    problem = _typed(manifest, MANIFEST_SCHEMA, "manifest")
    if problem:
        return problem
    if manifest["format"] != FORMAT or manifest["version"] not in READABLE_VERSIONS:
        return (f"format {manifest['format']!r} version {manifest['version']} is not {FORMAT!r} version "
                f"{' or '.join(map(str, READABLE_VERSIONS))}")
    if manifest["precision"] not in PRECISIONS:
        return f"precision {manifest['precision']!r} is not one of {PRECISIONS}"
    if manifest["world_size"] < 1:
        return f"world_size {manifest['world_size']} is not positive"
    problem = _layout_schema_problem(manifest["layout"], "layout")
    if problem is None and "expert_layout" in manifest:  # expert parallelism: the expert engine's, beside it
        problem = _layout_schema_problem(manifest["expert_layout"], "expert_layout")
    problem = problem or _mesh_problem(manifest)
    for i, f in enumerate(manifest["files"] if problem is None else []):
        problem = problem or _typed(f, FILE_SCHEMA, f"files[{i}]")
        if problem is None and not re.fullmatch(r"[0-9a-f]{64}", f["sha256"]):
            problem = f"files[{i}].sha256 {f['sha256']!r} is not 64 hex digits"
    return problem


def _layout_schema_problem(layout, what: str) -> str | None:
    """Why the flat layout `layout` (the manifest's `what`) does not have a layout's keys and types, or None."""
    if not isinstance(layout, dict):
        return f"{what} is a JSON {type(layout).__name__}, not an object"
    problem = _typed(layout, LAYOUT_SCHEMA, what)
    for i, p in enumerate(layout["params"] if problem is None else []):
        problem = problem or _typed(p, PARAM_SCHEMA, f"{what}.params[{i}]")
        if problem is None and not all(_count(d) for d in p["shape"]):
            problem = f"{what}.params[{i}].shape {p['shape']} is not a list of sizes"
    for i, b in enumerate(layout["buckets"] if problem is None else []):
        problem = problem or _typed(b, BUCKET_SCHEMA, f"{what}.buckets[{i}]")
    if problem is None and not all(isinstance(ranges, list) and all(
            isinstance(r, list) and len(r) == 2 and all(_count(v) for v in r) for r in ranges)
            for ranges in layout["owned_ranges"]):
        problem = f"{what}.owned_ranges is not a list of [start, end] lists per rank"
    return problem


def _mesh_problem(manifest: dict) -> str | None:
    """Why the mesh and TP slices (when recorded) are not well-typed and consistent with the world size, or None."""
    if not any(k in manifest for k in MESH_KEYS):
        return None
    for have, missing in (MESH_KEYS, MESH_KEYS[::-1]):
        if missing not in manifest:
            return f"manifest has {have!r} but no {missing!r}"
    mesh = manifest["mesh"]
    problem = _typed(mesh, MESH_SCHEMA, "mesh")
    if problem:
        return problem
    T, D, W = mesh["tp"], mesh["dp"], manifest["world_size"]
    if T < 1 or D < 1 or T * D != W:
        return f"mesh TP {T} x DP {D} does not make world_size {W}"
    if manifest["layout"]["world_size"] != D:
        return f"layout.world_size {manifest['layout']['world_size']} differs from the mesh's DP size {D}"
    for key in ("tp_slices", "expert_tp_slices"):  # expert_tp_slices: an --ep checkpoint's, of its expert layout
        problem = _slices_problem(manifest, key, T) if key in manifest else None
        if problem:
            return problem
    return None


def _slices_problem(manifest: dict, key: str, T: int) -> str | None:
    """Why manifest[key] is not a well-typed map of TP slices over T TP ranks, or None."""
    slices = manifest[key]
    if not isinstance(slices, dict):
        return f"{key} is a {type(slices).__name__}, not an object"
    for name, d in slices.items():
        where = f"{key}[{name!r}]"
        problem = _typed(d, TP_SLICE_SCHEMA, where)
        if problem:
            return problem
        if not d["full_shape"] or not all(_count(n) for n in d["full_shape"]) or d["dim"] >= len(d["full_shape"]):
            return f"{where} has full_shape {d['full_shape']} and dim {d['dim']}, not a shape and one of its dims"
        if len(d["parts"]) != T or not all(isinstance(ranges, list) and all(
                isinstance(r, list) and len(r) == 2 and all(_count(v) for v in r) for r in ranges)
                for ranges in d["parts"]):
            return f"{where}.parts is not a list of [start, end] lists for each of the {T} TP ranks"
    return None


def mesh_of(manifest: dict) -> tuple[int, int]:
    """(TP, DP) of the mesh that wrote the checkpoint; a manifest from before TP is TP 1 x DP world_size."""
    mesh = manifest.get("mesh") or {"tp": 1, "dp": manifest["world_size"]}
    return mesh["tp"], mesh["dp"]


def ep_of(manifest: dict) -> int:
    """The EP degree that wrote the checkpoint: its mesh's "ep", 1 for a mesh without it (or a manifest without a
    mesh). As recorded: partition_problem checks it."""
    return (manifest.get("mesh") or {}).get("ep", 1)


def layout_of(manifest: dict, path: str) -> ShardLayout:
    """The manifest's layout as a ShardLayout; CheckpointError if its entries do not make one."""
    try:
        return ShardLayout.from_dict(manifest["layout"])
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: layout does not describe a ShardLayout ({e})") from None


def tp_slices_of(manifest: dict, key: str = "tp_slices") -> dict[str, TPSlice]:
    """Each split parameter's TP slice, by its full-model name ({} without TP); `key` "expert_tp_slices": an --ep
    checkpoint's experts', by EP rank 0's names (absent before --ep composed with --tp: {})."""
    return {name: TPSlice.from_dict(d) for name, d in manifest.get(key, {}).items()}


def _typed(obj, schema: dict, where: str) -> str | None:
    if not isinstance(obj, dict):
        return f"{where} is a {type(obj).__name__}, not an object"
    for key, kind in schema.items():
        if key not in obj:
            return f"{where} has no {key!r}"
        value = obj[key]
        if kind is int and not _count(value):
            return f"{where}.{key} is {value!r}, expected a non-negative integer"
        if not isinstance(value, kind):
            return f"{where}.{key} is a {type(value).__name__}, expected {kind.__name__}"
    return None


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint folder `path`, checked against the schema (CheckpointError if not)."""
    file = os.path.join(path, MANIFEST)
    try:
        with open(file) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: {MANIFEST} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e})") from None
    problem = schema_problem(manifest)
    if problem:
        raise CheckpointError(f"{file}: {problem}")
    return manifest


def incompatibility(manifest: dict, model_config: dict) -> str | None:
    """Why a checkpoint cannot initialise this model, or None."""
    theirs = manifest.get("config", {}).get("model")
    if theirs is None:
        return "checkpoint records no model config"
    theirs = {**vars(ModelConfig()), **theirs}  # settings added since it was written have their defaults
    for key, value in model_config.items():
        if theirs.get(key) != value:
            return f"checkpoint has model.{key}={theirs.get(key)}, this run has {value}"
    return None
