"""--init-from: start training from the weights of a local Hugging Face folder or a zerotrain checkpoint or export.

The source decides the architecture, the sizes and the vocabulary (a flag that says otherwise is refused,
naming both values) and brings its tokenizer. Each rank reads only the slices of the tensors it trains
(safetensors' lazy slicing, through the architecture's table in mapping.py), one tensor at a time, straight into
the engine's flat buffers (FileValues: the model is built on the meta device): no rank ever holds a full copy of a
tensor it trains TP-sharded (nor of a fused one, Phi-3's qkv_proj: a rank reads the rows of its parts' slices),
and at ZeRO-3 a rank reads only the rows that hold its owned ranges (a range that cuts a row reads that row). A
zerotrain checkpoint without a model file (format 2) stores its model as its shards' masters: a rank reads each
tensor it trains from the byte ranges of the shards that hold it (checkpoint.ShardedModel), whole, and keeps its TP
slice of it (there, one full tensor is held beyond what the rank keeps). A tensor stacking every expert of a layer
(gpt-oss's, Mistral 4's, Llama 4's, Gemma 4's) is read as any other by the rows of the parts the rank trains: the
stored elements of those rows, a strided slice of their expert's (stacked_rows); in MXFP4 one expert's slice at a
time, dequantized. Each file's safetensors header is read once a rank (WeightSource.headers; under torchrun the
source each rank checks in config_from_args is the one its start-up reads from, checked_source), and not at all by a
resume whose checkpoint overwrites every value (weight_source's `listed`). Weights only: the optimizer and the
schedule start fresh. Pickle files (pytorch_model.bin, *.pt) are refused: nothing is unpickled.
The launcher checks the folder before any rank starts, from headers alone (weight_source with verify):
config.json's types and values, every tensor's name, shape and dtype, every file's size, tokenizer.json.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

from zerotrain.checkpoint import (MANIFEST, CheckpointError, ShardedModel, has_model_file, read_manifest, shard_name,
                                   verify_or_raise)
from zerotrain.checkpoint.stream import read_header
from zerotrain.config import Config, ModelConfig, setting_for
from zerotrain.data.tokenizer import TOKENIZER_FILE, read_tokenizer_file
from zerotrain.errors import ConfigError
from zerotrain.model import meta_model, model_class, parallelize
from zerotrain.model.init import RestoredValues, SeedValues

from .base_digest import folder_record
from .export import INDEX_FILE, MODEL_FILE, read_export_config, tensor_files
from .mapping import MAPPINGS, MXFP4_BLOCKS, MXFP4_SCALES, HFMapping, dequantize_mxfp4
from .mtp_layers import is_mtp_tensor, trained_name
from .pretrained import model_folder

FLOATING = ("F64", "F32", "BF16", "F16")  # safetensors dtypes a parameter can be read from
# Tensors of Llama-family models zerotrain's llama does not build: a folder whose config.json says llama but holds
# these is another family relabelled.
FOREIGN = {"self_attn.q_proj.bias": "q/k/v biases are Qwen2's", "self_attn.k_proj.bias": "q/k/v biases are Qwen2's",
           "self_attn.v_proj.bias": "q/k/v biases are Qwen2's", "self_attn.q_norm.weight": "q/k norms are Qwen3's",
           "self_attn.k_norm.weight": "q/k norms are Qwen3's", "self_attn.qkv_proj.weight": "a fused qkv_proj is Phi-3's",
           "mlp.gate_up_proj.weight": "a fused gate_up_proj is Phi-3's"}


@dataclass(frozen=True)
class WeightSource:
    """Where --init-from's weights are: the folder, what it is, its model, and which file holds each tensor."""

    folder: str
    kind: str  # "hf", "safetensors" (a zerotrain export) or "checkpoint"
    model: ModelConfig
    files: dict[str, str]  # tensor name (zerotrain's) -> the safetensors file holding it
    mapping: HFMapping | None  # hf: the architecture's layouts; a zerotrain folder stores its own
    stored: dict[str, str] = dataclasses.field(default_factory=dict)  # zerotrain's name -> the file's, where they differ
    first_row: dict[str, int] = dataclasses.field(default_factory=dict)  # a part of a fused tensor (Phi-3's qkv_proj)
    # A checkpoint without a model file (format 2): its shards, whose masters are its model, by name -> the sha256
    # its manifest records (and the source was verified against)
    shards: dict[str, str] = dataclasses.field(default_factory=dict)
    # An expert's part of a tensor stacking every expert of a layer (gpt-oss's): zerotrain's name -> (its expert, its
    # place among the stacking's parts, the stacking); the stored name is in `stored`
    experts: dict[str, tuple] = dataclasses.field(default_factory=dict)
    # A stacked tensor stored in MXFP4 (gpt-oss's released folders): its name -> the files of its blocks and scales
    quantized: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    # Each file's safetensors header (read_header's), by path, once read: listing model.safetensors' tensors
    # (tensor_files) and checking them (check_tensors) read it once, not once each
    headers: dict[str, dict] = dataclasses.field(default_factory=dict)
    # The folder's weight files, where its tensors were not listed (weight_source's `listed` False): what record hashes
    unlisted: tuple[str, ...] = ()

    def record(self, comm=None) -> dict:
        """What a checkpoint's manifest records of it: the folder, its kind, each weight file's digest (base_digest:
        a sha256 per block and one of those, with the block size; a checkpoint's model file, or its shards without
        one, by the sha256 its manifest records, which the source was verified against: its shards hashed again
        would read the optimizer state too).

        With `comm`, every rank calls this together: each hashes about 1/W of the folder's blocks and the digests
        are gathered under --io-timeout, so no rank reads more than its share (whole files, one rank each, made
        four of 64 ranks hash 4.02 GB each for Llama-3-8B) and none waits for another's hashing on the step's
        timeout. Every rank gets the record; one process alone computes the same.
        """
        if self.kind == "checkpoint":
            listed = self.shards or {f["name"]: f["sha256"] for f in read_manifest(self.folder)["files"]}
            names = sorted(self.shards or {os.path.basename(f) for f in (*self.files.values(), *self.unlisted)})
            return {"path": self.folder, "kind": self.kind,
                    "files": [{"name": name, "sha256": listed[name]} for name in names]}
        held = set(self.files.values()) | {f for pair in self.quantized.values() for f in pair} | set(self.unlisted)
        block_bytes, files = folder_record(sorted(held, key=os.path.basename), comm)
        return {"path": self.folder, "kind": self.kind, "block_bytes": block_bytes, "files": files}


