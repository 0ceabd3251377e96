"""The digest a manifest records of a base model's weight files: a sha256 per fixed-size block, hashed by every rank.

A file is cut into blocks of `block_bytes` (the last one shorter); its digest is the sha256 of its blocks' sha256s
(32 bytes each, in order), with the block size beside it, so that W ranks hash the folder together, each the run of
its blocks that holds about 1/W of its bytes, and one process (export, sample, merge, a resume's check) computes
the same digest alone.
The block size depends on the folder alone (its total bytes: about FOLDER_BLOCKS blocks, a power of two between
MIN_BLOCK and MAX_BLOCK), so it is the same at every world size; a comparer reads it from the record.

Hashing whole files, one rank per file, made a few ranks read 16x their share at Llama-3-8B DP 64 (four 4.02 GB
files hashed by four of 64 ranks) and 8.8x at 70B.

An entry of a manifest's record is {"name", "bytes", "blocks_sha256"} under the record's "block_bytes"; records
written before it ({"name", "sha256"}: the file's own sha256) are still read, the file hashed whole to compare. As a
string (`tagged`), a block digest is "blocks-<block_bytes>:<hex>" and a whole file's sha256 its plain hex.
"""

from __future__ import annotations

import hashlib
import os

from zerotrain.checkpoint.stream import CHUNK, count_read, sha256_file, storage_delay

MAX_BLOCK = 64 << 20  # 64 MiB: Llama-3-70B's 141 GB are ~2,100 blocks, 8-9 for each of 256 ranks
MIN_BLOCK = 4 << 10
FOLDER_BLOCKS = 1024  # about this many blocks a folder, so that a few ranks share it evenly (16 MiB blocks for 8B)


