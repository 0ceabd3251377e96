"""The bytes each rank reads, writes and holds at start-up, in a step, at a save, a resume and an export, before the run.

The memory plan (memory_plan.py) says what a rank holds in a step; this says what the other phases of a run cost
each rank, from the same layout (the model on the meta device, TP rank 0's slices, the flat layout over the DP
ranks), so that "a rank's cost shrinks with the ranks" can be read off a plan and checked against what a run counts
(summary.json's per_rank figures; `differences`):

    start-up, read       with --init-from, its files: at stage 3 the rows that hold the rank's owned ranges (a range that
                         cuts a row reads that row), at stages 1 and 2 its TP slice of every parameter, in the files'
                         dtype (FileValues, init_bytes_read; an expert's part of a stacked tensor as any other: its
                         rows' stored elements, init_from.stacked_rows); a LoRA run's are its frozen base's, at stage 3
                         in the base's own flat layout (units.frozen_layout_of), its adapters drawn apart
             drawn       without it, from the seed: the values of its owned ranges at stage 3, of its TP slices otherwise
                         (init_values_drawn)
             hashed      --init-from's files this rank hashes for the manifests' record: its run of their blocks,
                         about 1/W of the folder (hub/base_digest.py, WeightSource.record; counted in
                         checkpoint_bytes_read). A run without --init-from (a plan for a folder that is not here)
                         is planned as Hugging Face saves a model: files of at most 5 GB
             headers     every file's safetensors header, which each rank reads once to list and check the tensors'
                         names, shapes and dtypes (tensor_files, check_tensors: WeightSource.headers keeps it; under
                         torchrun the rank's check before the run reads it and hands it to the start-up,
                         init_from.checked_source; counted in checkpoint_bytes_read; 0 for a folder not here). A
                         resume of full fine-tuning reads none (its record needs the files, not their tensors); under
                         torchrun its check still reads them once: resume_headers_torchrun, which differences adds
                         where told the run was launched so
             held        the state (the memory plan's state rows) and the largest one read (its rows in the file's
                         dtype and in fp32)
    step, held           the memory plan's total (parameters, gradients, optimizer state, activations, ...)
    save, written        its shard file: masters, exp_avg, exp_avg_sq in fp32 and the step, with its header (with
                         --dp-replicate R replica group 0's ranks, what S x T ranks would write; the others 0); rank 0
                         also copies --init-from's tokenizer.json and the files configuring it into every checkpoint
                         (checkpoint_bytes_written; the manifest is not counted, nor a data tokenizer's copy
                         without --init-from)
    resume, read         on the mesh that saved: its own shard file, read once and hashed as it loads, and its share
                         of the copied files, shared by size as their hashing at start-up is (checkpoint_bytes_read)
                         (with --dp-replicate R > 1: the files verified together, hashed shared by size over
                         all W ranks, then its masters and moments read by ranges, shard x 12: resume_by_ranges)
            held         the state: that file is read into it in place, a block at a time (on CUDA through a few
                         8 MiB blocks on the CPU: read_blocks_held)
    export, written      model.safetensors: every parameter once, fp32, with its header
            held beyond  what the exporting process holds beyond the model it writes: the largest tensor as it is
                         assembled from the shards (fp32, with a TP rank's part of it), in a bf16 run also its bf16
                         rounding and the fp32 copy of that (10 bytes a value)

With --ep E every phase counts a rank's two shares: its dense share (the flat layout of the parameters that are not
routed experts, over the DP ranks) and its block of experts (EP rank 0's block laid out over its replica group of
DP / E ranks; DP rank d is replica d // E of EP rank d mod E, and every EP rank's block has the same shapes). Start-up
reads or draws both (a rank's own experts only, their owned ranges at stage 3); its shard file holds both shards
(the expert engine's under expert_ keys, with its own step), which the save writes and a resume reads; the export
writes every expert once, as without --ep.

Reads and draws are planned both ways, whether or not the run gives --init-from: a plan for an 8B model's folder
need not have the folder.

Not planned yet: a resume onto another mesh (a reshard reads ranges of the old shards). Every TP rank of a Llama or GPT-2 model
holds slices of one shape, so TP rank 0's figures are each TP rank's; the
ranks differ by their DP rank (which rows their owned ranges cut) and by the blocks they hash.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import asdict, dataclass

import torch

from zerotrain.checkpoint import MANIFEST
from zerotrain.checkpoint.homes import EXPERT_PREFIX
from zerotrain.checkpoint.stream import header_bytes, read_blocks_held, read_header, shape_header_bytes
from zerotrain.checkpoint.verify import share_by_size
from zerotrain.config import Config
from zerotrain.data.tokenizer import TOKENIZER_FILE
from zerotrain.data.tokenizer_config import config_files
from zerotrain.hub import base_digest
from zerotrain.parallel.parts import Placement, parts_for
from zerotrain.parallel.units import frozen_layout_of

from .memory_plan import STATE, MemoryPlan, PlannedModel, memory_plan, planned_layouts

HF_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained max_shard_size default: the files a model folder has
FILE_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
# How far a run's counters may be from the plan before `differences` names them: the reads, writes and draws are
# planned exactly, so 1% (with 4 KiB for a header a dtype or a name could lengthen) only absorbs what a
# folder's files add that the plan leaves out.
TOLERANCE, SLACK = 0.01, 4096


@dataclass
class RankIO:
    """One rank's planned bytes, by phase."""

    rank: int  # world rank: DP rank x TP + TP rank
    startup_read: int
    startup_drawn: int  # values, not bytes
    startup_hashed: int
    startup_headers: int
    startup_held: int
    step_held: int
    save_written: int
    resume_read: int
    resume_held: int
    # a resume's headers under torchrun: its rank's check of --init-from's folder before the run reads them (zerotrain's
    # launcher checks the folder once, before the ranks start: none a rank)
    resume_headers_torchrun: int = 0


