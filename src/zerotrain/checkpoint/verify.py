"""Checking a checkpoint folder against its manifest: names, sizes, hashes, the layout's partition, shards, model.

`verify_checkpoint(path)` runs every check and returns one `Check` each, in this order, stopping after the
first group that has a failure (later groups read what an earlier one found bad):

    manifest   manifest.json is present, valid JSON, and has the writer's keys and types (schema)
    name       each listed name stays inside the folder: no `..`, no path, no symlink leading out
    files      it lists one optimizer shard per rank of its world size (T x D with TP), the tokenizer files
               its "tokenizer" record names (tokenizer.json, "files") and, at format version 1 only,
               model.safetensors
    size       each file has the recorded size ...
    sha256     ... and the recorded sha256
    partition  the buckets tile the padded flat buffer, the owned ranges of all ranks (the D ranks of
               a DP group) cover it exactly once (no gap, no overlap), and each is the chunk of its
               bucket the DP size implies (the one the loader assembles shards with); each TP slice's
               distinct parts tile its full tensor (replicated KV heads: the same parts on several TP
               ranks), every TP rank an equal share of the layout's shape, and they are the slices
               the manifest's model config gives at its TP degree (the model is assembled through
               them: a manifest with slices swapped would assemble another model); the full
               model's parameters add up to param_count
    shard      each shard holds master, exp_avg, exp_avg_sq (float32, shard_numel) and step (int64, 1)
    replicas   (TP only) every TP rank's masters of the replicated parameters equal TP rank 0's, and those of
               a KV head on several TP ranks equal its first rank's (with --ep also the experts' replicated
               values, gpt-oss's down biases, in the expert masters): each shard's pieces of them digested
               (replica_digests) by the reader of that shard, the digests compared
    model      (version 1) model.safetensors equals the masters assembled through the layout, with TP
               placed through the TP slices (full names, full shapes); in bf16, the masters rounded to
               bf16: the parameters the model file was written from. Version 2 has no model file: the
               masters are the model

Loading runs the same checks on the files it reads (see load.py) before restoring anything.

`verify_checkpoint(path, part=(r, W))` runs rank r's share of the checks that read file data (sha256, shard
headers and replica digests, model) and every cheap one; `verify_together(path, comm)` has every rank of `comm` run
its share at once, compares the replica digests and merges the results, so a reshard verifies at the speed of W
readers, not one, and no reader reads more than its share. `checks_beside_own_shard` is a same-mesh load's share:
there each rank hashes its own shard as it reads it (and digests it in memory), so only the other files and the
cross-file checks are left to share out.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors import safe_open

from zerotrain.config import ModelConfig
from zerotrain.model import plan
from zerotrain.parallel import ShardLayout

from .format import (MANIFEST, MODEL_FILE, STATE_KEYS, CheckpointError, ep_of, expected_files, layout_of,
                      mesh_of, schema_problem, shard_name, tp_slices_of)
from .homes import EXPERT_PREFIX, expert_layout_of, expert_numel
from .consolidate import ShardedModel
from .stream import FileRecord, count_read, read_header, sha256_file


@dataclass(frozen=True)
class Check:
    name: str  # which check: manifest, json, schema, files, name, size, sha256, partition, shard, replicas, model
    ok: bool
    detail: str  # why it failed ("" when ok)
    file: str  # the file it is about, relative to the checkpoint folder

    def line(self) -> str:
        text = f"{'ok' if self.ok else 'FAIL':<4} {self.name} {self.file}"
        return text if self.ok else f"{text}: {self.detail}"


# The checks in the order verify_checkpoint runs them; the last three read file data and are shared out by `part`.
ORDER = ("manifest", "json", "schema", "name", "files", "size", "sha256", "partition", "shard", "replicas", "model")


def verify_checkpoint(path: str, part: tuple[int, int] | None = None) -> list[Check]:
    """Every check of the checkpoint folder `path`, in order, up to the first group with a failure.

    With `part=(r, W)`: of the checks that read file data, only reader r's share of W (files, shard headers and
    replica digests, and model tensors balanced by bytes); every cheap one in full. The replicas check compares every
    shard's digests, so a share of W > 1 leaves it out: verify_together runs it on what every reader digested.
    """
    return _verify_share(path, *(part or (0, 1)))[0]


def _verify_share(path: str, r: int, W: int) -> tuple[list[Check], dict[int, dict[str, str]] | None, dict]:
    """Reader r of W's checks, the replica digests of its share of the shards (None if it stopped before them) and
    the manifest ({} if unreadable)."""
    checks: list[Check] = []

    def group(results) -> bool:
        checks.extend(results)
        return all(c.ok for c in results)

    manifest = _manifest_checks(path, checks)
    if manifest is None:
        return checks, None, {}
    listed = [f["name"] for f in manifest["files"]]
    entries = {f["name"]: f for f in manifest["files"]}
    if not group([_check("name", n, name_problem(path, n)) for n in listed]):
        return checks, None, manifest
    if not group([_check("files", MANIFEST, files_problem(manifest))]):
        return checks, None, manifest
    sizes = [_check("size", n, size_problem(path, entries[n])) for n in listed]
    if not group(sizes):
        return checks, None, manifest
    hashed = _share([(n, entries[n]["bytes"]) for n in listed], W)[r]
    if not group([_check("sha256", n, hash_problem(path, entries[n])) for n in hashed]):
        return checks, None, manifest
    if not group([_check("partition", MANIFEST, partition_problem(manifest))]):
        return checks, None, manifest
    shard_numel = manifest["layout"]["shard_numel"]  # of the local layout: every world rank's shard has it
    # each reader the headers and replica digests of its share of the shards: W readers of W shards open one file each
    world = manifest["world_size"]
    ranks = _share([(str(q), 1) for q in range(world)], W)[r]
    if not group([_check("shard", shard_name(int(q), world), _header_problem(path, shard_name(int(q), world),
                                                                             shard_numel, expert_numel(manifest)))
                  for q in ranks]):
        return checks, None, manifest
    layouts = layout_of(manifest, path), expert_layout_of(manifest, path) if "expert_layout" in manifest else None
    digests = {int(q): shard_digests(path, manifest, *layouts, int(q)) for q in ranks}
    group(cross_file_checks(path, manifest, (r, W), digests if W == 1 else None))
    return checks, digests, manifest


def cross_file_checks(path: str, manifest: dict, part: tuple[int, int],
                      digests: dict[int, dict[str, str]] | None = None) -> list[Check]:
    """Reader r of W's share of the checks that compare files with one another, run once each file's own checks
    passed: replicas (TP only, when `digests` holds every shard's replica_digests), then model (version 1, its tensors
    dealt out by size); none after a failure."""
    r, W = part
    checks = []
    if mesh_of(manifest)[0] > 1 and digests is not None:
        checks.append(replicas_check(path, manifest, digests))
        if not checks[-1].ok:
            return checks
    if MODEL_FILE in {f["name"] for f in manifest["files"]}:  # version 1: the model file beside its masters
        sizes = [(p["name"], math.prod(_full_shape(manifest, p))) for p in manifest["layout"]["params"]]
        checks.append(_check("model", MODEL_FILE, model_problem(path, manifest, names=_share(sizes, W)[r])))
    return checks


def checks_beside_own_shard(path: str, manifest: dict, part: tuple[int, int]) -> list[Check]:
    """Reader r of W's share of the data checks a load on the checkpoint's own mesh needs besides each world rank
    reading (and hashing) its own shard: the size and sha256 of the other listed files (tokenizer files; version 1's
    model file), dealt out by _share, then its share of cross_file_checks; none after the first failure. With W the
    checkpoint's world size, every file is read by one reader. The replicas check is the caller's: it compares what
    every rank digested of its own shard (replica_digests), gathered with the load's outcome."""
    shards = {shard_name(i, manifest["world_size"]) for i in range(manifest["world_size"])}
    others = [(f["name"], f["bytes"]) for f in manifest["files"] if f["name"] not in shards]
    entries = {f["name"]: f for f in manifest["files"]}
    checks = []
    for name in _share(others, part[1])[part[0]]:
        checks.append(_check("sha256", name, name_problem(path, name) or size_problem(path, entries[name])
                             or hash_problem(path, entries[name])))
        if not checks[-1].ok:
            return checks
    return checks + cross_file_checks(path, manifest, part)


