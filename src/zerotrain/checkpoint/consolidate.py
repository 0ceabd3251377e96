"""The model a checkpoint holds, by parameter name: read from its model file or assembled from its shards' masters.

Format 2 stores the parameters once, as the fp32 masters in the shards: world rank d x T + t holds DP rank d's chunk
of each bucket of TP rank t's padded flat layout. The full model is those chunks put together through the manifest's
layout and TP slices (a split tensor from every TP rank's part, a KV head held by several TP ranks from the first of
them, a replicated tensor from TP rank 0), in a bf16 run rounded to bf16 (the parameters the run computes with).
Format 1 also held `model.safetensors`, the same tensors rank 0 gathered and wrote: read as it is. Names are
zerotrain's (the layout's; a tied head once, under the embedding's name); a LoRA run's checkpoint holds its adapters.

`model_tensors` gives the model one full tensor at a time (load_model, sample, eval: a reader holds one tensor beyond
the model it fills; an export takes each tensor by name from `ShardedModel` as it writes, holding one), through
`ShardedModel`, which reads only that tensor's byte ranges of the shards'
masters (--init-from too: a rank never holds more than one tensor it does not keep); `checkpoint_model` keeps them
all (a LoRA run's adapters). Each reads what the caller verified first; none needs torch.distributed.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import weakref
from collections.abc import Iterator

import torch
from safetensors import safe_open

from zerotrain.errors import CheckpointError

from .format import MODEL_FILE, read_manifest, shard_name
from .homes import CheckpointHomes, Home
from .stream import count_read, read_at


def has_model_file(manifest: dict) -> bool:
    """Whether the checkpoint lists a model file (format 1) beside its shards."""
    return any(f["name"] == MODEL_FILE for f in manifest["files"])


def checkpoint_model(folder: str, manifest: dict | None = None,
                     from_shards: bool | None = None) -> dict[str, torch.Tensor]:
    """Every trained parameter of the checkpoint `folder` by name, full shape, fp32 on the CPU, each tensor its own
    storage: model_tensors, kept. The whole model at once: for small models (a LoRA run's adapters) and tests; a reader
    of a whole model takes model_tensors one at a time."""
    return dict(model_tensors(folder, manifest, from_shards))


def model_tensors(folder: str, manifest: dict | None = None,
                  from_shards: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every trained parameter of the checkpoint `folder`, one at a time, in the layout's order
    (the model file's, at format 1), fp32 on the CPU, each its own storage: the model file's tensors when the manifest
    lists one, else each assembled from the byte ranges of the shards' masters that hold it (ShardedModel). Nothing
    but the tensor yielded is held: a caller that puts each where it belongs and lets it go holds one tensor beyond
    what it keeps (`held_bytes` counts the tensors yielded and still alive).

    `from_shards` True assembles from the shards even when there is a model file (to compare the two), False insists
    on the model file. The caller verifies the checkpoint first.
    """
    manifest = manifest if manifest is not None else read_manifest(folder)
    if from_shards is None:
        from_shards = not has_model_file(manifest)
    if not from_shards:
        path = os.path.join(folder, MODEL_FILE)
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                count_read(t.numel() * t.element_size())
                yield name, _held(t)
                del t  # before the next one is read
        return
    with ShardedModel(folder, manifest) as shards:
        for name in shards.shapes:
            yield name, shards.tensor(name)


_HELD = {"now": 0, "peak": 0}  # bytes of the tensors model_tensors / ShardedModel gave that are alive, in this process
_HELD_LOCK = threading.Lock()


def _held(t: torch.Tensor) -> torch.Tensor:
    """`t`, counted in held_bytes until it is freed."""
    n = t.numel() * t.element_size()
    with _HELD_LOCK:
        _HELD["now"] += n
        _HELD["peak"] = max(_HELD["peak"], _HELD["now"])
    weakref.finalize(t, _release, n)
    return t


def _release(n: int) -> None:
    with _HELD_LOCK:
        _HELD["now"] -= n


def held_bytes(reset_peak: bool = False) -> dict[str, int]:
    """{"now", "peak"}: bytes of the tensors model_tensors yielded (ShardedModel.tensor gave) that are alive now, and
    the most at once (since the last reset_peak, which sets the peak to now)."""
    with _HELD_LOCK:
        if reset_peak:
            _HELD["peak"] = _HELD["now"]
        return dict(_HELD)


class ShardedModel:
    """A checkpoint's model one full tensor at a time, each read from the byte ranges of the shards' masters that hold
    it (read with pread: _FlatReader), never a whole shard or flat buffer, and no page of a shard kept mapped.

    A parameter lies in one bucket of the flat layout; its values are spread over the DP ranks' chunks of that bucket,
    so it is read from at most D shards per TP rank it is taken from. A split parameter is read whole, every TP part
    of it: a reader that keeps a TP slice takes it from the full tensor (`TPSlice.take`), so it holds one full tensor
    beyond what it keeps. The values equal `checkpoint_model(..., from_shards=True)`'s bitwise.
    """

    def __init__(self, folder: str, manifest: dict | None = None):
        self.folder = folder
        self.manifest = manifest if manifest is not None else read_manifest(folder)
        # where each parameter lives, by global name: with --ep an expert in the expert layout of its EP rank
        self.homes = CheckpointHomes.of(self.manifest, folder)
        self.layout, self.tp_slices = self.homes.layout, self.homes.tp_slices
        self.shapes = self.homes.shapes  # name -> full shape, in layout order (then the experts of an --ep one)
        self._opened: dict[tuple[int, str], _FlatReader] = {}

    def tensor(self, name: str) -> torch.Tensor:
        """Parameter `name`'s full tensor, fp32 (in a bf16 run the masters rounded to bf16), its own storage."""
        home = self.homes.home(name)  # with --ep an expert's: its EP rank's, split as EP rank 0's (expert_tp_slices)
        tp_slice = home.tp_slice
        if tp_slice is None:  # replicated: every TP rank holds it bitwise alike (verify's replicas check); TP rank 0's
            full = self._local(home, 0)
        else:
            full = torch.empty(tp_slice.full_shape)
            for t in range(len(tp_slice.parts)):
                if tp_slice.first_holder(t) == t:  # a KV head held by several TP ranks: once, from the first
                    tp_slice.place(full, self._local(home, t), t)
        return _held(full.bfloat16().float() if self.manifest["precision"] == "bf16" else full)

    def _local(self, home: Home, t: int) -> torch.Tensor:
        """TP rank t's tensor of `home`'s slot: its range of its layout, read from the DP ranks' chunks that hold it
        (with --ep an expert's from its EP rank's replica group at TP index t, their shards' expert masters)."""
        slot = home.slot
        local = torch.empty(slot.numel)
        for p in home.layout.pieces(slot.offset, slot.offset + slot.numel):
            at = p.start - slot.offset
            self._masters(home.world_rank(p.rank, t), home.prefix + "master").read_into(p.shard_offset,
                                                                                   local[at : at + p.numel])
            count_read(4 * p.numel)
        return local.view(slot.shape)

    def _masters(self, rank: int, key: str = "master") -> "_FlatReader":
        """World rank `rank`'s master shard (`key`: expert_master for its expert engine's), opened once, read
        by ranges."""
        if (rank, key) not in self._opened:
            path = os.path.join(self.folder, shard_name(rank, self.manifest["world_size"]))
            self._opened[rank, key] = _FlatReader(path, key)
        return self._opened[rank, key]

    def close(self) -> None:
        for reader in self._opened.values():
            reader.close()
        self._opened.clear()

    def __enter__(self) -> "ShardedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _FlatReader:
    """Ranges of one 1-D tensor of a safetensors file, read with pread into the caller's tensor.

    Not safetensors' safe_open: it maps the file, and the pages of every range read stay resident in the reading
    process while the file is open. An export (zerotrain bench ranks, 229 M parameters) peaked at the model plus
    1,068 MB beyond it, the masters' pages it had touched, where the tensor it assembles is 131 MB.
    """

    def __init__(self, path: str, key: str):
        self._file = open(path, "rb", buffering=0)
        (n,) = struct.unpack("<Q", self._file.read(8))
        entry = json.loads(self._file.read(n))[key]
        self.dtype = _FLAT_DTYPES[entry["dtype"]]
        self._start = 8 + n + entry["data_offsets"][0]

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        """Values [offset, offset + out.numel()) of the tensor into `out` (contiguous, of its dtype)."""
        if out.dtype != self.dtype:
            raise CheckpointError(f"{self._file.name}: its tensor is {self.dtype}, not {out.dtype}")
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        read_at(self._file, self._start + offset * out.element_size(), view)

    def close(self) -> None:
        self._file.close()


_FLAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
