"""The model a checkpoint holds, by parameter name: read from its model file or assembled from its shards' masters.

Format 2 stores the parameters once, as the fp32 masters in the shards: world rank d x T + t holds DP rank d's chunk
of each bucket of TP rank t's padded flat layout. The full model is those chunks put together through the manifest's
layout and TP slices (a split tensor from every TP rank's part, a KV head held by several TP ranks from the first of
them, a replicated tensor from TP rank 0), in a bf16 run rounded to bf16 (the parameters the run computes with).
Format 1 also held `model.safetensors`, the same tensors rank 0 gathered and wrote: read as it is. Names are
zerotrain's (the layout's; a tied head once, under the embedding's name); a LoRA run's checkpoint holds its adapters.

Two readers: `checkpoint_model` gives the whole model at once (load_model, sample, eval, export), assembled with the
verifier's own assembly (verify.tp_masters, tp_slices.full_tensors); `ShardedModel` gives one full tensor at a time,
reading only that tensor's byte ranges of the shards' masters (--init-from: a rank never holds more than one tensor it
does not keep). Both read what the caller verified first; neither needs torch.distributed.
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from zerotrain.parallel import ParamSlot
from zerotrain.parallel.tp_slices import full_tensors

from .format import MODEL_FILE, mesh_of, read_manifest, shard_name, tp_slices_of
from .reshard import full_shapes
from .stream import count_read
from .verify import layout_of, tp_masters


def has_model_file(manifest: dict) -> bool:
    """Whether the checkpoint lists a model file (format 1) beside its shards."""
    return any(f["name"] == MODEL_FILE for f in manifest["files"])


def checkpoint_model(folder: str, manifest: dict | None = None,
                     from_shards: bool | None = None) -> dict[str, torch.Tensor]:
    """Every trained parameter of the checkpoint `folder` by name, full shape, fp32 on the CPU, each tensor its own
    storage: the model file when the manifest lists one, else assembled from every shard's masters.

    `from_shards` True assembles from the shards even when there is a model file (to compare the two), False insists
    on the model file. The caller verifies the checkpoint first.
    """
    manifest = manifest if manifest is not None else read_manifest(folder)
    if from_shards is None:
        from_shards = not has_model_file(manifest)
    if not from_shards:
        return _model_file(os.path.join(folder, MODEL_FILE))
    layout = layout_of(manifest, folder)
    full = full_tensors(layout, tp_slices_of(manifest), tp_masters(folder, manifest, layout))
    return {name: t.clone() for name, t in full.items()}  # not views of one flat buffer: safetensors refuses those


def _model_file(path: str) -> dict[str, torch.Tensor]:
    """A model file's tensors, each its own storage (one tensor read at a time: no second copy of the file)."""
    with safe_open(path, framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    count_read(os.path.getsize(path))
    return tensors


class ShardedModel:
    """A checkpoint's model one full tensor at a time, each read from the byte ranges of the shards' masters that hold
    it (safetensors' lazy slices), never a whole shard or flat buffer.

    A parameter lies in one bucket of the flat layout; its values are spread over the DP ranks' chunks of that bucket,
    so it is read from at most D shards per TP rank it is taken from. A split parameter is read whole, every TP part
    of it: a reader that keeps a TP slice takes it from the full tensor (`TPSlice.take`), so it holds one full tensor
    beyond what it keeps. The values equal `checkpoint_model(..., from_shards=True)`'s bitwise.
    """

    def __init__(self, folder: str, manifest: dict | None = None):
        self.folder = folder
        self.manifest = manifest if manifest is not None else read_manifest(folder)
        self.layout = layout_of(self.manifest, folder)
        self.tp_slices = tp_slices_of(self.manifest)
        self.shapes = full_shapes(self.layout, self.tp_slices)  # name -> full shape, in layout order
        self._slots = {s.name: s for s in self.layout.slots}
        self._opened: dict[int, object] = {}

    def tensor(self, name: str) -> torch.Tensor:
        """Parameter `name`'s full tensor, fp32 (in a bf16 run the masters rounded to bf16), its own storage."""
        slot, tp_slice = self._slots[name], self.tp_slices.get(name)
        if tp_slice is None:  # replicated: every TP rank holds it bitwise alike (verify's replicas check); TP rank 0's
            full = self._local(slot, 0)
        else:
            full = torch.empty(tp_slice.full_shape)
            for t in range(len(tp_slice.parts)):
                if tp_slice.first_holder(t) == t:  # a KV head held by several TP ranks: once, from the first
                    tp_slice.place(full, self._local(slot, t), t)
        return full.bfloat16().float() if self.manifest["precision"] == "bf16" else full

    def _local(self, slot: ParamSlot, t: int) -> torch.Tensor:
        """TP rank t's tensor of `slot`: its range of the flat layout, read from the DP ranks' chunks that hold it."""
        T, D = mesh_of(self.manifest)
        bucket = self.layout.buckets[slot.bucket]
        chunk = bucket.chunk_numel(D)
        local = torch.empty(slot.numel)
        at, end = slot.offset, slot.offset + slot.numel
        while at < end:
            d, offset = divmod(at - bucket.start, chunk)  # DP rank d's chunk holds `at`, `offset` into it
            n = min(end - at, chunk - offset)
            lo = bucket.shard_offset + offset  # where that chunk sits in d's shard
            local[at - slot.offset : at - slot.offset + n] = self._masters(d * T + t)[lo : lo + n]
            count_read(4 * n)
            at += n
        return local.view(slot.shape)

    def _masters(self, rank: int):
        """World rank `rank`'s master shard, opened once, read lazily."""
        if rank not in self._opened:
            path = os.path.join(self.folder, shard_name(rank, self.manifest["world_size"]))
            self._opened[rank] = safe_open(path, framework="pt")
        return self._opened[rank].get_slice("master")

    def close(self) -> None:
        self._opened.clear()

    def __enter__(self) -> "ShardedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