def verify_together(path: str, comm) -> list[Check]:
    """verify_checkpoint's checks of `path`, each rank of `comm` reading its share; the same merged list on every rank.

    A check that fails on any rank fails (a rank that cannot see a file says so); the list stops after the
    first group with a failure, as verify_checkpoint's does. The replicas check compares the digests every rank took
    of its share of the shards, gathered with the checks: no rank reads another's share. The wait is comm.io's
    (--io-timeout).
    """
    mine, digests, manifest = _verify_share(path, comm.rank, comm.world_size)
    rows = [[c.name, c.ok, c.detail, c.file] for c in mine]
    every = comm.io.all_gather_json({"checks": rows, "digests": _listed(digests)}, "verify_checkpoint")
    lists = [[Check(*row) for row in share["checks"]] for share in every]
    if comm.world_size > 1 and manifest and mesh_of(manifest)[0] > 1 and all(s["digests"] is not None for s in every):
        gathered = {q: d for share in every for q, d in share["digests"]}
        lists.append([replicas_check(path, manifest, gathered)])
    return merge_checks(lists)


def _listed(digests: dict[int, dict[str, str]] | None) -> list | None:
    """Digests by world rank as JSON can carry them (its object keys are strings)."""
    return None if digests is None else sorted(digests.items())