def weight_source(path: str, verify: bool = True, weights: bool = True, listed: bool = True) -> WeightSource:
    """The weights `path` names; ConfigError (exit 2) for a folder zerotrain cannot start from, naming why.

    With `verify` (the launcher, or each rank under torchrun, in config_from_args) the folder is checked whole
    before any rank starts, from headers alone: a checkpoint verified, config.json's types and values, every
    tensor's name, shape and dtype and every file's size against its safetensors header, and tokenizer.json
    read. The ranks then read a source that was checked already (`verify` False).

    Without `weights` (a plan, made before the weights are downloaded) a folder holding config.json and no weight
    files is its model alone: a source without files, which no run starts from (a run needs `weights`).

    Without `listed` (a resume whose checkpoint overwrites every value: the source is recorded, never read) the
    folder's weight files alone (`unlisted`), its tensors not listed: model.safetensors' header is not read.

    A source this process checked (`verify`) is handed to its next unchecked one of the same folder, unchanged since
    (checked_source): under torchrun a rank's check and its start-up read each header once between them.
    """
    if not os.path.exists(path):
        raise ConfigError(f"--init-from {path}: no such folder")
    if not os.path.isdir(path):
        raise ConfigError(f"--init-from {path}: not a folder (a Hugging Face model folder, a zerotrain checkpoint, "
                          "run folder or export)")
    try:
        folder = os.path.abspath(model_folder(path))
        if not weights and not has_weight_files(folder):
            kind, model, _ = read_export_config(folder)
            return WeightSource(folder, kind, model, {}, None)
        source = None if verify else checked_source(folder)
        if source is None:
            source = _source(folder, verify, listed)
        if verify:
            check_tensors(source, expected_shapes(source.model))
            _check_tokenizer(os.path.join(source.folder, TOKENIZER_FILE))
            _CHECKED[folder] = (source, _folder_state(folder))
    except CheckpointError as e:
        raise ConfigError(f"--init-from {path}: {e}") from None
    return source


