"""Safetensors files written and read in one pass, the sha256 computed on the bytes as they stream.

The bytes are the standard format, the same safetensors.torch.save_file writes: an 8-byte
little-endian header length, a JSON header giving each tensor's dtype, shape and byte range
(tensors ordered by dtype, widest first, then by name; the header padded with spaces to a multiple
of 8 so the data is aligned), then the raw little-endian tensor bytes in header order. Writing
them here instead of with save_file lets the hash be taken from the memory being written (no
second read of the file) and lets a hook run midway through a file (fault injection). That hash is the file's
integrity: nothing reads a file back after writing it; every reader checks the bytes it reads against it.

sha256 runs in a second thread behind the write (never holding the writer back: the blocks it has yet to hash are
views of memory the writer holds anyway, so the hash overlaps the writes and the fsync): hashlib and file writes
both release the GIL on large buffers, so the two overlap: a write loses little of its throughput to a hash in a
thread, much more to one inline or to a re-read after save_file (docs/benchmarks.md). Reading hashes the same way, a
block at a time, straight into the tensors the caller names (read_hashed_into: a resume's into the engine's own
state, with pread, so no copy of the file is held), so what is verified is exactly what is loaded.

Every byte this process writes or reads here is counted (`bytes_counted`; `count_read` for readers elsewhere,
such as a reshard's ranged reads, `count_written` for the tokenizer files rank 0 copies into a checkpoint): the run reports each rank's checkpoint I/O.

`slow_storage(F)` (fault injection: storage shared by many nodes, or far away) makes every checkpoint file this
process reads or writes from then on cost F seconds per MiB, and at least F per file (`storage_delay`, which the
commit calls for the manifest and retention for each folder it deletes; the sidecars and `latest`, a few bytes
each, are not charged).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .format import CheckpointError

CHUNK = 8 << 20  # bytes per write/read and per hash update: large enough that both release the GIL

# safetensors orders a header by its Dtype enum, largest first; this dict is in that order.
DTYPE_CODES = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.uint32: "U32",
    torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint16: "U16", torch.int16: "I16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_COUNTS = {"checkpoint_bytes_written": 0, "checkpoint_bytes_read": 0}  # this process's, since it started
_COUNTS_LOCK = threading.Lock()  # an async save writes from its own thread
MIB = 1 << 20
_SLOW = {"s_per_mib": 0.0}  # slow_storage's delay; 0: storage as it is
_RANK = {code: i for i, code in enumerate(DTYPE_CODES.values())}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

assert sys.byteorder == "little", "safetensors stores little-endian bytes; this writer copies memory as is"


def count_read(n: int) -> None:
    """Count `n` checkpoint bytes read by this process."""
    with _COUNTS_LOCK:
        _COUNTS["checkpoint_bytes_read"] += n


def _count_written(n: int) -> None:
    with _COUNTS_LOCK:
        _COUNTS["checkpoint_bytes_written"] += n


def count_written(n: int) -> None:
    """Count `n` checkpoint bytes written by this process (a file copied into a checkpoint)."""
    _count_written(n)


def slow_storage(seconds_per_mib: float) -> None:
    """Fault injection: from now on each checkpoint file this process reads or writes costs `seconds_per_mib` per
    MiB, and at least that much per file (0 turns it off)."""
    _SLOW["s_per_mib"] = seconds_per_mib


def storage_delay(nbytes: int) -> None:
    """What slow_storage charges for reading or writing one file of `nbytes` (nothing unless it is on)."""
    if _SLOW["s_per_mib"]:
        time.sleep(_SLOW["s_per_mib"] * max(nbytes, MIB) / MIB)


def bytes_counted() -> dict[str, int]:
    """The checkpoint bytes this process has written and read so far (saves, loads, reshards, verification's
    hashing), by name: checkpoint_bytes_written, checkpoint_bytes_read."""
    with _COUNTS_LOCK:
        return dict(_COUNTS)


@dataclass(frozen=True)
class FileRecord:
    """What a manifest records of one file: its name in the folder, its size and its sha256."""

    name: str
    bytes: int
    sha256: str

    def to_dict(self) -> dict:
        return asdict(self)


class _Hasher:
    """sha256 of a sequence of buffers, computed in a thread while the caller moves on to the next one.

    The buffers must stay unchanged until `hexdigest()` returns (they are views, not copies). `queued`: at most
    that many blocks wait (0: no bound). A reader faster than the hash whose blocks are fresh bytes (sha256_file)
    bounds them, waiting rather than holding the whole file in memory. A writer does not: its blocks are views of
    memory it holds anyway, and a bound made every write wait for the hash (QUEUED on the write path cost a sync
    save a share of the disk's bandwidth: docs/benchmarks.md); unbounded, the hash overlaps the fsync instead.
    """

    QUEUED = 4

    def __init__(self, threaded: bool = True, queued: int = 0):
        self._sha = hashlib.sha256()
        self._queue: queue.Queue | None = queue.Queue(maxsize=queued) if threaded else None
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="zerotrain-sha256", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while (block := self._queue.get()) is not None:
            self._sha.update(block)

    def update(self, block) -> None:
        if self._queue is None:
            self._sha.update(block)
        else:
            self._queue.put(block)

    def hexdigest(self) -> str:
        self.close()
        return self._sha.hexdigest()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"a tensor to write must be contiguous on the CPU, got {t.device} contiguous={t.is_contiguous()}")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _parts(value) -> list[torch.Tensor]:
    """A tensor to write as its one part, or a 1-D tensor given as the list of its parts (written one after another:
    a rank's shard straight from the pieces of the buffer that hold it, with no copy to concatenate them)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _meta(value) -> tuple[torch.dtype, list[int], int]:
    """(dtype, shape, bytes) of a tensor, or of the 1-D tensor its parts make."""
    parts = _parts(value)
    if len(parts) == 1 and not isinstance(value, (list, tuple)):
        t = parts[0]
        return t.dtype, list(t.shape), t.numel() * t.element_size()
    if len({t.dtype for t in parts}) != 1:
        raise ValueError(f"the parts of a tensor to write have dtypes {sorted({str(t.dtype) for t in parts})}")
    numel = sum(t.numel() for t in parts)
    return parts[0].dtype, [numel], numel * parts[0].element_size()


def header_bytes(tensors: dict, metadata: dict[str, str] | None = None) -> tuple[bytes, list[tuple[str, object]]]:
    """The length prefix and JSON header of a safetensors file, and the tensors (or lists of parts) in the order of
    their bytes; `metadata` is the header's __metadata__ (an export's {"format": "pt"}, as save_file writes it)."""
    described = {name: _meta(t) for name, t in tensors.items()}
    head, names = _header(described, metadata)
    return head, [(name, tensors[name]) for name in names]


def shape_header_bytes(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> bytes:
    """header_bytes' header for tensors of `shapes`, all of `dtype`, from the shapes alone: a plan sizes an export's
    header without a tensor (DeepSeek-V3-671B's 90k names: 1 s as meta tensors)."""
    size = dtype.itemsize
    return _header({name: (dtype, list(shape), math.prod(shape) * size) for name, shape in shapes.items()})[0]


def _header(described: dict[str, tuple[torch.dtype, list[int], int]],
            metadata: dict[str, str] | None = None) -> tuple[bytes, list[str]]:
    """The length prefix and JSON header of tensors given as (dtype, shape, bytes), and their names in the order of
    their bytes."""
    names = sorted(described, key=lambda name: (_RANK[DTYPE_CODES[described[name][0]]], name))
    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for name in names:
        dtype, shape, size = described[name]
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, names


def write_safetensors(path: str, tensors: dict, *, halfway: Callable[[], None] | None = None,
                      hash_in_thread: bool = True) -> FileRecord:
    """Write `tensors` to `path` and fsync it; the sha256 is of the bytes written, taken as they go.

    A value may be a tensor or a list of tensors, the parts of one 1-D tensor (header_bytes). `halfway`, if given,
    runs once about half of the file's bytes are written.
    """
    head, ordered = header_bytes(tensors)
    hasher = _Hasher(threaded=hash_in_thread)
    try:
        views = [memoryview(head)] + [_byte_view(part) for _, t in ordered for part in _parts(t)]
        total = write_durably(path, [v for v in views if v.nbytes], hasher.update, halfway)
        return FileRecord(os.path.basename(path), total, hasher.hexdigest())
    finally:
        hasher.close()


def write_durably(path: str, views: list[memoryview], on_block: Callable[[memoryview], None] | None = None,
                  halfway: Callable[[], None] | None = None) -> int:
    """Write the buffers one after another into a new file at `path` and fsync it; return the bytes written.

    `on_block` sees each block just before it is written (the hasher); `halfway` runs once, midway.
    Asking the kernel to start writeback early (posix_fadvise DONTNEED every 64 MiB) made sync saves slower, and was
    dropped (docs/benchmarks.md).
    """
    total = sum(v.nbytes for v in views)
    written, half_done = 0, halfway is None
    with open(path, "wb", buffering=0) as f:
        for view in views:
            for lo in range(0, view.nbytes, CHUNK):
                block = view[lo : lo + CHUNK]
                if on_block is not None:
                    on_block(block)
                while block.nbytes:  # a raw write may take fewer bytes than offered
                    n = f.write(block)
                    block, written = block[n:], written + n
                    _count_written(n)
                if not half_done and written * 2 >= total:
                    half_done = True
                    halfway()
        os.fsync(f.fileno())
    storage_delay(written)
    return written


def sha256_file(path: str) -> tuple[int, str]:
    """Size and sha256 of a file, read in chunks (hashing behind the read) without holding it in memory."""
    hasher, size = _Hasher(queued=_Hasher.QUEUED), 0  # fresh bytes: bounded
    try:
        with open(path, "rb", buffering=0) as f:
            while block := f.read(CHUNK):
                hasher.update(block)
                size += len(block)
                count_read(len(block))
        storage_delay(size)
        return size, hasher.hexdigest()
    finally:
        hasher.close()


def read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], FileRecord]:
    """Every tensor of a safetensors file, each its own, and the size and sha256 of the file's bytes."""
    return read_hashed_into(path, lambda header: {})


def read_at(f, pos: int, view: memoryview) -> None:
    """Fill `view` with the bytes of the open file `f` from offset `pos`, with pread into the caller's memory: nothing
    mapped (safetensors' safe_open maps the file, and every page it touches stays resident while it is open), no
    buffer between, the file's position untouched. CheckpointError if the file ends first."""
    at = 0
    while at < view.nbytes:  # a pread may return fewer bytes than asked
        n = os.preadv(f.fileno(), [view[at:]], pos + at)
        if not n:
            raise CheckpointError(f"{f.name} ends at byte {pos + at}, inside what was to be read")
        at += n


def read_hashed_into(path: str, places: Callable[[dict[str, tuple[str, list[int]]]], dict]
                     ) -> tuple[dict[str, torch.Tensor], FileRecord]:
    """Read a safetensors file straight into the caller's tensors, a block at a time, hashing every byte as it is
    read: (the tensors it had no place for, each its own, the size and sha256 of the file's bytes).

    `places(header)` sees each tensor's (dtype code, shape) before any of its data is read (it raises to refuse
    them) and names where each tensor goes: a contiguous tensor of its dtype and size, or a list of them whose values,
    one after another, are its values, as write_safetensors takes them (a rank's shard state where the engine holds
    it: master_views, exp_avg, exp_avg_sq). A tensor it leaves out is read into a new one. So no copy of the file is
    held: the bytes land where they stay. A place off the CPU is filled through blocks of CHUNK bytes on the CPU, a
    few at a time. The caller compares the record with the manifest before it uses what was read: on a mismatch the
    places hold the file's (corrupt) bytes.
    """
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        hasher = _Hasher(queued=_Hasher.QUEUED)  # bounded: the blocks filled off the CPU's places are fresh ones
        try:
            head = torch.empty(min(size, 8), dtype=torch.uint8)
            _read_hashed_block(f, 0, head, hasher)
            if size < 8:
                raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, shorter than its header length")
            (n,) = struct.unpack("<Q", head.numpy().tobytes())
            if n > size - 8:
                raise CheckpointError(f"{path} is not a safetensors file: header of {n} bytes in a {size}-byte file")
            text = torch.empty(n, dtype=torch.uint8)
            _read_hashed_block(f, 8, text, hasher)
            entries = _header_entries(text.numpy().tobytes(), size - 8 - n, path)
            where = places({name: (e["dtype"], e["shape"]) for name, e in entries.items()})
            fresh = {}
            for name, e in sorted(entries.items(), key=lambda item: item[1]["data_offsets"]):  # in the file's order
                lo, hi = e["data_offsets"]
                dtype = _DTYPES[e["dtype"]]
                if name not in where:
                    fresh[name] = torch.empty(e["shape"], dtype=dtype)
                parts = _parts(where[name] if name in where else fresh[name])
                if (any(p.dtype != dtype or not p.is_contiguous() for p in parts)
                        or sum(p.numel() for p in parts) * dtype.itemsize != hi - lo):
                    raise ValueError(f"the places of {name} are not {hi - lo} contiguous bytes of {dtype}")
                pos = 8 + n + lo
                for part in parts:
                    _read_hashed_part(f, pos, part, hasher)
                    pos += part.numel() * dtype.itemsize
            if os.pread(f.fileno(), 1, size):
                raise CheckpointError(f"{path} grew while it was read (more than {size} bytes)")
            storage_delay(size)
            digest = hasher.hexdigest()
        finally:
            hasher.close()
    return fresh, FileRecord(os.path.basename(path), size, digest)


def read_blocks_held(device: str) -> int:
    """The most bytes read_hashed_into holds beside the places it fills on `device`: none on the CPU (each block is
    read where it stays), else the CPU blocks on their way (those queued for the hash, the one hashed, the one read)."""
    return 0 if device == "cpu" else (_Hasher.QUEUED + 2) * CHUNK


def _read_hashed_part(f, pos: int, part: torch.Tensor, hasher: _Hasher) -> None:
    """The bytes at `pos` of file `f` into the tensor `part`, a CHUNK at a time, each hashed once it is read."""
    flat = part.detach().view(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        for lo in range(0, flat.numel(), CHUNK):
            _read_hashed_block(f, pos + lo, flat[lo : lo + CHUNK], hasher)
        return
    for lo in range(0, flat.numel(), CHUNK):  # off the CPU: through a fresh block, which the hasher holds a while
        block = torch.empty(min(CHUNK, flat.numel() - lo), dtype=torch.uint8)
        _read_hashed_block(f, pos + lo, block, hasher)
        flat[lo : lo + block.numel()].copy_(block)


def _read_hashed_block(f, pos: int, block: torch.Tensor, hasher: _Hasher) -> None:
    view = memoryview(block.numpy()).cast("B")
    try:
        read_at(f, pos, view)
    except CheckpointError:
        raise CheckpointError(f"{f.name} shrank while it was read (it ends before byte {pos + view.nbytes})") from None
    hasher.update(view)
    count_read(view.nbytes)


def read_header(path: str) -> dict[str, tuple[str, list[int]]]:
    """Each tensor's dtype code and shape, from the header alone (the data is not read)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        count_read(len(prefix))
        if len(prefix) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, shorter than its header length")
        (n,) = struct.unpack("<Q", prefix)
        if n > size - 8:
            raise CheckpointError(f"{path} is not a safetensors file: header of {n} bytes in a {size}-byte file")
        text = f.read(n)
        count_read(len(text))
        entries = _header_entries(text, size - 8 - n, path)
    storage_delay(8 + n)
    return {name: (e["dtype"], e["shape"]) for name, e in entries.items()}


def _header_entries(text: bytes, data_bytes: int, path: str) -> dict[str, dict]:
    """The header's tensor entries, checked: known dtypes, sizes matching shapes, byte ranges tiling the data."""
    def bad(why: str):
        return CheckpointError(f"{path} is not a valid safetensors file: {why}")

    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    spans = []
    for name, e in entries.items():
        if not (isinstance(e, dict) and e.get("dtype") in _DTYPES and _int_list(e.get("shape"))
                and _int_list(e.get("data_offsets")) and len(e["data_offsets"]) == 2):
            raise bad(f"tensor {name!r} has a malformed entry {e!r}")
        lo, hi = e["data_offsets"]
        numel = 1
        for d in e["shape"]:
            numel *= d
        if hi - lo != numel * _DTYPES[e["dtype"]].itemsize:
            raise bad(f"tensor {name!r} spans {hi - lo} bytes, its shape and dtype need {numel * _DTYPES[e['dtype']].itemsize}")
        spans.append((lo, hi, name))
    end = 0
    for lo, hi, name in sorted(spans):
        if lo != end:
            raise bad(f"tensor {name!r} starts at byte {lo}, expected {end} (gap or overlap)")
        end = hi
    if end != data_bytes:
        raise bad(f"its tensors hold {end} bytes, the file has {data_bytes} after the header")
    return entries


def _int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