def merge_checks(every: list[list[Check]]) -> list[Check]:
    """Every reader's checks as one list in ORDER: a failure on any reader wins; cut after the first failing group."""
    merged: dict[tuple[str, str], Check] = {}
    for checks in every:
        for c in checks:
            if (c.name, c.file) not in merged or not c.ok and merged[(c.name, c.file)].ok:
                merged[(c.name, c.file)] = c
    checks = sorted(merged.values(), key=lambda c: ORDER.index(c.name))  # stable: each reader's order within a check
    bad = first_failure(checks)
    return checks if bad is None else [c for c in checks if ORDER.index(c.name) <= ORDER.index(bad.name)]


def _share(items: list[tuple[str, int]], readers: int) -> list[list[str]]:
    """`items` (name, bytes) split over `readers`, largest first to the least loaded: each reader's names in order."""
    shares: list[list[str]] = [[] for _ in range(readers)]
    load = [0] * readers
    for name, size in sorted(items, key=lambda item: -item[1]):
        least = load.index(min(load))
        shares[least].append(name)
        load[least] += size
    order = {name: i for i, (name, _) in enumerate(items)}
    return [sorted(names, key=order.get) for names in shares]


share_by_size = _share  # public: the I/O plan (training/io_plan.py) predicts which rank hashes which file


def _full_shape(manifest: dict, param: dict, key: str = "tp_slices") -> list[int]:
    slices = manifest.get(key, {})
    return slices[param["name"]]["full_shape"] if param["name"] in slices else param["shape"]


def verify_or_raise(path: str) -> None:
    """Raise CheckpointError naming the first bad file of `path` and why; return if every check passes."""
    bad = first_failure(verify_checkpoint(path))
    if bad:
        raise CheckpointError(failure_message(path, bad))


def first_failure(checks: list[Check]) -> Check | None:
    return next((c for c in checks if not c.ok), None)


def failure_message(path: str, check: Check) -> str:
    return f"{os.path.join(path, check.file)}: {check.detail}"