# The source a check (weight_source with `verify`) built, by folder, with the folder's state then: taken once by
# the next unchecked weight_source of that folder in this process (under torchrun, the rank's start-up)
_CHECKED: dict[str, tuple[WeightSource, tuple]] = {}


def checked_source(folder: str) -> WeightSource | None:
    """The source this process checked of `folder` (an abspath of model_folder), once, if no file of the folder
    changed since (by size and modification time): its headers, read by the check, are not read again."""
    source, state = _CHECKED.pop(folder, (None, None))
    return source if source is not None and state == _folder_state(folder) else None


def _folder_state(folder: str) -> tuple:
    """Each entry of `folder` by name, size and modification time: what a checked source was built from."""
    return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(folder)))


def has_weight_files(folder: str) -> bool:
    """Whether `folder` (a model_folder) holds weights: a checkpoint's manifest, or model.safetensors or its index."""
    return any(os.path.isfile(os.path.join(folder, name)) for name in (MANIFEST, MODEL_FILE, INDEX_FILE))


def _check_tokenizer(file: str) -> None:
    """A folder's tokenizer.json, if it has one, must be one the tokenizers library reads (its end-of-text token is
    needed, and checked, only where text is tokenized with it: data.resolve.model_tokenizer)."""
    if os.path.isfile(file):
        try:
            read_tokenizer_file(file)
        except ValueError as e:
            raise CheckpointError(f"{file}: the tokenizers library cannot read it ({e})") from None


def _source(folder: str, verify: bool, listed: bool = True) -> WeightSource:
    headers: dict[str, dict] = {}  # the header tensor_files reads, kept for check_tensors
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        if verify:
            verify_or_raise(folder)
        manifest = read_manifest(folder)
        if manifest["config"].get("lora", {}).get("lora_rank"):  # its model.safetensors holds the adapters alone
            raise CheckpointError(f"{folder} holds a LoRA run's adapters, not a whole model: start from it merged "
                                  "(zerotrain export RUN OUT --format safetensors, then --init-from OUT)")
        model = ModelConfig(**manifest["config"]["model"])
        if not has_model_file(manifest):  # format 2: the model is the shards' masters
            names = {shard_name(r, manifest["world_size"]) for r in range(manifest["world_size"])}
            shards = {f["name"]: f["sha256"] for f in manifest["files"] if f["name"] in names}
            return WeightSource(folder, "checkpoint", model, {}, None, shards=shards)
        if not listed:
            return WeightSource(folder, "checkpoint", model, {}, None, unlisted=weight_files(folder))
        return WeightSource(folder, "checkpoint", model, tensor_files(folder, headers), None, headers=headers)
    kind, model, _ = read_export_config(folder)
    if not listed:
        return WeightSource(folder, kind, model, {}, None, unlisted=weight_files(folder))
    files, mapping = tensor_files(folder, headers), MAPPINGS[model.arch] if kind == "hf" else None
    if mapping is None:
        return WeightSource(folder, kind, model, files, None, headers=headers)
    names, first_row, experts, quantized = {}, {}, {}, {}
    for n in files:  # an MXFP4 pair (X_blocks, X_scales) is read as the tensor X it dequantizes to
        base = n[: -len(MXFP4_BLOCKS)]
        if n.endswith(MXFP4_BLOCKS) and base + MXFP4_SCALES in files:
            quantized[base] = (files[n], files[base + MXFP4_SCALES])
    pairs = {q + suffix for q in quantized for suffix in (MXFP4_BLOCKS, MXFP4_SCALES)}
    stored_files = {n: f for n, f in files.items() if n not in pairs}
    stored_files.update({q: blocks for q, (blocks, _) in quantized.items()})
    for n in stored_files:  # zerotrain's names: a fused tensor's parts each name its rows of it, a stacked one its experts
        if mapping.layers_after and is_mtp_tensor(model, mapping.canonical(n)):  # read where --mtp train trains them
            ours = trained_name(mapping.canonical(n))
            if ours is not None:
                names[ours] = n
            continue
        stacked = mapping.expert_parts(mapping.canonical(n), model)
        for z, e, i, stack in stacked:
            names[z], experts[z] = n, (e, i, stack)
        for z, at, rows in [] if stacked else mapping.unfused(mapping.canonical(n), model):
            names[z] = n
            if rows is not None:
                first_row[z] = at
    return WeightSource(folder, kind, model, {z: stored_files[n] for z, n in names.items()}, mapping,
                        {z: n for z, n in names.items() if z != n}, first_row, experts=experts, quantized=quantized,
                        headers=headers)


