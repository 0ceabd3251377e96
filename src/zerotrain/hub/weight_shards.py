"""An exported model's weights as Hugging Face shards: the split, each shard written tensor by tensor, the index.

The split is huggingface_hub's (split_state_dict_into_shards_factory, which save_pretrained calls): tensors in
transformers' order (plan_shards) fill a shard until the next would take it past --max-shard-size, a tensor larger than that gets a shard
of its own; one shard is `model.safetensors`, several are `model-0000k-of-0000n.safetensors` with
`model.safetensors.index.json` (metadata.total_size, weight_map) naming each tensor's file. The sizes are those of
the dtype written (--dtype), so the split is known before a value is read: from the model's shapes alone (meta
tensors through the architecture's table, mapping.to_hf).

A shard is written as its header (checkpoint.stream.header_bytes: the bytes safetensors.save_file writes) and then
each tensor at its place with pwrite, as it comes in the model's order (the file's order is by name): a writer holds
one group of the model's tensors beyond what it writes, a tensor, or the parts Hugging Face fuses into one (Phi-3's
qkv_proj, gpt-oss's stacked experts). Each shard is written by one process, from the checkpoint's shards (their
byte ranges: checkpoint.consolidate.ShardedModel), so N processes writing N parts of the shards read and write 1/N of
the model each, and the files do not depend on N (`owners`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerotrain.checkpoint.stream import header_bytes
from zerotrain.errors import CheckpointError, ConfigError

from .mapping import HFMapping

MODEL_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
SHARD_FILE = "model-{k:05d}-of-{n:05d}.safetensors"
SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # an earlier export's shards, for --overwrite
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}  # config.json's
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # huggingface_hub's parse_size_to_int: decimal
DEFAULT_SHARD_SIZE = "5GB"  # huggingface_hub's MAX_SHARD_SIZE, the size published folders are cut to
STAMP = {"format": "pt"}  # the metadata save_pretrained gives each shard


def parse_shard_size(text: str) -> int:
    """Bytes of a --max-shard-size: a count of bytes, or a number with TB, GB, MB or KB (powers of 1000, as Hugging
    Face's); ConfigError naming the value otherwise."""
    value = str(text).strip()
    unit = value[-2:].upper()
    number = value[:-2] if unit in SIZE_UNITS else value
    try:
        size = int(float(number) * SIZE_UNITS.get(unit, 1))
    except ValueError:
        size = 0
    if size <= 0:
        raise ConfigError(f"--max-shard-size must be a positive size such as 5GB, 500MB or a count of bytes, "
                          f"got {text!r}")
    return size


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Group:
    """Tensors of the model that become Hugging Face tensors together: `sources` (zerotrain's names) give `names`."""

    sources: tuple[str, ...]
    names: tuple[str, ...]


def hf_groups(mapping: HFMapping | None, shapes: dict[str, torch.Tensor]) -> tuple[list[Group], dict[str, torch.Tensor]]:
    """The model's tensors (zerotrain's names -> meta tensors, in the model's order) as Hugging Face stores them:
    the groups a writer reads at once, and every stored tensor's meta tensor, in the model's order. A tensor stored
    as it is (or transposed) is a group alone; those a block fuses or stacks into one are a group (mapping None:
    zerotrain's own names, each alone)."""
    if mapping is None:
        return [Group((n,), (n,)) for n in shapes], dict(shapes)
    blocks: dict[str, list[str]] = {}
    for name in shapes:
        rest = name[len(mapping.block_prefix):]
        key = mapping.block_prefix + rest.split(".")[0] if name.startswith(mapping.block_prefix) else name
        blocks.setdefault(key, []).append(name)
    groups, stored = [], {}
    for names in blocks.values():
        whole = mapping.to_hf({n: shapes[n] for n in names})
        alone = [n for n in names if mapping.stored_name(n) in whole]
        groups += [Group((n,), (mapping.stored_name(n),)) for n in alone]
        fused = tuple(n for n in whole if n not in {mapping.stored_name(a) for a in alone})
        if fused:
            groups.append(Group(tuple(n for n in names if n not in alone), fused))
        stored.update(whole)
    return groups, stored


@dataclass(frozen=True)
class ShardPlan:
    """Which file holds each stored tensor, and its dtype and shape there (meta tensors), in the model's order."""

    shards: tuple[tuple[str, ...], ...]  # each shard's tensor names
    metas: dict[str, torch.Tensor]

    @property
    def files(self) -> list[str]:
        n = len(self.shards)
        return [MODEL_FILE] if n == 1 else [SHARD_FILE.format(k=k + 1, n=n) for k in range(n)]

    def file_bytes(self, k: int) -> int:
        """The size shard k's file has when written whole."""
        head, _ = header_bytes({n: self.metas[n] for n in self.shards[k]}, metadata=STAMP)
        return len(head) + sum(nbytes(self.metas[n]) for n in self.shards[k])

    def index(self) -> dict | None:
        """model.safetensors.index.json's contents (as save_pretrained writes them), None for a single file."""
        if len(self.shards) == 1:
            return None
        files = self.files
        return {"metadata": {"total_parameters": sum(t.numel() for t in self.metas.values()),
                             "total_size": sum(nbytes(t) for t in self.metas.values())},
                "weight_map": {n: files[k] for k, names in enumerate(self.shards) for n in names}}

    def owners(self, nproc: int) -> list[int]:
        """The process that writes each shard: consecutive shards to each, about 1/nproc of the bytes each."""
        sizes = [sum(nbytes(self.metas[n]) for n in names) for names in self.shards]
        total, before, owners = sum(sizes) or 1, 0, []
        for size in sizes:
            owners.append(min(nproc - 1, (before + size // 2) * nproc // total))
            before += size
        return owners


def natural_key(name: str) -> list[tuple]:
    """transformers' order of a state dict's names (core_model_loading.dot_natural_key): by their dotted parts,
    numbers by value (layers.2 before layers.10, shard_2 before shard_11), words alphabetically."""
    key = []
    for part in name.split("."):
        if part.isdigit():
            key.append((0, int(part)))
        else:
            text = part.rstrip("0123456789")
            key.append((1, text, int(part[len(text):])) if part != text else (1, text))
    return key


def plan_shards(metas: dict[str, torch.Tensor], max_shard_size: int) -> ShardPlan:
    """huggingface_hub's split of `metas` into shards of at most `max_shard_size` bytes, in transformers' order.

    transformers 5 hands save_pretrained's split the state dict sorted by natural_key where it converts a model's
    weights on loading (GPT-2, the mixtures of experts), in its modules' order otherwise (Llama: attention, MLP, then
    the two norms of each layer); zerotrain, which writes without transformers, takes the sorted order for every
    model: each layer's tensors still share one or two files, and any order loads the same.
    """
    metas = dict(sorted(metas.items(), key=lambda item: natural_key(item[0])))
    shards, current, size = [], [], 0
    for name, t in metas.items():
        if nbytes(t) > max_shard_size:  # alone, before the shard being filled, as huggingface_hub does
            shards.append([name])
            continue
        if current and size + nbytes(t) > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes(t)
    if current or not shards:
        shards.append(current)
    return ShardPlan(tuple(tuple(s) for s in shards), metas)


def write_shards(plan: ShardPlan, which: list[int], folder: str, groups: list[Group],
                 read: Callable[[str], torch.Tensor], mapping: HFMapping | None, mode_of: str) -> None:
    """Write shards `which` of `plan` into `folder`, each tensor made from `read(zerotrain name)` (fp32) through
    `mapping` and cast to the plan's dtype; each file gets the mode of the file `mode_of` and is fsynced."""
    group_of = {n: g for g in groups for n in g.names}
    order = {n: i for i, n in enumerate(group_of)}  # the groups' order: the model's
    for k in which:
        head, ordered = header_bytes({n: plan.metas[n] for n in plan.shards[k]}, metadata=STAMP)
        offsets, at = {}, len(head)
        for name, meta in ordered:
            offsets[name], at = at, at + nbytes(meta)
        path = os.path.join(folder, plan.files[k])
        with open(path, "wb", buffering=0) as f:
            _write_at(f, head, 0)
            group, held = None, {}
            for name in sorted(plan.shards[k], key=order.get):  # a group's tensors one after the other
                if group_of[name] is not group:  # the next group: the one before is let go before it is read
                    group, held = group_of[name], {}
                    held = {n: read(n) for n in group.sources}
                    held = mapping.to_hf(held) if mapping is not None else held
                t = stored_tensor(held.pop(name), plan.metas[name].dtype)
                if t.shape != plan.metas[name].shape:  # the shapes the split was made from are the model config's
                    raise CheckpointError(f"{name} has shape {tuple(t.shape)}, the model its config describes "
                                          f"{tuple(plan.metas[name].shape)}")
                _write_at(f, memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B"), offsets[name])
                del t
            os.fsync(f.fileno())
        shutil.copymode(mode_of, path)


def stored_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor as the file holds it: in the export's dtype (round to nearest even from fp32), contiguous."""
    return t.detach().to(dtype).contiguous()


def _write_at(f, view, pos: int) -> None:
    view = memoryview(view).cast("B")
    while view.nbytes:  # a pwrite may take fewer bytes than offered
        n = os.pwrite(f.fileno(), view, pos)
        view, pos = view[n:], pos + n


def write_index(plan: ShardPlan, folder: str) -> None:
    index = plan.index()
    if index is not None:
        with open(os.path.join(folder, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")


def missing_shard(plan: ShardPlan, folder: str) -> str | None:
    """The first shard of `plan` that is not in `folder` at its full size, as a message; None when all are."""
    for k, name in enumerate(plan.files):
        path = os.path.join(folder, name)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size != plan.file_bytes(k):
            return f"{name} was not written whole ({size} bytes, {plan.file_bytes(k)} expected)"
    return None