@dataclass
class IOPlan:
    """Every rank's RankIO, and the export's figures (one process, not a rank)."""

    ranks: list[RankIO]
    export_written: int
    export_held_beyond: int
    file_dtype_bytes: int
    init_from: bool  # whether the run starts from files (start-up reads) or from the seed (draws)
    resume_by_ranges: bool = False  # --dp-replicate R > 1: a resume reads by ranges (resume_by_ranges)

    def to_dict(self) -> dict:
        return {"ranks": [asdict(r) for r in self.ranks], "export_written": self.export_written,
                "export_held_beyond": self.export_held_beyond, "file_dtype_bytes": self.file_dtype_bytes,
                "init_from": self.init_from, "resume_by_ranges": self.resume_by_ranges}


def io_plan(cfg: Config, world_size: int | None = None, memory: MemoryPlan | None = None,
            planned: PlannedModel | None = None) -> IOPlan:
    """What each rank of `cfg`'s run reads, writes and holds by phase (module docstring), on --nproc ranks or
    `world_size`; `memory`: the run's memory plan, `planned`: its planned_layouts, where the caller has them already."""
    p, tp = cfg.parallel, cfg.parallel.tp
    world = world_size or cfg.launch.nproc
    dp = world // tp
    # as the memory plan lays the model out; with --ep DP rank d is replica d // E of EP rank d mod E
    planned = planned or planned_layouts(cfg, dp)
    local, shapes, L, experts = planned
    parts = parts_for(cfg)
    place, E = parts.placement, p.ep
    S = parts.shard_ranks(dp)  # with --dp-replicate R: DP rank d holds what d mod S of replica group 0 does
    # What start-up reads or draws: the trained parameters, or a LoRA run's frozen base (its adapters are drawn by
    # add_adapters, from their own seed, not read); stage 3 shards the base in a layout of its own
    source = frozen_layout_of(local, S, p.bucket_numel) if cfg.lora.rank else L
    esize = file_dtype_bytes(cfg)
    memory = memory or memory_plan(cfg, world_size=world, planned=planned)
    state = sum(memory.rows[k] for k in STATE)
    shard_file = shard_file_bytes(L.shard_numel, experts.shard_numel if experts is not None else 0)
    hashed = hashed_bytes(cfg, shapes, esize, world)
    headers = header_reads(cfg)
    copied = copied_files(cfg)  # rank 0 writes them all; a resume's ranks hash them shared by size
    copied_read = [sum(dict(copied)[n] for n in names) for names in share_by_size(copied, world)]
    copied_written = sum(size for _, size in copied)
    resumed = resume_by_ranges(cfg, L, experts, shard_file, copied, world) if S < dp else None
    # ranks with one DP rank in their replica group (TP ranks, replica groups) read the same rows, and so do the DP
    # ranks of one expert replica: each read counted once (DeepSeek-V3 on 256 ranks at --ep 32: 264 counts, not 512)
    source_rows = functools.cache(lambda d: place.read_rows(source, d))
    expert_rows = functools.cache(lambda q: place.read_rows(experts, q))
    ranks = []
    for rank in range(world):
        d = rank // tp % S  # its DP rank within its replica group
        rows = source_rows(d)  # the placement's: its owned ranges' rows, or its TP slices
        if experts is not None:  # and its block of experts, its owned ranges of them at stage 3
            rows = rows + expert_rows(d // E)
        largest = max((r for r, _ in rows), default=0) * (esize + 4)  # read in the file's dtype, then fp32
        writes = parts.writes_shard(rank // tp, dp)  # with --dp-replicate R, replica group 0's ranks
        ranks.append(RankIO(rank, sum(r for r, _ in rows) * esize, sum(v for _, v in rows), hashed[rank], headers,
                            state + largest, memory.total,
                            (shard_file if writes else 0) + (copied_written if rank == 0 else 0),
                            shard_file + copied_read[rank] if resumed is None else resumed[rank],
                            state + read_blocks_held(cfg.launch.device), resume_check_headers(cfg, headers)))
    biggest = max(math.prod(s) for s in shapes.values())
    beyond = biggest * 10 if p.precision == "bf16" else biggest * 4 + (biggest * 4 // tp if tp > 1 else 0)
    return IOPlan(ranks, export_file_bytes(shapes), beyond, esize, bool(cfg.checkpoint.init_from), resumed is not None)


def resume_by_ranges(cfg: Config, L, experts, shard_file: int, copied: list[tuple[str, int]],
                     world: int) -> list[int]:
    """Each world rank's bytes read resuming a checkpoint of R replica groups at R > 1 (its shard files are replica
    group 0's, world / R of them: another mesh's, for load.py): the checkpoint's files verified together, hashed
    shared by size over every rank (verify.share_by_size), with the headers of its share of the shard files; then
    its own state read by ranges from them: the masters and two moments (fp32) of its owned values (a shard's
    padding is not read) and the step, of each engine (with --ep the expert engine's too)."""
    tp, writers = cfg.parallel.tp, world // cfg.parallel.dp_replicate
    files = [(f"shard-{q}", shard_file) for q in range(writers)] + copied
    shared = [sum(dict(files)[n] for n in names) for names in share_by_size(files, world)]
    steps = 8 * (2 if experts is not None else 1)
    header = shard_file - 12 * (L.shard_numel + (experts.shard_numel if experts is not None else 0)) - steps
    headers = [len(names) * header for names in share_by_size([(str(q), 1) for q in range(writers)], world)]
    out = []
    for rank in range(world):
        d = rank // tp % L.world_size  # its DP rank within its replica group
        owned = owned_values(L, d) + (owned_values(experts, d // cfg.parallel.ep) if experts is not None else 0)
        out.append(shared[rank] + headers[rank] + 12 * owned + steps)
    return out


def owned_values(layout, dp_rank: int) -> int:
    """The values of parameters (not of the buckets' padding) that DP rank `dp_rank` owns in `layout`."""
    return sum(end - start for _, start, end in layout.owned_slots(dp_rank))


def file_dtype_bytes(cfg: Config) -> int:
    """Bytes per value of --init-from's files (the first tensor's dtype), or the run's precision's without them."""
    folder = cfg.checkpoint.init_from
    if folder and os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                header = read_header(os.path.join(folder, name))
                dtypes = [v[0] for v in header.values() if v[0] in FILE_DTYPE_BYTES]
                if dtypes:
                    return FILE_DTYPE_BYTES[dtypes[0]]
    return 2 if cfg.parallel.precision == "bf16" else 4


def hashed_bytes(cfg: Config, shapes: dict[str, tuple[int, ...]], esize: int, world: int) -> list[int]:
    """Each world rank's bytes of --init-from's files hashed for the manifests, its run of their blocks
    (hub.base_digest): the folder's own files where it is here (none for a checkpoint, whose manifest's sha256s
    are recorded), else files of at most HF_SHARD_BYTES holding the model."""
    folder = cfg.checkpoint.init_from
    if folder and os.path.isfile(os.path.join(folder, MANIFEST)):
        return [0] * world
    files = [(n, os.path.getsize(os.path.join(folder, n))) for n in sorted(os.listdir(folder))
             if n.endswith(".safetensors")] if folder and os.path.isdir(folder) else []
    if not files:  # not here, or its config.json alone (a plan before the download)
        total = sum(math.prod(s) for s in shapes.values()) * esize
        count = -(-total // HF_SHARD_BYTES)
        files = [(f"model-{i + 1:05d}-of-{count:05d}.safetensors", total // count) for i in range(count)]
    return base_digest.hashed_bytes(files, world)


def copied_files(cfg: Config) -> list[tuple[str, int]]:
    """(name, bytes) of the files rank 0 copies into every checkpoint from --init-from's folder
    (data.resolve.checkpoint_tokenizer): its tokenizer.json and the files that configure it; none for a folder that
    is not here."""
    folder = cfg.checkpoint.init_from
    if not (folder and os.path.isdir(folder)):
        return []
    files = dict(config_files(folder))
    if os.path.isfile(os.path.join(folder, TOKENIZER_FILE)):
        files[TOKENIZER_FILE] = os.path.join(folder, TOKENIZER_FILE)
    return sorted((name, os.path.getsize(path)) for name, path in files.items())


def header_reads(cfg: Config) -> int:
    """The bytes of every safetensors header of --init-from's folder (its 8-byte length and its JSON), which each
    rank reads; 0 for a folder that is not here."""
    folder = cfg.checkpoint.init_from
    if not (folder and os.path.isdir(folder)):
        return 0
    total = 0
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                total += 8 + struct.unpack("<Q", f.read(8))[0]
    return total


def resume_check_headers(cfg: Config, headers: int) -> int:
    """What a resume's rank reads of --init-from's folder under torchrun beyond the record's hashing: its check before
    the run (config_from_args) reads every header (`headers`), where the resume itself reads none; a LoRA run's
    resume reads its base, the check's headers handed to its start-up (0 here)."""
    return 0 if cfg.lora.rank else headers


def shard_file_bytes(shard_numel: int, expert_numel: int = 0) -> int:
    """A rank's shard file: its masters and AdamW's two moments (fp32) and the step count, with the header; with --ep
    also the expert engine's shard (`expert_numel` values) under expert_ keys, with its own step."""
    step = torch.empty(1, dtype=torch.int64, device="meta")
    meta = {k: torch.empty(shard_numel, device="meta") for k in ("master", "exp_avg", "exp_avg_sq")}
    meta["step"] = step
    if expert_numel:
        meta.update({EXPERT_PREFIX + k: torch.empty(expert_numel, device="meta")
                     for k in ("master", "exp_avg", "exp_avg_sq")})
        meta[EXPERT_PREFIX + "step"] = step
    head, _ = header_bytes(meta)
    return len(head) + 12 * (shard_numel + expert_numel) + 8 * (2 if expert_numel else 1)


def export_file_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """model.safetensors of an export: every parameter once (a tied head as the embedding), fp32, with its header
    (in zerotrain's names; Hugging Face's differ by a few bytes each)."""
    return len(shape_header_bytes(shapes, torch.float32)) + 4 * sum(math.prod(s) for s in shapes.values())


# What a run's summary.json counts (per_rank) against the plan's figure for each phase.
COUNTERS = {"startup": (("init_bytes_read", "startup_read"), ("init_values_drawn", "startup_drawn")),
            "save": (("checkpoint_bytes_written", "save_written"),),
            "resume": (("checkpoint_bytes_read", "resume_read"),)}


def differences(plan: IOPlan, per_rank: dict[str, list[int]], phases=("startup", "save"), saves: int = 1,
                hashed: bool = True, torchrun: bool = False) -> list[str]:
    """Where a run's counters (summary.json's per_rank) are off the plan beyond TOLERANCE, one line each, naming the
    rank, the counter and both figures. `phases`: what the run did (a fresh run starts and saves; a resumed one
    resumes, and may save); `saves`: how many checkpoints it wrote; `hashed`: its checkpoint reads include the
    hashing of --init-from's files (a run given --init-from hashes them whether it resumes or not, for the
    manifests' record; a resume of full fine-tuning reads nothing else of them, not even their headers, but for its
    check before the run under torchrun: `torchrun`, the run was launched so)."""
    out = []
    for rank in plan.ranks:
        for phase in phases:
            for counter, key in COUNTERS[phase]:
                if (counter, plan.init_from) in (("init_bytes_read", False), ("init_values_drawn", True)):
                    continue  # a run reads its model or draws it
                planned = getattr(rank, key) * (saves if phase == "save" else 1)
                if phase == "resume" and hashed and plan.init_from:  # the record; no header is read (_restores)
                    planned += rank.startup_hashed + (rank.resume_headers_torchrun if torchrun else 0)
                measured = per_rank[counter][rank.rank]
                if abs(measured - planned) > TOLERANCE * planned + SLACK:
                    out.append(f"rank {rank.rank} {counter} {measured:,}, the plan {planned:,}")
        if "startup" in phases and hashed and plan.init_from and "resume" not in phases:
            measured, planned = per_rank["checkpoint_bytes_read"][rank.rank], rank.startup_hashed + rank.startup_headers
            if abs(measured - planned) > TOLERANCE * planned + SLACK:
                out.append(f"rank {rank.rank} checkpoint_bytes_read {measured:,} (--init-from's files hashed and "
                           f"headers read), "
                           f"the plan {planned:,}")
    return out


# The rows of `describe`'s table: (RankIO field, label, what it is).
LINES = (("startup_read", "start-up: read", "with --init-from, from its files: {read_how}"),
         ("startup_drawn", "start-up: drawn (values)", "without, from the seed: {drawn_how}"),
         ("startup_hashed", "start-up: hashed", "--init-from's files hashed for the manifests, its run of their blocks{files}"),
         ("startup_held", "start-up: held", "the state, and the largest tensor read (file dtype and fp32)"),
         ("step_held", "step: held", "the memory plan's total above"),
         ("save_written", "save: written", "its shard file (fp32 masters and AdamW's moments){writers}"),
         ("resume_read", "resume: read", "{resume_how}"),
         ("resume_held", "resume: held", "the state: its shard file is read into it in place"))


def describe(plan: IOPlan, placement: Placement, gib) -> list[str]:
    """`zerotrain plan`'s section of it: each figure for rank 0 and its least and most over the ranks; what a rank
    reads and draws at start-up in the words of its parameters' `placement` (parts.py)."""
    notes = {"read_how": placement.read_how, "drawn_how": placement.drawn_how,
             "files": "" if plan.init_from else " (Hugging Face's files of at most 5 GB)",
             "writers": "; replica group 0's ranks, the others none" if plan.resume_by_ranges else "",
             "resume_how": "its share of the files hashed, then its owned values by ranges (replica groups)"
                           if plan.resume_by_ranges else
                           "its own shard file, hashed as it loads (on the mesh that saved)"}
    width = max(len(label) for _, label, _ in LINES)
    lines = [f"  {'per rank, by phase':<{width}}  {'rank 0':>11}  {'least':>11}  {'most':>11}"]
    for key, label, how in LINES:
        values = [getattr(r, key) for r in plan.ranks]
        if key == "startup_drawn":
            shown = [f"{v:,}" if v else "0" for v in (values[0], min(values), max(values))]
        else:
            shown = [gib(v) for v in (values[0], min(values), max(values))]
        lines.append(f"  {label:<{width}}  {shown[0]:>11}  {shown[1]:>11}  {shown[2]:>11}  {how.format(**notes)}")
    lines.append(f"  {'export: written':<{width}}  {gib(plan.export_written):>11}  {'':>11}  {'':>11}  "
                 "model.safetensors, fp32, one process")
    lines.append(f"  {'export: held beyond':<{width}}  {gib(plan.export_held_beyond):>11}  {'':>11}  {'':>11}  "
                 "beyond what it writes: the tensor assembled, its bf16 rounding and fp32 copy")
    return lines