def block_size(total_bytes: int) -> int:
    """The block size of a folder whose weight files hold `total_bytes`: the power of two at or above
    total_bytes / FOLDER_BLOCKS, within [MIN_BLOCK, MAX_BLOCK]."""
    want = -(-total_bytes // FOLDER_BLOCKS)
    return min(MAX_BLOCK, max(MIN_BLOCK, 1 << max(0, want - 1).bit_length()))


def blocks(sizes: list[tuple[str, int]], block_bytes: int) -> list[tuple[str, int, int]]:
    """(name, offset, length) of every block of the files `sizes` (name, bytes), file by file in the given order; an
    empty file has one empty block (its digest is then that of one empty block)."""
    out = []
    for name, size in sizes:
        out.extend((name, at, min(block_bytes, size - at)) for at in range(0, max(size, 1), block_bytes))
    return out


def block_ranks(every: list[tuple[str, int, int]], ranks: int) -> list[int]:
    """The rank of `ranks` that hashes each of `every`'s blocks: the one in whose 1/`ranks` of the folder's bytes (the
    files one after another) the block starts, so a rank hashes its share and at most one block more, however the
    files' last blocks fall."""
    total, at, out = sum(n for _, _, n in every), 0, []
    for _, _, length in every:
        out.append(min(ranks - 1, at * ranks // total) if total else 0)
        at += length
    return out


def rank_blocks(every: list[tuple[str, int, int]], rank: int, ranks: int) -> list[tuple[str, int, int]]:
    """The run of `every`'s blocks rank `rank` of `ranks` hashes (block_ranks); in order, so the ranks' digests
    gathered in rank order are every block's in order."""
    return [block for block, r in zip(every, block_ranks(every, ranks)) if r == rank]


def hashed_bytes(sizes: list[tuple[str, int]], ranks: int) -> list[int]:
    """The bytes each of `ranks` ranks hashes of files `sizes` (name, bytes): the I/O plan's figure, in one pass over
    the blocks (a pass a rank took 3 s of a 256-rank plan)."""
    every, out = blocks(sizes, block_size(sum(s for _, s in sizes))), [0] * ranks
    for (_, _, length), rank in zip(every, block_ranks(every, ranks)):
        out[rank] += length
    return out


def sha256_range(path: str, offset: int, length: int) -> bytes:
    """The sha256 of bytes [offset, offset + length) of a file, read in chunks and counted (checkpoint_bytes_read).
    Not charged by slow_storage: its callers charge each file once for the bytes they read of it (charge_files)."""
    sha, done = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while done < length:
            block = f.read(min(CHUNK, length - done))
            if not block:
                raise OSError(f"{path} is shorter than {offset + length} bytes")
            sha.update(block)
            done += len(block)
            count_read(len(block))
    return sha.digest()


def charge_files(ranges) -> None:
    """slow_storage's charge for reading `ranges` ((path, offset, length), ...): once per file, for its bytes read,
    as a whole file read is charged (not once per block: a small folder's 4 KiB blocks would each cost a file's)."""
    per_file: dict[str, int] = {}
    for p, _, n in ranges:
        per_file[p] = per_file.get(p, 0) + n
    for n in per_file.values():
        storage_delay(n)


def folder_record(paths: list[str], comm=None, block_bytes: int | None = None) -> tuple[int, list[dict]]:
    """(the block size, each file's entry {"name", "bytes", "blocks_sha256"}) of the weight files `paths`, in that
    order, in blocks of `block_bytes` (None: block_size's for the folder). With `comm`, every rank calls it together:
    each hashes its run of the blocks (rank_blocks) and the digests are gathered under --io-timeout; every rank gets
    the entries."""
    sizes = [(p, os.path.getsize(p)) for p in paths]
    block_bytes = block_bytes or block_size(sum(s for _, s in sizes))
    every = blocks(sizes, block_bytes)
    rank, ranks = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    run = rank_blocks(every, rank, ranks)
    mine = [sha256_range(p, at, n).hex() for p, at, n in run]
    charge_files(run)
    digests = mine if comm is None else [d for got in comm.io.all_gather_json(mine, "hash_init_from") for d in got]
    by_file = {p: hashlib.sha256() for p, _ in sizes}
    for (p, _, _), d in zip(every, digests, strict=True):
        by_file[p].update(bytes.fromhex(d))
    return block_bytes, [{"name": os.path.basename(p), "bytes": size, "blocks_sha256": by_file[p].hexdigest()}
                         for p, size in sizes]


def file_digest(path: str, block_bytes: int) -> str:
    """One process's block digest of a file (folder_record's, for one file), tagged."""
    return tag(folder_record([path], block_bytes=block_bytes)[1][0]["blocks_sha256"], block_bytes)


def tag(hexdigest: str, block_bytes: int | None) -> str:
    """A digest as a string that says its kind: "blocks-<block_bytes>:<hex>", or a whole file's sha256 as is."""
    return hexdigest if block_bytes is None else f"blocks-{block_bytes}:{hexdigest}"


def tagged_digests(record: dict | None) -> dict[str, str]:
    """Each file's digest of a manifest's base `record` (WeightSource.record's, of either format) by its name."""
    record = record or {}
    return {f["name"]: tag(f["blocks_sha256"], record["block_bytes"]) if "blocks_sha256" in f else f["sha256"]
            for f in record.get("files", [])}


def digest_like(path: str, theirs: str) -> str:
    """The digest of the file at `path` of the kind `theirs` is (a tagged digest): its blocks' at their size, or
    the whole file's sha256 (an older record's)."""
    if theirs.startswith("blocks-"):
        return file_digest(path, int(theirs[len("blocks-"):].split(":", 1)[0]))
    return sha256_file(path)[1]


def shown(digest: str | None) -> str:
    """A digest as messages show it: "sha256 1a2b3c4d5e6f...", "of 16 MiB blocks" after a block digest."""
    if digest is None:
        return "no such file"
    kind, _, hexdigest = digest.rpartition(":")
    if not kind:
        return f"sha256 {hexdigest[:12]}..."
    size = int(kind[len("blocks-"):])
    count, unit = next((size // b, u) for u, b in (("MiB", 1 << 20), ("KiB", 1 << 10), ("bytes", 1)) if size % b == 0)
    return f"sha256 {hexdigest[:12]}... of {count} {unit} blocks"


def first_difference(theirs: dict[str, str], record: dict) -> tuple[str, str | None, str | None] | None:
    """(file name, this base's digest, theirs) of the first file where the base `record` describes (this run's
    --init-from, WeightSource.record) differs from `theirs` (tagged_digests of the record a checkpoint or a stored
    reference keeps), or None. A digest of another kind (an older record's whole-file sha256, another block
    size) is computed again from the base's file, in this process."""
    mine = tagged_digests(record)
    for name in sorted(set(theirs) | set(mine)):
        a, b = mine.get(name), theirs.get(name)
        if a is not None and b is not None and a != b and _kind(a) != _kind(b):
            path = os.path.join(record["path"], name)
            a = digest_like(path, b) if os.path.isfile(path) else None
        if a != b:
            return name, a, b
    return None


def _kind(digest: str) -> str:
    return digest.rpartition(":")[0]