def _check(name: str, file: str, problem: str | None) -> Check:
    return Check(name, problem is None, problem or "", file)


def _manifest_checks(path: str, checks: list[Check]) -> dict | None:
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        checks.append(Check("manifest", False, f"{MANIFEST} is missing: not a committed checkpoint", MANIFEST))
        return None
    checks.append(Check("manifest", True, "", MANIFEST))
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        checks.append(Check("json", False, f"not valid JSON ({e})", MANIFEST))
        return None
    checks.append(Check("json", True, "", MANIFEST))
    problem = schema_problem(manifest)
    checks.append(_check("schema", MANIFEST, problem))
    return None if problem else manifest


def files_problem(manifest: dict) -> str | None:
    """Why the manifest's file list is not exactly one shard per rank, the tokenizer's files and (version 1) the model
    file, or None."""
    listed = [f["name"] for f in manifest["files"]]
    expected = expected_files(manifest["world_size"], manifest.get("tokenizer"), manifest["version"])
    twice = sorted({n for n in listed if listed.count(n) > 1})
    if twice:
        return f"lists {twice[0]} more than once"
    missing = [n for n in expected if n not in listed]
    if missing:
        return f"does not list {missing[0]} (world size {manifest['world_size']})"
    extra = [n for n in listed if n not in expected]
    if extra:
        return f"lists {extra[0]!r}, which is not a file of a world-size-{manifest['world_size']} checkpoint"
    return None