def weight_files(folder: str) -> tuple[str, ...]:
    """The folder's weight files without reading a header: model.safetensors, or the files its index names."""
    single = os.path.join(folder, MODEL_FILE)
    return (single,) if os.path.isfile(single) else tuple(sorted(set(tensor_files(folder).values())))


def expected_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each parameter's full shape in zerotrain's names (a tied head once, as the embedding), from the meta device."""
    return {n: tuple(p.shape) for n, p in meta_model(model).named_parameters()}


def check_tensors(source: WeightSource, shapes: dict[str, tuple[int, ...]]) -> None:
    """CheckpointError naming the first tensor of the source's files that is extra, missing, misshapen or not
    floating point against `shapes` (full shapes, zerotrain's layout), and the file; from the headers alone (a
    format-2 checkpoint: from its manifest's layout and TP slices)."""
    if source.shards:
        held = ShardedModel(source.folder).shapes  # from the manifest: nothing is read from the shards
        for name in sorted(set(held) | set(shapes)):
            if held.get(name) != shapes.get(name):
                raise CheckpointError(f"its shards hold {name} as {list(held.get(name) or [])}, the model its config "
                                      f"describes needs {list(shapes.get(name) or [])}")
        return
    mapping = source.mapping or MAPPINGS[source.model.arch]
    transposed = mapping.is_transposed if source.mapping is not None else (lambda name: False)
    tied_head = ("lm_head.weight",) if source.model.tie_embeddings else ()
    extra = sorted(n for n in source.files if n not in shapes and not mapping.is_ignored(n, source.model)
             and n not in tied_head)
    if extra:
        hint = next((why for suffix, why in FOREIGN.items() if extra[0].endswith(suffix)), None) \
            if source.model.arch == "llama" else None
        said = f"the {source.model.arch} model it describes does not have" + \
            (f" ({hint}: config.json says llama, its weights say otherwise)" if hint else "")
        raise CheckpointError(f"{os.path.basename(source.files[extra[0]])} holds {extra[0]}, which {said}")
    held = sorted({os.path.basename(f) for f in source.files.values()})
    if not held:
        raise CheckpointError("its weight files hold no tensors")
    fused_rows: dict[str, int] = {}  # a fused tensor's rows: its parts'
    for name in source.first_row:
        if name in shapes:
            fused_rows[source.stored[name]] = fused_rows.get(source.stored[name], 0) + shapes[name][0]
    headers = source.headers  # each file's read once, here or when its tensors were listed
    for name, full in shapes.items():
        file = source.files.get(name)
        if file is None:
            raise CheckpointError(f"no tensor {name} in {held[0] if len(held) == 1 else INDEX_FILE}, which the model "
                                  "its config describes has")
        header = headers.get(file) or headers.setdefault(file, read_header(file))
        stored_name = source.stored.get(name, name)
        if stored_name in source.quantized:
            _check_mxfp4(source, stored_name, name, full, headers)
            continue
        if stored_name not in header:
            raise CheckpointError(f"{INDEX_FILE} puts {stored_name} in {os.path.basename(file)}, which does not hold it")
        dtype, stored = header[stored_name][0], tuple(header[stored_name][1])
        want = tuple(reversed(full)) if transposed(name) else full
        if name in source.first_row:
            name, want = stored_name, (fused_rows[stored_name], *full[1:])  # the fused tensor whole
        if name in source.experts:  # the stacked tensor whole: each expert's slice splits into its parts' shapes
            name, want = stored_name, _stacked_shape(source, name, stored, full)
        if stored != want:
            raise CheckpointError(f"{name} is {list(stored)} in {os.path.basename(file)}, the model its config "
                                  f"describes needs {list(want)}")
        if dtype not in FLOATING:
            raise CheckpointError(f"{name} is {dtype} in {os.path.basename(file)}, not a floating-point type "
                                  f"({', '.join(FLOATING)})")


def _stacked_shape(source: WeightSource, name: str, stored: tuple[int, ...], full: tuple[int, ...]
                   ) -> tuple[int, ...]:
    """The shape a stacked tensor must have for expert part `name` to be `full`: the stored one, if its slice splits
    into a part of that shape (found on the meta device), and it holds the model's experts."""
    _, i, stack = source.experts[name]
    if len(stored) < 2 or tuple(stack.split(torch.empty(stored[1:], device="meta"))[i].shape) != full:
        return (source.model.n_experts, *stack.join(*(torch.empty(full, device="meta"),) * len(stack.parts)).shape)
    return (source.model.n_experts, *stored[1:])


def _check_mxfp4(source: WeightSource, stored_name: str, name: str, full: tuple[int, ...], headers: dict) -> None:
    """An MXFP4 pair: uint8 blocks (E, rows, G, 16) and scales (E, rows, G) that dequantize to the stacked tensor
    expert part `name` (of shape `full`) is taken from."""
    files = source.quantized[stored_name]
    (blocks_dtype, blocks), (scales_dtype, scales) = (
        (lambda h: (h[0], tuple(h[1])))(
            (headers.get(f) or headers.setdefault(f, read_header(f)))[stored_name + suffix])
        for f, suffix in zip(files, (MXFP4_BLOCKS, MXFP4_SCALES)))
    if blocks_dtype != "U8" or scales_dtype != "U8" or len(blocks) != 4 or blocks[-1] != 16 or blocks[:-1] != scales:
        raise CheckpointError(f"{stored_name}{MXFP4_BLOCKS} {list(blocks)} ({blocks_dtype}) and {MXFP4_SCALES} "
                              f"{list(scales)} ({scales_dtype}) in {os.path.basename(files[0])} are not an MXFP4 "
                              "pair (uint8 blocks (E, rows, G, 16) and scales (E, rows, G))")
    dequantized = (blocks[0], 32 * blocks[2], blocks[1])
    want = _stacked_shape(source, name, dequantized, full)
    if dequantized != want:
        raise CheckpointError(f"{stored_name}{MXFP4_BLOCKS} dequantizes to {list(dequantized)} in "
                              f"{os.path.basename(files[0])}, the model its config describes needs {list(want)}")


def adopt(model: ModelConfig, source: WeightSource, given: set[str]) -> ModelConfig:
    """The run's model: the source's, where no flag or TOML key in `given` says otherwise; ConfigError if one does.

    A model may train on a shorter window (--seq-len) than the positions it holds, which it keeps (its context).
    """
    theirs = dataclasses.asdict(source.model)
    for key, value in theirs.items():
        mine = getattr(model, key)
        if key not in given or mine == value:
            continue
        if key in ("mtp", "mtp_loss_weight"):  # how the run trains the folder's MTP layers: the run's choice
            theirs[key] = mine
            continue
        if key == "seq_len" and mine <= source.model.positions:
            theirs["seq_len"], theirs["context"] = mine, source.model.positions
            continue
        raise ConfigError(f"{setting_for(key).flag} {mine} contradicts --init-from {source.folder}, whose model has {key} = "
                          f"{value}: leave it out, the model's comes with it")
    return ModelConfig(**theirs)


class FileValues:
    """Initial values from --init-from's files (model/init.py's interface): each tensor this rank trains read on its
    own, its TP slice only (safetensors' lazy slicing), so at most one tensor is read beyond what the rank keeps; or
    (`flat_values`, ZeRO-3's owned chunks) only the rows of it that hold a flat range, a range that cuts a row
    reading that row. Every byte taken from the files is counted where it is read (`bytes_read`, the run's
    init_bytes_read).

    CheckpointError naming the first tensor that is missing, extra or of the wrong shape (check_tensors), at once.
    """

    def __init__(self, source: WeightSource, model: torch.nn.Module, tp_slices: dict, tp_rank: int):
        self.source, self.tp_slices, self.tp_rank = source, tp_slices, tp_rank
        mapping = source.mapping or MAPPINGS[source.model.arch]
        self.transposed = mapping.is_transposed if source.mapping is not None else (lambda name: False)
        self.rows = {n: param_rows(n, p, tp_slices) for n, p in model.named_parameters()}  # a tied head once
        try:  # checked before the ranks start already, but a file may have changed since; cheap: the headers this
            # rank read to list the source's tensors, or read now, once
            check_tensors(source, {n: tuple(tp_slices[n].full_shape) if n in tp_slices else tuple(p.shape)
                                   for n, p in model.named_parameters()})
        except CheckpointError as e:
            raise CheckpointError(f"--init-from {source.folder}: {e}") from None
        self._opened: dict[str, object] = {}
        self._shards = ShardedModel(source.folder) if source.shards else None
        self.bytes_read = 0  # bytes taken from the source's files so far

    def values(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.flat_values(name, shape, 0, math.prod(shape)).view(shape)

    def flat_values(self, name: str, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
        """Values [lo, hi) of this rank's tensor of `name` (its TP slice) flattened, fp32: the rows holding them
        read."""
        if self._shards is not None:
            # A checkpoint without a model file: the full tensor from its shards' masters (fp32), then the range.
            full, tp_slice = self._shards.tensor(name), self.tp_slices.get(name)
            self.bytes_read += full.numel() * 4
            local = full if tp_slice is None else tp_slice.take(full, self.tp_rank)
            return local.reshape(-1)[lo:hi].clone()
        width = math.prod(shape[1:])  # values per row (a 1-D tensor's rows are its values)
        first, last = lo // width, -(-hi // width)
        if name in self.source.experts:  # its rows of its expert's part of the stacked tensor
            rows = self._expert_rows(name, first, last)
        else:
            rows = _read_rows(self._open(self.source.files[name]), self.source.stored.get(name, name),
                              self.tp_slices.get(name), self.tp_rank, self.transposed(name),
                              self.source.first_row.get(name, 0), first, last, self._count)
        return rows.reshape(-1)[lo - first * width : hi - first * width].to(torch.float32)

    def _open(self, file: str):
        return self._opened.get(file) or self._opened.setdefault(file, safe_open(file, framework="pt"))

    def _expert_rows(self, name: str, first: int, last: int) -> torch.Tensor:
        """Rows [first, last) of this TP rank's slice of expert part `name`: the stored elements that make them
        (stacked_rows), or from an MXFP4 tensor its expert's slice dequantized whole, then split and sliced."""
        e, i, stack = self.source.experts[name]
        stored, tp_slice = self.source.stored.get(name, name), self.tp_slices.get(name)
        if stored in self.source.quantized:
            blocks, scales = (self._count(self._open(f).get_slice(stored + suffix)[e])
                              for f, suffix in zip(self.source.quantized[stored], (MXFP4_BLOCKS, MXFP4_SCALES)))
            part = stack.split(dequantize_mxfp4(blocks, scales))[i]
            return (part if tp_slice is None else tp_slice.take(part, self.tp_rank))[first:last]
        lazy = self._open(self.source.files[name]).get_slice(stored)
        return stacked_rows(lazy, e, stack.split, i, tp_slice, self.tp_rank, first, last, self._count)

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        self._opened.clear()
        if self._shards is not None:
            self._shards.close()


def load_local(model: torch.nn.Module, source: WeightSource, tp_slices: dict, tp_rank: int) -> None:
    """Fill `model` (this rank's parameters, TP-sliced by `tp_slices`, on a device) from the source, each rank
    reading its slices (FileValues)."""
    values = FileValues(source, model, tp_slices, tp_rank)
    try:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(values.values(name, tuple(param.shape)).to(param.dtype))
    finally:
        values.close()


def param_rows(name: str, param: torch.Tensor, tp_slices: dict) -> int:
    """The rows of parameter `name` in the full model."""
    return tp_slices[name].full_shape[0] if name in tp_slices else param.shape[0]


def tp_row_ranges(tp_slice, rank: int, first: int, last: int) -> tuple[list[tuple[int, int]], list | None]:
    """Where rows [first, last) of TP rank `rank`'s slice of a tensor are in the full one: its row ranges (a slice
    along rows maps them through the slice's parts) and its column ranges (a slice along columns: those columns of
    the rows; else None)."""
    row_ranges, at = [], 0
    for a, b in (tp_slice.parts[rank] if tp_slice is not None and tp_slice.dim == 0 else [(0, last)]):
        lo, hi = max(first, at), min(last, at + b - a)  # local rows [at, at + b - a) are the full rows [a, b)
        if hi > lo:
            row_ranges.append((a + lo - at, a + hi - at))
        at += b - a
    return row_ranges, (tp_slice.parts[rank] if tp_slice is not None and tp_slice.dim == 1 else None)


def stacked_rows(lazy, e: int, split, i: int, tp_slice, rank: int, first: int, last: int, count) -> torch.Tensor:
    """Rows [first, last) of TP rank `rank`'s slice of part `i` of expert `e` of a stacked tensor (`lazy`,
    safetensors' slice of it; `split` its StackedExperts' split, a view: a transpose, a chunk, strided columns),
    read from the stored elements they are made of and nothing more (at ZeRO-3 a rank's owned rows, under --tp its
    slice: Llama 4's gate_proj rows are columns of gate_up_proj, gpt-oss's every other column). The split is taken
    of each stored dimension's index, broadcast (nothing of the expert's size is made), which says where each row
    range lies: a strided box of the stored expert, read as one slice (`count` is given each one)."""
    shape = tuple(lazy.get_shape()[1:])
    index = [split(torch.arange(n).view([n if d == j else 1 for d in range(len(shape))]).expand(shape))[i]
             for j, n in enumerate(shape)]
    row_ranges, columns = tp_row_ranges(tp_slice, rank, first, last)
    pieces = []
    for a, b in row_ranges:
        boxes = [[t[a:b] for t in index]] if columns is None else [[t[a:b, c:d] for t in index] for c, d in columns]
        read = [_read_strided(lazy, e, box, count) for box in boxes]
        pieces.append(torch.cat(read, dim=1) if len(read) > 1 else read[0])
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _read_strided(lazy, e: int, index: list[torch.Tensor], count) -> torch.Tensor:
    """The elements of expert `e` of stacked tensor `lazy` whose index along each stored dimension `index` gives (one
    tensor of the box's shape per dimension): each of the box's dimensions steps along one stored dimension (a view
    of it), so they are the strided slice of the stored expert from the box's first element, permuted to the box."""
    box = index[0].shape
    corner = (0,) * len(box)
    slices, along = [], {}  # along: stored dimension -> the box's dimension it steps along
    for j, t in enumerate(index):
        start = int(t[corner])
        steps = {k: int(t[tuple(int(d == k) for d in range(len(box)))]) - start for k in range(len(box)) if box[k] > 1}
        moving = [(k, step) for k, step in steps.items() if step]
        if len(moving) > 1 or any(step < 0 for _, step in moving):
            raise ValueError(f"the split of a stacked tensor is not a strided view of it (steps {steps})")
        if moving:
            (k, step), = moving
            along[j] = k
            slices.append(slice(start, start + step * (box[k] - 1) + 1, step))
        else:
            slices.append(slice(start, start + 1))
    if sorted(along.values()) != [k for k in range(len(box)) if box[k] > 1]:
        raise ValueError(f"the split of a stacked tensor is not a strided view of it (its box {list(box)})")
    read = count(lazy[(e, *slices)])
    return read.permute(sorted(range(len(index)), key=lambda j: along.get(j, -1))).reshape(box)


def _read_rows(f, name: str, tp_slice, rank: int, transposed: bool, first_row: int, first: int, last: int,
               count) -> torch.Tensor:
    """Rows [first, last) of this rank's tensor (its TP slice of stored tensor `name`), in zerotrain's layout, read
    from the file and nothing more: a tensor split along its rows maps them through the slice's parts, one split
    along its columns reads those columns of them (tp_row_ranges); a transposed one (GPT-2's Conv1D) reads the
    file's columns; a part of a fused tensor (never transposed, split along its rows) starts at `first_row`. `count`
    is given each piece read."""
    lazy = f.get_slice(name)
    row_ranges, columns = tp_row_ranges(tp_slice, rank, first, last)
    pieces = []
    for a, b in ((first_row + a, first_row + b) for a, b in row_ranges):
        if columns is None:
            pieces.append(count(lazy[:, a:b]).t() if transposed else count(lazy[a:b]))
        else:
            pieces.append(torch.cat([count(lazy[c:d, a:b]).t() if transposed else count(lazy[a:b, c:d])
                                     for c, d in columns], dim=1))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def initial_model(cfg: Config, mesh, restored: bool = False, source: WeightSource | None = None
                  ) -> tuple[torch.nn.Module, object]:
    """This rank's model on the meta device (its TP slice of it over `mesh` when --tp > 1) and the source of its
    initial values: --init-from's files (FileValues), or else the seed (model/init.py's SeedValues). What the engine
    fills its flat buffers from, and what a full fine-tuning's live DPO reference copies. `restored`: a checkpoint
    will overwrite every value (a resume of full fine-tuning), which is then neither read nor drawn
    (RestoredValues). `source`: --init-from's weight_source where the caller has it (its headers read already)."""
    model = meta_model(cfg.model)
    slices = parallelize(model, mesh.tp_size, mesh.tp_rank, mesh.tp, mesh.kv) if mesh.tp_size > 1 else {}
    if restored:
        return model, RestoredValues()
    if cfg.checkpoint.init_from:
        source = source or weight_source(cfg.checkpoint.init_from, verify=False)
        return model, FileValues(source, model, slices, mesh.tp_rank)
    return model, SeedValues(cfg.model, cfg.loop.seed, slices, mesh.tp_rank)