def name_problem(folder: str, name: str) -> str | None:
    """Why file `name` of a manifest could leave checkpoint `folder`, or None."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name):
        return f"file name {name!r} is not a plain name inside the checkpoint folder"
    real_folder = os.path.realpath(folder)
    real = os.path.realpath(os.path.join(folder, name))
    if os.path.commonpath([real, real_folder]) != real_folder or real == real_folder:
        return f"is a symlink to {real}, outside the checkpoint folder"
    return None


def size_problem(folder: str, entry: dict) -> str | None:
    file = os.path.join(folder, entry["name"])
    if not os.path.isfile(file):
        return "is missing"
    size = os.path.getsize(file)
    if size != entry["bytes"]:
        return f"has {size} bytes, {MANIFEST} records {entry['bytes']} (truncated or overwritten)"
    return None


def hash_problem(folder: str, entry: dict) -> str | None:
    _, digest = sha256_file(os.path.join(folder, entry["name"]))
    return record_problem(FileRecord(entry["name"], entry["bytes"], digest), entry)


def record_problem(record: FileRecord, entry: dict) -> str | None:
    """Why the bytes read (their size and sha256) are not what the manifest recorded, or None."""
    if record.bytes != entry["bytes"]:
        return f"has {record.bytes} bytes, {MANIFEST} records {entry['bytes']} (truncated or overwritten)"
    if record.sha256 != entry["sha256"]:
        return f"sha256 {record.sha256[:12]}... differs from {entry['sha256'][:12]}... in {MANIFEST} (corrupt)"
    return None


def partition_problem(manifest: dict) -> str | None:
    """Why the layout's buckets, parameters, owned ranges and TP slices are not a consistent exact partition, or None.

    The layout is sharded over a DP group: its size is the DP size (the world size without TP). An expert-parallel
    checkpoint's expert layout is checked alike, over its replica group (the DP size over --ep).
    """
    dp = mesh_of(manifest)[1]
    problem = layout_problem(manifest["layout"], dp, "layout", "the DP size (world_size / mesh.tp)")
    if problem is None and "expert_layout" in manifest:
        ep = ep_of(manifest)
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or dp % ep:
            return f"mesh.ep {ep!r} does not divide the DP size {dp}"
        problem = layout_problem(manifest["expert_layout"], dp // ep, "expert_layout",
                                 "the expert replica group's size (DP size / mesh.ep)")
    if problem:
        return problem
    # expert parallelism: the experts' TP slices against their own layout (EP rank 0's)
    experts = ("expert_tp_slices", "expert_layout") if "expert_layout" in manifest else None
    problem = tp_slices_problem(manifest) or planned_slices_problem(manifest) or \
        (tp_slices_problem(manifest, *experts) or planned_slices_problem(manifest, *experts) if experts else None)
    if problem:
        return problem
    full = sum(math.prod(_full_shape(manifest, p)) for p in manifest["layout"]["params"])
    if experts:  # every EP rank holds as many expert values as EP rank 0, split as EP rank 0's
        full += sum(math.prod(_full_shape(manifest, p, experts[0])) for p in manifest["expert_layout"]["params"]) * \
            ep_of(manifest)
    if full != manifest["param_count"]:
        return f"the full model's parameters hold {full} values, param_count is {manifest['param_count']}"
    return None


def layout_problem(L: dict, W: int, what: str, over: str) -> str | None:
    """Why the layout `L` (the manifest's `what`), sharded over W ranks (`over` says which), is not an exact
    partition: buckets, owned ranges and parameters; or None."""
    buckets, owned = L["buckets"], L["owned_ranges"]
    if L["world_size"] != W:
        return f"{what}.world_size {L['world_size']} differs from {over}, {W}"
    if not buckets:
        return f"{what} has no buckets"
    if buckets[-1]["end"] != L["padded_numel"] or L["shard_numel"] * W != L["padded_numel"]:
        return (f"buckets end at {buckets[-1]['end']}, padded_numel is {L['padded_numel']}, "
                f"shard_numel {L['shard_numel']} x world size {W}")
    end = shard_offset = 0
    for i, b in enumerate(buckets):
        if b["index"] != i or b["start"] != end or b["end"] <= b["start"] or (b["end"] - b["start"]) % W:
            return f"bucket {i} [{b['start']}, {b['end']}) does not follow bucket {i - 1} in multiples of world size {W}"
        if not b["start"] <= b["decay_end"] <= b["end"] or b["shard_offset"] != shard_offset:
            return f"bucket {i} has decay_end {b['decay_end']} or shard_offset {b['shard_offset']} out of place"
        end, shard_offset = b["end"], shard_offset + (b["end"] - b["start"]) // W
    if len(owned) != W or any(len(ranges) != len(buckets) for ranges in owned):
        return f"owned_ranges has {len(owned)} ranks, expected {W} ranks with one range per bucket ({len(buckets)})"
    pieces = sorted((lo, hi, r) for r, ranges in enumerate(owned) for lo, hi in ranges)
    at, previous = 0, None
    for lo, hi, r in pieces:  # together, every rank's ranges tile the padded flat buffer exactly once
        if hi <= lo:
            return f"rank {r}'s owned range [{lo}, {hi}) is empty or reversed"
        if lo < at:
            return f"owned ranges overlap: rank {previous[2]}'s [{previous[0]}, {previous[1]}) and rank {r}'s [{lo}, {hi})"
        if lo > at:
            return f"[{at}, {lo}) of the flat buffer is owned by no rank"
        at, previous = hi, (lo, hi, r)
    if at != L["padded_numel"]:
        return f"[{at}, {L['padded_numel']}) of the flat buffer is owned by no rank"
    for i, b in enumerate(buckets):  # and they are the chunks the loader assembles shards with
        c = (b["end"] - b["start"]) // W
        for r in range(W):
            if owned[r][i] != [b["start"] + r * c, b["start"] + (r + 1) * c]:
                return f"rank {r}'s range {owned[r][i]} of bucket {i} is not its chunk {r} of {W}"
    taken, numel = [], 0
    for p in L["params"]:
        size = 1
        for d in p["shape"]:
            size *= d
        b = buckets[p["bucket"]] if p["bucket"] < len(buckets) else None
        if size != p["numel"] or b is None or not b["start"] <= p["offset"] <= p["offset"] + size <= b["end"]:
            return f"parameter {p['name']} ({p['numel']} values at {p['offset']}) does not fit its shape or bucket"
        taken.append((p["offset"], p["offset"] + size, p["name"]))
        numel += size
    for (_, hi, a), (lo, _, b) in zip(sorted(taken), sorted(taken)[1:]):
        if lo < hi:
            return f"parameters {a} and {b} overlap in the flat buffer"
    if numel != L["numel"]:
        return f"parameters hold {numel} values, {what}.numel is {L['numel']}"
    return None


def tp_slices_problem(manifest: dict, key: str = "tp_slices", layout: str = "layout") -> str | None:
    """Why a TP slice does not split a parameter of the layout into T equal parts tiling its full tensor, or None
    (`key`, `layout`: an --ep checkpoint's expert_tp_slices and expert_layout).

    TP ranks holding the same parts (a KV head replicated on several ranks) count as one in the tiling.
    """
    T = mesh_of(manifest)[0]
    shapes = {p["name"]: p["shape"] for p in manifest[layout]["params"]}
    for name, d in manifest.get(key, {}).items():
        if name not in shapes:
            return f"{key} names {name}, which is not a parameter of the {layout.replace('_', ' ')}"
        extent = d["full_shape"][d["dim"]]
        widths = [sum(hi - lo for lo, hi in ranges) for ranges in d["parts"]]
        pieces = sorted((lo, hi, t) for t, ranges in enumerate(d["parts"]) for lo, hi in ranges
                        if d["parts"].index(ranges) == t)
        at = 0
        for lo, hi, t in pieces:  # the TP ranks' distinct parts together tile [0, extent) of the split dim once
            if hi <= lo or lo != at:
                return (f"{key}[{name!r}]: TP rank {t}'s part [{lo}, {hi}) leaves a gap or overlaps at {at} "
                        f"of dim {d['dim']}")
            at = hi
        local = list(d["full_shape"])
        local[d["dim"]] = widths[0]
        if at != extent or len(set(widths)) != 1 or shapes[name] != local:
            return (f"{key}[{name!r}] splits dim {d['dim']} of {d['full_shape']} into parts of {widths} "
                    f"covering {at}, not {T} equal parts of the layout's shape {shapes[name]}")
    return None


def planned_slices_problem(manifest: dict, key: str = "tp_slices", layout: str = "layout") -> str | None:
    """Why the TP slices of the layout's parameters are not those the manifest's model config splits them into at its
    TP degree (model.plan), or None; a manifest without a model config, or a parameter the plan does not know (a
    LoRA adapter), is not compared. `key`, `layout`: an --ep checkpoint's expert_tp_slices and expert_layout."""
    T = mesh_of(manifest)[0]
    config = manifest.get("config")
    if T == 1 or not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        return None
    try:
        planned = plan(ModelConfig(**config["model"]), T)
    except (TypeError, ValueError) as e:
        return f"config.model does not describe a model ({e})"
    recorded = manifest.get(key, {})
    for p in manifest[layout]["params"]:
        name = p["name"]
        if name not in recorded and name in planned and p["shape"] == list(planned[name].full_shape):
            continue  # kept whole on every TP rank: the embedding and head of a checkpoint written before TP split them
        if name in planned and recorded.get(name) != planned[name].to_dict():
            return (f"{key}[{name!r}] is {recorded.get(name)}, not the slice TP {T} gives it: "
                    f"{planned[name].to_dict()}")
    return None


def shard_problem(found: dict[str, tuple[str, list[int]]], shard_numel: int, expert_numel: int | None = None
                  ) -> str | None:
    """Why a shard's tensors (name -> (dtype code, shape)) are not what the layout implies, or None. An expert-parallel
    checkpoint's shards hold the expert engine's shard too (expert_numel values), its keys prefixed expert_."""
    expected = {**{k: ("F32", [shard_numel]) for k in STATE_KEYS}, "step": ("I64", [1])}
    if expert_numel is not None:
        expected.update({EXPERT_PREFIX + k: ("F32", [expert_numel]) for k in STATE_KEYS},
                        **{EXPERT_PREFIX + "step": ("I64", [1])})
    for key, (dtype, shape) in expected.items():
        if key not in found:
            return f"has no tensor {key!r}"
        if (found[key][0], list(found[key][1])) != (dtype, shape):
            return f"tensor {key} is {found[key][0]} {list(found[key][1])}, the layout implies {dtype} {shape}"
    extra = sorted(set(found) - set(expected))
    return f"holds an unexpected tensor {extra[0]!r}" if extra else None


def _header_problem(folder: str, name: str, shard_numel: int, expert_numel: int | None = None) -> str | None:
    try:
        return shard_problem(read_header(os.path.join(folder, name)), shard_numel, expert_numel)
    except CheckpointError as e:
        return str(e)


DIGEST_VALUES = 1 << 20  # values per read and hash update of a replica digest: 4 MiB of fp32 at a time


# The replica digests' prefix for an --ep checkpoint's experts (EP rank 0's names: every EP rank lays them out alike)
EXPERT = "expert:"


def replicated_names(manifest: dict, key: str = "tp_slices", layout: str = "layout") -> list[str]:
    """The parameters some TP rank holds a copy of (of TP rank 0's, or a KV head of the first TP rank holding it), in
    the layout's order: none without TP. `key`, `layout`: an --ep checkpoint's expert_tp_slices and expert_layout."""
    T, slices = mesh_of(manifest)[0], tp_slices_of(manifest, key)
    if T == 1 or layout not in manifest:
        return []
    return [p["name"] for p in manifest[layout]["params"]
            if p["name"] not in slices or any(slices[p["name"]].first_holder(t) != t for t in range(T))]


def replica_digests(manifest: dict, layout: ShardLayout, experts: ShardLayout | None, world_rank: int,
                    read: Callable[..., torch.Tensor]) -> dict[str, str]:
    """What world rank `world_rank`'s shard holds of each replicated parameter (replicated_names), as a digest each:
    sha256 of those master values in flat order (in a bf16 run rounded to bf16: the parameters the run computes with),
    its first 16 hex digits. `read(lo, hi, key)` gives values [lo, hi) of the rank's master shard (key "master", or
    "expert_master": its expert engine's), at most DIGEST_VALUES at a time. With --ep the experts' replicated values
    (gpt-oss's down biases) too, keyed EXPERT + their name in the expert layout, `experts` (the manifest's
    expert_layout, which the caller parses once for every shard it digests; None without --ep).

    The local layout is the same on every TP rank, so DP rank d's shards on every TP rank hold the same flat pieces of
    a parameter: their digests are equal iff (almost surely) the copies are bitwise equal. Likewise the expert layout:
    DP rank d's TP ranks hold EP rank d mod E's experts, replica d // E's chunks of them.
    """
    T = mesh_of(manifest)[0]
    out = _digests(manifest, layout, replicated_names(manifest), world_rank // T, lambda lo, hi: read(lo, hi, "master"))
    names = replicated_names(manifest, "expert_tp_slices", "expert_layout")
    if names:
        digests = _digests(manifest, experts, names, world_rank // T // ep_of(manifest),
                           lambda lo, hi: read(lo, hi, "expert_master"))
        out.update({EXPERT + name: d for name, d in digests.items()})
    return out


def _digests(manifest: dict, layout: ShardLayout, names: list[str], dp_rank: int, read) -> dict[str, str]:
    """replica_digests of `names`, parameters of `layout`, in the shard of DP rank `dp_rank` over it."""
    slots = {s.name: s for s in layout.slots}
    out = {}
    for name in names:
        s, sha = slots[name], hashlib.sha256()
        for p in layout.owned_pieces(dp_rank, s.offset, s.offset + s.numel):
            for lo in range(p.shard_offset, p.shard_offset + p.numel, DIGEST_VALUES):
                values = read(lo, min(lo + DIGEST_VALUES, p.shard_offset + p.numel))
                if manifest["precision"] == "bf16":
                    values = values.bfloat16()
                sha.update(values.contiguous().view(torch.uint8).numpy())
        out[name] = sha.hexdigest()[:16]
    return out


def shard_digests(path: str, manifest: dict, layout: ShardLayout, experts: ShardLayout | None,
                  world_rank: int) -> dict[str, str]:
    """replica_digests of world rank `world_rank`'s shard file in the checkpoint `path`, reading only the master values
    they cover (counted)."""
    if mesh_of(manifest)[0] == 1:
        return {}
    with safe_open(os.path.join(path, shard_name(world_rank, manifest["world_size"])), framework="pt") as f:
        masters = {}

        def read(lo: int, hi: int, key: str) -> torch.Tensor:
            if key not in masters:
                masters[key] = f.get_slice(key)
            count_read(4 * (hi - lo))
            return masters[key][lo:hi]

        return replica_digests(manifest, layout, experts, world_rank, read)


def replicas_check(path: str, manifest: dict, digests: dict[int, dict[str, str]]) -> Check:
    """Every TP rank's masters of the replicated parameters equal TP rank 0's, and a KV head's on several TP ranks its
    first holder's: from `digests` (world rank -> replica_digests of its shard, every world rank's), no file read."""
    T, D = mesh_of(manifest)
    slices = tp_slices_of(manifest)  # the experts' replicated values have none: TP rank 0's is the reference
    for name in replicated_names(manifest) + [EXPERT + n for n in replicated_names(manifest, "expert_tp_slices",
                                                                                   "expert_layout")]:
        for t in range(1, T):
            ref = slices[name].first_holder(t) if name in slices else 0
            if ref == t:
                continue
            for d in range(D):
                if digests[d * T + t][name] != digests[d * T + ref][name]:
                    holders = "every TP rank holds" if ref == 0 else f"TP ranks {ref} and {t} hold"
                    return _check("replicas", shard_name(d * T + t, T * D),
                                  f"master of replicated tensor {name} differs from TP rank {ref}'s "
                                  f"({shard_name(d * T + ref, T * D)}) although {holders} it identically")
    return _check("replicas", MANIFEST, None)


def model_problem(folder: str, manifest: dict, names: list[str] | None = None) -> str | None:
    """Why model.safetensors is not the full model of the masters (through the layout and TP slices), or None.

    `names`: only those tensors (a reader's share); the file's extra tensors are checked by the share with the
    first parameter. None: all. One tensor at a time, each read from the byte ranges of the masters that hold it
    (ShardedModel): a reader holds one tensor of each, whatever the model's size.
    """
    try:
        shards = ShardedModel(folder, manifest)
    except CheckpointError as e:
        return str(e)
    if names is not None and not names:
        return None
    params = manifest["layout"]["params"]
    checks_extra = names is None or (bool(params) and params[0]["name"] in names)
    with shards, safe_open(os.path.join(folder, MODEL_FILE), framework="pt") as f:
        present = set(f.keys())
        for name in shards.shapes:
            if names is not None and name not in names:
                continue
            if name not in present:
                return f"has no tensor {name}"
            t = f.get_tensor(name)
            count_read(t.numel() * t.element_size())
            want = shards.tensor(name)
            if t.dtype != torch.float32 or tuple(t.shape) != tuple(want.shape):
                return (f"tensor {name} is {t.dtype} {tuple(t.shape)}, the layout and TP slices imply "
                        f"float32 {tuple(want.shape)}")
            if not torch.equal(t.view(torch.int32), want.view(torch.int32)):  # bitwise, NaN included
                diff = (t - want).abs().nan_to_num(float("inf")).max().item()
                return f"tensor {name} differs from the assembled master shards (max |diff| {diff:.3g})"
        extra = sorted(present - set(shards.shapes)) if checks_extra else []
    return f"holds a tensor {extra[0]!r} the layout does not have" if extra else None
